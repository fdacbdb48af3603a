"""`fit --resume` on run directories that are damaged or do not add up, and `fit` when every
rollout of a step fails: one `mas-trainer fit: error: ...` line naming the file or the step and
what to do, a non-zero exit, nothing deleted, no traceback. (The checks themselves, one by one:
tests/run/test_rundir.py; kill -9 and resume: tests/loop/test_recovery.py.)"""

import json
import logging
import shutil
from pathlib import Path

import pytest

from mas_trainer.cli import main
from mas_trainer.config import load_config
from mas_trainer.errors import UserError
from mas_trainer.run.rundir import RunDir
from mas_trainer.loop.trainer import fit

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
TASKS = [json.loads(line) for line in DATA.read_text().splitlines()]
SETTINGS = ["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "learner.lr=1e-2", "rollout.max_tokens=12",
            "seed=3", "save_every=1"]


def _cfg(*overrides):
    return load_config(overrides=[*SETTINGS, *overrides])


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 2 steps, a checkpoint after each: each test damages a copy of it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    fit(f"{APP}:single", TASKS[:2], _cfg("steps=2"), out)
    return out


def _copy(finished, tmp_path):
    return Path(shutil.copytree(finished, tmp_path / "run"))


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def _state(out, **fields):
    path = out / "checkpoint" / "state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _cli(capsys, out, *args, app=f"{APP}:single"):
    """`mas-trainer fit` in this process: (exit status, its error lines, stdout)."""
    loggers = [logging.getLogger(name) for name in ("mas_trainer", "mas_trainer.loop.session")]
    saved = [(lg, lg.level, list(lg.handlers)) for lg in loggers]
    capsys.readouterr()
    try:
        rc = main(["fit", app, "--data", str(DATA), "--output", str(out), *SETTINGS, *args])
    finally:  # the CLI's log handler writes to this test's captured stderr: not to a later test's
        for lg, level, handlers in saved:
            lg.setLevel(level)
            lg.handlers[:] = handlers
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return rc, [line for line in captured.err.splitlines() if line.startswith("mas-trainer fit: error:")], captured.out


def test_a_negative_step_in_state_json_is_refused_and_nothing_deleted(finished, tmp_path):
    out = _copy(finished, tmp_path)
    _state(out, step=-4)
    before = _files(out)
    with pytest.raises(UserError, match=r"state.json is not a checkpoint state written by `mas-trainer fit` "
                                        r"\(step: Input should be greater than or equal to 1\); nothing was deleted"):
        fit(f"{APP}:single", TASKS[:2], _cfg("steps=3"), out, resume=True)
    assert _files(out) == before


def test_a_state_one_save_interval_behind_is_refused_and_nothing_deleted(finished, tmp_path, capsys):
    """save_every=1, checkpoint committed at step 2, state.json edited to say step 1: the row of
    step 2 is where step 1's next checkpoint would be, so only checkpoints.jsonl (a line per
    commit) proves step 2 was committed; resume must not truncate it."""
    out = _copy(finished, tmp_path)
    _state(out, step=1, position=2)
    before = _files(out)
    rc, errors, _ = _cli(capsys, out, "--resume", "steps=3")
    assert rc == 2
    assert errors == [f"mas-trainer fit: error: {out}/checkpoint/state.json says step 1, but checkpoints.jsonl says a "
                      "checkpoint was committed at step 2: the state is older than the run's last checkpoint and resuming "
                      "from it would delete committed steps, so nothing was deleted; restore the run's own checkpoint "
                      "folder from a backup, or train into a new --output"]
    assert _files(out) == before


def test_a_damaged_metrics_line_keeps_the_intact_rows_after_it_and_resume_counts_each_step_once(finished, tmp_path, caplog):
    """A garbage line between the rows of steps 1 and 2, and what a `fit --resume steps=3` killed
    in step 3 leaves (its config, step 3's row and trajectories, after the checkpoint of step 2):
    the resumed run keeps the rows of steps 1 and 2, drops the garbage with a warning naming
    the line, and replaces step 3's records with its own."""
    out = _copy(finished, tmp_path)
    config = out / "config.yaml"
    config.write_text(config.read_text().replace("\nsteps: 2\n", "\nsteps: 3\n"))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    lines.insert(1, '{"kind": "train", "step": \x00\x13 garbage')
    lines.append(json.dumps({"kind": "train", "step": 3, "rollouts": 99}))
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (out / "trajectories" / "step_000003.jsonl").write_text('{"stale": true}\n')
    with caplog.at_level(logging.WARNING, logger="mas_trainer.run.rundir"):
        rows = fit(f"{APP}:single", TASKS[:2], _cfg("steps=3"), out, resume=True)
    on_disk = RunDir(out).metrics()
    assert [(r["kind"], r["step"]) for r in rows] == [("train", 1), ("train", 2), ("train", 3)]
    assert [(r["step"], r["rollouts"]) for r in on_disk] == [(1, 4), (2, 4), (3, 4)]
    assert f"{out / 'metrics.jsonl'} line 2: not a JSON row, damaged; skipped" in caplog.text
    assert '"stale"' not in (out / "trajectories" / "step_000003.jsonl").read_text()
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 3


def test_a_garbage_state_json_is_one_error_line(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    (out / "checkpoint" / "state.json").write_text('{"step": 2, "posi')
    before = _files(out)
    rc, errors, _ = _cli(capsys, out, "--resume", "steps=3")
    assert rc == 2
    assert errors == [f"mas-trainer fit: error: {out}/checkpoint/state.json is damaged (not JSON: Unterminated string "
                      "starting at: line 1 column 13 (char 12)); nothing was deleted: restore the run's own checkpoint "
                      "folder from a backup, or train into a new --output"]
    assert _files(out) == before


def test_a_state_beyond_the_data_is_one_error_line(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    _state(out, step=50, position=100)
    before = _files(out)
    rc, errors, _ = _cli(capsys, out, "--resume")
    assert rc == 2
    assert len(errors) == 1 and errors[0].startswith(f"mas-trainer fit: error: {out}/checkpoint/state.json says step 50, "
                                                     "but the run's records (metrics.jsonl, trajectories/) end at step 2")
    assert _files(out) == before


def test_resume_of_a_finished_run_says_so_and_fewer_steps_are_refused(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    before = _files(out)
    rc, errors, stdout = _cli(capsys, out, "--resume", "steps=2")
    assert rc == 0 and not errors
    assert f"{out} has finished its 2 steps (checkpoint at step 2): nothing to train; to train more, run again with " \
           "--resume and steps=N, N > 2" in " ".join(stdout.split())
    rc, errors, _ = _cli(capsys, out, "--resume", "steps=1")
    assert rc == 2 and errors == [f"mas-trainer fit: error: {out}: its checkpoint is at step 2, past steps=1, so there is "
                                  "nothing to train; to train on, pass steps=N with N > 2 (steps counts from the run's start)"]
    assert _files(out) == before


@pytest.mark.parametrize("name", ["policies/solo/model.safetensors", "learner/solo/optimizer.pt"])
def test_a_truncated_checkpoint_file_is_one_error_line(finished, tmp_path, capsys, name):
    out = _copy(finished, tmp_path)
    path = out / "checkpoint" / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    before = _files(out)
    rc, errors, _ = _cli(capsys, out, "--resume", "steps=3")
    assert rc == 2
    assert len(errors) == 1 and errors[0].startswith(f"mas-trainer fit: error: {path} is damaged (")
    assert "`--resume` cannot continue from the checkpoint of step 2, and nothing was deleted" in errors[0]
    assert _files(out) == before


FAILING_APP = '''
from typing import TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable


class State(TypedDict, total=False):
    question: str
    answer: str


def answer(s):
    # every call refused by the gateway (400: temperature above 2), as a model folder without a
    # chat template or a server answering 503 would refuse them all
    return {"answer": ChatOpenAI(model="m", max_tokens=8, max_retries=0, temperature=3).invoke(s["question"]).content}


g = StateGraph(State)
g.add_node("answer", answer)
g.add_edge(START, "answer")
g.add_edge("answer", END)
graph = trainable(g.compile(), roles={"answer": "solo"}, policies={"solo": "tiny"}, reward=lambda t, s, tr: 1.0)
'''


def test_a_step_whose_rollouts_all_fail_stops_the_run_before_its_checkpoint(tmp_path, capsys):
    app = tmp_path / "failing_app.py"
    app.write_text(FAILING_APP)
    out = tmp_path / "run"
    rc, errors, _ = _cli(capsys, out, "steps=2", app=f"{app}:graph")
    assert rc == 2
    assert len(errors) == 1, errors
    assert errors[0].startswith("mas-trainer fit: error: step 1: all 4 rollouts failed (4 error); the first, s000001-t")
    assert "Error: Error code: 400 - temperature: Input should be less than or equal to 2; nothing was trained" in errors[0]
    assert errors[0].endswith(f"nothing was trained and no checkpoint written for this step (the rollouts: "
                              f"{out}/trajectories/step_000001.jsonl); fix the cause, then run again with --resume")
    assert not (out / "checkpoint").exists() and not (out / ".checkpoint-staging").exists()
    assert RunDir(out).metrics() == []
    trajs = [json.loads(line) for line in (out / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
    assert len(trajs) == 4 and all(t["status"] == "error" for t in trajs)


def test_resume_with_an_app_that_trains_a_policy_the_checkpoint_lacks_is_one_error(finished, tmp_path):
    out = _copy(finished, tmp_path)
    before = _files(out)
    with pytest.raises(UserError, match=r"checkpoint holds no weights for policy 'crew', which the app trains \(it has solo\): "
                                        r"resume with the app the run was started with"):
        fit(f"{APP}:graph", TASKS[:2], _cfg("steps=3"), out, resume=True)
    kept = lambda files: {k: v for k, v in files.items() if k not in ("app.json", "config.yaml", "plan.json")}  # noqa: E731 - rewritten
    assert kept(_files(out)) == kept(before)


def test_the_failure_threshold_is_a_share_of_the_step_rollouts(tmp_path):
    from mas_trainer.loop.trainer import rollouts_failed
    from mas_trainer.trace.schema import Trajectory

    def trajs(failed, ok):
        return ([Trajectory(rollout_id=f"f{i}", task={}, status="error", error="boom") for i in range(failed)]
                + [Trajectory(rollout_id=f"o{i}", task={}, status="ok") for i in range(ok)])

    where = tmp_path / "step_000001.jsonl"
    assert rollouts_failed(1, trajs(3, 1), where) is None  # the default: only when every rollout failed
    assert "all 4 rollouts failed (4 error); the first, f0, with: boom" in str(rollouts_failed(1, trajs(4, 0), where))
    err = rollouts_failed(1, trajs(2, 2), where, max_failed=0.5)
    assert err is not None and "2 of 4 (rollout.max_failed=0.5) rollouts failed" in str(err)
    assert rollouts_failed(1, trajs(1, 3), where, max_failed=0.5) is None
    assert rollouts_failed(1, trajs(0, 4), where, max_failed=0.1) is None
