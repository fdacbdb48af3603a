"""A policy hosted by verl: a `RayWorkerGroup` of `PolicyWorker`s, one per rank.

Every rank holds a `VerlLearner`; rank 0 also serves (`Serving`) and shares the step's turns
with the other ranks by a collective, never through the controller. Each rank runs
`policy_step`; then the new weights go where the policy is served through its weight sink
(`WEIGHT_SINKS`, by engine kind): gathered from the shards (verl's `get_per_tensor_param`,
the stream of its own weight sync) into rank 0's engine, or to the replicas by verl's sync.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from mas_trainer.engines.threads import set_torch_threads
from mas_trainer.engines.base import Generation, SamplingParams
from mas_trainer.learners.verl_learner import VerlLearner, torch_device
from mas_trainer.policy.contract import StepResult, WarmStartExample, WorkerPlan
from mas_trainer.policy.step import policy_step
from mas_trainer.policy.turns import BufferedTurn, Serving, TurnStore

if TYPE_CHECKING:
    from mas_trainer.algo.advantages import TurnRecord
    from mas_trainer.config import WarmStartConfig

__all__ = ["PolicyWorker", "WEIGHT_SINKS", "register_weight_sink"]

WEIGHT_SINKS: dict[str, type] = {}
"""engine kind -> the weight sink of a verl rank serving it (`register_weight_sink`)."""


def register_weight_sink(*kinds: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        WEIGHT_SINKS.update(dict.fromkeys(kinds, cls))
        return cls
    return add


@register_weight_sink("embedded")
class EngineSink:
    """Rank 0's embedded engine: the full parameters are gathered into it after every change
    of weights, so the next request is served by them; the Hugging Face folder is written from it."""

    def __init__(self, plan: WorkerPlan, learner: VerlLearner, rank: int) -> None:
        from mas_trainer.engines.torch_engine import load_engine

        self.engine = load_engine(learner.model_dir, name=plan.policy, settings=plan.engine_settings,
                                  device=torch_device(plan.device), threads=plan.torch_threads) if rank == 0 else None
        self.tokenizer = self.engine.tokenizer if self.engine is not None else None

    def changed(self, learner: VerlLearner) -> None:
        """The weights changed (an update, the warm start, a resume): every rank reads the stream."""
        from mas_trainer.learners.verl_parts import load_streamed_weights

        params = learner.params()
        if self.engine is None:
            for _ in params:  # the all-gathers happen as the stream is read
                pass
            return
        self.engine.run_exclusive(lambda model: load_streamed_weights(model, params)).result()

    def before_save(self, learner: VerlLearner) -> None:
        pass  # the engine holds the weights of the last change

    def save(self, folder: str) -> None:
        from mas_trainer.engines.models import save_pretrained

        assert self.engine is not None
        self.engine.run_exclusive(lambda model: save_pretrained(model, self.tokenizer, folder)).result()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


@register_weight_sink("vllm", "torch-replica")
class ReplicaSink:
    """Rollout replicas serve: verl's weight sync sends them the stream after each update
    (`PolicyWorker.update_weights`, driven by the controller's fleet); rank 0 keeps a full host
    copy only to write the Hugging Face folder, gathered when a checkpoint is saved."""

    engine = None

    def __init__(self, plan: WorkerPlan, learner: VerlLearner, rank: int) -> None:
        from mas_trainer.engines.models import load_model
        from mas_trainer.replicas.fleet import learner_checkpoint_engine, rollout_config

        self.host_model: Any = None
        self.tokenizer: Any = None
        if rank == 0:
            self.host_model, self.tokenizer = load_model(learner.model_dir)
        self.checkpoint_engine: Any = None
        self.rollout = None  # colocated vLLM (verl's hybrid engine): this rank's adapter to its replica's server
        rcfg = rollout_config(plan.policy, plan.engine, plan.replica, device=plan.device)
        if rcfg.checkpoint_engine.backend == "naive":
            self.rollout = _server_adapter(rcfg, learner.model_dir, plan.replica_first_rank + rank // rcfg.tensor_model_parallel_size)
        else:  # the sending side of verl's weight sync, configured as the replicas' side
            self.checkpoint_engine = learner_checkpoint_engine(rcfg, rank)

    def changed(self, learner: VerlLearner) -> None:
        pass  # the replicas get the weights from update_weights, after the step

    def before_save(self, learner: VerlLearner) -> None:
        from mas_trainer.learners.verl_parts import load_streamed_weights

        params = learner.params()
        if self.host_model is None:
            for _ in params:
                pass
            return
        load_streamed_weights(self.host_model, params)

    def save(self, folder: str) -> None:
        from mas_trainer.engines.models import save_pretrained

        save_pretrained(self.host_model, self.tokenizer, folder)

    def close(self) -> None:
        pass


class PolicyWorker(Worker):
    """One rank of a policy's verl worker group (see the module docstring)."""

    def __init__(self, plan: WorkerPlan) -> None:
        super().__init__()
        if plan.torch_threads:
            set_torch_threads(plan.torch_threads)
        if plan.device == "cpu" and not torch.distributed.is_initialized():
            # verl's own set-up would ask for "cpu:gloo,cpu:gloo", which torch refuses
            torch.distributed.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        self.plan = plan
        self.learner = VerlLearner(plan.model, plan.learner, critic=plan.critic if plan.advantage.estimator == "gae" else None,
                                   reference=plan.reference, seed=plan.seed, device=plan.device,
                                   offload=plan.offload_between_phases, rank=self.rank, world_size=self.world_size)
        self.sink = WEIGHT_SINKS[plan.engine](plan, self.learner, self.rank)
        self.serving = Serving(self.sink.engine, TurnStore(plan.policy, plan.max_staleness))

    # --- serving (rank 0) ------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None = None) -> list[Generation]:
        return await self.serving.generate(prompt_ids, params, turn_id, self.learner.updates)

    async def discard(self) -> int:
        return self.serving.discard()

    # --- training (every rank) -------------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def train(self, records: Sequence[TurnRecord], turns: dict[str, BufferedTurn] | None = None) -> StepResult | None:
        """One update from the controller's thin records; its result on rank 0.

        `turns` (`BufferedTurn`s by turn id) come with the records when rollout replicas,
        not rank 0's engine, generated them."""
        t0 = time.perf_counter()
        shared: list[Any] = [None]
        if self.rank == 0:
            self.serving.turns.add(turns or {})
            shared = [self.serving.turns.take(records, self.learner.updates)]
        torch.distributed.broadcast_object_list(shared, src=0)
        stale = self.serving.turns.stale_metrics()
        if not shared[0]:  # the weights' version goes back with it: the replicas are told it after every step
            return StepResult({"turns": 0.0, "updates": float(self.learner.updates), **stale}) if self.rank == 0 else None
        with self.learner.on_device():  # shared GPUs: the update's turn, then the rollouts'
            result = policy_step(shared[0], self.plan.advantage, self.learner)
            self.sink.changed(self.learner)
        if self.rank != 0:
            return None
        result.metrics.update(seconds=time.perf_counter() - t0, updates=float(self.learner.updates), **stale,
                              **self.serving.figures())
        return result

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def warm_start(self, examples: Sequence[WarmStartExample], config: WarmStartConfig) -> dict[str, float] | None:
        """The supervised warm start (`VerlLearner.warm_start`), then the weights to the sink;
        `sft_metrics` on rank 0."""
        from mas_trainer.learners.sft import sft_metrics

        with self.learner.on_device():
            losses, norms, tokens = self.learner.warm_start(examples, steps=config.steps, lr=config.lr,
                                                            batch_size=config.batch_size)
            self.sink.changed(self.learner)
        return sft_metrics(losses, tokens, len(examples), norms) if self.rank == 0 else None

    # --- weights to the rollout replicas: verl's actor side of CheckpointEngineManager ----
    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.sink.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        """Stream the full parameters (gathered from the shards) to the replicas; every rank joins.

        `naive` (colocated): verl's in-process sync of its own hybrid worker (`engine_workers.py`
        `update_weights`): wake the replica's weights, hand each tensor to vLLM on the same GPU
        (CUDA IPC through verl's ServerAdapter), then wake its KV cache once every rank is done.
        Offloaded shards (`share_gpus`) need no move first: verl's FSDP2 stream stages each
        tensor on the GPU as it gathers it."""
        sink = self.sink
        if not isinstance(sink, ReplicaSink):
            raise RuntimeError("update_weights: this policy has no rollout replicas to send weights to (engine=embedded)")
        if sink.rollout is None:
            return await sink.checkpoint_engine.send_weights(self.learner.params(), global_steps=global_steps) or {}
        from verl.utils.device import set_expandable_segments

        set_expandable_segments(False)
        torch.cuda.empty_cache()
        await sink.rollout.resume(tags=["weights"])
        await sink.rollout.update_weights(self.learner.params(), global_steps=global_steps)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        await asyncio.to_thread(torch.distributed.barrier)
        await sink.rollout.resume(tags=["kv_cache"])
        set_expandable_segments(True)
        return {}

    # --- checkpoints (every rank) ----------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def save(self, folder: str, learner_dir: str) -> None:
        """verl's checkpoint (shards, optimizer, RNG) in `learner_dir`; the Hugging Face folder
        of the policy (fp32, tokenizer included) in `folder`, written by rank 0 from its sink."""
        with self.learner.on_device():
            self.learner.save_checkpoint(learner_dir)
            self.sink.before_save(self.learner)
        if self.rank == 0:
            self.sink.save(folder)
            (Path(learner_dir) / "mas_trainer.json").write_text(json.dumps({"updates": self.learner.updates}))
        torch.distributed.barrier()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def load(self, learner_dir: str) -> int:
        """Resume: shards, optimizer and RNG from `learner_dir`, then the weights to the sink."""
        from mas_trainer.run.untrusted import refuse_code_in_checkpoints

        refuse_code_in_checkpoints(learner_dir)  # verl unpickles these with weights_only=False
        with self.learner.on_device():
            self.learner.load_checkpoint(learner_dir)
            self.learner.updates = json.loads((Path(learner_dir) / "mas_trainer.json").read_text())["updates"]
            self.sink.changed(self.learner)
        return self.learner.updates

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def close(self) -> None:
        self.sink.close()


def _server_adapter(rcfg: Any, model_dir: str, replica_rank: int) -> Any:
    """verl's ServerAdapter for this learner rank's colocated replica, as verl's own hybrid
    worker builds it; it finds the server by the replica rank the fleet gave it."""
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.base import get_rollout_class

    return get_rollout_class(rcfg.name, rcfg.mode)(config=rcfg, model_config=HFModelConfig(path=model_dir),
                                                   device_mesh=None, replica_rank=replica_rank)
