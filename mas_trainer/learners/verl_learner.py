"""verl's training worker as the learner: its configs from ours, and turns in its batch layout.

A trainable policy's worker group is a verl `RayWorkerGroup`; on every rank
`verl.workers.engine_workers.TrainingWorker` (FSDP2) holds the policy's shard, takes verl's
`ppo_loss` through `set_loss_fn`, gives log-probs through `infer_batch` and updates through
`train_mini_batch`. This module only translates:

- `training_worker_config(...)`: a :class:`LearnerConfig` (the same keys the torch learner
  reads) as verl's `TrainingWorkerConfig` (model, FSDP2 engine, AdamW, checkpoint contents);
- `turns_batch(turns, ...)`: turns laid out as verl's trainer lays out a batch (prompts
  left-padded, responses right-padded, then `left_right_2_no_padding`), with rows that carry
  no tokens appended so the batch splits evenly over data-parallel ranks and mini-batches.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mas_trainer.learners.batch import Turn
from mas_trainer.learners.config import LearnerConfig

__all__ = ["training_worker_config", "turns_batch", "padded_size", "response_values"]


def training_worker_config(
    model_dir: str,
    learner: LearnerConfig,
    *,
    model_type: str = "language_model",
    forward_only: bool = False,
    seed: int = 0,
    bf16: bool = True,
    lr: float | None = None,
) -> Any:
    """verl's `TrainingWorkerConfig` for one policy (or its reference / value model)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig

    model = HFModelConfig(
        path=model_dir,
        # verl defaults to flash-attention 2, which exists only on CUDA builds
        override_config={"attn_implementation": "sdpa"},
        enable_gradient_checkpointing=False,
        use_remove_padding=False,
    )
    precision = "bf16" if bf16 else "fp32"
    engine = FSDPEngineConfig(
        strategy="fsdp2",  # FSDP1 refuses CPU parameters; FSDP2 runs on both
        forward_only=forward_only,
        model_dtype="fp32",
        mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_dynamic_bsz=learner.micro_batch_tokens is not None,
        max_token_len_per_gpu=learner.micro_batch_tokens,
        infer_max_token_len_per_gpu=learner.micro_batch_tokens,
        micro_batch_size_per_gpu=learner.micro_batch_size,
        infer_micro_batch_size_per_gpu=learner.micro_batch_size,
        use_torch_compile=False,
        use_remove_padding=False,
        seed=seed,
    )
    optim = None if forward_only else FSDPOptimizerConfig(
        lr=lr if lr is not None else learner.lr,
        weight_decay=learner.weight_decay,
        betas=learner.betas,
        clip_grad=learner.max_grad_norm if learner.max_grad_norm is not None else float("inf"),
        override_optimizer_config={"eps": learner.eps},
    )
    # verl's own "hf_model" content would write bf16; the Hugging Face folder is written from
    # the engine's fp32 copy instead (runtime/verl_group.py), so only the resume state is here
    contents = ["model", "optimizer", "extra"] if not forward_only else ["model"]
    return TrainingWorkerConfig(
        model_type=model_type,
        model_config=model,
        engine_config=engine,
        optimizer_config=optim,
        checkpoint_config=CheckpointConfig(save_contents=contents, load_contents=contents),
    )


def padded_size(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple` (at least one multiple)."""
    return max(1, -(-n // multiple)) * multiple


def turns_batch(
    turns: Sequence[Turn],
    *,
    pad_id: int,
    size: int | None = None,
    filler: Turn | None = None,
    returns: Sequence[Sequence[float]] | None = None,
    values: Sequence[Sequence[float]] | None = None,
) -> Any:
    """A verl training batch (no-padding `TensorDict`) of `turns`, `size` rows in all.

    Rows past `len(turns)` repeat `filler` (default: the first turn) with an all-zero
    response mask: they carry
    no loss tokens, so the token-mean loss (`batch_num_tokens` counts mask tokens over all
    ranks) and its gradient are those of the real turns alone. Shapes before unpadding:
    prompts (B, P) left-padded, responses (B, R) right-padded, every per-token field (B, R).
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    turns = list(turns)
    size = size or len(turns)
    rows = turns + [filler or turns[0]] * (size - len(turns))
    P = max(len(t.prompt_ids) for t in rows)
    R = max(len(t.response_ids) for t in rows)
    prompts = torch.full((size, P), pad_id, dtype=torch.long)
    responses = torch.full((size, R), pad_id, dtype=torch.long)
    attention = torch.zeros((size, P + R), dtype=torch.long)
    response_mask = torch.zeros((size, R), dtype=torch.float32)
    old = torch.zeros((size, R), dtype=torch.float32)
    adv = torch.zeros((size, R), dtype=torch.float32)
    ret = torch.zeros((size, R), dtype=torch.float32)
    val = torch.zeros((size, R), dtype=torch.float32)
    for b, t in enumerate(rows):
        p, r = len(t.prompt_ids), len(t.response_ids)
        prompts[b, P - p :] = torch.tensor(list(t.prompt_ids), dtype=torch.long)
        responses[b, :r] = torch.tensor(list(t.response_ids), dtype=torch.long)
        attention[b, P - p : P + r] = 1
        if b < len(turns):
            response_mask[b, :r] = 1
            old[b, :r] = torch.as_tensor(list(t.old_logprobs), dtype=torch.float32)
            adv[b, :r] = torch.tensor(t.advantage_list(), dtype=torch.float32)
            if returns is not None:
                ret[b, :r] = torch.as_tensor(list(returns[b]), dtype=torch.float32)
            if values is not None:
                val[b, :r] = torch.as_tensor(list(values[b]), dtype=torch.float32)
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    fields = {
        "prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention,
        "position_ids": position_ids, "response_mask": response_mask, "old_log_probs": old, "advantages": adv,
    }
    if returns is not None:
        fields["returns"] = ret
    if values is not None:
        fields["values"] = val
    td = tu.get_tensordict(fields)
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0)  # the engine's log-probs are of raw logits
    return td


def response_values(padded: torch.Tensor, turns: Sequence[Turn]) -> list[list[float]]:
    """Each turn's (response_length,) values from a (B, R) tensor verl returned."""
    return [padded[b, : len(t.response_ids)].float().tolist() for b, t in enumerate(turns)]
