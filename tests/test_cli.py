"""`mas-trainer trace` end to end on the tiny model, and its one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APPS = ROOT / "examples" / "langgraph_apps"


def run_cli(*args, cwd=ROOT, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "mas_trainer.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_trace_map_reduce_on_tiny_model(tmp_path):
    out = tmp_path / "traj.jsonl"
    r = run_cli("trace", f"{APPS}/map_reduce.py:graph", "--data", f"{APPS}/data/map_reduce.jsonl", "--model", "tiny",
                "--output", str(out), "--max-tokens", "16")
    assert r.returncode == 0, r.stderr[-2000:]
    trajs = _read(out)
    tasks = (APPS / "data" / "map_reduce.jsonl").read_text().splitlines()
    assert len(trajs) == len(tasks)
    for t in trajs:
        assert t["schema_version"] == 1 and t["status"] == "ok", t["error"]
        nodes = {n["id"]: n for n in t["nodes"]}
        llm_nodes = [n for n in t["nodes"] if n["name"] in ("planner", "worker", "reducer")]
        assert len(t["llm_calls"]) == len(llm_nodes)  # one call per LLM node call, each once
        for c in t["llm_calls"]:
            assert nodes[c["node_id"]]["name"] == c["node"]
            assert c["policy"] == {"planner": "planner", "worker": "worker", "reducer": "worker"}[c["node"]]
            assert len(c["response_ids"]) == len(c["response_logprobs"]) > 0
    assert "planner" in r.stdout and "worker" in r.stdout  # the tree and the role table


def test_trace_undecorated_graph_with_input(tmp_path):
    out = tmp_path / "t.jsonl"
    task = json.loads((APPS / "data" / "untraced_plain.jsonl").read_text().splitlines()[0])
    r = run_cli("trace", "examples.langgraph_apps.untraced_plain:graph", "--input", json.dumps(task), "--model", "tiny",
                "--output", str(out), "--max-tokens", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    [t] = _read(out)
    assert {c["policy"] for c in t["llm_calls"]} == {"default"}
    assert {c["role"] for c in t["llm_calls"]} == {c["node"] for c in t["llm_calls"]}


@pytest.mark.parametrize(
    "args, needle",
    [
        (["nope.py:graph", "--input", "{}"], "app file not found: nope.py"),
        (["examples/langgraph_apps/map_reduce.py", "--input", "{}"], "APP must be"),
        (["examples/langgraph_apps/map_reduce.py:nothing", "--input", "{}"], "has no attribute 'nothing'"),
        (["no_such_pkg.mod:graph", "--input", "{}"], "module not found: no_such_pkg.mod"),
        (["examples/langgraph_apps/map_reduce.py:graph", "--input", "{bad"], "--input is not valid JSON"),
        (["examples/langgraph_apps/map_reduce.py:graph", "--input", "[1]"], "must be a JSON object"),
        (["examples/langgraph_apps/map_reduce.py:graph", "--data", "missing.jsonl"], "data file not found"),
        (["examples/langgraph_apps/map_reduce.py:graph", "--input", "{}", "--model", "./no/such/model"], "--model"),
        (["examples/langgraph_apps/map_reduce.py:graph", "--input", "{}", "--concurrency", "0"], "--concurrency 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = run_cli("trace", *args, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_bad_data_line_names_file_and_line(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"topic": "a"}\n{oops\n')
    r = run_cli("trace", "examples/langgraph_apps/map_reduce.py:graph", "--data", str(data), timeout=120)
    assert r.returncode == 2 and f"{data}:2: not valid JSON" in r.stderr


def test_every_verb_has_help():
    r = run_cli("trace", "--help", timeout=60)
    assert r.returncode == 0 and "--model" in r.stdout and "--data" in r.stdout


def test_docs_list_every_fit_config_key_with_its_default():
    from mas_trainer.config import describe_keys

    docs = (ROOT / "docs" / "training.md").read_text()
    missing = [line for line in describe_keys() if line not in docs]
    assert not missing, f"docs/training.md lacks (regenerate its key list from describe_keys): {missing}"


@pytest.mark.model
def test_trace_on_the_bundled_model(tmp_path):
    out = tmp_path / "traj.jsonl"
    r = run_cli("trace", f"{APPS}/subgraph_app.py:graph", "--data", f"{APPS}/data/subgraph_app.jsonl", "--model", "default",
                "--output", str(out), "--max-tokens", "24")
    assert r.returncode == 0, r.stderr[-2000:]
    trajs = _read(out)
    for t in trajs:
        assert t["status"] == "ok", t["error"]
        names = {c["node"] for c in t["llm_calls"]}
        assert {"research:search_query", "research:summarize", "final"} <= names
        for c in t["llm_calls"]:
            assert len(c["response_ids"]) == len(c["response_logprobs"]) > 0
            assert c["output_text"] is not None


# node -> policy of each example app (as its @trainable says), or None for undecorated apps
EXAMPLES = {
    "supervisor": {"supervisor": "supervisor_policy", "researcher": "researcher_policy", "writer": "writer_policy"},
    "reflection": {"generate": "shared", "reflect": "shared"},
    "map_reduce": {"planner": "planner", "worker": "worker", "reducer": "worker"},
    "subgraph_app": {"research:search_query": "research", "research:summarize": "research", "final": "writer"},
    "raw_openai": {"answer": "answerer", "review": "reviewer"},
    "tools_agent": {"agent": "agent"},
    "untraced_plain": {"draft": "default", "polish": "default"},
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_app_traces_on_tiny(tmp_path, name):
    out = tmp_path / "t.jsonl"
    r = run_cli("trace", f"{APPS}/{name}.py:graph", "--data", f"{APPS}/data/{name}.jsonl", "--model", "tiny",
                "--output", str(out), "--max-tokens", "12")
    assert r.returncode == 0, r.stderr[-2000:]
    expected = EXAMPLES[name]
    for t in _read(out):
        assert t["status"] == "ok", t["error"]
        nodes = {n["id"]: n for n in t["nodes"]}
        llm_node_calls = [n for n in t["nodes"] if n["name"] in expected]
        assert len(t["llm_calls"]) >= 1
        calls_per_node = {}
        for c in t["llm_calls"]:
            assert nodes[c["node_id"]]["name"] == c["node"]
            assert c["policy"] == expected[c["node"]], (c["node"], c["policy"])
            assert len(c["response_ids"]) == len(c["response_logprobs"]) > 0
            calls_per_node[c["node_id"]] = calls_per_node.get(c["node_id"], 0) + 1
        assert set(calls_per_node) <= {n["id"] for n in llm_node_calls}


def test_tasks_from_a_hugging_face_dataset(tmp_path, monkeypatch):
    import argparse

    import datasets

    from mas_trainer.cli import _load_tasks
    from mas_trainer.errors import UserError

    folder = tmp_path / "my_qa"
    folder.mkdir()
    rows = {"train": [{"question": "q1", "answer": "a1"}, {"question": "q2", "answer": "a2"}],
            "validation": [{"question": "q3", "answer": "a3"}]}
    for split, items in rows.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))

    def load(spec):
        return _load_tasks(argparse.Namespace(input=None, data=spec))

    assert load(f"hf:{folder}:validation") == rows["validation"]
    assert load(f"hf:{folder}") == rows["train"]
    with pytest.raises(UserError, match="hf:NAME:CONFIG:SPLIT"):
        load("hf:a:b:c:d")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what a machine without the hub sees
    with pytest.raises(UserError, match="cannot load Hugging Face dataset 'nobody/no-such-dataset'") as err:
        load("hf:nobody/no-such-dataset:test")
    assert "\n" not in str(err.value)


# --- trace runs the app's rewards (trajectory, role, turn) as fit would, before any training ---

REWARD_APP = '''
from typing import TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable


class S(TypedDict, total=False):
    question: str
    plan: str
    answer: str


llm = ChatOpenAI(model="m", max_retries=0)


def planner(s):
    return {"plan": llm.invoke("Plan: " + s["question"]).content}


def writer(s):
    return {"answer": llm.invoke("Answer: " + s["question"]).content}


g = StateGraph(S)
g.add_node("planner", planner)
g.add_node("writer", writer)
g.add_edge(START, "planner")
g.add_edge("planner", "writer")
g.add_edge("writer", END)


def answered(task, state, trajectory):
    return 1.0 if "answer" in state else 0.0


def plan_reward(task, calls, trajectory):
    return 0.5


def writer_reward(task, calls, trajectory):
    return None  # not applicable


def turn_reward(task, call, trajectory):
    return 0.25


def lookup(state):
    return state["missing"]  # RAISES HERE


def broken(task, state, trajectory):
    return lookup(state)


ROLES, POLICIES = {"planner": "p", "writer": "p"}, {"p": "tiny"}
graph = trainable(g.compile(), roles=ROLES, policies=POLICIES, reward=answered,
                  role_rewards={"planner": plan_reward, "writer": writer_reward}, turn_rewards=turn_reward)
bad = trainable(g.compile(), roles=ROLES, policies=POLICIES, reward=broken)
'''


@pytest.fixture
def reward_app(tmp_path):
    app = tmp_path / "reward_app.py"
    app.write_text(REWARD_APP)
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"question": "a"}\n{"question": "b"}\n')
    return app, data


def test_trace_scores_rollouts_at_every_level_and_writes_the_rewards(tmp_path, reward_app):
    app, data = reward_app
    out = tmp_path / "t.jsonl"
    r = run_cli("trace", f"{app}:graph", "--data", str(data), "--model", "tiny", "--output", str(out), "--max-tokens", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    trajs = _read(out)
    assert len(trajs) == 2
    for t in trajs:
        assert t["status"] == "ok", t["error"]
        rewards = t["rewards"]
        assert set(rewards) == {"trajectory", "roles", "turns", "detail"}  # the documented contract
        assert rewards["trajectory"] == 1.0 and rewards["roles"] == {"planner": 0.5}
        assert rewards["detail"]["not_applicable"]["roles"] == ["writer"]
        # fit's default allocator (broadcast, weights 1): trajectory + the call's role + its turn
        expected = {"planner": 1.0 + 0.5 + 0.25, "writer": 1.0 + 0.25}
        assert rewards["turns"] == {c["id"]: expected[c["role"]] for c in t["llm_calls"]}
    table = r.stdout[r.stdout.index("rewards by level"):]
    assert "planner 0.5" in table and "writer n/a" in table and "2 × 0.25" in table
    assert "1.25..1.75" in table  # the call rewards, summarised
    for t in trajs:
        assert t["rollout_id"][:12] in table


def test_trace_no_rewards_leaves_them_out(tmp_path, reward_app):
    app, data = reward_app
    out = tmp_path / "t.jsonl"
    r = run_cli("trace", f"{app}:bad", "--data", str(data), "--model", "tiny", "--output", str(out), "--max-tokens", "2",
                "--no-rewards")
    assert r.returncode == 0, r.stderr[-2000:]  # the raising reward is not run
    assert "rewards: not run (--no-rewards)" in r.stdout and "rewards by level" not in r.stdout
    for t in _read(out):
        assert t["rewards"] == {"trajectory": None, "roles": {}, "turns": {}, "detail": {}}


def test_trace_reward_that_raises_names_function_file_line_level_and_rollout(tmp_path, reward_app):
    app, data = reward_app
    out = tmp_path / "t.jsonl"
    r = run_cli("trace", f"{app}:bad", "--data", str(data), "--model", "tiny", "--output", str(out), "--max-tokens", "2")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.strip().splitlines() if line.startswith("mas-trainer trace: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = lines
    trajs = _read(out)  # written all the same, for a look at what the reward was given
    assert len(trajs) == 2 and all(t["status"] == "ok" for t in trajs)
    raising = next(i for i, text in enumerate(app.read_text().splitlines(), 1) if "RAISES HERE" in text)
    assert line.startswith(f"mas-trainer trace: error: reward broken raised KeyError: 'missing' at {app}:{raising} "
                           f"(trajectory level, rollout {trajs[0]['rollout_id']})"), line
    assert "2 of 2 rollouts not scored" in line and "_mas_app_" not in r.stderr


FAILING_APP = '''
from typing import TypedDict

from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable


class S(TypedDict, total=False):
    x: int


def work(s):
    raise ValueError(f"bad task {s['x']}")


g = StateGraph(S)
g.add_node("work", work)
g.add_edge(START, "work")
g.add_edge("work", END)
graph = trainable(g.compile(), roles={"work": "p"}, policies={"p": "tiny"}, reward=lambda task, state, traj: 1.0)
'''


def test_trace_without_output_prints_and_writes_nothing(tmp_path, reward_app):
    """A dry run leaves the working folder as it was: no trajectories.jsonl unasked."""
    app, data = reward_app
    work = tmp_path / "work"
    work.mkdir()
    r = run_cli("trace", f"{app}:graph", "--data", str(data), "--model", "tiny", "--max-tokens", "4", cwd=work)
    assert r.returncode == 0, r.stderr[-2000:]
    assert list(work.iterdir()) == []
    assert "2 rollouts in" in r.stdout and "not written (--output FILE keeps them)" in r.stdout


def test_trace_exits_non_zero_when_every_rollout_failed(tmp_path):
    app = tmp_path / "failing_app.py"
    app.write_text(FAILING_APP)
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"x": 1}\n{"x": 2}\n')
    out = tmp_path / "t.jsonl"
    r = run_cli("trace", f"{app}:graph", "--data", str(data), "--model", "tiny", "--output", str(out))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.strip().splitlines() if line.startswith("mas-trainer trace: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    trajs = _read(out)
    assert [t["status"] for t in trajs] == ["error", "error"]
    assert lines[0] == (f"mas-trainer trace: error: every rollout failed (2 of 2: 2 error); the first, {trajs[0]['rollout_id']}, "
                        f"with: ValueError: bad task 1; the trajectories: {out}")


def test_log_records_go_to_stderr_as_it_is_now_after_main_ran_with_another(monkeypatch, tmp_path):
    """`main` run twice in one process (the Python API, a test suite) with stderr replaced in
    between: its log records reach the stderr of the moment, never the first one, closed."""
    import io
    import logging

    from mas_trainer.cli import main

    monkeypatch.setenv("MAS_TRAINER_LOG", "INFO")
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    main(["data", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])  # any verb, failing or not, sets up logging first
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    raised: list[BaseException] = []
    monkeypatch.setattr(logging, "raiseExceptions", True)
    monkeypatch.setattr(logging.Handler, "handleError", lambda self, record: raised.append(sys.exc_info()[1]))
    logging.getLogger("mas_trainer.loop.session").info("gateway up")
    assert raised == []
    assert "INFO mas_trainer.loop.session: gateway up" in second.getvalue()
