"""A trainable policy's worker group as verl runs one: a `RayWorkerGroup` of `PolicyWorker`s.

Each rank composes verl's `TrainingWorker` (FSDP2 shard of the policy, verl's `ppo_loss`),
as verl's own `ActorRolloutRefWorker` does, plus a frozen reference `TrainingWorker` when
the KL loss needs one and a value-model `TrainingWorker` for GAE. Rank 0 also hosts the
policy's engine and the buffer of the turns it generated: the controller sends only thin
records; rank 0 shares the turns' token ids with the other ranks inside the group (a
collective, not through the controller), each rank scores and trains on its slice, and after
the update the full parameters are gathered from the shards (verl's `get_per_tensor_param`,
the stream its own rollout weight sync uses) straight into rank 0's engine.

On CPU the group runs on gloo through the platform in `learners/verl_cpu.py`; on GPUs the
same code runs on NCCL, one GPU per rank.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import torch
from tensordict import NonTensorData
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from mas_trainer.engines.base import EngineMeter, Generation, SamplingParams
from mas_trainer.engines.models import bf16_is_fast
from mas_trainer.runtime.plan import WorkerPlan
from mas_trainer.runtime.turns import BufferedTurn, TurnStore

__all__ = ["PolicyWorker"]


class PolicyWorker(Worker):
    """One rank of a policy's verl worker group (see the module docstring)."""

    def __init__(self, plan: WorkerPlan) -> None:
        super().__init__()
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils.losses import ppo_loss

        from mas_trainer.engines.models import materialize
        from mas_trainer.learners.torch_learner import build_actor_config
        from mas_trainer.learners.verl_learner import training_worker_config

        if plan.torch_threads:
            torch.set_num_threads(plan.torch_threads)
        if plan.device == "cpu" and not torch.distributed.is_initialized():
            # verl's own set-up would ask for "cpu:gloo,cpu:gloo", which torch refuses
            torch.distributed.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        self.plan = plan
        self.learner = plan.learner
        self.advantage = plan.advantage
        model_dir = str(materialize(plan.model, seed=plan.seed))
        bf16 = self.learner.bf16 if isinstance(self.learner.bf16, bool) else bf16_is_fast(_device(plan.device))
        self.actor_config = build_actor_config(self.learner)
        self.actor = TrainingWorker(training_worker_config(model_dir, self.learner, seed=plan.seed, bf16=bf16,
                                                            device=plan.device))
        self.actor.reset()
        self.actor.set_loss_fn(partial(ppo_loss, config=self.actor_config))
        self.ref = None
        if self.learner.kl_coef > 0:  # the frozen reference: the base model, forward only
            # verl's forward-only engine offloads to pinned memory, which needs an accelerator; on CPU
            # the reference is an ordinary engine that is never stepped (AdamW allocates no state then)
            self.ref = TrainingWorker(training_worker_config(str(materialize(plan.reference or plan.model, seed=plan.seed)),
                                                             self.learner, forward_only=plan.device != "cpu", seed=plan.seed,
                                                             bf16=bf16, device=plan.device))
            self.ref.reset()
        self.critic = None
        if self.advantage.estimator == "gae":
            self.critic = _build_critic(model_dir, plan)
            self.critic_config = plan.critic
        if plan.offload_between_phases:  # the rollouts come first
            for worker in self._trainable():
                worker.to("cpu")
        self.updates = 0
        self.turns = TurnStore(plan.policy, plan.max_staleness)
        self.engine = None
        self.meter: EngineMeter | None = None
        self.host_model = None  # replica engines: rank 0's full copy of the weights, gathered for each save
        self.tokenizer = None
        if self.rank == 0 and plan.engine == "embedded":
            from mas_trainer.engines.torch_engine import load_engine

            self.engine = load_engine(model_dir, name=plan.policy, max_batch_size=plan.max_batch_size,
                                      batch_wait_ms=plan.batch_wait_ms, bf16=plan.engine_bf16, device=_device(plan.device),
                                      prefix_cache_mb=plan.prefix_cache_mb, fast_decode=plan.fast_decode)
            self.tokenizer, self.meter = self.engine.tokenizer, EngineMeter(self.engine)
        elif self.rank == 0:
            from mas_trainer.engines.models import load_model

            self.host_model, self.tokenizer = load_model(model_dir)
        self.checkpoint_engine = None
        self.rollout = None  # colocated vLLM (verl's hybrid engine): this rank's adapter to its replica's server
        if plan.engine != "embedded":  # the sending side of verl's weight sync, configured as the replicas' side
            from mas_trainer.rollout.fleet import learner_checkpoint_engine, rollout_config

            rcfg = rollout_config(plan.policy, plan.engine, plan.replica, device=plan.device)
            ce = rcfg.checkpoint_engine
            if ce.backend == "naive":
                self.rollout = _server_adapter(rcfg, model_dir, plan.replica_first_rank + self.rank // rcfg.tensor_model_parallel_size)
            else:
                self.checkpoint_engine = learner_checkpoint_engine(rcfg, self.rank)
        self.pad_id = int(_pad_id(model_dir))

    # --- serving (rank 0) ------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None = None) -> list[Generation]:
        if self.engine is None:
            raise RuntimeError(f"rank {self.rank} holds no embedded engine: rank 0 of an engine=embedded policy serves")
        version = self.updates  # rank 0's engine runs no row across the weights' copy (run_exclusive)
        gens = await self.engine.generate(prompt_ids, params)
        self.turns.record(turn_id, prompt_ids, gens, version)
        return gens

    async def discard(self) -> int:
        """Forget stored turns (held-out rollouts); engine figures restart from here too."""
        if self.meter is not None:
            self.meter.read()
        return self.turns.clear()

    # --- training (every rank) -------------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def train(self, records: Sequence[Any], turns: dict[str, BufferedTurn] | None = None) -> dict[str, float] | None:
        """One PPO update from the controller's thin records; returns metrics on rank 0.

        `turns` (`BufferedTurn`s by turn id) come with the records when rollout replicas,
        not rank 0's engine, generated them."""
        from mas_trainer.learners.batch import Turn

        t0 = time.perf_counter()
        shared: list[list[tuple[Any, BufferedTurn]] | None] = [None]
        if self.rank == 0:
            self.turns.add(turns or {})
            shared = [self.turns.take(records, self.updates)]
        torch.distributed.broadcast_object_list(shared, src=0)
        pairs = shared[0]
        if not pairs:
            return {"turns": 0.0, **self.turns.stale_metrics()} if self.rank == 0 else None
        records = [r for r, _ in pairs]
        batch = [Turn(id=r.turn_id, prompt_ids=t.prompt_ids, response_ids=t.response_ids, old_logprobs=t.logprobs,
                      advantages=0.0) for r, t in pairs]
        with self._on_device():  # shared GPUs: the update's turn, then the rollouts'
            metrics = self._update(records, batch)
            if self.plan.engine == "embedded":
                self._sync_engine()  # replica engines get the weights from update_weights, after this call
        metrics.update(turns=float(len(batch)), seconds=time.perf_counter() - t0, updates=float(self.updates))
        metrics.update(self.turns.stale_metrics())  # rank 0's is the one returned
        if self.rank != 0:
            return None
        return {**metrics, **(self.meter.read() if self.meter is not None else {})}  # replicas: their group adds theirs

    def _trainable(self) -> list[Any]:
        """The workers holding parameters and optimizer state on the GPU (the reference is
        verl's forward-only engine, which offloads itself)."""
        return [w for w in (self.actor, self.critic) if w is not None]

    @contextmanager
    def _on_device(self) -> Any:
        """With GPUs shared between worker groups (`runtime.share_gpus`), the actor's and the
        critic's shards and optimizer states are on the GPU only inside this block; verl's
        `save_checkpoint` loads a CPU module onto the GPU and leaves it there, so saving runs in
        it too."""
        moved = self._trainable() if self.plan.offload_between_phases else []
        for worker in moved:
            worker.to("device")
        try:
            yield
        finally:
            for worker in moved:
                worker.to("cpu")
            if moved and torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _slice(self, n: int) -> tuple[int, int, int]:
        """(padded global size, start, stop) of this rank's rows."""
        from mas_trainer.learners.verl_learner import padded_size

        multiple = self.learner.mini_batch_size
        if self.critic is not None:  # both learners cut the same rows into whole mini-batches
            multiple = math.lcm(multiple, self.critic_config.mini_batch_size)
        size = padded_size(n, multiple)
        per = size // self.world_size
        return size, self.rank * per, (self.rank + 1) * per

    def _update(self, records: list[Any], turns: list[Any]) -> dict[str, float]:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        from mas_trainer.algo.advantages import compute_policy_advantages
        from mas_trainer.learners.verl_learner import response_values, turns_batch

        size, lo, hi = self._slice(len(turns))
        rows = (turns + [turns[0]] * (size - len(turns)))[lo:hi]
        real = max(0, min(hi, len(turns)) - lo)
        local = rows[:real]

        def batch(ts: list[Any], **kw: Any) -> Any:
            return turns_batch(ts, pad_id=self.pad_id, size=len(rows), filler=rows[0], **kw)

        def infer(worker: Any, td: Any, key: str) -> list[list[float]]:
            tu.assign_non_tensor(td, compute_loss=False, calculate_entropy=False)
            out = worker.infer_batch(td)
            return response_values(no_padding_2_padding(tu.get(out, key), td), rows)

        # old (and reference) log-probs from the learner's own forward, as verl's trainer does, unless
        # learner.old_logprobs=bypass takes the engine's
        mode = self.learner.old_logprobs if self.learner.old_logprobs != "auto" else "recompute"
        engine_old = [list(t.old_logprobs) for t in local] + [[0.0] * len(r.response_ids) for r in rows[real:]]
        t_old = time.perf_counter()
        old = engine_old if mode == "bypass" else infer(self.actor, batch(local), "log_probs")
        t_old = time.perf_counter() - t_old
        ref = infer(self.ref, batch(local), "log_probs") if self.ref is not None else None
        values = None
        if self.critic is not None:
            mine = infer(self.critic, batch(local), "values")[:real]
            values = _all_gather(dict(zip([t.id for t in local], mine)))
        adv = compute_policy_advantages(records, self.advantage, values=values).per_turn()
        diff = [abs(a - b) for t, o in zip(local, old) for a, b in zip(t.old_logprobs, o)]
        trained = [replace(t, old_logprobs=o[: len(t.response_ids)], advantages=adv[t.id].advantages.tolist(),
                           ref_logprobs=(ref[i][: len(t.response_ids)] if ref is not None else None))
                   for i, (t, o) in enumerate(zip(local, old))]
        td = batch(trained)
        if ref is not None:
            td["ref_log_prob"] = _response_tensor(td, [t.ref_logprobs for t in trained], len(rows))
        corr_metrics: dict[str, float] = {}
        if mode == "rollout_correction":
            td["rollout_is_weights"], corr_metrics = _rollout_is_weights(
                td, old, engine_old, len(rows), real, threshold=self.learner.rollout_is_threshold)
        cfg = self.learner
        tu.assign_non_tensor(
            td, calculate_entropy=self.actor_config.calculate_entropy, global_batch_size=cfg.mini_batch_size,
            mini_batch_size=cfg.mini_batch_size, epochs=cfg.ppo_epochs,
            seed=cfg.seed * 1_000_003 + self.updates * 1009, dataloader_kwargs={"shuffle": cfg.shuffle}, compute_loss=True,
        )
        t_train = time.perf_counter()
        out = self.actor.train_mini_batch(td)
        t_train = time.perf_counter() - t_train
        self.updates += 1
        metrics = _flatten(tu.get(out, "metrics")) if out is not None else {}
        metrics["time/train_mini_batch_s"] = t_train
        if mode != "bypass":  # the learner's forward for the old log-probs (outside train_mini_batch)
            metrics["time/old_logprob_s"] = t_old
        metrics.update(corr_metrics)
        mismatch = _all_gather({"sum": sum(diff), "n": len(diff)}, merge=lambda ds: {k: sum(d[k] for d in ds) for k in ds[0]})
        if mode != "bypass":  # bypass computes no learner log-probs to compare (ppo_kl shows the mismatch then)
            metrics["logprob_diff"] = mismatch["sum"] / max(1, mismatch["n"])
        if self.critic is not None and values is not None:  # values: the critic's, above
            returns = [adv[t.id].returns.tolist() for t in local]
            ctd = batch(local, returns=returns, values=[values[t.id] for t in local])
            cc = self.critic_config
            tu.assign_non_tensor(ctd, global_batch_size=cc.mini_batch_size, mini_batch_size=cc.mini_batch_size,
                                 epochs=cc.ppo_epochs, seed=cc.seed * 1_000_003 + self.updates * 1009,
                                 dataloader_kwargs={"shuffle": cc.shuffle})
            cout = self.critic.train_mini_batch(ctd)
            if cout is not None:
                metrics.update({f"critic/{k}": v for k, v in _flatten(tu.get(cout, "metrics")).items()})
        all_adv = torch.cat([a.advantages for a in adv.values()])
        metrics.update(adv_mean=float(all_adv.mean()), adv_abs_mean=float(all_adv.abs().mean()))
        return metrics

    # --- the supervised warm start (every rank) ----------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def warm_start(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]], config: Any) -> dict[str, float] | None:
        """`config.steps` optimizer steps of verl's `sft_loss` on (prompt ids, completion ids)
        examples (`learners/sft.py` batches, each cut over the ranks), then `ppo_loss` again and
        the weights into rank 0's engine; returns `sft_metrics` on rank 0.

        The learner's own optimizer, at `config.lr` for the phase, and its moments cleared
        afterwards: at a fresh run it holds no state yet, so this is a fresh AdamW for the warm
        start and again for RL (see `TorchLearner.supervised` for why). `train_batch`, not
        `train_mini_batch`, so verl's LR scheduler does not advance."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.losses import ppo_loss, sft_loss

        from mas_trainer.learners.batch import Turn
        from mas_trainer.learners.sft import sft_batches, sft_metrics

        turns = [Turn(f"sft{i}", p, r, [0.0] * len(r), 0.0) for i, (p, r) in enumerate(examples)]
        optimizer = self.actor.engine.optimizer
        lrs = [group["lr"] for group in optimizer.param_groups]
        losses: list[float] = []
        norms: list[float] = []
        tokens = 0
        self.actor.set_loss_fn(partial(sft_loss, config=None))  # sft_loss reads no config
        try:
            with self._on_device():
                for group in optimizer.param_groups:
                    group["lr"] = config.lr
                for batch in sft_batches(len(turns), config.steps, config.batch_size, self.plan.seed):
                    rows = [turns[i] for i in batch]
                    per = -(-len(rows) // self.world_size)  # rows a rank; rows past the batch carry no loss tokens
                    mine = rows[self.rank * per:(self.rank + 1) * per]
                    td = _sft_batch(mine, pad_id=self.pad_id, size=per, filler=rows[0])
                    tu.assign_non_tensor(td, global_token_num=NonTensorData(td["input_ids"].offsets().diff().tolist()),
                                         update_lr_scheduler=False)
                    out = self.actor.train_batch(td)
                    tokens += sum(len(t.response_ids) for t in rows)
                    if out is not None:
                        metrics = tu.get(out, "metrics")
                        losses.append(float(metrics["loss"]))
                        if metrics.get("grad_norm") is not None and math.isfinite(float(metrics["grad_norm"])):
                            norms.append(float(metrics["grad_norm"]))
                for group, lr in zip(optimizer.param_groups, lrs):
                    group["lr"] = lr
                optimizer.state.clear()
                if self.plan.engine == "embedded":
                    self._sync_engine()
        finally:
            self.actor.set_loss_fn(partial(ppo_loss, config=self.actor_config))
        if self.rank != 0:
            return None
        return sft_metrics(losses, tokens, len(turns), norms)

    # --- weights to the rollout replicas: verl's actor side of CheckpointEngineManager ----
    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        """Stream the full parameters (gathered from the shards) to the replicas; every rank joins.

        `naive` (colocated): verl's in-process sync of its own hybrid worker (`engine_workers.py`
        `update_weights`): wake the replica's weights, hand each tensor to vLLM on the same GPU
        (CUDA IPC through verl's ServerAdapter), then wake its KV cache once every rank is done.
        Offloaded shards (`share_gpus`) need no move first: verl's FSDP2 stream stages each
        tensor on the GPU as it gathers it."""
        if self.rollout is None:
            if self.checkpoint_engine is None:
                raise RuntimeError("update_weights: this policy has no rollout replicas to send weights to (engine=embedded)")
            params, _ = self.actor.engine.get_per_tensor_param()
            return await self.checkpoint_engine.send_weights(params, global_steps=global_steps) or {}
        from verl.utils.device import set_expandable_segments

        set_expandable_segments(False)
        torch.cuda.empty_cache()
        await self.rollout.resume(tags=["weights"])
        params, _ = self.actor.engine.get_per_tensor_param()
        await self.rollout.update_weights(params, global_steps=global_steps)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        await asyncio.to_thread(torch.distributed.barrier)
        await self.rollout.resume(tags=["kv_cache"])
        set_expandable_segments(True)
        return {}

    def _sync_engine(self) -> None:
        """Gather the full parameters from the shards into rank 0's engine or host copy (every rank joins)."""
        from mas_trainer.learners.verl_learner import load_streamed_weights

        params, _ = self.actor.engine.get_per_tensor_param()
        if self.engine is None and self.host_model is None:
            for _ in params:  # the all-gathers happen as the stream is read
                pass
            return
        if self.engine is None:
            load_streamed_weights(self.host_model, params)
            return
        self.engine.run_exclusive(lambda model: load_streamed_weights(model, params)).result()

    # --- checkpoints (every rank) ----------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def save(self, folder: str, learner_dir: str) -> None:
        """verl's checkpoint (shards, optimizer, RNG) in `learner_dir`; the Hugging Face folder
        of the policy (fp32, tokenizer included) in `folder`, written from rank 0's engine,
        which holds the full parameters gathered after the last update."""
        with self._on_device():
            self.actor.save_checkpoint(learner_dir)
            if self.critic is not None:
                self.critic.save_checkpoint(os.path.join(learner_dir, "critic"))
            if self.plan.engine != "embedded":
                self._sync_engine()  # the host copy is gathered only when it is written
        if self.rank == 0:
            from mas_trainer.engines.models import save_pretrained

            if self.engine is not None:
                self.engine.run_exclusive(lambda model: save_pretrained(model, self.tokenizer, folder)).result()
            else:
                save_pretrained(self.host_model, self.tokenizer, folder)
            (Path(learner_dir) / "mas_trainer.json").write_text(json.dumps({"updates": self.updates}))
        torch.distributed.barrier()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def load(self, learner_dir: str) -> int:
        """Resume: shards, optimizer and RNG from `learner_dir`, then the engine's weights."""
        from mas_trainer.runtime.untrusted import refuse_code_in_checkpoints

        refuse_code_in_checkpoints(learner_dir)  # verl unpickles these with weights_only=False
        with self._on_device():
            self.actor.load_checkpoint(learner_dir, del_local_after_load=False)
            if self.critic is not None:
                self.critic.load_checkpoint(os.path.join(learner_dir, "critic"), del_local_after_load=False)
            self.updates = json.loads((Path(learner_dir) / "mas_trainer.json").read_text())["updates"]
            if self.plan.engine == "embedded":
                self._sync_engine()
        return self.updates

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _sft_batch(turns: list[Any], *, pad_id: int, size: int, filler: Any) -> Any:
    """The PPO batch layout of `turns` (`turns_batch`) with the `loss_mask` verl's `sft_loss`
    reads in its no-padding mode: over each row's whole sequence, 1 on the completion tokens
    (sft_loss shifts it by one to line it up with the log-probs); rows past `turns` all 0."""
    from mas_trainer.learners.verl_learner import turns_batch

    td = turns_batch(turns, pad_id=pad_id, size=size, filler=filler)
    offsets = td["input_ids"].offsets()
    mask = torch.zeros(int(offsets[-1]), dtype=torch.float32)
    for b, t in enumerate(turns):
        mask[int(offsets[b + 1]) - len(t.response_ids):int(offsets[b + 1])] = 1
    td["loss_mask"] = torch.nested.nested_tensor_from_jagged(mask, offsets=offsets)
    return td


def _server_adapter(rcfg: Any, model_dir: str, replica_rank: int) -> Any:
    """verl's ServerAdapter for this learner rank's colocated replica, as verl's own hybrid
    worker builds it; it finds the server by the replica rank the fleet gave it."""
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.base import get_rollout_class

    return get_rollout_class(rcfg.name, rcfg.mode)(config=rcfg, model_config=HFModelConfig(path=model_dir),
                                                   device_mesh=None, replica_rank=replica_rank)


def _device(name: str) -> torch.device:
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pad_id(model_dir: str) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    return int(pad[0] if isinstance(pad, (list, tuple)) else (pad or 0))


def _all_gather(obj: Any, merge: Any = None) -> Any:
    """Every rank's `obj`, merged (dicts: union) on every rank."""
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    if merge is not None:
        return merge(out)
    merged: dict = {}
    for part in out:
        merged.update(part)
    return merged


def _response_tensor(td: Any, per_row: list[Any], size: int) -> Any:
    """A (B, R) right-padded float tensor of per-response-token values (pad rows 0)."""
    R = td["responses"].shape[1]
    t = torch.zeros(size, R, dtype=torch.float32)
    for b, vals in enumerate(per_row):
        t[b, : len(vals)] = torch.as_tensor(vals, dtype=torch.float32)
    return t


def _flatten(metrics: dict[str, Any]) -> dict[str, float]:
    """verl's metric lists (one entry per mini-batch / micro-batch) as means, `actor/` dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        vals = value if isinstance(value, list) else [value]
        nums = [float(v.value if hasattr(v, "value") else v) for v in vals if v is not None]
        if nums:
            out[key.removeprefix("actor/").removeprefix("critic/")] = sum(nums) / len(nums)
    return out


def _build_critic(model_dir: str, plan: WorkerPlan) -> Any:
    """A value-model `TrainingWorker` (verl's value head on the policy's body) with verl's
    clipped `value_loss`, configured from the policy's `CriticConfig`."""
    from types import SimpleNamespace

    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import value_loss

    from mas_trainer.learners.config import LearnerConfig
    from mas_trainer.learners.verl_learner import training_worker_config

    c = plan.critic
    opt = LearnerConfig(lr=c.lr, max_grad_norm=c.max_grad_norm, mini_batch_size=c.mini_batch_size,
                        micro_batch_size=c.micro_batch_size)
    bf16 = c.bf16 if isinstance(c.bf16, bool) else bf16_is_fast(_device(plan.device))
    worker = TrainingWorker(training_worker_config(model_dir, opt, model_type="value_model", seed=plan.seed, bf16=bf16,
                                                    device=plan.device))
    worker.reset()
    # value_loss reads these three fields of verl's CriticConfig
    worker.set_loss_fn(partial(value_loss, config=SimpleNamespace(
        cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode, loss_scale_factor=None)))
    return worker


def _rollout_is_weights(td: Any, old: list[list[float]], engine: list[list[float]], size: int, real: int,
                        threshold: float) -> tuple[torch.Tensor, dict[str, float]]:
    """`learners/correction.py`'s weights on the rows of this rank (filler rows masked out)."""
    from mas_trainer.learners.correction import rollout_is_weights

    learner_lp = _response_tensor(td, old[:size], size)
    engine_lp = _response_tensor(td, engine[:size], size)
    mask = torch.zeros_like(learner_lp)
    for b, vals in enumerate(engine[:real]):
        mask[b, : len(vals)] = 1.0
    return rollout_is_weights(learner_lp, engine_lp, mask, threshold)
