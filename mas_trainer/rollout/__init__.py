"""Rollout replicas: policies served by vLLM (or the embedded engine) through verl's
rollout machinery, with weights synced from the learner after each update.

Torch-free here: `ReplicaEngine`, `ReplicaConfig`. `mas_trainer.rollout.fleet` (Ray, verl),
`torch_replica` and `gloo_sync` (torch) are imported where a run uses them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.rollout.config import ENGINES, ReplicaConfig
    from mas_trainer.rollout.engine import ReplicaEngine, ReplicaError, vllm_sampling

__all__ = ["ENGINES", "ReplicaConfig", "ReplicaEngine", "ReplicaError", "vllm_sampling"]

# imported on first use: `import mas_trainer.config` (every CLI command) must not pay for
# FastAPI, OpenTelemetry or Ray through a package's __init__
_LAZY = {
    "ENGINES": "mas_trainer.rollout.config",
    "ReplicaConfig": "mas_trainer.rollout.config",
    "ReplicaEngine": "mas_trainer.rollout.engine",
    "ReplicaError": "mas_trainer.rollout.engine",
    "vllm_sampling": "mas_trainer.rollout.engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
