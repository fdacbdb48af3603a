"""Trackers (`logger`) and the progress lines of `fit`: every metrics row reaches TensorBoard,
MLflow and W&B (offline), read back with each tool's own reader, each step once after a resume;
the step line is rounded and readable; a missing tracker is one line."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from mas_trainer.cli import main
from mas_trainer.config import ConfigError, load_config
from mas_trainer.errors import UserError
from mas_trainer.loop import trainer
from mas_trainer.run.progress import duration, number, step_line, val_line
from mas_trainer.run.rundir import RunDir
from mas_trainer.config import check_trackers
from mas_trainer.run.tracking import Trackers, tracker_values, wandb_history

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
TASKS = [json.loads(line) for line in DATA.read_text().splitlines()]
LONG_FLOAT = re.compile(r"\d\.\d{5,}")


@pytest.fixture(autouse=True)
def _offline_trackers(monkeypatch, tmp_path):
    """Trackers as a new user has them: no server, W&B's own files kept in the test's folder."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / ".wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / ".wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / ".wandb-data"))


# --- what each tool reads back -------------------------------------------------------------------
def tensorboard_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_history(run: Path, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    ids = json.loads((run / "trackers.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{run.resolve() / 'mlflow.db'}")
    assert ids["mlflow_tracking_uri"] == f"sqlite:///{run.resolve() / 'mlflow.db'}"
    return sorted((m.step, m.value) for m in client.get_metric_history(ids["mlflow_run_id"], key))


def expected(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` as `metrics.jsonl` has it (held-out rows under val/)."""
    return sorted((r["step"], v) for r in rows for k, v in tracker_values(r).items() if k == key)


def close(a: list[tuple[int, float]], b: list[tuple[int, float]], rel: float = 1e-6) -> bool:
    return [s for s, _ in a] == [s for s, _ in b] and all(math.isclose(x, y, rel_tol=rel, abs_tol=rel) for (_, x), (_, y) in zip(a, b))


# --- progress lines ------------------------------------------------------------------------------
ROW = {"kind": "train", "step": 3, "rollouts": 8, "rollouts/ok": 7, "rollouts/error": 1, "rollouts/dropped": 0,
       "reward/mean": 0.5528998778998779, "reward/std": 0.1234567, "reward/role/critic": 0.55289987,
       "reward/role/planner": 1.2222222222, "reward/role/writer": 0.5528998778998779, "tokens/response": 340,
       "time/step_s": 1.7345678, "time/rollout_s": 1.234567891, "time/update_s": 0.4999999,
       "perf/rollouts_per_s": 6.480000123456, "perf/tokens_per_s": 275.40123456}


def test_step_line_is_rounded_and_names_rewards_per_role_speed_times_and_eta():
    line = step_line(ROW, 20, eta_s=125.4)
    assert line == ("step 3/20  reward 0.553 (critic 0.553, planner 1.222, writer 0.553)  6.48 rollouts/s (1 error)  "
                    "275 tok/s  rollout 1.2s  update 0.5s  ETA 2m05s")
    assert not LONG_FLOAT.search(line)
    assert step_line({**ROW, "step": 20}, 20, eta_s=3.0).endswith("ETA 0s")
    assert "(critic 0.553, planner 1.222, writer 0.553)  groups 6/9 kept  6.48 rollouts/s" in step_line(
        {**ROW, "rollout/groups": 9, "rollout/groups_kept": 6}, 20, eta_s=1.0)  # rollout.filter_groups
    assert "ETA ?" in step_line({**ROW, "reward/mean": None}, 20, eta_s=None) and "reward -" in step_line({**ROW, "reward/mean": None}, 20, None)
    val = val_line({"kind": "val", "step": 10, "rollouts": 4, "reward/mean": 0.61234567, "reward/role/writer": 0.6123,
                    "time/eval_s": 4.2345})
    assert val == "held-out at step 10: reward 0.612 (writer 0.612)  4 rollouts in 4.2s"


def test_numbers_and_durations_for_reading():
    assert [number(v) for v in (0, 0.123456, 1.23456, 12.3456, 1234.5678, 0.000123456, None)] == [
        "0", "0.123", "1.23", "12.3", "1235", "0.00012", "-"]
    assert [duration(s) for s in (0.44, 12.4, 185, 3725, None)] == ["0.4s", "12s", "3m05s", "1h02m", "?"]


def test_a_live_bar_with_a_countdown_on_a_terminal_and_only_lines_elsewhere():
    import io

    from rich.console import Console

    from mas_trainer.run.progress import FitProgress

    outputs = {}
    for terminal in (True, False):
        buf = io.StringIO()
        with FitProgress(Console(file=buf, force_terminal=terminal, width=160, color_system=None), 4, start_step=1) as p:
            p.show({**ROW, "step": 2})
        outputs[terminal] = buf.getvalue()
    assert "fit " in outputs[True] and "2/4" in outputs[True] and "ETA " in outputs[True] and "━" in outputs[True]
    lines = outputs[False].splitlines()  # piped: the step line alone, no bar, no escape codes
    assert len(lines) == 1 and lines[0].startswith("step 2/4  reward 0.553 (critic 0.553, ") and " ETA " in lines[0]
    assert "━" not in outputs[False] and "\x1b" not in outputs[False]


# --- a missing tracker ------------------------------------------------------------------------------
def test_a_tracker_that_is_not_installed_is_one_line_before_anything_starts(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(UserError, match=r"^logger: mlflow needs the mlflow package, not installed: pip install"):
        check_trackers(["console", "mlflow"])
    with pytest.raises(ConfigError, match="pip install"):
        load_config(overrides=["logger=[console,mlflow]"])
    code = main(["fit", f"{APP}:single", "--data", str(DATA), "--output", str(tmp_path / "run"), "logger=[mlflow]"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and "pip install" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched
    assert load_config(overrides=["logger=console,tensorboard"]).logger == ["console", "tensorboard"]
    with pytest.raises(ConfigError, match="logger"):
        load_config(overrides=["logger=[console,neptune]"])


# --- the trackers on their own: resume edits each history ----------------------------------------------
def _row(kind: str, step: int, value: float) -> dict:
    timing = {"time/step_s": 1.0 + step} if kind == "train" else {"time/eval_s": 2.0}
    return {"kind": kind, "step": step, "reward/mean": value, "reward/role/a b": value / 2, "rollouts": 4, **timing}


def test_trackers_resume_the_same_run_without_repeating_steps(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    names = ["tensorboard", "mlflow", "wandb"]
    t = Trackers(names, root, config={"seed": 0, "rollout": {"n": 2}})
    t.log(_row("val", 0, 0.1))
    for step in range(1, 6):  # a run killed after step 5, its checkpoint at step 3
        t.log(_row("train", step, step / 10))
    t.close(failed=True)
    ids = json.loads((root / "trackers.json").read_text())
    t = Trackers(names, root, after_step=3, config={"seed": 0, "rollout": {"n": 2}})
    for step in range(4, 8):
        t.log(_row("train", step, float(step)))
    t.close()
    assert json.loads((root / "trackers.json").read_text()) == ids  # the same MLflow and W&B runs

    want = [(1, 0.1), (2, 0.2), (3, 0.3), (4, 4.0), (5, 5.0), (6, 6.0), (7, 7.0)]
    tb = tensorboard_scalars(root)
    assert close(tb["reward/mean"], want) and close(tb["val/reward/mean"], [(0, 0.1)])
    assert close(mlflow_history(root, "reward/mean"), want) and close(mlflow_history(root, "reward/role/a b"), [(s, v / 2) for s, v in want])
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=ids["mlflow_tracking_uri"]).get_run(ids["mlflow_run_id"])
    assert run.data.metrics["reward/mean"] == 7.0 and run.data.params["rollout.n"] == "2" and run.info.status == "FINISHED"
    # W&B's history is append-only: the steps it had keep their first values, none twice
    hist = [(r["_step"], r["reward/mean"]) for r in wandb_history(root, ids["wandb_run_id"]) if "reward/mean" in r]
    assert hist == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5), (6, 6.0), (7, 7.0)]
    assert [r["_step"] for r in wandb_history(root, ids["wandb_run_id"])] == list(range(8))


# --- fit end to end -------------------------------------------------------------------------------------
def test_fit_sends_every_metrics_row_to_every_tracker_and_resume_repeats_no_step(tmp_path, monkeypatch, capsys):
    """A run with all trackers on, stopped after step 3 (checkpoint at 2), resumed to step 4:
    TensorBoard and MLflow have exactly metrics.jsonl's rows (every numeric field, train and
    held-out), W&B every step once; the command printed one rounded line per step."""
    out = tmp_path / "run"
    args = ["fit", f"{APP}:graph", "--data", str(DATA), "--output", str(out), "runtime.execution=local",
            "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_tokens=8", "learner.lr=1e-2", "seed=3",
            "steps=4", "save_every=2", "eval_every=2", "val_fraction=0.25", "logger=[console,tensorboard,mlflow,wandb]"]
    real_step = trainer._Fit.collect

    async def dies_at_step_4(self, session, step, position):
        if step == 4:
            raise RuntimeError("killed")
        return await real_step(self, session, step, position)

    monkeypatch.setattr(trainer._Fit, "collect", dies_at_step_4)
    with pytest.raises(RuntimeError, match="killed"):
        main(args)
    first = capsys.readouterr().out
    assert [r["step"] for r in RunDir(out).metrics() if r["kind"] == "train"] == [1, 2, 3]
    ids = json.loads((out / "trackers.json").read_text())
    monkeypatch.setattr(trainer._Fit, "collect", real_step)
    assert main([*args, "--resume"]) == 0
    second = capsys.readouterr().out

    rows = RunDir(out).metrics()
    assert [(r["kind"], r["step"]) for r in rows] == [("val", 0), ("train", 1), ("train", 2), ("val", 2), ("train", 3),
                                                      ("train", 4), ("val", 4)]
    keys = sorted({k for r in rows for k in tracker_values(r)})
    assert {"reward/mean", "reward/role/planner", "policy/lead/pg_loss", "policy/crew/grad_norm", "perf/tokens_per_s",
            "time/update_s", "val/reward/mean", "val/reward/role/writer"} <= set(keys)
    assert json.loads((out / "trackers.json").read_text()) == ids
    tb = tensorboard_scalars(out)
    assert sorted(tb) == keys
    for key in keys:
        assert close(tb[key], expected(rows, key), rel=1e-5), key  # TensorBoard keeps float32
        assert close(mlflow_history(out, key), expected(rows, key)), key
    wb = wandb_history(out, ids["wandb_run_id"])
    assert [r["_step"] for r in wb] == [0, 1, 2, 3, 4]  # each step once (step 3: the first attempt's values)
    for r in wb:
        if r["_step"] != 3:
            assert all(math.isclose(r[k], v) for k, v in expected_row(rows, r["_step"]).items()), r["_step"]

    for text in (first, second):
        assert not LONG_FLOAT.search(text) and "trainer.py:" not in text, text
    lines = [line for line in second.splitlines() if not line.startswith("fit [")]  # phase lines come first
    assert second.startswith("fit [") and lines[0].startswith("step 3/4  reward ") and "(critic " in lines[0] and "rollouts/s" in lines[0] and "ETA " in lines[0]
    assert lines[1].startswith("step 4/4 ") and lines[2].startswith("held-out at step 4: reward ")
    assert [line for line in first.splitlines() if not line.startswith("fit [")][0].startswith("held-out at step 0: reward ")
    assert "held-out reward: step 0 " in second and "mlflow.db" in second


def expected_row(rows: list[dict], step: int) -> dict[str, float]:
    """Every tracker value logged at `step` (train and held-out rows merged, as W&B stores them)."""
    merged: dict[str, float] = {}
    for r in rows:
        if r["step"] == step:
            merged.update(tracker_values(r))
    return merged


def test_a_resumed_wandb_attempt_never_writes_into_the_folder_of_the_one_before(tmp_path, monkeypatch):
    """W&B names an offline attempt's folder after the second it starts in: a resume within the
    same second as the attempt before would share it, and one attempt's steps would be lost
    (the flaky failure of the test above on a fast machine)."""
    import time

    from mas_trainer.run.tracking import _next_second

    stamp = time.strftime("%Y%m%d_%H%M%S")
    (tmp_path / "wandb" / f"offline-run-{stamp}-abc123").mkdir(parents=True)
    _next_second(tmp_path, "abc123")
    assert time.strftime("%Y%m%d_%H%M%S") != stamp
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    _next_second(tmp_path, "other")  # another run's folder: no wait
    assert slept == []
