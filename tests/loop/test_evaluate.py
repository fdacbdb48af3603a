"""eval with base and trained policies (as fit measured them); export as Hugging Face folders;
timed-out rollouts counted apart; the default number of rollouts in flight."""

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from transformers import AutoModelForCausalLM

from mas_trainer import trainable

from mas_trainer.config import load_config
from mas_trainer.loop import evaluate as evaluate_module
from mas_trainer.loop.evaluate import evaluate
from mas_trainer.production.export import export
from mas_trainer.loop.trainer import fit

ROOT = Path(__file__).resolve().parents[2]
APP = f"{ROOT / 'tests' / 'fixtures' / 'words_app.py'}:graph"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
TASKS = [json.loads(line) for line in DATA.read_text().splitlines()]


def test_eval_base_vs_trained_and_export(tmp_path):
    run = tmp_path / "run"
    fit(APP, TASKS[:2], load_config(overrides=["runtime.execution=local", "steps=1", "rollout.tasks_per_step=2",
                                               "rollout.n=2", "rollout.max_tokens=12"]), run)
    base = evaluate(APP, TASKS[:3], max_tokens=12)
    trained = evaluate(APP, TASKS[:3], run_dir=run, max_tokens=12)
    assert base["policies"]["lead"] == base["policies"]["crew"] == "tiny"
    assert trained["policies"]["lead"].endswith("checkpoint/policies/lead")
    for result in (base, trained):
        assert result["rollouts"] == 3 and {"reward/role/planner", "reward/role/writer", "reward/role/critic"} <= set(result)

    out = export(run, tmp_path / "export")
    mapping = json.loads((out / "mas-trainer.json").read_text())
    assert mapping["roles"] == {"planner": "lead", "writer": "crew", "critic": "crew"}
    assert set(mapping["policies"]) == {"lead", "crew"}
    for policy in ("lead", "crew"):
        AutoModelForCausalLM.from_pretrained(out / policy)


def test_fit_held_out_score_is_what_eval_measures_on_the_checkpoint(tmp_path, monkeypatch):
    """Greedy, on the engines the run's config describes (bf16 as fit's default, one row per
    batch so no batch-mate changes the rounding): eval --run reproduces fit's last held-out
    evaluation token for token, hence its rewards. The tiny model's greedy tokens hardly
    depend on the precision; their log-probs do, to the last bit: an fp32 engine fails this."""
    run = tmp_path / "run"
    cfg = load_config(overrides=["runtime.execution=local", "steps=1", "rollout.tasks_per_step=2", "rollout.n=2",
                                 "rollout.max_tokens=12", "rollout.val_temperature=0", "runtime.max_batch_size=1", "seed=5",
                                 # bf16 whatever the CPU (auto is off where bf16 is emulated): eval must follow the run
                                 "runtime.engine_bf16=true"])
    rows = fit(APP, TASKS[:4], cfg, run, val_tasks=TASKS[4:])
    held_out = [r for r in rows if r["kind"] == "val"][-1]
    assert held_out["step"] == 1

    scored = []
    assign = evaluate_module.assign_rewards
    monkeypatch.setattr(evaluate_module, "assign_rewards", lambda t, *a, **kw: scored.append(assign(t, *a, **kw)))
    result = evaluate(APP, TASKS[4:], run_dir=run, temperature=0)

    def responses(trajs):
        return sorted((t["task"]["question"], [(c["role"], c["response_ids"], c["response_logprobs"]) for c in t["llm_calls"]])
                      for t in trajs)

    fit_trajs = [json.loads(line) for line in (run / "trajectories" / "step_000001_val.jsonl").read_text().splitlines()]
    assert responses(fit_trajs) == responses(json.loads(t.to_json()) for t in scored)
    for key in ("reward/mean", "reward/role/planner", "reward/role/writer", "reward/role/critic", "tokens/response"):
        assert result[key] == held_out[key], key


def test_eval_cli_prints_json_and_rejects_a_non_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "eval", APP, "--data", str(DATA), "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["rollouts"] == len(TASKS)
    bad = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "eval", APP, "--data", str(DATA), "--run", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "has no checkpoint" in bad.stderr


# --- timeouts apart, and a default concurrency that fits the engine ---------------------------

class _Load:
    """How many rollouts are inside the app's node at once."""

    def __init__(self) -> None:
        self.lock, self.now, self.peak = threading.Lock(), 0, 0

    def __enter__(self):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def __exit__(self, *exc):
        with self.lock:
            self.now -= 1


def _timed_app(load: _Load):
    """One node: it sleeps `sleep_s` (a slow task), then asks the model if the task says `ask`;
    every finished rollout scores 1."""

    class S(TypedDict, total=False):
        sleep_s: float
        ask: bool
        answer: str

    def work(s: S) -> S:
        with load:
            time.sleep(s.get("sleep_s", 0.0))
        return {"answer": ChatOpenAI(model="m", max_retries=0).invoke("hi").content if s.get("ask") else "-"}

    g = StateGraph(S)
    g.add_node("work", work)
    g.add_edge(START, "work")
    g.add_edge("work", END)
    return trainable(g.compile(), roles={"work": "p"}, policies={"p": "tiny"}, reward=lambda task, state, traj: 1.0)


def test_eval_counts_timed_out_rollouts_apart_instead_of_scoring_them_zero():
    tasks = [{"sleep_s": 0.0}, {"sleep_s": 0.0, "ask": True}, {"sleep_s": 180.0, "ask": True}]
    # 45 s: a hang guard for a 4-token call on a busy machine (well under a second idle), far short of the sleeper
    result = evaluate(_timed_app(_Load()), tasks, max_tokens=4, timeout_s=45)
    assert result["rollouts"] == 3 and result["rollouts/timeout"] == 1
    assert result["reward/mean"] == 1.0  # over the 2 that finished; scoring the timeout 0 would say 0.667
    assert result["timeout_s"] == 45
    warning = evaluate_module.timeout_warning(result)
    assert warning.startswith("warning: 1 of 3 rollouts ran past rollout.timeout_s (45 s)")
    assert "--max-in-flight" in warning and "--timeout" in warning
    assert evaluate_module.timeout_warning({**result, "rollouts/timeout": 0}) is None


def test_eval_runs_one_engine_batch_of_rollouts_at_once_by_default():
    load = _Load()
    batch = load_config().runtime.max_batch_size
    result = evaluate(_timed_app(load), [{"sleep_s": 0.3}] * (2 * batch + 4), max_tokens=2)
    assert result["max_in_flight"] == batch and result["rollouts/timeout"] == 0
    assert load.peak == batch  # every rollout at once (20) before
    load = _Load()
    assert evaluate(_timed_app(load), [{"sleep_s": 0.3}] * 6, max_tokens=2, max_in_flight=2)["max_in_flight"] == 2
    assert load.peak == 2


def test_eval_cli_reports_timeouts_beside_the_mean_and_checks_its_numbers(tmp_path):
    app = tmp_path / "slow_app.py"
    app.write_text(textwrap.dedent('''
        import time
        from typing import TypedDict
        from langgraph.graph import END, START, StateGraph
        from mas_trainer import trainable

        class S(TypedDict, total=False):
            sleep_s: float

        def work(s):
            time.sleep(s.get("sleep_s", 0.0))
            return {}

        g = StateGraph(S)
        g.add_node("work", work)
        g.add_edge(START, "work")
        g.add_edge("work", END)
        graph = trainable(g.compile(), roles={"work": "p"}, policies={"p": "tiny"}, reward=lambda task, state, traj: 1.0)
    '''))
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"sleep_s": 0}\n{"sleep_s": 30}\n')
    r = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "eval", f"{app}:graph", "--data", str(data), "--timeout", "2",
                        "--max-in-flight", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["rollouts/timeout"] == 1 and result["reward/mean"] == 1.0 and result["max_in_flight"] == 2
    assert "timed out (not scored)" in r.stderr and "warning: 1 of 2 rollouts ran past rollout.timeout_s (2 s)" in r.stderr
    assert "Traceback" not in r.stderr and "Exception in ASGI" not in r.stderr
    bad = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "eval", f"{app}:graph", "--data", str(data),
                          "--max-in-flight", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "mas-trainer eval: error: --max-in-flight 0: run at least 1 rollout at once"]


# --- every rollout failed: nothing to score, one line and a non-zero exit ---------------------

def _failing_app():
    class S(TypedDict, total=False):
        x: int

    def work(s: S) -> S:
        raise ValueError(f"bad task {s['x']}\nwith a second line")

    g = StateGraph(S)
    g.add_node("work", work)
    g.add_edge(START, "work")
    g.add_edge("work", END)
    return trainable(g.compile(), roles={"work": "p"}, policies={"p": "tiny"}, reward=lambda task, state, traj: 1.0)


def test_eval_raises_one_line_when_every_rollout_failed():
    import pytest

    with pytest.raises(evaluate_module.EveryRolloutFailed) as err:
        evaluate(_failing_app(), [{"x": 1}, {"x": 2}], max_tokens=2)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("every rollout failed (2 of 2: 2 error); the first, ") and "with: ValueError: bad task 1" in msg
    assert msg.endswith("; no reward to report")


def test_every_rollout_failed_only_when_none_finished():
    from mas_trainer.trace.schema import Trajectory

    ok, bad = (Trajectory(rollout_id=i, task={}, status=s, error=e) for i, s, e in (("a", "ok", None), ("b", "timeout", None)))
    assert evaluate_module.every_rollout_failed([]) is None
    assert evaluate_module.every_rollout_failed([bad, ok]) is None
    failed = evaluate_module.every_rollout_failed([bad, bad], "what next")
    assert str(failed) == "every rollout failed (2 of 2: 2 timeout); the first, b, with: timeout; what next"


def test_eval_cli_exits_non_zero_with_one_line_when_every_rollout_failed(tmp_path):
    app = tmp_path / "failing_app.py"
    app.write_text(textwrap.dedent('''
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
    '''))
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"x": 1}\n{"x": 2}\n')
    r = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "eval", f"{app}:graph", "--data", str(data)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr[-2000:])
    lines = [line for line in r.stderr.strip().splitlines() if line.startswith("mas-trainer eval: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("mas-trainer eval: error: every rollout failed (2 of 2: 2 error); the first, ")
    assert "with: ValueError: bad task 1; no reward to report" in lines[0]


def test_eval_reward_that_raises_names_the_apps_file_and_line(tmp_path):
    app = tmp_path / "reward_app.py"
    app.write_text(textwrap.dedent('''
        from typing import TypedDict
        from langgraph.graph import END, START, StateGraph
        from mas_trainer import trainable

        class S(TypedDict, total=False):
            x: int

        def work(s):
            return {}

        def reward(task, state, trajectory):
            return state["missing"]  # RAISES HERE

        g = StateGraph(S)
        g.add_node("work", work)
        g.add_edge(START, "work")
        g.add_edge("work", END)
        graph = trainable(g.compile(), roles={"work": "p"}, policies={"p": "tiny"}, reward=reward)
    '''))
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"x": 1}\n')
    r = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "eval", f"{app}:graph", "--data", str(data)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    raising = next(i for i, text in enumerate(app.read_text().splitlines(), 1) if "RAISES HERE" in text)
    [line] = [line for line in r.stderr.strip().splitlines() if line.startswith("mas-trainer eval: error:")]
    assert line.startswith(f"mas-trainer eval: error: reward reward raised KeyError: 'missing' at {app}:{raising} "
                           "(trajectory level, rollout "), line
    assert "_mas_app_" not in r.stderr
