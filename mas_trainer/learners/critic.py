"""The embedded critic: a value model for GAE, trained with verl's clipped value loss.

The value model is a deep copy of the policy's transformer body (``AutoModelForCausalLM``'s
``.model``, i.e. everything but the LM head) plus a scalar linear value head. The head
starts at zero (weight and bias), so every initial value is exactly 0: GAE's first
advantages are then plain discounted returns, not noise from a random head. The copy has
its own weights and AdamW state; the policy's model is never touched.

Alignment is the actor's (see :mod:`mas_trainer.learners.batch`): the value of response
token ``t`` is read from the hidden state at position ``t - 1``, the state that has seen
everything *before* token ``t``, which is how verl's critics slice values
(``values[:, -response_length - 1 : -1]``). So ``values(turns)[id][j]`` sits next to the
actor's log-prob of response token ``j`` and GAE's ``values`` input lines up token for token.

``update(turns, returns, old_values)`` runs verl's ``core_algos.compute_value_loss`` with
the same batching as the actor (the same functions of :mod:`mas_trainer.learners.batch`):
mini-batches of ``mini_batch_size`` turns, one AdamW step each, split into micro-batches of
at most ``micro_batch_size`` turns (and ``micro_batch_tokens``) whose gradients accumulate.
Each micro-batch loss is normalised by the whole mini-batch (its response-token count, turn
count and longest response, as verl's ``global_batch_info``), so the summed micro losses
equal the mini-batch loss whatever the split.

Like the learner, run the critic on the engine's worker thread (``engine.run_exclusive``):
it shares no weights with the engine, but this keeps all torch compute of the process on
one thread.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from mas_trainer.engines.models import bf16_is_fast

from mas_trainer.learners.batch import PackedTurns, Turn, clipped_step, micro_batches, pack_turns, run_epochs
from mas_trainer.learners.config import CriticConfig

__all__ = ["TorchCritic"]


class _ValueModel(torch.nn.Module):
    """Transformer body + scalar head: one module, so one state_dict holds both."""

    def __init__(self, body: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.value_head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        # Zero output at the start: values are exactly 0 until the critic has learned.
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)


class TorchCritic:
    """Value model (copy of ``base_model``'s body + linear head) with its own AdamW."""

    def __init__(self, base_model: Any, config: CriticConfig | None = None) -> None:
        from verl.trainer.ppo import core_algos
        from verl.utils import torch_functional as verl_F

        self.config = config = config or CriticConfig()
        self._core, self._verl_F = core_algos, verl_F
        body = getattr(base_model, getattr(base_model, "base_model_prefix", "model"), None)
        if body is None:
            body = base_model.model
        first = next(base_model.parameters())
        self.device = first.device
        self.module = _ValueModel(copy.deepcopy(body), base_model.config.hidden_size).to(self.device)
        # from_pretrained models come in eval mode; keep it (no dropout), as the actor does,
        # so values() and the forward inside update() agree exactly.
        self.module.eval().requires_grad_(True)
        self.bf16 = config.bf16 if isinstance(config.bf16, bool) else bf16_is_fast(self.device)
        self._params = list(self.module.parameters())
        fused = self.device.type in ("cpu", "cuda") and all(p.dtype in (torch.float32, torch.bfloat16) for p in self._params)
        self.optimizer = torch.optim.AdamW(self._params, lr=config.lr, fused=fused or None)
        pad_id = getattr(base_model.config, "pad_token_id", None)
        if isinstance(pad_id, (list, tuple)):
            pad_id = pad_id[0]
        self.pad_id = int(pad_id or 0)
        self.updates = 0
        self.optimizer_steps = 0

    # ---------------------------------------------------------------- values

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext()

    def _forward(self, batch: PackedTurns) -> torch.Tensor:
        """Values of columns ``response_start:`` of ``batch``: (B, W) float32, W = T - s.

        ``out[b, j]`` is the value of token ``input_ids[b, s + j]``, read from the hidden
        state at position ``s + j - 1``. No attention mask, as in the actor: right padding
        plus the causal mask keep pads out of every real row.
        """
        ids, s = batch.input_ids, batch.response_start
        with self._autocast():
            hidden = self.module.body(input_ids=ids, use_cache=False).last_hidden_state  # (B, T, H)
        # The head runs in fp32 outside autocast: values are regression outputs, and bf16's
        # 8-bit mantissa would quantise them (and the loss) visibly.
        return self.module.value_head(hidden[:, s - 1 : -1].float()).squeeze(-1)

    def _micro_batches(self, turns: Sequence[Turn]) -> list[list[Turn]]:
        return micro_batches(turns, max_rows=self.config.micro_batch_size, max_tokens=self.config.micro_batch_tokens)

    @torch.no_grad()
    def values(self, turns: Sequence[Turn]) -> dict[str, list[float]]:
        """turn id -> value of each response token, ``(response_length,)`` as a list of floats."""
        out: dict[str, list[float]] = {}
        for micro in self._micro_batches(turns):
            batch = pack_turns(micro, pad_id=self.pad_id).to(self.device)
            full = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
            full[:, batch.response_start :] = self._forward(batch)
            for tid, v in zip(batch.turn_ids, batch.response_values(full), strict=True):
                out[tid] = v.cpu().tolist()
        return out

    # ---------------------------------------------------------------- update

    def update(
        self,
        turns: Sequence[Turn],
        returns: Mapping[str, Sequence[float] | torch.Tensor],
        old_values: Mapping[str, Sequence[float] | torch.Tensor],
    ) -> dict[str, float]:
        """``ppo_epochs`` passes of clipped value regression toward ``returns``; returns metrics.

        ``returns`` and ``old_values``: turn id -> (response_length,) per turn (the GAE
        returns, and the values the advantages were computed with, i.e. ``values(turns)``
        before this update). Keys: vf_loss (mean over optimiser steps of the mini-batch
        loss), vf_clipfrac and vpred_mean (means over response tokens), grad_norm (pre-clip;
        absent when no step was taken), optimizer_steps, skipped_steps (non-finite norm),
        turns, tokens (real tokens forwarded, all epochs), seconds. The caller prefixes them (e.g.
        ``critic/``) next to the actor's. With no turns nothing changes.
        """
        t0 = time.perf_counter()
        turns = list(turns)
        if not turns:
            return {"turns": 0.0, "tokens": 0.0, "optimizer_steps": 0.0, "seconds": 0.0}
        for t in turns:  # fail before any step, not half-way through the update
            for name, table in (("returns", returns), ("old_values", old_values)):
                if t.id not in table:
                    raise ValueError(f"critic update: no {name} for turn {t.id}")
                if len(table[t.id]) != len(t.response_ids):
                    raise ValueError(f"turn {t.id}: {len(table[t.id])} {name} for {len(t.response_ids)} response tokens")
        cfg = self.config
        sums: dict[str, float] = defaultdict(float)
        losses: list[float] = []

        def step(mini: list[Turn]) -> float | None:
            loss, norm = self._mini_batch_step(mini, returns, old_values, sums)
            losses.append(loss)
            return norm

        steps, skipped, norms = run_epochs(turns, cfg, self.updates, step, self.optimizer)
        self.updates += 1
        n_tok = sums["_response_tokens"]
        metrics = {
            "vf_loss": sum(losses) / len(losses),
            "vf_clipfrac": sums["vf_clipfrac"] / n_tok,
            "vpred_mean": sums["vpred_mean"] / n_tok,
            "optimizer_steps": float(steps - skipped),
            "skipped_steps": float(skipped),
            "turns": float(len(turns)),
            "tokens": sums["_tokens"],
            "seconds": time.perf_counter() - t0,
        }
        if norms:
            metrics["grad_norm"] = sum(norms) / len(norms)
        return metrics

    def _aligned(self, batch: PackedTurns, table: Mapping[str, Any]) -> torch.Tensor:
        """Per-turn response values laid out like ``batch``: (B, T) float32, 0 off the response."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for b, (tid, p, r) in enumerate(zip(batch.turn_ids, batch.prompt_lengths, batch.response_lengths, strict=True)):
            out[b, p : p + r] = torch.as_tensor(table[tid], dtype=torch.float32).reshape(-1)
        return out.to(self.device)

    def micro_loss(
        self, batch: PackedTurns, returns: torch.Tensor, old_values: torch.Tensor, global_info: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """verl's clipped value loss of one micro-batch, normalised by ``global_info``.

        ``returns``, ``old_values``: token-aligned (B, T) like ``batch``. ``global_info``:
        ``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor`` of the
        mini-batch. Returns (loss, vf_clipfrac, vpreds (B, W), mask (B, W) bool), W = T - s.
        """
        s = batch.response_start
        mask = batch.response_mask[:, s:].bool()
        vpreds = self._forward(batch)
        loss, clipfrac = self._core.compute_value_loss(
            vpreds=vpreds, returns=returns[:, s:], values=old_values[:, s:], response_mask=mask,
            cliprange_value=self.config.cliprange_value, loss_agg_mode=self.config.loss_agg_mode, **global_info,
        )
        return loss, clipfrac, vpreds, mask

    def _mini_batch_step(
        self, mini: list[Turn], returns: Mapping[str, Any], old_values: Mapping[str, Any], sums: dict[str, float]
    ) -> tuple[float, float | None]:
        """Accumulate the micro-batch gradients of ``mini``, then one AdamW step.

        Returns (mini-batch loss, pre-clip grad norm or None when not finite: step skipped).
        """
        cfg = self.config
        # The mini-batch totals: each micro loss is a partial sum of the mini-batch loss.
        info = dict(
            dp_size=1,
            batch_num_tokens=sum(len(t.response_ids) for t in mini),
            global_batch_size=len(mini),
            loss_scale_factor=max(len(t.response_ids) for t in mini),
        )
        total = 0.0
        for micro in self._micro_batches(mini):
            batch = pack_turns(micro, pad_id=self.pad_id).to(self.device)
            loss, clipfrac, vpreds, mask = self.micro_loss(
                batch, self._aligned(batch, returns), self._aligned(batch, old_values), info
            )
            loss.backward()
            total += loss.item()
            n = float(batch.num_response_tokens)
            sums["vf_clipfrac"] += float(clipfrac) * n
            sums["vpred_mean"] += float(self._verl_F.masked_mean(vpreds.detach(), mask)) * n
            sums["_response_tokens"] += n
            sums["_tokens"] += float(batch.num_tokens)
        norm = clipped_step(self._params, self.optimizer, cfg.max_grad_norm)
        self.optimizer_steps += norm is not None
        return total, norm

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Weights (body + head), optimiser state and counters: everything to resume."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
            "optimizer_steps": self.optimizer_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` (the shuffle order continues where it left off)."""
        self.module.load_state_dict(state["model"])  # copies into our parameters
        # Optimizer.load_state_dict keeps tensors already on the right device and dtype
        # as they are, so without a copy two critics would share (and both advance) the
        # same AdamW moments after an in-process load.
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.updates = int(state["updates"])
        self.optimizer_steps = int(state["optimizer_steps"])
