"""The run directory: config, metrics, trajectories per step, checkpoints, resume state.

```
RUN_DIR/config.yaml               resolved config
RUN_DIR/app.json                  the policy map the run trained (`AppRecord`)
RUN_DIR/plan.json                 the run plan `fit` resolved at its last launch (`RunPlan`; informative, resume does not need it)
RUN_DIR/metrics.jsonl             one row per training step (kind "train") and evaluation (kind "val"); the warm
                                  start's row (kind "warm_start", step 0) first, when there is one
RUN_DIR/trajectories/step_000001.jsonl
RUN_DIR/checkpoint/policies/NAME/ Hugging Face folder per policy (transformers / vllm serve)
RUN_DIR/checkpoint/learner/NAME/  the learner's resume state (optimizer, RNG; verl: sharded model too)
RUN_DIR/checkpoint/state.json     step, data position, seeds, the policies warm-started, the best evaluation and patience
RUN_DIR/best/step_000015/policies/NAME/  the weights of the best held-out evaluation (`best.keep`), the one state.json names
RUN_DIR/checkpoints.jsonl         one line per committed checkpoint ({"step": S}), appended after its rename
RUN_DIR/rewards.png               reward per role over steps
RUN_DIR/workers.log               what the Ray workers printed (logs, tracebacks), appended by each launch
RUN_DIR/.lock                     held by the live `fit` (pid inside)
```

A checkpoint is committed by one rename of a complete folder, so a run killed at any
moment resumes from the last complete one; rows and trajectory files written after it
are removed on resume, then written again by the resumed steps: none lost, none twice.
A run killed before its first checkpoint has nothing to resume: `start_over` clears it.

The best held-out evaluation's weights are kept the same way, by step: staged in
`best/.staging`, made durable, renamed to `best/step_N` (`commit_best`); the state that names
it is committed later, with the next checkpoint (an early stop checkpoints at once), and only
then do the folders of the bests it supersedes go (`keep_best`). So whatever moment a run is
killed, the best that committed state.json names is on disk, and a folder it does not name (a
newer best of steps the resumed run repeats, an older one not yet removed) is removed on resume.
`trained_checkpoint` is where `serve`, `export`, `eval` and `FitResult` find the weights: the
best by default where the run kept one, else, or when asked, the last checkpoint.

Resume trusts nothing it reads (`load_state`, `check_resume`, `check_start_over`): state.json
is validated field by field (`CheckpointState`), then checked against the records beside it
before anything is deleted. The records must reach the checkpoint's step (else the state is
not this data's), and none may lie past the step where the run would have committed its next
checkpoint (`save_every`, `steps` of config.yaml, the config of the attempt that wrote them):
such a record proves a later checkpoint was committed, so the state is stale and acting on it
would delete committed steps. And every commit leaves its own record, a line of
`checkpoints.jsonl` appended once the rename is durable: a line past state.json's step proves
that a later checkpoint was committed, so a state even one save interval behind is refused
(a state ahead of the log is fine: killed between the rename and the line). A run without a
checkpoint whose log names one is not started over either. The checkpoint's files are checked
for truncation (safetensors headers against their size, torch zip archives, JSON). A damaged
line of metrics.jsonl is skipped with a warning, the rows after it kept.

Durability (power loss, not only kill -9): records are flushed as they are written and
fsynced once per checkpoint, just before it is committed (`commit`): the trajectory files,
`metrics.jsonl`, every file and folder of the staged checkpoint, `state.json`; then the
rename, then the run directory itself, then the line of checkpoints.jsonl. So a committed
checkpoint never points at steps whose rows or trajectories are not on disk, its line never
names a checkpoint whose rename was lost, and the cost is a few fsyncs every `save_every` steps.

One `fit` at a time: `locked()` holds a POSIX lock on `RUN_DIR/.lock` for the whole run
(released by the kernel when the process dies, kill -9 included), so a second `fit` on the
same directory is refused instead of deleting the live run's files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import struct
import zipfile
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mas_trainer.config import ConfigError, FitConfig, load_config
from mas_trainer.errors import UserError
from mas_trainer.spec import FROZEN_POLICY, ResolvedSpec, TrainSpec

__all__ = ["RunDir", "AppRecord", "BestRecord", "CheckpointState", "PolicyRecord", "TrainedCheckpoint", "CHECKPOINTS", "fsync_path",
           "fsync_tree", "run_config", "trained_checkpoint", "trained_policies"]

log = logging.getLogger(__name__)

_STEP_FILE = re.compile(r"step_(\d{1,9})(_val|_forks)?")  # a trajectory file's stem: step_000012, step_000010_val,
# step_000012_forks (counterfactual credit's continuations of a training step)
_DEFAULT_SAVE_EVERY, _DEFAULT_STEPS = 10, 20  # FitConfig's defaults, for a config.yaml that leaves them out
_RESTORE = "restore the run's own checkpoint folder from a backup, or train into a new --output"
CHECKPOINTS = ("best", "last")  # what `serve`, `export` and `eval` may be asked for (--checkpoint)


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
        s = spec.declared
        return cls(nodes=list(spec.nodes), roles=dict(s.roles), role_names=dict(s.role_names), frozen=sorted(s.frozen),
                   default_policy=s.default_policy,
                   policies={p: PolicyRecord(base_model=pol.base_model, trainable=pol.trainable) for p, pol in spec.policies.items()})

    def resolved(self) -> ResolvedSpec:
        """The spec `fit` resolved against the app's graph, rebuilt without the app."""
        pols = {p: v.base_model for p, v in self.policies.items() if p != FROZEN_POLICY}
        spec = TrainSpec.build(self.roles, pols, role_names=self.role_names, frozen=self.frozen, default_policy=self.default_policy)
        return spec.resolve(self.nodes)


class BestRecord(BaseModel):
    """The best held-out evaluation so far, in `state.json` (loop/selection.py ranks them)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    step: int = Field(ge=1)
    metric: str
    mode: Literal["max", "min"]
    value: float
    kept: bool  # its weights are in best/step_N (best.keep)


class CheckpointState(BaseModel):
    """`checkpoint/state.json` as `fit` commits it. Strict: a wrong type, a missing or unknown
    field refuses the whole state (a checkpoint is only ever written after a step: step >= 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    step: int = Field(ge=1)
    position: int = Field(ge=0)
    seed: int
    policies: list[str]
    warm_start: list[str] = []  # the policies whose supervised warm start ran before step 1 (never again on resume)
    best: BestRecord | None = None  # None: no held-out evaluation after step 0 yet (states of runs before it: none kept)
    stale: int = Field(0, ge=0)  # held-out evaluations since the last improvement of more than best.min_delta

    @field_validator("policies")
    @classmethod
    def _folder_names(cls, names: list[str]) -> list[str]:
        for name in names:  # each names a folder under checkpoint/policies and checkpoint/learner
            if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
                raise ValueError(f"{name!r} is not a policy folder name")
        return names


def _row_step(row: Any) -> int | None:
    """The step of a metrics row, None when it is not one (not an object, no whole step >= 0)."""
    if not isinstance(row, dict):
        return None
    step = row.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def file_step(path: Path) -> tuple[int, bool] | None:
    """(step, held-out) of a trajectory file of `fit` (`step_000012.jsonl`, `step_000010_val.jsonl`,
    `step_000012_forks.jsonl`)."""
    m = _STEP_FILE.fullmatch(path.stem)
    return (int(m.group(1)), m.group(2) == "_val") if m else None


def _damage(path: Path) -> str | None:
    """Why a checkpoint file is damaged (cut short by a full disk, a copy, a crash outside `fit`),
    or None: checked by format, without loading it. safetensors: the header's tensors must end
    exactly at the end of the file; torch archives (zip): the central directory must be there;
    JSON: must parse. Other files are not checked."""
    suffix = path.suffix
    if suffix not in (".safetensors", ".pt", ".pth", ".bin", ".json"):
        return None
    size = path.stat().st_size
    if size == 0:
        return "it is empty"
    with path.open("rb") as f:
        head = f.read(8)
        if suffix == ".safetensors":
            if len(head) < 8:
                return "cut short inside its header"
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:  # safetensors' own limit
                return f"its header claims {n} bytes"
            if n > size - 8:
                return f"cut short inside its header: {size} bytes, a header of {n}"
            try:
                header = json.loads(f.read(n))
                end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
                return "its header is not valid safetensors"
            if 8 + n + end != size:
                return f"{'cut short' if size < 8 + n + end else 'the wrong size'}: {size} bytes where its header describes {8 + n + end}"
            return None
    if suffix == ".json":
        try:
            json.loads(path.read_bytes())
        except (ValueError, RecursionError) as exc:
            return f"not valid JSON: {exc}"
        return None
    if head[:4] == b"PK\x03\x04":  # torch.save's archive (a legacy pickle is not checked)
        try:
            with zipfile.ZipFile(path):
                pass
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            return f"not a complete torch archive: {exc}"
    return None


class RunDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.metrics_path = self.root / "metrics.jsonl"
        self.traj_dir = self.root / "trajectories"
        self.checkpoint = self.root / "checkpoint"
        self._staging = self.root / ".checkpoint-staging"
        self._old = self.root / ".checkpoint-old"
        self.commits_path = self.root / "checkpoints.jsonl"
        self.best_root = self.root / "best"
        self._best_staging = self.best_root / ".staging"
        self._unsynced: set[Path] = set()  # written since the last checkpoint, fsynced by `commit`

    @contextlib.contextmanager
    def locked(self) -> Iterator["RunDir"]:
        """Hold the run directory for one `fit`; refuse it if another live process holds it.
        A POSIX lock: not inherited by forked children, released when the process dies. A `fit`
        refused before it wrote anything (no config.yaml) leaves no trace: the lock file and a
        folder it had to create go again."""
        made = [p for p in (*reversed(self.root.parents), self.root) if not p.exists()]
        self.root.mkdir(parents=True, exist_ok=True)
        lock = self.root / ".lock"
        new_lock = not lock.exists()
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        held = False
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise UserError(f"{self.root} is in use by another running `mas-trainer fit` (pid {holder}); "
                                "wait for it or stop it, or choose another --output") from None
            held = True
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield self
        finally:
            # unlinked while still held, so no other fit can have locked the file that goes away
            gone = held and new_lock and not (self.root / "config.yaml").exists()
            if gone:
                with contextlib.suppress(OSError):
                    lock.unlink()
            os.close(fd)  # releases the lock
            if gone:
                with contextlib.suppress(OSError):
                    for folder in reversed(made):
                        folder.rmdir()  # only empty ones: never anything another process wrote

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
        return (bool(self.metrics()) or bool(self.trajectory_files()) or self.checkpoint.exists() or self._old.exists()
                or self.commits_path.exists() or self.best_root.exists())

    def start_over(self) -> tuple[int, int]:
        """Clear a run that has no complete checkpoint (killed before its first one), so it
        runs again from step 0: its metrics rows, trajectory files and any partial checkpoint
        go. Returns (rows, files) discarded."""
        rows, files = len(self.metrics()), len(self.trajectory_files())
        for folder in (self._staging, self._old, self.checkpoint, self.best_root):
            shutil.rmtree(folder, ignore_errors=True)
        self.commits_path.unlink(missing_ok=True)
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
        """Every intact row of metrics.jsonl, in order: a damaged line is skipped, not the rows after it."""
        return self._read_metrics()[0]

    def _read_metrics(self) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
        """(intact rows, [(line number, why)] of the damaged lines). The last line without its
        newline is a row cut by a kill mid-write: "cut"."""
        if not self.metrics_path.exists():
            return [], []
        try:
            data = self.metrics_path.read_bytes()
        except OSError as exc:
            raise UserError(f"{self.metrics_path} cannot be read ({exc.strerror or exc}); make it a readable file "
                            "(the run's metrics rows, one JSON object a line)") from None
        lines = data.split(b"\n")
        cut = lines.pop()  # b"" when the file ends with its newline
        rows: list[dict[str, Any]] = []
        damaged: list[tuple[int, str]] = []
        for i, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (ValueError, RecursionError):  # not JSON, not UTF-8
                damaged.append((i, "not a JSON row"))
                continue
            if _row_step(row) is None:
                damaged.append((i, "not a metrics row (a JSON object with a whole step >= 0)"))
                continue
            rows.append(row)
        if cut.strip():
            damaged.append((len(lines) + 1, "cut"))
        return rows, damaged

    def _warn_damaged(self, damaged: list[tuple[int, str]]) -> None:
        for lineno, why in damaged[:5]:
            if why == "cut":  # what a kill mid-write leaves: expected, the step runs again
                log.info("%s line %d: a row cut short by the end of the run; dropped", self.metrics_path, lineno)
            else:
                log.warning("%s line %d: %s, damaged; skipped (dropped from the file), the intact rows after it are kept",
                            self.metrics_path, lineno, why)
        if len(damaged) > 5:
            log.warning("%s: %d more damaged lines skipped", self.metrics_path, len(damaged) - 5)

    # --- what a resume may trust ---------------------------------------------------------------
    def _records(self) -> tuple[set[int], int, str]:
        """(training steps that left a metrics row or a trajectory file, the highest step of any
        record, train or held-out, -1 if none, and which file holds it)."""
        train: set[int] = set()
        last, where = -1, ""
        for row in self.metrics():
            step = row["step"]
            if row.get("kind") == "train":
                train.add(step)
            if step > last:
                last, where = step, self.metrics_path.name
        for path in self.trajectory_files():
            found = file_step(path)
            if found is None:
                continue
            step, held_out = found
            if not held_out:
                train.add(step)
            if step > last:
                last, where = step, f"{self.traj_dir.name}/{path.name}"
        return train, last, where

    def committed(self) -> int:
        """The highest step `checkpoints.jsonl` says a checkpoint was committed at, 0 if none.
        A line that is not a whole step >= 1 is skipped (a damaged log proves less, never more)."""
        try:
            data = self.commits_path.read_bytes()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise UserError(f"{self.commits_path} cannot be read ({exc.strerror or exc}), so the checkpoint cannot be "
                            "checked against it and nothing was deleted; make it a readable file") from None
        last = 0
        for raw in data.split(b"\n"):
            try:
                step = _row_step(json.loads(raw)) if raw.strip() else None
            except (ValueError, RecursionError):
                step = None
            if step is not None and step > last:
                last = step
        return last

    def _schedule(self) -> tuple[int, int]:
        """(save_every, steps) of config.yaml: the config of the `fit` that wrote the records
        after the checkpoint (each `fit` writes it once it has removed the previous one's)."""
        path = self.root / "config.yaml"
        unchecked = ("without it the checkpoint cannot be checked against the run's records, so nothing was deleted; "
                     "restore it (the run's resolved config), or train into a new --output")
        try:
            config = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path} is missing: {unchecked}") from None
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            why = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"{path} is damaged ({why}): {unchecked}") from None
        config = config if isinstance(config, dict) else {}
        values = []
        for key, default in (("save_every", _DEFAULT_SAVE_EVERY), ("steps", _DEFAULT_STEPS)):
            value = config.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{path}: {key}={value!r} is not a whole number >= 1, so the checkpoint cannot be checked "
                                "against the run's records and nothing was deleted; restore the run's config.yaml")
            values.append(value)
        return values[0], values[1]

    def _next_commit(self, step: int) -> tuple[int, int]:
        """(the step at which the run, past `step`, commits its next checkpoint; save_every)."""
        save_every, steps = self._schedule()
        if step >= steps:
            return step, save_every
        return min((step // save_every + 1) * save_every, steps), save_every

    def check_start_over(self) -> None:
        """Before `start_over` clears a run without a checkpoint: refuse if its records go past
        the step where its first checkpoint was committed (the checkpoint was lost, not never written)."""
        _train, last, where = self._records()
        bound, save_every = self._next_commit(0)
        if last > bound:
            raise UserError(f"{self.root} has no checkpoint, but its {where} holds step {last}, past step {bound} where the run "
                            f"committed its first checkpoint (save_every={save_every}): the checkpoint folder was removed, and "
                            f"starting over would delete the committed steps, so nothing was deleted; {_RESTORE}")
        committed = self.committed()
        if committed:
            raise UserError(f"{self.root} has no checkpoint, but its {self.commits_path.name} says one was committed at step "
                            f"{committed}: the checkpoint folder was removed, and starting over would delete the committed "
                            f"steps, so nothing was deleted; {_RESTORE}")

    def check_resume(self, state: dict[str, Any]) -> None:
        """Refuse, before anything is deleted, a checkpoint that does not match the records
        beside it or whose files are damaged (see the module's docstring)."""
        path, step = self.checkpoint / "state.json", state["step"]
        if state["position"] < step:
            raise UserError(f"{path}: position {state['position']} is less than step {step} (each step draws at least one "
                            f"task): not a state `mas-trainer fit` wrote, so nothing was deleted; {_RESTORE}")
        committed = self.committed()
        if committed > step:
            raise UserError(f"{path} says step {step}, but {self.commits_path.name} says a checkpoint was committed at step "
                            f"{committed}: the state is older than the run's last checkpoint and resuming from it would "
                            f"delete committed steps, so nothing was deleted; {_RESTORE}")
        train, last, where = self._records()
        reached = max(train, default=0)
        if step > reached:
            raise UserError(f"{path} says step {step}, but the run's records (metrics.jsonl, trajectories/) end at step "
                            f"{reached}: the checkpoint is not this run's, so nothing was deleted; {_RESTORE}")
        bound, save_every = self._next_commit(step)
        if last > bound:
            raise UserError(f"{path} says step {step}, but {where} holds step {last}, past step {bound} where the run "
                            f"committed its next checkpoint (save_every={save_every}): the checkpoint is older than the run's "
                            f"records and resuming from it would delete committed steps, so nothing was deleted; {_RESTORE}")
        best = state.get("best")
        best_dir = self.best_dir(best["step"]) if best and best["kept"] else None
        for policy in state["policies"]:
            for folder in (self.policy_dir(policy), self.learner_dir(policy), *([self.policy_dir(policy, best_dir)] if best_dir else [])):
                if not folder.is_dir():
                    raise UserError(f"{folder} is missing: the checkpoint of step {step} is incomplete, so nothing was "
                                    f"deleted; {_RESTORE}")
        for dirpath, _dirs, files in (*os.walk(self.checkpoint), *(os.walk(best_dir) if best_dir else ())):
            for name in sorted(files):
                file = Path(dirpath) / name
                if file.is_symlink():
                    continue
                try:
                    why = _damage(file)
                except OSError as exc:
                    why = f"cannot be read: {exc.strerror or exc}"
                if why is not None:
                    raise UserError(f"{file} is damaged ({why}): `--resume` cannot continue from the checkpoint of step "
                                    f"{step}, and nothing was deleted; {_RESTORE}")

    # --- checkpoints -----------------------------------------------------------------------
    def staging(self) -> Path:
        shutil.rmtree(self._staging, ignore_errors=True)
        (self._staging / "policies").mkdir(parents=True)
        return self._staging

    def commit(self, state: dict[str, Any]) -> None:
        """Make the staged folder the checkpoint. Everything it covers is on disk first (the
        steps' records, the staged files, state.json last), then one rename, then the run
        directory is fsynced so the rename itself survives a power loss; then the commit's own
        record, a line of checkpoints.jsonl (never on disk before the rename it records)."""
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
        new = not self.commits_path.exists()
        with self.commits_path.open("a+b") as f:
            f.seek(0, os.SEEK_END)
            cut = f.tell() > 0 and os.pread(f.fileno(), 1, f.tell() - 1) != b"\n"  # a line cut by a kill: end it
            f.write(b"\n" * cut + json.dumps({"step": state["step"]}).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        if new:
            fsync_path(self.root)
        shutil.rmtree(self._old, ignore_errors=True)

    # --- the best held-out evaluation's weights ------------------------------------------------
    def best_dir(self, step: int) -> Path:
        return self.best_root / f"step_{step:06d}"

    def best_staging(self, linked_from: Path | None = None) -> Path:
        """An empty staging folder for the best's weights, or one holding `linked_from/policies`
        (a staged checkpoint's) as hard links: the same files, not a second copy on disk."""
        shutil.rmtree(self._best_staging, ignore_errors=True)
        self.best_root.mkdir(exist_ok=True)
        if linked_from is None:
            (self._best_staging / "policies").mkdir(parents=True)
        else:
            shutil.copytree(linked_from / "policies", self._best_staging / "policies", copy_function=_link_or_copy)
        return self._best_staging

    def commit_best(self, step: int) -> Path:
        """The staged best becomes `best/step_N`: its files on disk first, then one rename, then the
        folder that holds it. The learner's resume state a policy's save wrote beside the weights goes
        first: only the weights are the best's."""
        shutil.rmtree(self._best_staging / "learner", ignore_errors=True)
        fsync_tree(self._best_staging)
        target = self.best_dir(step)
        shutil.rmtree(target, ignore_errors=True)  # a step's own folder from an attempt that did not commit it
        os.replace(self._best_staging, target)
        fsync_path(self.best_root)
        return target

    def keep_best(self, step: int | None) -> None:
        """Remove every folder under best/ but the one of `step` (the best committed state.json
        names; None: none): superseded bests, bests of steps a resumed run repeats, a staging."""
        if not self.best_root.exists():
            return
        keep = None if step is None else self.best_dir(step).name
        for entry in self.best_root.iterdir():
            if entry.name == keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        if step is None:
            self.best_root.rmdir()

    def load_state(self) -> dict[str, Any] | None:
        """The committed checkpoint's state (`CheckpointState` as a dict), None when there is no
        checkpoint; a damaged or foreign state.json is refused in one line (UserError)."""
        if not self.checkpoint.exists() and self._old.exists():  # killed between the two renames
            os.replace(self._old, self.checkpoint)
        path = self.checkpoint / "state.json"
        if not self.checkpoint.exists():
            return None
        if not path.exists():  # `commit` renames a folder with its state.json in it: never one without
            raise UserError(f"{self.checkpoint} has no state.json: the checkpoint is incomplete or damaged, so nothing "
                            f"was deleted; {_RESTORE}")
        try:
            data = json.loads(path.read_bytes())
        except OSError as exc:
            raise UserError(f"{path} cannot be read ({exc.strerror or exc}); nothing was deleted: {_RESTORE}") from None
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8
            raise UserError(f"{path} is damaged (not JSON: {str(exc).splitlines()[0]}); nothing was deleted: {_RESTORE}") from None
        try:
            return CheckpointState.model_validate(data).model_dump()
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(map(str, err["loc"])) or "the state"
            raise UserError(f"{path} is not a checkpoint state written by `mas-trainer fit` ({field}: {err['msg']}); "
                            f"nothing was deleted: {_RESTORE}") from None

    def policy_dir(self, policy: str, root: Path | None = None) -> Path:
        return (root or self.checkpoint) / "policies" / policy

    def learner_dir(self, policy: str, root: Path | None = None) -> Path:
        """The learner's own resume state of a policy (optimizer, RNG, verl's shards)."""
        return (root or self.checkpoint) / "learner" / policy

    def truncate_to(self, step: int) -> None:
        """Forget what steps after `step` wrote (they will run again): their metrics rows and
        trajectory files. Damaged lines of metrics.jsonl go too (with a warning), never the
        intact rows after them. Callers check the step first (`check_resume`)."""
        all_rows, damaged = self._read_metrics()
        if step >= 0:
            self._warn_damaged(damaged)
        rows = [r for r in all_rows if r["step"] <= step]
        tmp = self.metrics_path.with_suffix(".tmp")
        with tmp.open("w") as f:  # the rows kept are the checkpoint's: durable before the old file goes
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.metrics_path)
        fsync_path(self.root)
        for path in self.trajectory_files():
            found = file_step(path)
            if found is not None and found[0] > step:  # a file `fit` did not name is not its to delete
                path.unlink()
        for path in self.traj_dir.glob("*.tmp"):
            path.unlink()


def run_config(run_dir: str | Path) -> FitConfig:
    """The config a `fit` run trained with (its `config.yaml`)."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise ConfigError(f"{run_dir} has no config.yaml (is it a `mas-trainer fit` run directory?)")
    return load_config(path, upgrade=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


@dataclass(frozen=True)
class TrainedCheckpoint:
    """The weights of a run that `serve`, `export`, `eval` and `FitResult.policies` take."""

    which: str  # "best" or "last"
    step: int
    policies: dict[str, Path]  # policy -> its Hugging Face folder
    best: dict[str, Any] | None  # state.json's record of the best evaluation (step, metric, mode, value, kept)


def trained_checkpoint(run_dir: str | Path, which: str | None = None) -> TrainedCheckpoint:
    """The run's best checkpoint where it kept one (`best.keep`, a held-out evaluation after
    step 0), else its last; `which` "best" or "last" asks for one (a best the run did not keep is
    refused). Both are what the committed state.json names: the weights `--resume` would trust."""
    if which is not None and which not in CHECKPOINTS:
        raise UserError(f"--checkpoint {which!r}: choose best or last")
    run = RunDir(run_dir)
    state = run.load_state()
    if state is None:
        raise ConfigError(f"{run_dir} has no checkpoint; train it with `mas-trainer fit --output {run_dir}` first")
    best = state["best"]
    kept = best is not None and best["kept"]
    if which == "best" and not kept:
        why = "best.keep was off" if best is not None else "it has no held-out evaluation after step 0 (--val-data, val_fraction)"
        raise ConfigError(f"{run_dir} kept no best checkpoint ({why}); take its last, step {state['step']}, with --checkpoint last")
    which = "best" if kept and which != "last" else "last"
    root, step = (run.best_dir(best["step"]), best["step"]) if which == "best" else (run.checkpoint, state["step"])
    folder = root / "policies"
    if not folder.is_dir():
        raise UserError(f"{folder} is missing, though {run.checkpoint / 'state.json'} names it: {_RESTORE}")
    return TrainedCheckpoint(which, step, {p.name: p for p in sorted(folder.iterdir()) if p.is_dir()}, best)


def trained_policies(run_dir: str | Path, which: str | None = None) -> dict[str, Path]:
    """policy -> the Hugging Face folder of its weights in the run's best checkpoint, else its last
    (`trained_checkpoint`)."""
    return trained_checkpoint(run_dir, which).policies
