"""What the controller tells a worker group to be: one typed plan per trainable policy.

The plan crosses a process boundary (a Ray actor's constructor), so it carries plain data;
the configs inside it are the already-validated sections of the `fit` config, dumped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mas_trainer.config import Resources

__all__ = ["WorkerPlan"]


class WorkerPlan(BaseModel):
    """Everything one worker group needs to start (picklable, validated once)."""

    model_config = ConfigDict(extra="forbid")

    policy: str
    model: str = Field(description="model spec the weights start from: tiny | default | folder")
    reference: str | None = Field(None, description="model of the frozen KL reference (default: `model`)")
    learner: dict[str, Any]
    advantage: dict[str, Any]
    critic: dict[str, Any]
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    resources: Resources = Field(default_factory=Resources)
    max_batch_size: int = 8
    batch_wait_ms: float = 5.0
    engine_bf16: bool | Literal["auto"] = False
    torch_threads: int | None = None
    engine: Literal["embedded", "vllm", "torch-replica"] = Field(
        "embedded", description="embedded: rank 0 hosts the engine; otherwise rollout replicas serve and receive the weights")
    replica: dict[str, Any] = Field(default_factory=dict, description="ReplicaConfig, dumped (replica engines)")
    replica_first_rank: int = Field(0, ge=0, description="the policy's first rollout replica rank (ranks are unique in a run)")
    offload_between_phases: bool = Field(
        False, description="GPUs shared with other worker groups: the learner's shards and optimizer leave the GPU after each update")
