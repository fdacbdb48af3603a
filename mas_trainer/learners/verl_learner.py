"""verl's `TrainingWorker`s as one rank's learner (the step's `PolicyLearner` on verl).

Each rank composes verl's `TrainingWorker` (FSDP2 shard of the policy, verl's `ppo_loss`),
as verl's own `ActorRolloutRefWorker` does, plus a frozen reference `TrainingWorker` when
the KL loss needs one and a value-model `TrainingWorker` for GAE. Every rank gets all the
step's turns, scores and trains on its slice, and shares what the others need (the critic's
values, the log-prob mismatch) through collectives inside the group, never the controller.
Configs, batch layout and the weight stream are `learners/verl_parts.py`'s.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch

from mas_trainer.engines.models import bf16_is_fast, materialize
from mas_trainer.learners.batch import Turn
from mas_trainer.learners.verl_parts import (
    all_gather, flatten_metrics, pad_id_of, response_tensor, response_values, sft_batch, training_worker_config, turns_batch,
)

if TYPE_CHECKING:
    from mas_trainer.algo.advantages import TurnAdvantage
    from mas_trainer.learners.config import CriticConfig, LearnerConfig

__all__ = ["VerlLearner", "torch_device"]


def torch_device(name: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


class VerlLearner:
    """One rank's actor (and reference, and critic) `TrainingWorker`s of a policy: its weights
    start from `model`, the KL reference is `reference` (default: `model`), a `critic` config
    brings a value model (GAE); `offload`: GPUs shared with other policies (`runtime.share_gpus`)."""

    def __init__(self, model: str, config: LearnerConfig, *, critic: CriticConfig | None, reference: str | None = None,
                 seed: int = 0, device: str = "cpu", offload: bool = False, rank: int = 0, world_size: int = 1) -> None:
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils.losses import ppo_loss

        self.config, self.critic_config, self.seed, self.offload = config, critic, seed, offload
        self.rank, self.world_size = rank, world_size
        self.model_dir = str(materialize(model, seed=seed))
        bf16 = config.bf16 if isinstance(config.bf16, bool) else bf16_is_fast(torch_device(device))
        self.actor_config = config.actor_config()
        self.actor = TrainingWorker(training_worker_config(self.model_dir, config, seed=seed, bf16=bf16, device=device,
                                                               world_size=world_size))
        self.actor.reset()
        self._ppo_loss = partial(ppo_loss, config=self.actor_config)
        self.actor.set_loss_fn(self._ppo_loss)
        self.ref = None
        if config.kl_coef > 0:  # the frozen reference: the base model, forward only
            # verl's forward-only engine offloads to pinned memory, which needs an accelerator; on CPU
            # the reference is an ordinary engine that is never stepped (AdamW allocates no state then)
            self.ref = TrainingWorker(training_worker_config(str(materialize(reference or model, seed=seed)), config,
                                                             forward_only=device != "cpu", seed=seed, bf16=bf16, device=device,
                                                             world_size=world_size))
            self.ref.reset()
        self.critic = _build_critic(self.model_dir, critic, seed, device, world_size) if critic is not None else None
        if offload:  # the rollouts come first
            for worker in self._trainable():
                worker.to("cpu")
        self.updates = 0
        self.pad_id = pad_id_of(self.model_dir)

    def _trainable(self) -> list[Any]:
        """The workers holding parameters and optimizer state on the GPU (the reference is
        verl's forward-only engine, which offloads itself)."""
        return [w for w in (self.actor, self.critic) if w is not None]

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """With GPUs shared between worker groups (`runtime.share_gpus`), the actor's and the
        critic's shards and optimizer states are on the GPU only inside this block. The host
        enters it once around each call that computes or saves (a step, the warm start, a
        checkpoint): verl's `save_checkpoint` loads a CPU module onto the GPU and leaves it there."""
        moved = self._trainable() if self.offload else []
        for worker in moved:
            worker.to("device")
        try:
            yield
        finally:
            for worker in moved:
                worker.to("cpu")
            if moved and torch.cuda.is_available():
                torch.cuda.empty_cache()

    def params(self) -> Any:
        """The full parameters, gathered from the shards as they are read (every rank must read)."""
        return self.actor.engine.get_per_tensor_param()[0]

    # --- the step's learner contract -----------------------------------------------------
    def _rows(self, turns: list[Turn]) -> tuple[list[Turn], int]:
        """This rank's rows of the batch padded to whole mini-batches over the ranks, and how many
        of them are real turns (the rest repeat a turn and carry no loss)."""
        from mas_trainer.learners.verl_parts import padded_size

        multiple = self.config.mini_batch_size
        if self.critic_config is not None:  # both learners cut the same rows into whole mini-batches
            multiple = math.lcm(multiple, self.critic_config.mini_batch_size)
        size = padded_size(len(turns), multiple)
        per = size // self.world_size
        lo, hi = self.rank * per, (self.rank + 1) * per
        return (turns + [turns[0]] * (size - len(turns)))[lo:hi], max(0, min(hi, len(turns)) - lo)

    def _batch(self, rows: list[Turn], turns: list[Turn], **kw: Any) -> Any:
        return turns_batch(turns, pad_id=self.pad_id, size=len(rows), filler=rows[0], **kw)

    def _infer(self, worker: Any, rows: list[Turn], real: int, key: str) -> list[list[float]]:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        td = self._batch(rows, rows[:real])
        tu.assign_non_tensor(td, compute_loss=False, calculate_entropy=False)
        out = worker.infer_batch(td)
        return response_values(no_padding_2_padding(tu.get(out, key), td), rows)

    def values(self, turns: list[Turn]) -> dict[str, list[float]] | None:
        """The critic's values of every turn: each rank scores its rows, all ranks get all."""
        if self.critic is None:
            return None
        rows, real = self._rows(turns)
        mine = self._infer(self.critic, rows, real, "values")[:real]
        return all_gather(dict(zip([t.id for t in rows[:real]], mine, strict=True)))

    def update(self, turns: list[Turn], advantages: Mapping[str, TurnAdvantage],
               values: dict[str, list[float]] | None) -> dict[str, float]:
        rows, real = self._rows(turns)
        metrics = self._update_actor(rows, real, advantages)
        if self.critic is not None and values is not None:  # values: the critic's, before this update
            metrics.update(self._update_critic(rows, real, advantages, values))
        return metrics

    def _update_actor(self, rows: list[Turn], real: int, advantages: Mapping[str, TurnAdvantage]) -> dict[str, float]:
        """Old (and reference) log-probs from the learner's own forward, as verl's trainer does
        (unless learner.old_logprobs=bypass takes the engine's), then verl's `ppo_loss` update."""
        from verl.utils import tensordict_utils as tu

        local, cfg = rows[:real], self.config
        mode = cfg.old_logprobs if cfg.old_logprobs != "auto" else "recompute"
        engine_old = [list(t.old_logprobs) for t in local] + [[0.0] * len(r.response_ids) for r in rows[real:]]
        t_old = time.perf_counter()
        old = engine_old if mode == "bypass" else self._infer(self.actor, rows, real, "log_probs")
        t_old = time.perf_counter() - t_old
        ref = self._infer(self.ref, rows, real, "log_probs") if self.ref is not None else None
        trained = [replace(t, old_logprobs=o[: len(t.response_ids)], advantages=advantages[t.id].advantages.tolist(),
                           ref_logprobs=(ref[i][: len(t.response_ids)] if ref is not None else None))
                   for i, (t, o) in enumerate(zip(local, old[:real], strict=True))]
        td = self._batch(rows, trained)
        if ref is not None:
            td["ref_log_prob"] = response_tensor(td, [t.ref_logprobs for t in trained], len(rows))
        correction: dict[str, float] = {}
        if mode == "rollout_correction":
            td["rollout_is_weights"], correction = _rollout_is_weights(td, old, engine_old, len(rows), real,
                                                                       threshold=cfg.rollout_is_threshold)
        tu.assign_non_tensor(
            td, calculate_entropy=self.actor_config.calculate_entropy, global_batch_size=cfg.mini_batch_size,
            mini_batch_size=cfg.mini_batch_size, epochs=cfg.ppo_epochs,
            seed=cfg.seed * 1_000_003 + self.updates * 1009, dataloader_kwargs={"shuffle": cfg.shuffle}, compute_loss=True,
        )
        t_train = time.perf_counter()
        out = self.actor.train_mini_batch(td)
        self.updates += 1  # before the critic's update, whose shuffle seed counts this one
        metrics = {**(flatten_metrics(tu.get(out, "metrics")) if out is not None else {}),
                   "time/train_mini_batch_s": time.perf_counter() - t_train, **correction}
        diff = [abs(a - b) for t, o in zip(local, old[:real], strict=True) for a, b in zip(t.old_logprobs, o, strict=True)]
        mismatch = all_gather({"sum": sum(diff), "n": len(diff)}, merge=lambda ds: {k: sum(d[k] for d in ds) for k in ds[0]})
        if mode != "bypass":  # bypass computes no learner log-probs to compare (ppo_kl shows the mismatch then)
            metrics["time/old_logprob_s"] = t_old
            metrics["logprob_diff"] = mismatch["sum"] / max(1, mismatch["n"])
        return metrics

    def _update_critic(self, rows: list[Turn], real: int, advantages: Mapping[str, TurnAdvantage],
                       values: dict[str, list[float]]) -> dict[str, float]:
        from verl.utils import tensordict_utils as tu

        local, cc = rows[:real], self.critic_config
        assert cc is not None
        ctd = self._batch(rows, local, returns=[advantages[t.id].returns.tolist() for t in local],
                          values=[values[t.id] for t in local])
        tu.assign_non_tensor(ctd, global_batch_size=cc.mini_batch_size, mini_batch_size=cc.mini_batch_size,
                             epochs=cc.ppo_epochs, seed=cc.seed * 1_000_003 + self.updates * 1009,
                             dataloader_kwargs={"shuffle": cc.shuffle})
        assert self.critic is not None
        out = self.critic.train_mini_batch(ctd)
        return {f"critic/{k}": v for k, v in flatten_metrics(tu.get(out, "metrics")).items()} if out is not None else {}

    # --- the supervised warm start -------------------------------------------------------
    def warm_start(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]], *, steps: int, lr: float,
                   batch_size: int) -> tuple[list[float], list[float], int]:
        """`steps` optimizer steps of verl's `sft_loss` on (prompt ids, completion ids)
        examples (`learners/sft.py` batches, each cut over the ranks), then `ppo_loss` again;
        (losses, grad norms, completion tokens).

        The learner's own optimizer, at `lr` for the phase, and its moments cleared
        afterwards: at a fresh run it holds no state yet, so this is a fresh AdamW for the warm
        start and again for RL (see `TorchLearner.supervised` for why). `train_batch`, not
        `train_mini_batch`, so verl's LR scheduler does not advance."""
        from verl.workers.utils.losses import sft_loss

        from mas_trainer.learners.sft import sft_batches

        turns = [Turn(f"sft{i}", p, r, [0.0] * len(r), 0.0) for i, (p, r) in enumerate(examples)]
        optimizer = self.actor.engine.optimizer
        lrs = [group["lr"] for group in optimizer.param_groups]
        losses: list[float] = []
        norms: list[float] = []
        tokens = 0
        self.actor.set_loss_fn(partial(sft_loss, config=None))  # sft_loss reads no config
        try:
            for group in optimizer.param_groups:
                group["lr"] = lr
            for batch in sft_batches(len(turns), steps, batch_size, self.seed):
                tokens += self._sft_step([turns[i] for i in batch], losses, norms)
            for group, lr in zip(optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            optimizer.state.clear()
        finally:
            self.actor.set_loss_fn(self._ppo_loss)
        return losses, norms, tokens

    def _sft_step(self, rows: list[Turn], losses: list[float], norms: list[float]) -> int:
        from tensordict import NonTensorData
        from verl.utils import tensordict_utils as tu

        per = -(-len(rows) // self.world_size)  # rows a rank; rows past the batch carry no loss tokens
        mine = rows[self.rank * per:(self.rank + 1) * per]
        td = sft_batch(mine, pad_id=self.pad_id, size=per, filler=rows[0])
        tu.assign_non_tensor(td, global_token_num=NonTensorData(td["input_ids"].offsets().diff().tolist()),
                             update_lr_scheduler=False)
        out = self.actor.train_batch(td)
        if out is not None:
            metrics = tu.get(out, "metrics")
            losses.append(float(metrics["loss"]))
            if metrics.get("grad_norm") is not None and math.isfinite(float(metrics["grad_norm"])):
                norms.append(float(metrics["grad_norm"]))
        return sum(len(t.response_ids) for t in rows)

    # --- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, learner_dir: str) -> None:
        """verl's checkpoint: shards, optimizer, RNG (call inside `on_device`)."""
        import os

        self.actor.save_checkpoint(learner_dir)
        if self.critic is not None:
            self.critic.save_checkpoint(os.path.join(learner_dir, "critic"))

    def load_checkpoint(self, learner_dir: str) -> None:
        """verl unpickles these with weights_only=False: vet the folder first (`run/untrusted.py`)."""
        import os

        self.actor.load_checkpoint(learner_dir, del_local_after_load=False)
        if self.critic is not None:
            self.critic.load_checkpoint(os.path.join(learner_dir, "critic"), del_local_after_load=False)


def _build_critic(model_dir: str, c: CriticConfig, seed: int, device: str, world_size: int) -> Any:
    """A value-model `TrainingWorker` (verl's value head on the policy's body) with verl's
    clipped `value_loss`, configured from the policy's `CriticConfig`."""
    from types import SimpleNamespace

    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import value_loss

    from mas_trainer.learners.config import LearnerConfig

    opt = LearnerConfig(lr=c.lr, max_grad_norm=c.max_grad_norm, mini_batch_size=c.mini_batch_size,
                        micro_batch_size=c.micro_batch_size)
    bf16 = c.bf16 if isinstance(c.bf16, bool) else bf16_is_fast(torch_device(device))
    worker = TrainingWorker(training_worker_config(model_dir, opt, model_type="value_model", seed=seed, bf16=bf16,
                                                    device=device, world_size=world_size))
    worker.reset()
    # value_loss reads these three fields of verl's CriticConfig
    worker.set_loss_fn(partial(value_loss, config=SimpleNamespace(
        cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode, loss_scale_factor=None)))
    return worker


def _rollout_is_weights(td: Any, old: list[list[float]], engine: list[list[float]], size: int, real: int,
                        threshold: float) -> tuple[torch.Tensor, dict[str, float]]:
    """`learners/correction.py`'s weights on the rows of this rank (filler rows masked out)."""
    from mas_trainer.learners.correction import rollout_is_weights

    learner_lp = response_tensor(td, old[:size], size)
    engine_lp = response_tensor(td, engine[:size], size)
    mask = torch.zeros_like(learner_lp)
    for b, vals in enumerate(engine[:real]):
        mask[b, : len(vals)] = 1.0
    return rollout_is_weights(learner_lp, engine_lp, mask, threshold)
