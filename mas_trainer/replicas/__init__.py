"""Rollout replicas: policies served by vLLM (or the embedded engine) through verl's
rollout machinery, with weights synced from the learner after each update.

Torch-free here: `ReplicaEngine`, `ReplicaConfig`. `mas_trainer.replicas.fleet` (Ray, verl),
`torch_replica` and `gloo_sync` (torch) are imported where a run uses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_trainer._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.replicas.config import ENGINES, ReplicaConfig
    from mas_trainer.replicas.engine import ReplicaEngine, ReplicaError, vllm_sampling

__all__ = ["ENGINES", "ReplicaConfig", "ReplicaEngine", "ReplicaError", "vllm_sampling"]

__getattr__ = lazy_exports(__name__, {
    "mas_trainer.replicas.config": ["ENGINES", "ReplicaConfig"],
    "mas_trainer.replicas.engine": ["ReplicaEngine", "ReplicaError", "vllm_sampling"],
})
