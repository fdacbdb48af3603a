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
```

A checkpoint is committed by one rename of a complete folder, so a run killed at any
moment resumes from the last complete one; rows and trajectory files written after it
are removed on resume, then written again by the resumed steps: none lost, none twice.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError

from mas_trainer.errors import UserError
from mas_trainer.spec import FROZEN_POLICY, ResolvedSpec, TrainSpec

__all__ = ["RunDir", "AppRecord", "PolicyRecord"]


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

    def create(self, config_yaml: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.traj_dir.mkdir(exist_ok=True)
        (self.root / "config.yaml").write_text(config_yaml)

    def write_app(self, spec: ResolvedSpec) -> None:
        (self.root / "app.json").write_text(AppRecord.from_spec(spec).model_dump_json(indent=1))

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

    # --- records ---------------------------------------------------------------------------
    def write_trajectories(self, step: int, lines: Iterable[str], name: str | None = None) -> Path:
        path = self.traj_dir / f"{name or f'step_{step:06d}'}.jsonl"
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            for line in lines:
                f.write(line + "\n")
        os.replace(tmp, path)
        return path

    def append_metrics(self, row: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

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
        """Make the staged folder the checkpoint: state.json last, then one rename."""
        (self._staging / "state.json").write_text(json.dumps(state, indent=1))
        shutil.rmtree(self._old, ignore_errors=True)
        if self.checkpoint.exists():
            os.replace(self.checkpoint, self._old)
        os.replace(self._staging, self.checkpoint)
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
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, self.metrics_path)
        for path in self.traj_dir.glob("step_*.jsonl"):
            if int(path.stem.split("_")[1]) > step:
                path.unlink()
        for path in self.traj_dir.glob("*.tmp"):
            path.unlink()
