"""The run directory on its own: what `--resume` reads is checked before it deletes anything
(state.json, the records beside it, the checkpoint's files), and a damaged metrics line costs
that line only. (`fit --resume` on damaged run directories: tests/run/test_resume_attacks.py.)"""

import json
import logging
import struct

import pytest
import torch

from mas_trainer.errors import UserError
from mas_trainer.run.rundir import RunDir
from mas_trainer.run.tracking import _load_ids


def _state(**fields):
    return {"step": 2, "position": 4, "seed": 3, "policies": ["solo"], **fields}


def _safetensors(path, n=256):
    """A valid safetensors file of one float32 tensor of n values."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4 * n))


def _run(root, *, steps=4, save_every=2, checkpoint=2, written=3, val=(0,)):
    """A run of `steps` steps (save_every) that wrote steps 1..`written` and committed `checkpoint`."""
    run = RunDir(root)
    run.create(f"steps: {steps}\nsave_every: {save_every}\nseed: 3\n")
    for step in range(0, written + 1):
        if step in val:
            run.append_metrics({"kind": "val", "step": step, "rollouts": 2})
            run.write_trajectories(step, ['{"val": 1}'], name=f"step_{step:06d}_val")
        if step:
            run.append_metrics({"kind": "train", "step": step, "rollouts": 4})
            run.write_trajectories(step, [f'{{"step": {step}}}'])
    if checkpoint:
        staging = run.staging()
        (staging / "policies" / "solo").mkdir()
        _safetensors(staging / "policies" / "solo" / "model.safetensors")
        (staging / "policies" / "solo" / "config.json").write_text('{"model_type": "llama"}')
        (staging / "learner" / "solo").mkdir(parents=True)
        torch.save({"learner": {"step": torch.tensor(3.0)}}, staging / "learner" / "solo" / "optimizer.pt")
        run.commit(_state(step=checkpoint, position=2 * checkpoint))
    return run


def _files(run):
    return {p.relative_to(run.root).as_posix(): p.read_bytes() for p in sorted(run.root.rglob("*")) if p.is_file()}


# --- metrics.jsonl --------------------------------------------------------------------------
def test_a_damaged_metrics_line_costs_that_line_only_and_says_which(tmp_path, caplog):
    run = _run(tmp_path / "run", checkpoint=0, written=3)
    lines = run.metrics_path.read_text().splitlines()
    lines.insert(2, '{"kind": "train", "st\x00garbage')  # between step 1's row and step 2's
    lines.insert(4, "[1, 2]")  # JSON, not a row
    run.metrics_path.write_text("\n".join(lines) + "\n")
    assert [r["step"] for r in run.metrics()] == [0, 1, 2, 3]
    with caplog.at_level(logging.INFO, logger="mas_trainer.run.rundir"):
        run.truncate_to(2)
    assert [(r["kind"], r["step"]) for r in run.metrics()] == [("val", 0), ("train", 1), ("train", 2)]
    assert f"{run.metrics_path} line 3: not a JSON row, damaged; skipped" in caplog.text
    assert f"{run.metrics_path} line 5: not a metrics row" in caplog.text
    assert sorted(p.name for p in run.trajectory_files()) == ["step_000000_val.jsonl", "step_000001.jsonl", "step_000002.jsonl"]


def test_a_row_cut_by_a_kill_is_dropped_quietly_and_odd_files_are_left_alone(tmp_path, caplog):
    run = _run(tmp_path / "run", checkpoint=0, written=2)
    with run.metrics_path.open("a") as f:
        f.write('{"kind": "train", "step": 3, "rew')
    (run.traj_dir / "step_notes.jsonl").write_text("mine\n")
    with caplog.at_level(logging.WARNING, logger="mas_trainer.run.rundir"):
        run.truncate_to(1)
    assert not caplog.text
    assert [r["step"] for r in run.metrics()] == [0, 1] and run.metrics_path.read_text().endswith("\n")
    assert (run.traj_dir / "step_notes.jsonl").exists() and not (run.traj_dir / "step_000002.jsonl").exists()


# --- state.json -----------------------------------------------------------------------------
@pytest.mark.parametrize("text, says", [
    ("{not json", r"is damaged \(not JSON: "),
    (b"\xff\xfe\x00garbage", r"is damaged \(not JSON: "),
    ("[]", r"the state: Input should be a valid dictionary"),
    (json.dumps(_state(step=-4)), r"step: Input should be greater than or equal to 1"),
    (json.dumps(_state(step=0)), r"step: Input should be greater than or equal to 1"),
    (json.dumps(_state(step="2")), r"step: Input should be a valid integer"),
    (json.dumps(_state(step=2.0)), r"step: Input should be a valid integer"),
    (json.dumps(_state(step=True)), r"step: Input should be a valid integer"),
    (json.dumps(_state(position=-1)), r"position: Input should be greater than or equal to 0"),
    (json.dumps(_state(extra=1)), r"extra: Extra inputs are not permitted"),
    (json.dumps({"step": 2, "position": 4, "seed": 3}), r"policies: Field required"),
    (json.dumps(_state(policies=["../../elsewhere"])), r"policies: Value error, '../../elsewhere' is not a policy folder"),
    (json.dumps(_state(best={"step": 0, "metric": "val/reward/mean", "mode": "max", "value": 1.0, "kept": True})),
     r"best.step: Input should be greater than or equal to 1"),
    (json.dumps(_state(best={"step": 2, "metric": "val/reward/mean", "mode": "max", "value": "high", "kept": True})),
     r"best.value: Input should be a valid number"),
    (json.dumps(_state(stale=-1)), r"stale: Input should be greater than or equal to 0"),
])
def test_a_damaged_or_foreign_state_is_refused_in_one_line(tmp_path, text, says):
    run = _run(tmp_path / "run")
    path = run.checkpoint / "state.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError, match=rf"^{path}.*{says}") as err:
        run.load_state()
    assert "\n" not in str(err.value) and "nothing was deleted" in str(err.value)


def test_a_checkpoint_without_its_state_is_refused(tmp_path):
    run = _run(tmp_path / "run")
    (run.checkpoint / "state.json").unlink()
    with pytest.raises(UserError, match=r"checkpoint has no state.json: the checkpoint is incomplete or damaged"):
        run.load_state()


def test_the_state_written_by_commit_loads(tmp_path):
    # a state of no warm start, and of a run before the best was kept: none, no patience spent
    assert _run(tmp_path / "run").load_state() == {**_state(step=2, position=4), "warm_start": [], "best": None, "stale": 0}


# --- the state against the records --------------------------------------------------------
def test_a_state_behind_a_committed_checkpoint_is_refused_and_nothing_deleted(tmp_path):
    """save_every=2, records up to step 5: step 4 was committed; a state at step 2 is stale."""
    run = _run(tmp_path / "run", steps=8, checkpoint=2, written=5)
    before = _files(run)
    with pytest.raises(UserError, match=r"state.json says step 2, but metrics.jsonl holds step 5, past "
                                        r"step 4 where the run committed its next checkpoint \(save_every=2\).*nothing was deleted"):
        run.check_resume(run.load_state())
    assert _files(run) == before


def _commit(run, step):
    """Commit a checkpoint of step `step` with the same files as `_run`'s."""
    staging = run.staging()
    (staging / "policies" / "solo").mkdir()
    _safetensors(staging / "policies" / "solo" / "model.safetensors")
    (staging / "policies" / "solo" / "config.json").write_text('{"model_type": "llama"}')
    (staging / "learner" / "solo").mkdir(parents=True)
    torch.save({"learner": {"step": torch.tensor(3.0)}}, staging / "learner" / "solo" / "optimizer.pt")
    run.commit(_state(step=step, position=2 * step))


def test_a_state_one_save_interval_behind_is_refused_by_the_commit_log(tmp_path):
    """save_every=1, checkpoints committed at steps 1, 2, 3; state.json edited to say 2: its
    records alone cannot tell (row 3 is where the next checkpoint would be), checkpoints.jsonl can."""
    run = _run(tmp_path / "run", steps=8, save_every=1, checkpoint=1, written=3)
    _commit(run, 2)
    _commit(run, 3)
    assert run.commits_path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    (run.checkpoint / "state.json").write_text(json.dumps(_state(step=2, position=4)))
    before = _files(run)
    with pytest.raises(UserError, match=r"state.json says step 2, but checkpoints.jsonl says a checkpoint was committed "
                                        r"at step 3: .* so nothing was deleted; restore the run's own checkpoint"):
        run.check_resume(run.load_state())
    assert _files(run) == before


def test_a_kill_between_the_rename_and_the_commit_log_resumes(tmp_path):
    """The state is ahead of checkpoints.jsonl (its line never written, or cut by the kill): fine;
    the next commit starts a fresh line after a cut one."""
    run = _run(tmp_path / "run", steps=8, save_every=1, checkpoint=1, written=2)
    _commit(run, 2)
    run.commits_path.write_text('{"step": 1}\n{"st')
    assert run.committed() == 1
    run.check_resume(run.load_state())
    _commit(run, 3)
    assert run.commits_path.read_text().splitlines()[1:] == ['{"st', '{"step": 3}']
    assert run.committed() == 3


def test_a_run_whose_checkpoint_was_removed_is_not_started_over_on_the_commit_log(tmp_path):
    """The records alone allow starting over (nothing past step 2), the commit log does not."""
    run = _run(tmp_path / "run", steps=8, checkpoint=2, written=2)
    import shutil

    shutil.rmtree(run.checkpoint)
    before = _files(run)
    with pytest.raises(UserError, match=r"has no checkpoint, but its checkpoints.jsonl says one was committed at step 2: "
                                        r".*nothing was deleted"):
        run.check_start_over()
    assert _files(run) == before


def test_records_up_to_the_next_checkpoint_are_what_a_kill_leaves(tmp_path):
    """Killed while committing step 4 (its rows written): resuming from 2 reruns 3 and 4."""
    run = _run(tmp_path / "run", steps=8, checkpoint=2, written=4, val=(0, 4))
    run.check_resume(run.load_state())
    run.truncate_to(2)
    assert [r["step"] for r in run.metrics()] == [0, 1, 2]


def test_a_state_beyond_the_records_is_refused(tmp_path):
    run = _run(tmp_path / "run", steps=8, checkpoint=2, written=3)
    (run.checkpoint / "state.json").write_text(json.dumps(_state(step=50, position=100)))
    with pytest.raises(UserError, match=r"says step 50, but the run's records \(metrics.jsonl, trajectories/\) end at step 3"):
        run.check_resume(run.load_state())
    (run.checkpoint / "state.json").write_text(json.dumps(_state(step=2, position=1)))
    with pytest.raises(UserError, match=r"position 1 is less than step 2"):
        run.check_resume(run.load_state())


def test_a_run_whose_checkpoint_was_removed_is_not_started_over(tmp_path):
    run = _run(tmp_path / "run", steps=8, checkpoint=2, written=3)
    import shutil

    shutil.rmtree(run.checkpoint)
    before = _files(run)
    with pytest.raises(UserError, match=r"has no checkpoint, but its metrics.jsonl holds step 3, past step "
                                        r"2 where the run committed its first checkpoint"):
        run.check_start_over()
    assert _files(run) == before
    _run(tmp_path / "short", steps=8, checkpoint=0, written=2).check_start_over()  # killed before: fine


def test_a_missing_or_damaged_config_stops_the_check(tmp_path):
    run = _run(tmp_path / "run")
    (run.root / "config.yaml").write_text("save_every: [1\n")
    with pytest.raises(UserError, match=r"config.yaml is damaged .*nothing was deleted"):
        run.check_resume(run.load_state())
    (run.root / "config.yaml").unlink()
    with pytest.raises(UserError, match=r"config.yaml is missing"):
        run.check_resume(run.load_state())


# --- the checkpoint's files -----------------------------------------------------------------
@pytest.mark.parametrize("name, says", [
    ("policies/solo/model.safetensors", r"cut short: \d+ bytes where its header describes \d+"),
    ("learner/solo/optimizer.pt", r"not a complete torch archive: File is not a zip file"),
    ("policies/solo/config.json", r"not valid JSON: Unterminated string"),
])
def test_a_truncated_checkpoint_file_is_refused(tmp_path, name, says):
    run = _run(tmp_path / "run")
    run.check_resume(run.load_state())
    path = run.checkpoint / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UserError, match=rf"^{path} is damaged \({says}.*\): `--resume` cannot continue"):
        run.check_resume(run.load_state())


def test_a_missing_policy_folder_is_refused(tmp_path):
    run = _run(tmp_path / "run")
    import shutil

    shutil.rmtree(run.checkpoint / "learner" / "solo")
    with pytest.raises(UserError, match=r"learner/solo is missing: the checkpoint of step 2 is incomplete"):
        run.check_resume(run.load_state())


# --- trackers.json --------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["{oops", "[]", '{"wandb_run_id": "../../x"}', '{"mlflow_run_id": 5}'])
def test_damaged_tracker_ids_start_new_tracker_runs(tmp_path, caplog, text):
    (tmp_path / "trackers.json").write_text(text)
    with caplog.at_level(logging.WARNING, logger="mas_trainer.run.tracking"):
        assert _load_ids(tmp_path) == {}
    assert "trackers.json is damaged" in caplog.text
    (tmp_path / "trackers.json").write_text('{"wandb_run_id": "0a1b2c3d4e5f"}')
    assert _load_ids(tmp_path) == {"wandb_run_id": "0a1b2c3d4e5f"}


def test_a_fit_refused_before_writing_leaves_no_lock_file_nor_folder(tmp_path):
    """The lock is taken before the app and the tasks are checked; a refusal then must leave the
    output as it was: a folder it created goes, an existing one keeps only what it had."""
    new = tmp_path / "a" / "b" / "run"
    with RunDir(new).locked():
        assert (new / ".lock").exists()
    assert not (tmp_path / "a").exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError):
        with RunDir(existing).locked():
            raise RuntimeError("refused")
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]
    run = tmp_path / "run"
    with RunDir(run).locked() as rd:
        rd.create("seed: 0\n")  # a run that started keeps its lock file (resume finds it there)
    assert (run / ".lock").exists() and (run / "config.yaml").exists()
