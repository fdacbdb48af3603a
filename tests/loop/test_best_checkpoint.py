"""The best checkpoint and early stop (config `best`): `fit` keeps the weights of its best
held-out evaluation, stops on a target or a plateau, and `serve`, `export` and `eval` take the
best by default, the last on request; `--resume` continues the best and the patience exactly.
(kill -9 at any moment, the best included: tests/loop/test_recovery.py.)

The held-out reward is a fixed function of the evaluation's step (its rollout ids say it), so
which evaluation is best, and when the run stops, is known in advance; training rollouts are
scored on their replies, so the weights move every step."""

import io
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from mas_trainer import api
from mas_trainer.apps import load_object
from mas_trainer.cli import main
from mas_trainer.config import ConfigError, load_config
from mas_trainer.loop.trainer import fit
from mas_trainer.run.rundir import trained_checkpoint

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
TASKS = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "words.jsonl").read_text().splitlines()]
HELD_OUT = {0: 0.1, 1: 0.3, 2: 0.9, 3: 0.5, 4: 0.6, 5: 0.4, 6: 0.2, 7: 0.95, 8: 0.3}  # by the evaluation's step


def _reward(task, state, traj):
    if traj.rollout_id.startswith("v"):  # a held-out rollout, v000002-t00000-r0
        return HELD_OUT[int(traj.rollout_id[1:7])]
    return load_object(f"{APP}:word_fraction")(state.get("answer", ""))


def _app():
    return load_object(f"{APP}:_single")(_reward)


def _cfg(*overrides):
    return load_config(overrides=["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_in_flight=1",
                                  "rollout.max_tokens=8", "learner.lr=1e-2", "learner.bf16=false", "runtime.engine_bf16=false",
                                  "seed=3", "steps=8", "eval_every=1", "save_every=3", *overrides])


def _fit(out, *overrides, resume=False):
    said = io.StringIO()
    rows = fit(_app, TASKS[:4], _cfg(*overrides), out, val_tasks=TASKS[6:7], resume=resume, console=Console(file=said, width=300))
    return rows, said.getvalue()


def _params(folder):
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def _state(out):
    return json.loads((out / "checkpoint" / "state.json").read_text())


@pytest.fixture(scope="module")
def plateau(tmp_path_factory):
    """Best at step 2 (0.9), then 2 evaluations without a better one: stops at step 4 of 8."""
    out = tmp_path_factory.mktemp("plateau") / "run"
    rows, said = _fit(out, "best.patience=2")
    return out, rows, said


def test_the_best_evaluation_is_kept_and_a_plateau_stops_the_run(plateau):
    out, rows, said = plateau
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    vals = [r for r in rows if r["kind"] == "val"]
    assert [r["reward/mean"] for r in vals] == [HELD_OUT[s] for s in range(5)]
    assert "best/step" not in vals[0] and [r["best/step"] for r in vals[1:]] == [1, 2, 2, 2]
    assert vals[-1]["best/value"] == 0.9
    # stopped where it stopped: a checkpoint of step 4, naming the best and the patience spent
    state = _state(out)
    assert state["step"] == 4 and state["stale"] == 2
    assert state["best"] == {"step": 2, "metric": "val/reward/mean", "mode": "max", "value": 0.9, "kept": True}
    assert [json.loads(line)["step"] for line in (out / "checkpoints.jsonl").read_text().splitlines()] == [3, 4]
    # the best's weights only (no optimizer state), the superseded best of step 1 gone
    assert sorted(p.name for p in (out / "best").iterdir()) == ["step_000002"]
    assert sorted(p.name for p in (out / "best" / "step_000002").iterdir()) == ["policies"]
    best, last = _params(out / "best" / "step_000002" / "policies" / "solo"), _params(out / "checkpoint" / "policies" / "solo")
    assert any(not torch.equal(best[k], last[k]) for k in best)
    line = next(x for x in said.splitlines() if "stopped early" in x)
    assert line.startswith("stopped early at step 4 of 8: 2 held-out evaluations without an improvement") and \
        "best: step 2, val/reward/mean 0.9 (kept in best/step_000002)" in line


def test_a_target_stops_the_run_at_once_and_its_best_is_the_checkpoint_it_commits(plateau, tmp_path):
    """best.target=0.85: step 2 reaches it and the run stops there; its best is that checkpoint
    (the same files, hard-linked), and the same weights as the plateau run's best of step 2."""
    out = tmp_path / "run"
    rows, said = _fit(out, "best.target=0.85")
    assert max(r["step"] for r in rows) == 2 and _state(out)["step"] == 2 and _state(out)["best"]["step"] == 2
    assert "stopped early at step 2 of 8: held-out val/reward/mean 0.9 at step 2 reached best.target=0.85" in said
    kept = out / "best" / "step_000002" / "policies" / "solo"
    weights = next(kept.glob("*.safetensors"))
    assert os.stat(weights).st_ino == os.stat(out / "checkpoint" / "policies" / "solo" / weights.name).st_ino
    other = _params(plateau[0] / "best" / "step_000002" / "policies" / "solo")
    assert all(torch.allclose(v, other[k], atol=1e-6) for k, v in _params(kept).items())


def test_serve_export_and_eval_take_the_best_by_default_and_the_last_on_request(plateau, tmp_path, caplog, capsys):
    out = plateau[0]
    assert trained_checkpoint(out).which == "best" and trained_checkpoint(out).step == 2
    assert trained_checkpoint(out, "last").policies == {"solo": out / "checkpoint" / "policies" / "solo"}
    run = api.FitResult(out)
    assert run.policies == {"solo": out / "best" / "step_000002" / "policies" / "solo"} and run.best["step"] == 2
    # export: the best's files, and mas-trainer.json says which
    assert main(["export", str(out), str(tmp_path / "best")]) == 0
    mapping = json.loads((tmp_path / "best" / "mas-trainer.json").read_text())
    assert (mapping["checkpoint"], mapping["step"]) == ("best", 2)
    assert (tmp_path / "best" / "solo" / "model.safetensors").read_bytes() == \
        (out / "best" / "step_000002" / "policies" / "solo" / "model.safetensors").read_bytes()
    assert main(["export", str(out), str(tmp_path / "last"), "--checkpoint", "last"]) == 0
    assert "exported the last checkpoint (step 4)" in capsys.readouterr().out
    assert json.loads((tmp_path / "last" / "mas-trainer.json").read_text())["step"] == 4
    # eval: the policies it measured
    for which, folder in ((None, out / "best" / "step_000002"), ("last", out / "checkpoint")):
        result = api.evaluate(_app, TASKS[6:7], run=out, checkpoint=which)
        assert result["policies"]["solo"] == str(folder / "policies" / "solo")
    # serve
    from mas_trainer.serve import build_gateway

    with caplog.at_level(logging.INFO, logger="mas_trainer.serve"):
        for which in (None, "last"):
            gateway = build_gateway(out, checkpoint=which)
            for backend in gateway.backends.values():
                backend.engine.close()
    assert [r.getMessage().split(" of ")[0] for r in caplog.records if r.name == "mas_trainer.serve"] == \
        ["serving the best checkpoint", "serving the last checkpoint"]


def test_a_run_without_a_kept_best_serves_its_last_and_refuses_to_name_one(plateau, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(plateau[0], out)
    state = _state(out)
    (out / "checkpoint" / "state.json").write_text(json.dumps({**state, "best": {**state["best"], "kept": False}}))
    assert trained_checkpoint(out).which == "last"
    assert main(["export", str(out), str(tmp_path / "x"), "--checkpoint", "best"]) == 2
    assert "kept no best checkpoint (best.keep was off); take its last, step 4, with --checkpoint last" in capsys.readouterr().err


def test_resume_continues_the_best_and_the_patience_where_the_checkpoint_left_them(plateau, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(plateau[0], out)
    before = (out / "metrics.jsonl").read_text()
    # the same config stops there again: nothing to train, nothing touched
    _, said = _fit(out, "best.patience=2", resume=True)
    assert "stopped early at step 4 of 8 (2 held-out evaluations without" in said and "nothing to train" in said
    assert (out / "metrics.jsonl").read_text() == before
    # another metric or mode would rank the kept best wrongly: refused before anything
    with pytest.raises(ConfigError, match="ranked by best.metric=val/reward/mean best.mode=max"):
        _fit(out, "best.mode=min", resume=True)
    # one more evaluation of patience: step 5 (0.4) is the 3rd without a better one, so it stops there;
    # a patience counted from 0 again would run on to step 7's 0.95
    rows, said = _fit(out, "best.patience=3", resume=True)
    assert max(r["step"] for r in rows) == 5 and "stopped early at step 5 of 8: 3 held-out evaluations" in said
    state = _state(out)
    assert state["step"] == 5 and state["stale"] == 3 and state["best"]["step"] == 2
    assert sorted(p.name for p in (out / "best").iterdir()) == ["step_000002"]


def test_best_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="'best.metric': 'reward/mean' must name a held-out metric as trackers do"):
        load_config(overrides=["best.metric=reward/mean"])
    with pytest.raises(ConfigError, match="best.min_delta sets what counts as an improvement for best.patience, which is off"):
        load_config(overrides=["best.min_delta=0.01"])
    with pytest.raises(ConfigError, match="stop on held-out evaluations, and this run has none"):
        fit(_app, TASKS[:4], _cfg("best.target=0.5"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
