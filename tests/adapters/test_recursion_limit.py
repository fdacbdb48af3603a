"""An app's own recursion limit (bound with `graph.with_config`, as create_agent and deepagents do)
stands unless the user sets one (`rollout.recursion_limit`, `trace`/`eval --recursion-limit`), and
the verbs say which applies. The fixture's node records the limit LangGraph gave the run."""

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from mas_trainer.api import evaluate, trace
from mas_trainer.apps import app_runner, forks_of, load_object

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "loop_app.py"
RAISE = "raise it with rollout.recursion_limit=N (fit) or --recursion-limit N (trace, eval)"


def _app(name: str):
    return load_object(f"{APP}:{name}")


def test_the_apps_own_limit_stands_when_the_user_sets_none(fake_session):
    app = fake_session.load_app(_app("bound")(4))
    assert app.describe_recursion_limit() == "4 (the app's)"
    [t] = fake_session.run([{"loops": 6}])
    assert t.status == "error" and len(t.nodes) == 4
    assert t.error == f"GraphRecursionError: recursion limit 4 (the app's) reached: the app did not finish within 4 supersteps; {RAISE}"

    fake_session.load_app(_app("bound")(10))
    [t] = fake_session.run([{"loops": 6}])
    assert t.status == "ok" and t.final_state == {"loops": 6, "turns": 6, "limit": 10}

    # create_agent's 9999: 60 supersteps, past the 50 every rollout used to be cut at
    fake_session.load_app(_app("graph"))
    [t] = fake_session.run([{"loops": 60}])
    assert t.status == "ok" and t.final_state["limit"] == 9999


def test_a_limit_the_user_sets_replaces_the_apps(fake_session):
    app = fake_session.load_app(_app("graph"), recursion_limit=3, recursion_limit_from="rollout.recursion_limit")
    assert app.describe_recursion_limit() == "3 (rollout.recursion_limit)"
    [t] = fake_session.run([{"loops": 6}])
    assert t.status == "error" and t.error.startswith("GraphRecursionError: recursion limit 3 (rollout.recursion_limit) reached")

    fake_session.load_app(_app("bound")(4), recursion_limit=20)
    [t] = fake_session.run([{"loops": 6}])
    assert t.status == "ok" and t.final_state["limit"] == 20


def test_forked_continuations_run_with_the_rollouts_limit():
    async def continuation_limit(app) -> int:
        forks = forks_of(app)
        async with forks.keeping_threads() as kept:
            assert (await app.run({"loops": 3}, "r0")).status == "ok"
            points = await forks.checkpoints(kept["r0"])
            result = await forks.continuations({"r0-cf1": points[1]}).run({}, "r0-cf1")  # the node runs twice more
        assert result.status == "ok" and result.final_state["turns"] == 3
        return result.final_state["limit"]

    assert asyncio.run(continuation_limit(app_runner(_app("graph")))) == 9999
    assert asyncio.run(continuation_limit(app_runner(_app("graph"), recursion_limit=20))) == 20


def test_an_app_that_binds_none_gets_langgraphs_default():
    # LangGraph's own knob for its default (10007 in langgraph 1.2): what is printed is what LangGraph applies
    script = f"""
import asyncio
from mas_trainer.apps import app_runner, load_object
app = app_runner(load_object("{APP}:builder").compile())
print(app.describe_recursion_limit())
for loops in (6, 10):
    r = asyncio.run(app.run({{"loops": loops}}, f"r{{loops}}"))
    print(r.status, r.error)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "LANGGRAPH_DEFAULT_RECURSION_LIMIT": "7"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "7 (LangGraph's default)", "ok None",
        f"error GraphRecursionError: recursion limit 7 (LangGraph's default) reached: the app did not finish within 7 "
        f"supersteps; {RAISE}"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mas_trainer.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)


def test_trace_recursion_limit_replaces_the_apps_and_says_which_applies(tmp_path):
    out = tmp_path / "t.jsonl"
    r = _cli("trace", f"{APP}:graph", "--input", '{"loops": 6}', "--model", "tiny", "--recursion-limit", "3",
             "--output", str(out))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "policies default=tiny; recursion limit 3 (--recursion-limit)" in " ".join(r.stdout.split())  # the banner, wrapped
    [line] = r.stderr.strip().splitlines()
    assert "GraphRecursionError: recursion limit 3 (--recursion-limit) reached" in line and RAISE in line
    [t] = [json.loads(x) for x in out.read_text().splitlines()]
    assert t["status"] == "error" and len(t["nodes"]) == 3

    # without it, the app's own: the banner says so
    console = io.StringIO()
    result = trace(str(APP) + ":graph", [{"loops": 6}], model="tiny", console=Console(file=console, width=300))
    assert console.getvalue().splitlines()[0].endswith("; recursion limit 9999 (the app's)")
    assert [t.final_state["limit"] for t in result.trajectories] == [9999]


def test_eval_recursion_limit_replaces_the_apps_and_its_result_says_which_applied():
    app = f"{APP}:graph"
    assert evaluate(app, [{"loops": 6}], model="tiny")["recursion_limit"] == "9999 (the app's)"
    with pytest.raises(Exception, match=r"recursion limit 3 \(--recursion-limit\) reached"):
        evaluate(app, [{"loops": 6}], model="tiny", recursion_limit=3)
    assert evaluate(app, [{"loops": 6}], model="tiny", recursion_limit=8)["recursion_limit"] == "8 (--recursion-limit)"


def test_trace_and_eval_refuse_a_recursion_limit_out_of_range():
    for verb, given in (("trace", "0"), ("eval", "10001")):
        r = _cli(verb, f"{APP}:graph", "--data", str(APP), "--recursion-limit", given)
        assert r.returncode == 2
        assert r.stderr.strip().splitlines() == [f"mas-trainer {verb}: error: --recursion-limit {given}: give the LangGraph "
                                                 "supersteps a rollout may take, 1 to 10000 (default: the app's own limit)"]
