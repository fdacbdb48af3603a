"""The worker-group contract, and the starting of each trainable policy's worker group.

Every learner presents the same typed contract (`WorkerGroupHandle`: generate, discard,
train, save, load, close), so the trainer and the gateway never ask which one runs:

- `verl` (`runtime.learner=verl`): each trainable policy is a verl `RayWorkerGroup` of
  `PolicyWorker`s (`runtime/verl_group.py`) on its own `RayResourcePool`, world size
  `nodes x procs_per_node`: FSDP2 over NCCL on GPUs, over gloo on CPU. This is the path that
  runs on clusters. With rollout replicas (`engine: vllm | torch-replica`) a
  `ReplicaGroupHandle` wraps it.
- `torch` (`runtime.learner=torch`): one process per policy, the embedded torch learner
  (`runtime/worker_group.py`), as a Ray actor or, with `runtime.execution=local`, the
  `WorkerGroup` object itself in the controller's process. On 2 CPU cores it updates faster
  (bench/bench_learner_verl.py).

The Ray proxies and the actors' life cycle are in `runtime/ray_group.py`.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Protocol, Sequence

from mas_trainer.engines.base import EngineMeter, Generation, SamplingParams, choice_id
from mas_trainer.runtime.plan import WorkerPlan
from mas_trainer.runtime.ray_init import init_ray_for
from mas_trainer.runtime.ray_group import VerlGroup, start_actor_groups, start_verl_groups
from mas_trainer.runtime.turns import TurnStore

__all__ = ["WorkerGroupHandle", "ReplicaGroupHandle", "WorkerEngine", "start_workers", "resolve_device",
           "serving_backends"]

log = logging.getLogger(__name__)


class WorkerGroupHandle(Protocol):
    """What the trainer and the gateway need of a policy's worker group, whichever learner
    and wherever it runs: `generate` (with a `turn_id` the choices' tokens stay in the group),
    `discard` (forget them; how many), `train` (one update from the controller's thin
    `TurnRecord`s; its metrics, with the engine keys of `engines.base.ENGINE_METRICS`),
    `warm_start` (the supervised phase before RL, on (prompt ids, completion ids) examples with
    a `WarmStartConfig`; its `sft_*` metrics; afterwards the engines serve the new weights), `save`
    (Hugging Face folder, learner state), `load` (learner state; verl: its update count)."""

    policy: str

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None = None) -> list[Generation]: ...

    async def discard(self) -> int: ...

    async def train(self, records: Sequence[Any]) -> dict[str, float]: ...

    async def warm_start(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]], config: Any) -> dict[str, float]: ...

    async def save(self, folder: str, learner_dir: str) -> None: ...

    async def load(self, learner_dir: str) -> int | None: ...

    def close(self) -> None: ...


class ReplicaGroupHandle:
    """The contract when rollout replicas serve the policy (`engine: vllm | torch-replica`):
    generation goes to the replicas through verl's client, the turns' tokens stay here until
    the update, which gets them with the records; after each update verl's weight sync sends
    the new weights to every replica before the next rollout starts (the step's
    `time/weight_sync_s`). Each answer carries the weights version that produced it: turns
    trained on weights one update behind are counted (`replica/stale_turns`, 0 unless
    `rollout.max_staleness` overlaps the rollouts with the update); older ones are never trained
    (`turns/stale`)."""

    def __init__(self, learner: VerlGroup, fleet: Any, tokenizer: Any) -> None:
        self.policy = learner.policy
        self.learner = learner
        self.fleet = fleet
        self._versions: dict[str, int] = {}
        self.engine = fleet.engine(tokenizer, on_output=self._answered)
        self.turns = TurnStore(learner.policy, learner.plan.max_staleness)
        self.meter = EngineMeter(self.engine)

    def _answered(self, request_id: str, out: Any) -> None:
        self._versions[request_id] = int(out.extra_fields.get("global_steps") or 0)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None = None) -> list[Generation]:
        call = turn_id or uuid.uuid4().hex  # named here, so a call without a turn leaves no version behind either
        gens = await self.engine.generate(prompt_ids, params, turn_id=call)
        answered = [self._versions.pop(choice_id(call, i), self.fleet.version) for i in range(len(gens))]
        if turn_id is not None:  # the oldest weights any of its choices came from
            self.turns.record(turn_id, prompt_ids, gens, min(answered, default=self.fleet.version))
        return gens

    async def discard(self) -> int:
        self._versions.clear()
        self.meter.read()
        return self.turns.clear()

    async def train(self, records: Sequence[Any]) -> dict[str, float]:
        if self.engine.failure is not None:  # never train on a step a dead replica cut short
            raise self.engine.failure
        turns = {r.turn_id: t for r, t in self.turns.take(records, self.fleet.version)}
        refused = self.turns.stale_metrics()
        stale = sum(1 for t in turns.values() if t.version != self.fleet.version)
        if not self.turns.max_staleness:  # nothing in flight: forget what cancelled calls left
            self._versions.clear()
        await self.fleet.sleep(self.learner.group)
        metrics = await self.learner.train(records, turns)
        try:
            metrics.update(await self.fleet.sync_weights(self.learner.group, int(metrics.get("updates", 0))))
        except Exception as exc:  # a replica gone during the sync: stop here, resumable
            raise self.engine.fail(f"weight sync: {type(exc).__name__}: {str(exc).strip()[:200]}") from exc
        metrics["replica/stale_turns"] = float(stale)
        for key, n in refused.items():  # the ones refused here, beside any the learner refused
            metrics[key] = metrics.get(key, 0.0) + n
        return {**metrics, **self.meter.read()}

    async def warm_start(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]], config: Any) -> dict[str, float]:
        """The learner's warm start, then verl's weight sync to the replicas (no rollout has run yet)."""
        await self.fleet.sleep(self.learner.group)
        metrics = await self.learner.warm_start(examples, config)
        try:
            await self.fleet.sync_weights(self.learner.group, self.fleet.version)
        except Exception as exc:
            raise self.engine.fail(f"weight sync: {type(exc).__name__}: {str(exc).strip()[:200]}") from exc
        return metrics

    async def save(self, folder: str, learner_dir: str) -> None:
        await self.learner.save(folder, learner_dir)

    async def load(self, learner_dir: str) -> int:
        updates = await self.learner.load(learner_dir)
        await self.fleet.set_version(int(updates))  # the replicas started from the checkpoint's weights
        return updates

    def close(self) -> None:
        try:
            self.fleet.close()
        finally:
            self.learner.close()


class WorkerEngine:
    """The gateway's `Engine` for a policy served by a worker group."""

    def __init__(self, handle: WorkerGroupHandle) -> None:
        self.handle = handle
        self.model_name = handle.policy

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None) -> list[Generation]:
        return await self.handle.generate(list(prompt_ids), params, turn_id)

    def close(self) -> None:  # the trainer closes worker groups; the gateway must not
        pass


def resolve_device(device: str) -> str:
    """`auto` -> `cuda` where torch sees a GPU, else `cpu`."""
    if device != "auto":
        return device
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - the core runs without torch
        return "cpu"


def start_workers(plans: dict[str, WorkerPlan], runtime: Any) -> dict[str, WorkerGroupHandle]:
    """One worker group per trainable policy, as the run plan (`runtime/plan.py`, where every rule
    was checked) says: `runtime` is its runtime section, learner and device decided."""
    if runtime.learner == "verl":
        return _start_verl(plans, runtime)
    if runtime.execution == "local":
        from mas_trainer.runtime.worker_group import WorkerGroup

        return {name: WorkerGroup(plan) for name, plan in plans.items()}
    return dict(start_actor_groups(plans, runtime))


def _start_verl(plans: dict[str, WorkerPlan], runtime: Any) -> dict[str, WorkerGroupHandle]:
    groups = start_verl_groups(plans, runtime)
    handles: dict[str, WorkerGroupHandle] = dict(groups)
    try:
        for name, group in groups.items():
            if group.plan.engine != "embedded":
                handles[name] = _with_replicas(group)
    except BaseException:
        for handle in handles.values():
            handle.close()
        raise
    return handles


def _with_replicas(learner: VerlGroup) -> ReplicaGroupHandle:
    """Start the policy's rollout replicas on its base (or resumed) weights."""
    from mas_trainer.engines.models import load_tokenizer, materialize
    from mas_trainer.rollout.fleet import RolloutFleet

    plan = learner.plan
    model_dir = str(materialize(plan.model, seed=plan.seed))
    opts = {"max_batch_size": plan.max_batch_size, "batch_wait_ms": plan.batch_wait_ms, "bf16": plan.engine_bf16,
            "prefix_cache_mb": plan.prefix_cache_mb, "fast_decode": plan.fast_decode,
            "torch_threads": plan.torch_threads}
    try:
        fleet = RolloutFleet(plan.policy, model_dir, plan.engine, plan.replica,
                             device=plan.device, torch_opts=opts, first_rank=plan.replica_first_rank).start(learner.group)
    except BaseException:
        learner.close()
        raise
    return ReplicaGroupHandle(learner, fleet, load_tokenizer(model_dir))


def serving_backends(checkpoints: dict[str, Any], kind: str, runtime: Any) -> dict[str, Any]:
    """`serve --engine vllm|torch-replica`: rollout replicas on each trained policy's Hugging
    Face folder (no learner, no weight sync), as gateway backends; closing a backend's engine
    stops its replicas."""
    from mas_trainer.engines.chat import HFChatFormat
    from mas_trainer.engines.models import load_tokenizer
    from mas_trainer.gateway import PolicyBackend
    from mas_trainer.rollout.config import ReplicaConfig, first_replica_ranks, require_vllm
    from mas_trainer.rollout.fleet import RolloutFleet

    if kind == "vllm":
        require_vllm()
    device = resolve_device(runtime.device)
    cfg: ReplicaConfig = runtime.replica.model_copy(update={"placement": "separate"})
    init_ray_for(device, runtime, cfg.replicas * len(checkpoints))
    opts = {"max_batch_size": runtime.max_batch_size, "batch_wait_ms": runtime.batch_wait_ms, "bf16": runtime.engine_bf16,
            "prefix_cache_mb": runtime.prefix_cache_mb, "fast_decode": runtime.fast_decode}
    backends: dict[str, Any] = {}
    fleets: list[RolloutFleet] = []
    try:
        first = first_replica_ranks({name: cfg.replicas for name in checkpoints})
        for name, folder in checkpoints.items():
            fleet = RolloutFleet(name, str(folder), kind, cfg, device=device, torch_opts=opts,
                                 first_rank=first[name]).start()
            fleets.append(fleet)
            tokenizer = load_tokenizer(str(folder))
            backends[name] = PolicyBackend(fleet.engine(tokenizer, owned=True), HFChatFormat(tokenizer))
    except BaseException:
        for fleet in fleets:
            fleet.close()
        raise
    return backends
