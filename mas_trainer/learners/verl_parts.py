"""The verl learner's parts: its configs from ours, turns in its batch layout, its weight stream.

On every rank `verl.workers.engine_workers.TrainingWorker` (FSDP2) holds the policy's shard,
takes verl's `ppo_loss` through `set_loss_fn`, gives log-probs through `infer_batch` and
updates through `train_mini_batch` (`learners/verl_learner.py` drives it). This module only
translates:

- `training_worker_config(...)`: a :class:`LearnerConfig` (the same keys the torch learner
  reads) as verl's `TrainingWorkerConfig` (model, FSDP2 engine, AdamW, checkpoint contents);
- `turns_batch(turns, ...)`: turns laid out as verl's trainer lays out a batch (prompts
  left-padded, responses right-padded, then `left_right_2_no_padding`), with rows that carry
  no tokens appended so the batch splits evenly over data-parallel ranks and mini-batches;
- `load_streamed_weights(model, params)`: the full parameters verl streams from its shards
  (`get_per_tensor_param`, MoE experts unpacked for vLLM) copied into a Hugging Face model.

On CUDA the learner takes verl's own GPU path where flash-attention is installed: packed
sequences (`use_remove_padding`), flash-attention 2 and `torch.compile`d entropy. Packing
needs flash-attention: under torch's SDPA a packed row attends across its sequences
(tests/learners/test_verl_gpu_path.py shows it), so without it the GPU keeps padded rows.
The CPU path is the padded, SDPA, uncompiled one.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from typing import Any, Iterable, Sequence

import torch

from mas_trainer.learners.batch import Turn
from mas_trainer.learners.config import LearnerConfig

__all__ = [
    "training_worker_config", "turns_batch", "padded_size", "response_values", "attention_implementation",
    "use_value_model_loader", "load_streamed_weights", "pad_id_of", "all_gather", "response_tensor", "flatten_metrics",
    "sft_batch",
]

log = logging.getLogger(__name__)


def attention_implementation(device: str) -> str:
    """`flash_attention_2` on CUDA where the `flash_attn` package is installed, else `sdpa`."""
    if device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def training_worker_config(
    model_dir: str,
    learner: LearnerConfig,
    *,
    model_type: str = "language_model",
    forward_only: bool = False,
    seed: int = 0,
    bf16: bool = True,
    lr: float | None = None,
    device: str = "cpu",
    world_size: int = 1,
) -> Any:
    """verl's `TrainingWorkerConfig` for one policy (or its reference / value model) on `device`,
    one of `world_size` ranks."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig

    attn = attention_implementation(device)
    packed = attn == "flash_attention_2"  # see the module docstring
    if model_type == "value_model":  # built in this process next, by verl's loader
        use_value_model_loader(attn)
    if device == "cuda" and not packed:
        log.warning("flash-attention is not installed: the verl learner runs padded rows with SDPA attention "
                    "(pip install -c mas-trainer/constraints-gpu.txt './mas-trainer[flash-attn]' from a checkout, for packed sequences)")
    # verl's default attention is flash-attention 2, CUDA builds only
    model = HFModelConfig(path=model_dir, override_config={"attn_implementation": attn}, enable_gradient_checkpointing=False,
                          use_remove_padding=packed)
    precision = "bf16" if bf16 else "fp32"
    # verl cuts each rank's share of a mini-batch into whole micro-batches: the largest that divides
    # it, within learner.micro_batch_size ("most turns per forward/backward")
    share = max(1, learner.mini_batch_size // world_size)
    micro = max(d for d in range(1, min(share, learner.micro_batch_size) + 1) if share % d == 0)
    engine = FSDPEngineConfig(
        strategy="fsdp2",  # FSDP1 refuses CPU parameters; FSDP2 runs on both
        forward_only=forward_only,
        model_dtype="fp32",
        mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_dynamic_bsz=learner.micro_batch_tokens is not None,
        max_token_len_per_gpu=learner.micro_batch_tokens,
        infer_max_token_len_per_gpu=learner.micro_batch_tokens,
        micro_batch_size_per_gpu=micro,
        infer_micro_batch_size_per_gpu=micro,
        use_torch_compile=device == "cuda",  # verl's default; on CPU compiling costs more than it saves
        use_remove_padding=packed,
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
    # the fp32 copy of the rank's weight sink instead (policy/verl_rank.py), so only the resume state is here
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

    Rows past `len(turns)` repeat `filler` (default: the first turn) with an all-zero response
    mask: they carry no loss tokens, so the token-mean loss (`batch_num_tokens` counts mask
    tokens over all ranks) and its gradient are those of the real turns alone. Shapes before
    unpadding: prompts (B, P) left-padded, responses (B, R) right-padded, per-token fields (B, R).
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


def use_value_model_loader(attn_implementation: str) -> None:
    """verl builds value models (GAE's critic) in `verl.utils.model.load_valuehead_model`,
    which writes in `attn_implementation="flash_attention_2"` (else it needs trl); neither is
    in the GPU extras. The same loader runs here with the learner's own attention instead (the
    FSDP engine looks the function up at call time, so replacing the module attribute is enough).
    `training_worker_config` calls it for every value model, on every device."""
    import verl.utils.model as verl_model

    if getattr(verl_model.load_valuehead_model, "_mas_attn", None) == attn_implementation:
        return

    def load_valuehead_model(local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)

    load_valuehead_model._mas_attn = attn_implementation  # type: ignore[attr-defined]
    verl_model.load_valuehead_model = load_valuehead_model


# verl's `unfuse_moe_params` streams Transformers 5's packed experts (`<base>.gate_up_proj`,
# (E, 2I, H), gate rows first; `<base>.down_proj`, (E, H, I)) as vLLM's per-expert names
_EXPERT = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<i>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _destination(own: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, str] | None:
    """The tensor (or packed-expert slice) of `own` that verl's streamed `name` fills, and its key."""
    if name in own:
        return own[name], name
    m = _EXPERT.match(name)
    if m is None:
        return None
    i = int(m["i"])
    if m["proj"] == "down_proj":
        key = f"{m['base']}.down_proj"
        return (own[key][i], key) if key in own and own[key].dim() == 3 else None
    key = f"{m['base']}.gate_up_proj"
    if key not in own or own[key].dim() != 3:
        return None
    half = own[key].shape[1] // 2
    rows = slice(0, half) if m["proj"] == "gate_proj" else slice(half, 2 * half)
    return own[key][i, rows], key


def load_streamed_weights(model: torch.nn.Module, params: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy the full parameters verl streams (`engine.get_per_tensor_param()`) into `model`.

    Every streamed name must land somewhere (MoE per-expert names go back into their packed
    tensors) and every tensor of `model` must be written in full (tied weights count once):
    a copy that skipped names would serve and save stale weights with no sign of it.
    """
    own = model.state_dict()
    written: dict[str, int] = {}
    cls = type(model).__name__
    error: str | None = None
    with torch.no_grad():
        for name, tensor in params:
            if error is not None:
                continue  # the stream is read to its end all the same: every rank gathers each tensor with this one
            found = _destination(own, name)
            if found is None:
                error = (f"verl streamed the weight {name!r}, which {cls} has no tensor for: the weight copy knows "
                         "Hugging Face names and verl's per-expert MoE names only; train this architecture with the "
                         "torch learner (runtime.learner=torch)")
                continue
            dest, key = found
            if dest.shape != tensor.shape:
                error = (f"verl streamed {name!r} with shape {tuple(tensor.shape)}, but {cls} holds {tuple(dest.shape)} "
                         "there: the learner and the engine hold different models")
                continue
            dest.copy_(tensor.to(dest.device, dest.dtype))
            written[key] = written.get(key, 0) + dest.numel()
    if error is not None:
        raise ValueError(error)
    full: dict[int, bool] = {}  # storage -> written in full under one of its names (tied weights)
    for key, t in own.items():
        full[t.data_ptr()] = full.get(t.data_ptr(), False) or written.get(key, 0) >= t.numel()
    missing = [key for key, t in own.items() if not full[t.data_ptr()]]
    if missing:
        raise ValueError(f"verl's weight stream left {len(missing)} tensor(s) of {cls} unwritten, e.g. {missing[:3]}: "
                         "the engine would serve stale weights; the learner and the engine hold different models")


def pad_id_of(model_dir: str) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    return int(pad[0] if isinstance(pad, (list, tuple)) else (pad or 0))


def all_gather(obj: Any, merge: Any = None) -> Any:
    """Every rank's `obj`, merged (dicts: union) on every rank."""
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    if merge is not None:
        return merge(out)
    merged: dict = {}
    for part in out:
        merged.update(part)
    return merged


def response_tensor(td: Any, per_row: list[Any], size: int) -> Any:
    """A (B, R) right-padded float tensor of per-response-token values (pad rows 0)."""
    R = td["responses"].shape[1]
    t = torch.zeros(size, R, dtype=torch.float32)
    for b, vals in enumerate(per_row):
        t[b, : len(vals)] = torch.as_tensor(vals, dtype=torch.float32)
    return t


def flatten_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """verl's metric lists (one entry per mini-batch / micro-batch) as means, `actor/` dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        vals = value if isinstance(value, list) else [value]
        nums = [float(v.value if hasattr(v, "value") else v) for v in vals if v is not None]
        if nums:
            out[key.removeprefix("actor/").removeprefix("critic/")] = sum(nums) / len(nums)
    return out


def sft_batch(turns: list[Any], *, pad_id: int, size: int, filler: Any) -> Any:
    """The PPO batch layout of `turns` (`turns_batch`) with the `loss_mask` verl's `sft_loss`
    reads in its no-padding mode: over each row's whole sequence, 1 on the completion tokens
    (sft_loss shifts it by one to line it up with the log-probs); rows past `turns` all 0."""
    td = turns_batch(turns, pad_id=pad_id, size=size, filler=filler)
    offsets = td["input_ids"].offsets()
    mask = torch.zeros(int(offsets[-1]), dtype=torch.float32)
    for b, t in enumerate(turns):
        mask[int(offsets[b + 1]) - len(t.response_ids):int(offsets[b + 1])] = 1
    td["loss_mask"] = torch.nested.nested_tensor_from_jagged(mask, offsets=offsets)
    return td
