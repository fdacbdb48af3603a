"""The run directory: config, metrics, trajectories per step, checkpoints, resume state.

```
RUN_DIR/config.yaml               resolved config
RUN_DIR/app.json                  the policy map the run trained (`AppRecord`)
RUN_DIR/metrics.jsonl             one row per training step (kind "train") and evaluation (kind "val")
RUN_DIR/trajectories/step_000001.jsonl
RUN_DIR/checkpoint/policies/NAME/ Hugging Face folder per policy (transformers / vllm serve)
RUN_DIR/checkpoint/learner/NAME/  the learner's resume state (optimizer, RNG; verl: sharded model too)
RUN_DIR/checkpoint/state.json     step, data position, seeds
RUN_DIR/rewards.png               reward per role over steps
RUN_DIR/.lock                     held by the live `fit` (pid inside)
```

A checkpoint is committed by one rename of a complete folder, so a run killed at any
moment resumes from the last complete one; rows and trajectory files written after it
are removed on resume, then written again by the resumed steps: none lost, none twice.
A run killed before its first checkpoint has nothing to resume: `start_over` clears it.

Durability (power loss, not only kill -9): records are flushed as they are written and
fsynced once per checkpoint, just before it is committed (`commit`): the trajectory files,
`metrics.jsonl`, every file and folder of the staged checkpoint, `state.json`; then the
rename, then the run directory itself. So a committed checkpoint never points at steps whose
rows or trajectories are not on disk, and the cost is a few fsyncs every `save_every` steps.

One `fit` at a time: `locked()` holds a POSIX lock on `RUN_DIR/.lock` for the whole run
(released by the kernel when the process dies, kill -9 included), so a second `fit` on the
same directory is refused instead of deleting the live run's files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

from pydantic import BaseModel, ValidationError

from mas_trainer.errors import UserError
from mas_trainer.spec import FROZEN_POLICY, ResolvedSpec, TrainSpec

__all__ = ["RunDir", "AppRecord", "PolicyRecord", "fsync_path", "fsync_tree"]


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the names in it, renames included, durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and folder under `root`, folders after their contents."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(dirpath)


class PolicyRecord(BaseModel):
    base_model: str
    trainable: bool


class AppRecord(BaseModel):
    """`app.json`: the policy map a run trained, written by `fit`, read by `export`, `serve`
    (which routes the unedited app's nodes with it) and anyone auditing the run."""

    nodes: list[str]
    roles: dict[str, str]  # node -> policy
    role_names: dict[str, str] = {}  # node -> role, where several nodes are one role
    frozen: list[str] = []
    default_policy: str | None = None
    policies: dict[str, PolicyRecord]  # the frozen policy included

    @classmethod
    def from_spec(cls, spec: ResolvedSpec) -> "AppRecord":
        s = spec.spec
        return cls(nodes=list(spec.nodes), roles=dict(s.roles), role_names=dict(s.role_names), frozen=sorted(s.frozen),
                   default_policy=s.default_policy,
                   policies={p: PolicyRecord(base_model=pol.base_model, trainable=pol.trainable) for p, pol in spec.policies.items()})

    def resolved(self) -> ResolvedSpec:
        """The spec `fit` resolved against the app's graph, rebuilt without the app."""
        pols = {p: v.base_model for p, v in self.policies.items() if p != FROZEN_POLICY}
        spec = TrainSpec.build(self.roles, pols, role_names=self.role_names, frozen=self.frozen, default_policy=self.default_policy)
        return spec.resolve(self.nodes)


class RunDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.metrics_path = self.root / "metrics.jsonl"
        self.traj_dir = self.root / "trajectories"
        self.checkpoint = self.root / "checkpoint"
        self._staging = self.root / ".checkpoint-staging"
        self._old = self.root / ".checkpoint-old"
        self._unsynced: set[Path] = set()  # written since the last checkpoint, fsynced by `commit`

    @contextlib.contextmanager
    def locked(self) -> Iterator["RunDir"]:
        """Hold the run directory for one `fit`; refuse it if another live process holds it.
        A POSIX lock: not inherited by forked children, released when the process dies."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise UserError(f"{self.root} is in use by another running `mas-trainer fit` (pid {holder}); "
                                "wait for it or stop it, or choose another --output") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield self
        finally:
            os.close(fd)  # releases the lock

    def create(self, config_yaml: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.traj_dir.mkdir(exist_ok=True)
        (self.root / "config.yaml").write_text(config_yaml)
        self._unsynced.add(self.root / "config.yaml")

    def write_app(self, spec: ResolvedSpec) -> None:
        (self.root / "app.json").write_text(AppRecord.from_spec(spec).model_dump_json(indent=1))
        self._unsynced.add(self.root / "app.json")

    def app(self) -> AppRecord:
        path = self.root / "app.json"
        if not path.exists():
            raise UserError(f"{self.root} has no app.json (is it a `mas-trainer fit` run directory?)")
        try:
            return AppRecord.model_validate_json(path.read_text())
        except ValidationError as exc:
            raise UserError(f"{path}: not a policy map written by `mas-trainer fit` ({exc.errors()[0]['msg']})") from exc

    def exists(self) -> bool:
        return self.root.exists() and any(self.root.iterdir())

    def trajectory_files(self) -> list[Path]:
        return sorted(self.traj_dir.glob("step_*.jsonl")) if self.traj_dir.exists() else []

    def holds_run(self) -> bool:
        """A run went past its start here: it logged a row, wrote trajectories or a checkpoint."""
        return bool(self.metrics()) or bool(self.trajectory_files()) or self.checkpoint.exists() or self._old.exists()

    def start_over(self) -> tuple[int, int]:
        """Clear a run that has no complete checkpoint (killed before its first one), so it
        runs again from step 0: its metrics rows, trajectory files and any partial checkpoint
        go. Returns (rows, files) discarded."""
        rows, files = len(self.metrics()), len(self.trajectory_files())
        for folder in (self._staging, self._old, self.checkpoint):
            shutil.rmtree(folder, ignore_errors=True)
        self.truncate_to(-1)
        return rows, files

    # --- records ---------------------------------------------------------------------------
    def write_trajectories(self, step: int, lines: Iterable[str], name: str | None = None) -> Path:
        path = self.traj_dir / f"{name or f'step_{step:06d}'}.jsonl"
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            for line in lines:
                f.write(line + "\n")
        os.replace(tmp, path)
        self._unsynced.add(path)
        return path

    def append_metrics(self, row: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self._unsynced.add(self.metrics_path)

    def sync(self) -> None:
        """Make what was written since the last checkpoint durable (files, then their folders)."""
        for path in sorted(self._unsynced):
            if path.exists():
                fsync_path(path)
        if self.traj_dir.exists():
            fsync_path(self.traj_dir)
        fsync_path(self.root)
        self._unsynced.clear()

    def metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        rows = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a row cut by a kill mid-write
                break
        return rows

    # --- checkpoints -----------------------------------------------------------------------
    def staging(self) -> Path:
        shutil.rmtree(self._staging, ignore_errors=True)
        (self._staging / "policies").mkdir(parents=True)
        return self._staging

    def commit(self, state: dict[str, Any]) -> None:
        """Make the staged folder the checkpoint. Everything it covers is on disk first (the
        steps' records, the staged files, state.json last), then one rename, then the run
        directory is fsynced so the rename itself survives a power loss."""
        self.sync()
        fsync_tree(self._staging)
        with (self._staging / "state.json").open("w") as f:
            f.write(json.dumps(state, indent=1))
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self._staging)
        shutil.rmtree(self._old, ignore_errors=True)
        if self.checkpoint.exists():
            os.replace(self.checkpoint, self._old)
        os.replace(self._staging, self.checkpoint)
        fsync_path(self.root)
        shutil.rmtree(self._old, ignore_errors=True)

    def load_state(self) -> dict[str, Any] | None:
        if not self.checkpoint.exists() and self._old.exists():  # killed between the two renames
            os.replace(self._old, self.checkpoint)
        state = self.checkpoint / "state.json"
        return json.loads(state.read_text()) if state.exists() else None

    def policy_dir(self, policy: str, root: Path | None = None) -> Path:
        return (root or self.checkpoint) / "policies" / policy

    def learner_dir(self, policy: str, root: Path | None = None) -> Path:
        """The learner's own resume state of a policy (optimizer, RNG, verl's shards)."""
        return (root or self.checkpoint) / "learner" / policy

    def truncate_to(self, step: int) -> None:
        """Forget what steps after `step` wrote (they will run again)."""
        rows = [r for r in self.metrics() if r.get("step", 0) <= step]
        tmp = self.metrics_path.with_suffix(".tmp")
        with tmp.open("w") as f:  # the rows kept are the checkpoint's: durable before the old file goes
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.metrics_path)
        fsync_path(self.root)
        for path in self.trajectory_files():
            if int(path.stem.split("_")[1]) > step:
                path.unlink()
        for path in self.traj_dir.glob("*.tmp"):
            path.unlink()
