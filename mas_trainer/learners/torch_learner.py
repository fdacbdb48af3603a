"""The embedded learner: PPO-style updates of one policy with verl's losses, in torch.

It composes verl's functions rather than its actor: ``get_policy_loss_fn(name)`` for the
policy loss, ``agg_loss`` for the entropy and KL terms and ``kl_penalty`` for the KL
estimator, all fed with a real ``verl.workers.config.ActorConfig`` built from
:class:`LearnerConfig`.

How one update runs (``update(turns)``):

- old log-probs are the engine's (exact for the weights that sampled, see `Turn`), so no
  forward pass is spent on them; with several epochs they stay the pre-update values, as
  PPO defines them;
- per epoch the turns are shuffled (seeded) and cut into mini-batches of
  ``mini_batch_size`` turns, one AdamW step each; a mini-batch is split into micro-batches
  (``micro_batch_size`` turns, optionally ``micro_batch_tokens``) whose gradients
  accumulate. The loss is normalised by the whole mini-batch (verl's ``global_batch_info``:
  its response-token count and turn count), so the summed micro-batch losses equal the
  mini-batch loss exactly, whatever the split;
- logits are computed only from the first column that can predict a response token on
  (``logits_to_keep``), and log-probs are taken in float32 from them;
- with ``share_prompts`` the turns of a micro-batch that have one prompt are run as one row
  (``batch.SharedPrompts``: the prompt once, each response attending to it and to itself),
  so a GRPO group's prompt is forwarded and backwarded once instead of once per sample; the
  log-probs, and so the loss and its gradient, are those of the unshared layout;
- forward and backward run under bf16 autocast (fp32 weights and optimiser state): on the
  2-core reference CPU a 4 x 256-token step takes ~2 s instead of ~4.5 s in fp32.

With ``lora_rank > 0`` the learner first injects a peft LoRA adapter into that model
(``learners/lora.py``) and trains only the adapter; between updates the adapter is merged
into the weights the engine generates with, and the KL reference is the base itself (the
adapter switched off), so no copy of the model is kept for it.

With ``adapter_name`` the learner trains one adapter of a shared base (``learner.shared_base``,
`policy/shared_base.py`): ``model`` is the peft model holding every policy's adapter, one
learner (and AdamW state) per adapter; its adapter is made the active one for an update and
never merged, since the engine generates rows of every adapter from the same base weights.

The learner updates the very model object its engine generates with, so the next
generation uses the new weights without any copy: run updates on the engine's worker
thread (``engine.run_exclusive(lambda _model: learner.update(turns))``, as the worker group
does), which also keeps all torch compute of the process on one thread.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from mas_trainer.engines.models import bf16_is_fast

from mas_trainer.errors import UserError
from mas_trainer.learners.batch import PackedTurns, Turn, clipped_step, micro_batches, pack_turns, run_epochs
from mas_trainer.learners.config import LearnerConfig

__all__ = ["TorchLearner"]


class TorchLearner:
    """AdamW + verl policy loss over one policy's model (shared with its engine).

    ``reference``: a frozen model for the KL loss; without one a deep copy of ``model`` is
    taken at construction when ``config.kl_coef > 0`` (and none is kept otherwise; with LoRA
    the reference is ``model`` with its adapter off). ``adapter``: a saved adapter folder to
    continue training (LoRA, on resume); ``base_model``: the model reference a new adapter records
    as its base; ``adapter_name``: train that adapter of ``model``, a peft model of a shared base
    (its other adapters belong to other learners).
    """

    def __init__(
        self,
        model: Any,
        config: LearnerConfig | None = None,
        *,
        reference: Any = None,
        pad_id: int | None = None,
        adapter: str | Path | None = None,
        base_model: str = "default",
        adapter_name: str | None = None,
    ) -> None:
        from verl.trainer.ppo import core_algos
        from verl.utils import torch_functional as verl_F

        # huggingface_hub decides lazily, and not thread-safely, whether Jinja2 is there (peft's adapter card needs it):
        # policies save at once on their engines' threads, and one asking mid-check is told it is missing. Ask here, first.
        from huggingface_hub.utils import is_jinja_available

        is_jinja_available()
        self.adapter_name = adapter_name
        if adapter_name is not None:  # one adapter of a shared base: the peft model holds them all
            self.peft, model = model, model.get_base_model()
        self.model = model
        self.config = config = config or LearnerConfig()
        self._core, self._verl_F = core_algos, verl_F
        self.actor_config = config.actor_config()
        self._policy_loss_fn = core_algos.get_policy_loss_fn(config.policy_loss)
        first = next(model.parameters())
        self.device = first.device
        self.bf16 = config.bf16 if isinstance(config.bf16, bool) else bf16_is_fast(self.device)
        if adapter_name is not None:
            import mas_trainer.learners.lora as lora

            self._params = [p.requires_grad_(True) for p in lora.adapter_params(self.peft, adapter_name)]
        else:
            self.peft = None
            if config.lora_rank:
                import mas_trainer.learners.lora as lora

                self.peft = lora.open_adapter(model, adapter) if adapter is not None else lora.add_adapter(
                    model, rank=config.lora_rank, alpha=config.lora_alpha, target_modules=config.target_modules,
                    base_model=base_model, layers=config.lora_layers)
            self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise UserError(f"adapter {adapter_name!r}: no parameters to train" if adapter_name else "the model has no trainable parameters")
        fused = config.fused_adamw if isinstance(config.fused_adamw, bool) else (
            self.device.type in ("cpu", "cuda") and all(p.dtype in (torch.float32, torch.bfloat16) for p in self._params)
        )
        self.optimizer = torch.optim.AdamW(
            self._params, lr=config.lr, betas=config.betas, eps=config.eps,
            weight_decay=config.weight_decay, fused=fused or None,
        )
        self._kl = config.kl_coef > 0
        if self._kl and self.peft is None:
            if reference is None:
                reference = copy.deepcopy(model)
            reference.requires_grad_(False).eval()
        self.reference = reference if self._kl and self.peft is None else None
        if pad_id is None:
            pad_id = getattr(model.config, "pad_token_id", None)
            if isinstance(pad_id, (list, tuple)):
                pad_id = pad_id[0]
        self.pad_id = int(pad_id or 0)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        attention = getattr(model.config, "_attn_implementation", None)
        from mas_trainer.engines.kv import ATTENTION  # the embedded engine's sdpa (it may share this model)

        if config.share_prompts and attention not in ("sdpa", "eager", ATTENTION):
            raise UserError(f"learner.share_prompts needs attention that takes a 4D mask (sdpa or eager); this model "
                            f"uses {attention!r}: load it with attn_implementation='sdpa', or set learner.share_prompts=false")
        self.updates = 0  # update() calls that trained on at least one turn
        self.optimizer_steps = 0
        self.merged = False  # LoRA: whether the adapter is folded into the weights now
        self._merge()

    # ---------------------------------------------------------------- LoRA

    def _merge(self) -> None:
        """Fold the adapter into the weights, so the engine generates at plain-model speed (not
        on a shared base: its engine mixes rows of every adapter over the same base weights)."""
        if self.peft is not None and not self.merged and self.adapter_name is None:
            self.peft.merge_adapter()
            self.merged = True

    def _unmerge(self) -> None:
        """Take the adapter back out of the weights: the update trains the adapter alone (on a
        shared base: make it the active adapter, the one a forward without adapter names runs)."""
        if self.adapter_name is not None:
            self.peft.set_adapter(self.adapter_name)
            for p in self._params:  # peft's set_adapter unfreezes the active adapter's layers; be sure of ours
                p.requires_grad_(True)
        elif self.peft is not None and self.merged:
            self.peft.unmerge_adapter()
            self.merged = False

    # ---------------------------------------------------------------- log-probs

    def _autocast(self) -> Any:
        if not self.bf16:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _forward(self, model: Any, batch: PackedTurns, *, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token-aligned log-probs (and entropies) of columns ``response_start:`` of ``batch``.

        Returns ``log_prob`` (B, W) float32 with W = T - response_start: ``log_prob[b, j]``
        is log p(input_ids[b, s + j] | input_ids[b, :s + j]) for s = response_start, from
        the logits at position s + j - 1. No attention mask is passed: with right padding
        the causal mask alone keeps pads (all after the real tokens) out of real rows, and
        the unmasked causal path is the fastest attention there is.
        """
        if batch.shared is not None:
            return self._forward_shared(model, batch, entropy=entropy)
        ids = batch.input_ids
        start = batch.response_start
        with self._autocast():
            if self._keeps_logits:
                logits = model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1] - start + 1).logits
            else:
                logits = model(input_ids=ids, use_cache=False).logits[:, start - 1 :]
        logits = logits[:, :-1].float()  # (B, W, V): positions s-1 .. T-2
        log_prob = logits.log_softmax(-1).gather(-1, ids[:, start:, None]).squeeze(-1)
        ent = self._verl_F.entropy_from_logits(logits) if entropy else None
        return log_prob, ent

    def _forward_shared(self, model: Any, batch: PackedTurns, *, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward` on the shared-prompt layout (``batch.shared``), same outputs: the logits
        that predict each response token are picked from its row and scattered to the turn layout."""
        shared, start = batch.shared, batch.response_start
        if shared is None:
            raise ValueError("_forward_shared needs a batch packed with share_prompts")
        width = shared.input_ids.shape[1]
        # every source column is >= (shortest prompt - 1) = start - 1: no logits are needed before it
        keep = dict(logits_to_keep=width - start + 1) if self._keeps_logits else {}
        # an additive float mask: torch's CPU attention runs fwd+bwd several times faster with it than with a bool mask
        dtype = torch.bfloat16 if self.bf16 else next(model.parameters()).dtype
        mask = torch.zeros(shared.attention_mask.shape, dtype=dtype, device=self.device).masked_fill(
            ~shared.attention_mask, torch.finfo(dtype).min)
        with self._autocast():
            logits = model(input_ids=shared.input_ids, position_ids=shared.position_ids,
                           attention_mask=mask, use_cache=False, **keep).logits
        offset = width - logits.shape[1]
        picked = logits[shared.source[:, 0], shared.source[:, 1] - offset].float()  # (N, V)
        values = picked.log_softmax(-1).gather(-1, shared.tokens[:, None]).squeeze(-1)
        rows, cols = shared.target[:, 0], shared.target[:, 1] - start
        shape = (batch.input_ids.shape[0], batch.input_ids.shape[1] - start)
        log_prob = torch.zeros(shape, dtype=torch.float32, device=values.device).index_put((rows, cols), values)
        ent = None
        if entropy:
            ent = torch.zeros(shape, dtype=torch.float32, device=values.device).index_put(
                (rows, cols), self._verl_F.entropy_from_logits(picked))
        return log_prob, ent

    def _micro_batches(self, turns: Sequence[Turn]) -> list[list[Turn]]:
        return micro_batches(turns, max_rows=self.config.micro_batch_size, max_tokens=self.config.micro_batch_tokens,
                             share=self.config.share_prompts)

    def _pack(self, turns: list[Turn]) -> PackedTurns:
        return pack_turns(turns, pad_id=self.pad_id, share=self.config.share_prompts).to(self.device)

    @torch.no_grad()
    def log_probs(self, turns: Sequence[Turn], model: Any = None) -> list[torch.Tensor]:
        """Each turn's response-token log-probs (float32, (response_length,)) under ``model``
        (default: the policy), in micro-batches, with the learner's dtype settings."""
        model = self.model if model is None else model
        index = {id(t): i for i, t in enumerate(turns)}
        out: list[torch.Tensor] = [torch.empty(0)] * len(turns)
        for micro in self._micro_batches(turns):
            batch = self._pack(micro)
            log_prob, _ = self._forward(model, batch, entropy=False)
            full = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
            full[:, batch.response_start :] = log_prob
            for turn, values in zip(micro, batch.response_values(full), strict=True):
                out[index[id(turn)]] = values.cpu()
        return out

    # ---------------------------------------------------------------- update

    def update(self, turns: Sequence[Turn]) -> dict[str, float]:
        """PPO update on ``turns``; returns metrics (means over tokens or steps).

        Keys: pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl (and any other metric the
        verl loss reports, without its ``actor/`` prefix), loss, grad_norm (pre-clip; absent
        when no step was taken), kl and kl_loss (only with a reference), entropy (only when
        computed), optimizer_steps (taken), skipped_steps (non-finite gradient norm: no
        step), turns (trained on), skipped_turns (left out by ``skip_zero_advantage``), tokens
        (real tokens forwarded and backwarded, all epochs), response_tokens, seconds,
        tokens_per_s. With no turns (to train on) nothing changes (no optimiser step, so no
        weight decay either).
        """
        t0 = time.perf_counter()
        turns = list(turns)
        cfg = self.config
        skipped_turns = 0
        if cfg.skip_zero_advantage:
            kept = [t for t in turns if any(a != 0 for a in t.advantage_list())]
            skipped_turns, turns = len(turns) - len(kept), kept
        if not turns:
            return {"turns": 0.0, "skipped_turns": float(skipped_turns), "tokens": 0.0, "response_tokens": 0.0,
                    "optimizer_steps": 0.0, "seconds": 0.0}
        self._unmerge()
        try:
            if self._kl:
                turns = self._with_reference(turns)
            correction: dict[str, float] = {}
            if cfg.old_logprobs in ("recompute", "rollout_correction"):
                turns, correction = self._recompute_old(turns)
            return {**self._update(turns, skipped_turns, t0), **correction}
        finally:
            self._merge()

    def _recompute_old(self, turns: list[Turn]) -> tuple[list[Turn], dict[str, float]]:
        """learner.old_logprobs=recompute | rollout_correction: the PPO ratio's old log-probs from
        this learner's forward before the update, as verl's trainer does; rollout_correction also
        weights each token by verl's truncated importance ratio learner/engine
        (`learners/correction.py`), which is what makes turns sampled one update earlier
        (`rollout.max_staleness=1`) fit to train on. Its metrics: time/old_logprob_s, logprob_diff
        (mean |learner - engine| per token) and, with the correction, verl's rollout_corr ones."""
        from mas_trainer.learners.correction import padded, rollout_is_weights

        t0 = time.perf_counter()
        learner = [lp.tolist() for lp in self.log_probs(turns)]
        metrics = {"time/old_logprob_s": time.perf_counter() - t0}
        diff = [abs(a - b) for t, lp in zip(turns, learner, strict=True) for a, b in zip(t.old_logprobs, lp, strict=True)]
        metrics["logprob_diff"] = sum(diff) / max(1, len(diff))
        if self.config.old_logprobs == "recompute":
            return [dataclasses.replace(t, old_logprobs=lp) for t, lp in zip(turns, learner, strict=True)], metrics
        engine = padded([t.old_logprobs for t in turns])
        mask = padded([[1.0] * len(t.response_ids) for t in turns])
        weights, corr = rollout_is_weights(padded(learner, engine.shape[1]), engine, mask, self.config.rollout_is_threshold)
        metrics.update(corr)
        return [dataclasses.replace(t, old_logprobs=lp, is_weights=weights[b, : len(lp)].tolist())
                for b, (t, lp) in enumerate(zip(turns, learner, strict=True))], metrics

    def _update(self, turns: list[Turn], skipped_turns: int, t0: float) -> dict[str, float]:
        cfg = self.config
        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)
        steps, skipped, grad_norms = run_epochs(turns, cfg, self.updates, lambda mini: self._mini_batch_step(mini, sums, weights),
                                                self.optimizer)
        self.updates += 1
        seconds = time.perf_counter() - t0
        metrics = {k: sums[k] / weights[k] for k in sums if weights[k] > 0}
        if grad_norms:
            metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics.update(
            optimizer_steps=float(steps - skipped),
            skipped_steps=float(skipped),
            turns=float(len(turns)),
            skipped_turns=float(skipped_turns),
            tokens=float(sums.pop("_tokens", 0.0)),
            response_tokens=float(sum(len(t.response_ids) for t in turns) * cfg.ppo_epochs),
            seconds=seconds,
        )
        metrics["tokens_per_s"] = metrics["tokens"] / seconds if seconds > 0 else 0.0
        return metrics

    def _with_reference(self, turns: list[Turn]) -> list[Turn]:
        """Turns with ``ref_logprobs`` filled from the frozen reference (once per update)."""
        missing = [t for t in turns if t.ref_logprobs is None]
        if not missing:
            return turns
        if self.peft is not None:  # the reference is the base: the same modules with the adapter off
            with self.peft.disable_adapter():
                computed = self.log_probs(missing)
        else:
            computed = self.log_probs(missing, model=self.reference)
        values = dict(zip(map(id, missing), computed, strict=True))
        return [
            t if t.ref_logprobs is not None else dataclasses.replace(t, ref_logprobs=values[id(t)].tolist())
            for t in turns
        ]

    def _mini_batch_step(self, mini: list[Turn], sums: dict[str, float], weights: dict[str, float]) -> float | None:
        """Accumulate gradients over the micro-batches of ``mini``, then one AdamW step.

        Returns the pre-clip gradient norm, or None when it was not finite (step skipped).
        """
        cfg = self.config
        info = self.actor_config.global_batch_info
        info.clear()
        info.update(
            dp_size=1,
            batch_num_tokens=sum(len(t.response_ids) for t in mini),
            global_batch_size=len(mini),
            loss_scale_factor=cfg.loss_scale_factor or max(len(t.response_ids) for t in mini),
        )
        totals: dict[str, float] = defaultdict(float)
        for micro in self._micro_batches(mini):
            batch = self._pack(micro)
            loss, parts, token_stats = self._micro_loss(batch)
            loss.backward()
            for key, value in parts.items():
                totals[key] += value
            n = float(batch.num_response_tokens)
            for key, value in token_stats.items():
                self._add(sums, weights, key, value, n)
            sums["_tokens"] += float(batch.num_tokens)
        # Loss terms are summed over micro-batches (each is already divided by the
        # mini-batch totals in global_batch_info), then averaged over optimiser steps.
        for key, value in totals.items():
            self._add(sums, weights, key, value, 1.0)
        norm = clipped_step(self._params, self.optimizer, cfg.max_grad_norm)
        self.optimizer_steps += norm is not None
        return norm

    def _micro_loss(self, batch: PackedTurns) -> tuple[torch.Tensor, dict[str, float], dict[str, Any]]:
        """The loss of one micro-batch, normalised by ``actor_config.global_batch_info``.

        loss = verl policy loss - entropy_coeff * agg(entropy) + kl_coef * agg(kl_penalty),
        every term over response tokens only (prompt and pad columns are masked out).
        Returns (loss, its terms as floats, per-token means for metrics).
        """
        cfg, core, info = self.config, self._core, self.actor_config.global_batch_info
        s = batch.response_start
        mask = batch.response_mask[:, s:].bool()
        log_prob, entropy = self._forward(self.model, batch, entropy=self.actor_config.calculate_entropy)
        pg_loss, pg_metrics = self._policy_loss_fn(
            old_log_prob=batch.old_log_prob[:, s:],
            log_prob=log_prob,
            advantages=batch.advantages[:, s:],
            response_mask=mask,
            loss_agg_mode=cfg.loss_agg_mode,
            config=self.actor_config,
            rollout_is_weights=None if batch.rollout_is_weights is None else batch.rollout_is_weights[:, s:],
        )
        loss = pg_loss
        parts = {"pg_loss": pg_loss.item()}
        token_stats: dict[str, Any] = {key.removeprefix("actor/"): value for key, value in pg_metrics.items()}
        if entropy is not None:
            ent_loss = core.agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode, **info)
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * ent_loss
            token_stats["entropy"] = self._verl_F.masked_mean(entropy.detach(), mask)
        if self._kl:
            if batch.ref_log_prob is None:
                raise ValueError("a learner with kl_coef > 0 needs ref_logprobs on every turn")
            kld = core.kl_penalty(logprob=log_prob, ref_logprob=batch.ref_log_prob[:, s:], kl_penalty=cfg.kl_penalty)
            kl_loss = core.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode, **info)
            loss = loss + cfg.kl_coef * kl_loss
            parts["kl_loss"] = kl_loss.item()
            token_stats["kl"] = self._verl_F.masked_mean(kld.detach(), mask)
        parts["loss"] = loss.item()
        return loss, parts, token_stats

    # ---------------------------------------------------------------- warm start

    def supervised(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]], *, steps: int, lr: float,
                   batch_size: int, seed: int) -> dict[str, float]:
        """The supervised warm start: `steps` AdamW steps on the mean NLL of the examples'
        completion tokens (`learners/sft.py`; prompt masked); returns `sft_metrics`.

        A fresh AdamW (the learner's betas, eps, weight decay, max_grad_norm; `lr` of its own)
        rather than the RL optimizer: supervised gradients are larger and steadier than policy
        gradients, and their moments would set RL's first step sizes; the RL optimizer starts
        untouched, as in a run without a warm start. With LoRA only the adapter trains."""
        from mas_trainer.learners.sft import sft_batches, sft_metrics

        cfg = self.config
        optimizer = torch.optim.AdamW(self._params, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        turns = [Turn(f"sft{i}", p, r, [0.0] * len(r), 0.0) for i, (p, r) in enumerate(examples)]
        losses: list[float] = []
        norms: list[float] = []
        tokens = 0
        self._unmerge()
        try:
            for batch in sft_batches(len(turns), steps, batch_size, seed):
                step = [turns[i] for i in batch]
                total = sum(len(t.response_ids) for t in step)
                loss_sum = 0.0
                for micro in self._micro_batches(step):
                    packed = self._pack(micro)
                    s = packed.response_start
                    log_prob, _ = self._forward(self.model, packed, entropy=False)
                    loss = -(log_prob * packed.response_mask[:, s:]).sum() / total  # token mean over the whole batch
                    loss.backward()
                    loss_sum += loss.item()
                losses.append(loss_sum)
                tokens += total
                norm = clipped_step(self._params, optimizer, cfg.max_grad_norm)  # as in RL
                if norm is not None:
                    norms.append(norm)
        finally:
            optimizer.zero_grad(set_to_none=True)
            self._merge()
        return sft_metrics(losses, tokens, len(turns), norms)

    @staticmethod
    def _add(sums: dict[str, float], weights: dict[str, float], key: str, value: Any, weight: float) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                return
            value = value.item()
        if isinstance(value, (int, float)):
            sums[key] += float(value) * weight
            weights[key] += weight

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Optimiser state and counters (the weights are saved by ``save_pretrained``)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
            "optimizer_steps": self.optimizer_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` (the shuffle order continues where it left off)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])
        self.optimizer_steps = int(state["optimizer_steps"])

    def save_pretrained(self, path: str | Path, tokenizer: Any = None) -> Path:
        """Write the policy as a Hugging Face folder (safetensors, config, tokenizer) that
        `from_pretrained` and `vllm serve` load, or with LoRA as a peft adapter folder
        (`load_model` merges it; `export` writes either form). Call it where the weights are
        not being changed (e.g. through ``engine.run_exclusive``)."""
        from mas_trainer.engines.models import save_pretrained

        if self.peft is None:
            return save_pretrained(self.model, tokenizer, path)
        if self.adapter_name is not None:  # one adapter of a shared base: a plain adapter folder of its own
            from mas_trainer.learners.lora import save_adapter

            save_adapter(self.peft, self.adapter_name, path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
            return Path(path)
        # the adapter's own weights, merged or not; no embedding layers (none are adapted), so peft does not look the base up online
        self.peft.save_pretrained(str(path), save_embedding_layers=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        return Path(path)
