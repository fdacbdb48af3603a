"""The embedded engine's settings: one typed object from the config to the engine.

`RuntimeConfig` inherits these fields (so they stay `runtime.max_batch_size` and so on for
users), and every path that builds an engine (a worker group, verl's rank 0, a rollout
replica, the verbs' backends) hands `EngineSettings.of(runtime)` through whole. A new engine
setting is a field here and its use in `torch_engine.py`, nothing in between.
Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EngineSettings"]


class EngineSettings(BaseModel):
    """How the embedded engine batches, caches and computes (not where: the device is the plan's)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(8, ge=1, description="embedded and torch-replica engines: rows decoded together; on every "
                                "engine also rollout.max_in_flight's default (vllm batches up to runtime.replica.max_num_seqs)")
    batch_wait_ms: float = Field(50.0, ge=0, description="embedded and torch-replica engines: how long an idle engine waits for "
                                 "more requests to fill a batch")
    prefix_cache_mb: float = Field(
        0.0, ge=0, description="embedded and torch-replica engines: MiB for the K/V of prompt prefixes reused across requests "
        "(a group's prompt, shared system prompts, earlier turns); cleared at every weight update; 0: off. Log-probs equal a "
        "full recompute within fp32 rounding, which can flip a rare sample: a resumed run may then differ from an uninterrupted one")
    fast_decode: bool = Field(
        True, description="embedded and torch-replica engines: decode with a K/V cache grown in place, grouped K/V heads read "
        "unrepeated and top-p from the top k (the same tokens and log-probs; decoding 1.2x as fast on the bundled model); false: "
        "Hugging Face's plain cache and attention and a full sort (the reference)")
    engine_bf16: bool | Literal["auto"] = Field(
        "auto", description="embedded and torch-replica engines: bf16 autocast while generating (auto: where bf16 is fast: GPUs, "
        "CPUs with AVX512-BF16/AMX; log-probs then carry bf16 rounding like the learner's); vllm: runtime.replica.dtype")

    @classmethod
    def of(cls, section: BaseModel) -> EngineSettings:
        """The engine settings of a config section that carries them (`RuntimeConfig`)."""
        return cls.model_validate(section.model_dump(include=set(cls.model_fields)))
