"""The start of each trainable policy's worker group by learner kind (`HOSTS`): `torch`, the
embedded learner in one process per policy (`policy/local.py`: a Ray actor, or in this process
with `runtime.execution=local`); `verl`, a `RayWorkerGroup` of `PolicyWorker`s per policy
(`policy/verl_rank.py`; FSDP2 over NCCL on GPUs, gloo on CPU: the path that runs on clusters),
wrapped by a `ReplicaGroupHandle` where rollout replicas serve. Every one presents
`policy.contract.WorkerGroupHandle`; the Ray proxies are in `cluster/groups.py`.
"""

from __future__ import annotations

import functools
import logging
import uuid
from typing import TYPE_CHECKING, Any, Callable, Sequence

from mas_trainer.engines.base import Generation, SamplingParams, choice_id, max_context
from mas_trainer.engines.config import EngineSettings
from mas_trainer.policy.contract import StepResult, WarmStartExample, WorkerGroupHandle, WorkerPlan
from mas_trainer.policy.turns import Serving, TurnStore
from mas_trainer.cluster.placement import place_pool
from mas_trainer.cluster.plan import RunPlan, check_joined_cluster, decide_device
from mas_trainer.cluster.ray_init import init_ray, init_ray_for
from mas_trainer.cluster.groups import VerlGroup, start_actor_groups, start_verl_groups

if TYPE_CHECKING:
    from mas_trainer.algo.advantages import TurnRecord
    from mas_trainer.config import RuntimeConfig, WarmStartConfig

__all__ = ["WorkerGroupHandle", "ReplicaGroupHandle", "WorkerEngine", "HOSTS", "register_host", "join_cluster", "start_workers",
           "serving_backends"]

log = logging.getLogger(__name__)


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
        self.serving = Serving(self.engine, TurnStore(learner.policy, learner.plan.max_staleness))

    def _answered(self, request_id: str, out: Any) -> None:
        version = out.extra_fields.get("global_steps")
        if version is not None:  # a server not yet told its version (verl's None) serves the fleet's: see generate
            self._versions[request_id] = int(version)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None = None) -> list[Generation]:
        call = turn_id or uuid.uuid4().hex  # named here, so a call without a turn leaves no version behind either
        gens = await self.engine.generate(prompt_ids, params, turn_id=call)
        answered = [self._versions.pop(choice_id(call, i), self.fleet.version) for i in range(len(gens))]
        if turn_id is not None:  # the oldest weights any of its choices came from
            self.serving.turns.record(turn_id, prompt_ids, gens, min(answered, default=self.fleet.version))
        return gens

    async def discard(self) -> int:
        self._versions.clear()
        return self.serving.discard()

    def failure(self) -> BaseException | None:
        return self.engine.failure

    async def train(self, records: Sequence[TurnRecord]) -> StepResult:
        if self.engine.failure is not None:  # never train on a step a dead replica cut short
            raise self.engine.failure
        store = self.serving.turns
        turns = {r.turn_id: t for r, t in store.take(records, self.fleet.version)}
        refused = store.stale_metrics()
        stale = sum(1 for t in turns.values() if t.version != self.fleet.version)
        if not store.max_staleness:  # nothing in flight: forget what cancelled calls left
            self._versions.clear()
        await self.fleet.sleep(self.learner.group)
        result = await self.learner.train(records, turns)
        metrics = result.metrics
        # a step that updated nothing leaves the weights, so their version, as they were: falling back to 0 would
        # file the next turns as that many updates old, and the learner would refuse them as stale
        metrics.update(await self._sync(int(metrics.get("updates", self.fleet.version))))
        metrics["replica/stale_turns"] = float(stale)
        for key, n in refused.items():  # the ones refused here, beside any the learner refused
            metrics[key] = metrics.get(key, 0.0) + n
        metrics.update(self.serving.figures())
        return result

    async def warm_start(self, examples: Sequence[WarmStartExample], config: WarmStartConfig) -> dict[str, float]:
        """The learner's warm start, then verl's weight sync to the replicas (no rollout has run yet)."""
        await self.fleet.sleep(self.learner.group)
        metrics = await self.learner.warm_start(examples, config)
        await self._sync(self.fleet.version)
        return metrics

    async def _sync(self, version: int, *, changed: bool = True) -> dict[str, float]:
        """verl's weight sync to every replica (`changed`: new weights; else only asleep ones need it,
        to wake); a replica gone during it stops the run here, resumable."""
        try:
            if changed:
                return await self.fleet.sync_weights(self.learner.group, version)
            await self.fleet.wake(self.learner.group, version)
            return {}
        except Exception as exc:
            raise self.engine.fail(f"weight sync: {type(exc).__name__}: {str(exc).strip()[:200]}") from exc

    async def save(self, folder: str, learner_dir: str) -> None:
        # colocated vLLM holds its share of the learner's GPUs while awake: the save gathers the full
        # weights and the optimizer's state there, so it runs while vLLM sleeps, as in verl's trainer
        await self.fleet.sleep(self.learner.group)
        await self.learner.save(folder, learner_dir)
        if self.fleet.asleep:
            await self._sync(self.fleet.version, changed=False)

    async def load(self, learner_dir: str) -> int:
        await self.fleet.sleep(self.learner.group)  # verl's order: replicas asleep, checkpoint loaded, weights synced
        updates = int(await self.learner.load(learner_dir) or 0)
        await self._sync(updates, changed=False)  # the replicas started from the checkpoint's weights
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

    @property
    def max_context(self) -> int | None:
        """The serving engine's context where this process holds it (rollout replicas' client, an
        in-process engine): the gateway then caps `max_tokens` by it and answers a prompt too
        long with a 400, instead of the engine failing the run on it."""
        engine = getattr(self.handle, "engine", None)
        return max_context(engine) if engine is not None else None

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None) -> list[Generation]:
        return await self.handle.generate(list(prompt_ids), params, turn_id)

    def close(self) -> None:  # the trainer closes worker groups; the gateway must not
        pass


HOSTS: dict[str, Callable[[dict[str, WorkerPlan], RuntimeConfig], dict[str, WorkerGroupHandle]]] = {}
"""learner kind (`runtime.learner`) -> what starts its policies' worker groups (`register_host`)."""


def register_host(learner: str) -> Callable[[Callable], Callable]:
    def add(start: Callable) -> Callable:
        HOSTS[learner] = start
        return start
    return add


def start_workers(plans: dict[str, WorkerPlan], runtime: RuntimeConfig) -> dict[str, WorkerGroupHandle]:
    """One worker group per trainable policy, as the run plan (`cluster/plan.py`, where every rule
    was checked) says: `runtime` is its runtime section, learner and device decided."""
    return HOSTS[runtime.learner](plans, runtime)


def join_cluster(plan: RunPlan) -> None:
    """Join the cluster at `runtime.ray_address` as the run's host will, and refuse in one line
    worker groups its nodes cannot hold (Ray would wait for them for ever), before the run
    directory is written. A local Ray instance is sized for the run when it starts."""
    if plan.runtime.ray_address is None or plan.execution == "local":
        return
    if plan.learner == "verl":
        init_ray_for(plan.device, plan.runtime, 0)
    else:
        init_ray(plan.runtime, 0, {})
    check_joined_cluster(plan)


@register_host("torch")
def _start_torch(plans: dict[str, WorkerPlan], runtime: RuntimeConfig) -> dict[str, WorkerGroupHandle]:
    if runtime.execution == "local":
        from mas_trainer.policy.local import LocalPolicy
        from mas_trainer.policy.shared_base import SharedBase, shared_groups

        bases, alone = shared_groups(plans)
        handles: dict[str, WorkerGroupHandle] = {}
        try:
            for group in bases.values():
                host = SharedBase(group)
                handles.update({name: host.handle(name) for name in group})
            handles.update({name: LocalPolicy(plan) for name, plan in alone.items()})
        except BaseException:
            for handle in handles.values():
                handle.close()
            raise
        return handles
    return dict(start_actor_groups(plans, runtime))


@register_host("verl")
def _start_verl(plans: dict[str, WorkerPlan], runtime: RuntimeConfig) -> dict[str, WorkerGroupHandle]:
    groups = start_verl_groups(plans, runtime)
    handles: dict[str, WorkerGroupHandle] = dict(groups)
    try:
        for name, group in groups.items():
            if group.plan.engine != "embedded":
                handles[name] = _with_replicas(group, runtime)
    except BaseException:
        for handle in handles.values():
            handle.close()
        raise
    return handles


def _placer(runtime: RuntimeConfig) -> Callable[..., None]:
    """A replica pool placed within `runtime.placement_timeout_s`, or one line (`place_pool`)."""
    return functools.partial(place_pool, timeout_s=runtime.placement_timeout_s, address=runtime.ray_address)


def _with_replicas(learner: VerlGroup, runtime: RuntimeConfig) -> ReplicaGroupHandle:
    """Start the policy's rollout replicas on its base (or resumed) weights."""
    from mas_trainer.engines.models import load_tokenizer, materialize
    from mas_trainer.replicas.fleet import RolloutFleet

    plan = learner.plan
    model_dir = str(materialize(plan.model, seed=plan.seed))
    fleet = RolloutFleet(plan.policy, model_dir, plan.engine, plan.replica, device=plan.device, settings=plan.engine_settings,
                         torch_threads=plan.torch_threads, first_rank=plan.replica_first_rank,
                         place=_placer(runtime))
    try:
        fleet.start(learner.group)
    except BaseException:
        try:
            fleet.close()  # what it placed and started so far
        finally:
            learner.close()
        raise
    return ReplicaGroupHandle(learner, fleet, load_tokenizer(model_dir))


def serving_backends(checkpoints: dict[str, Any], kind: str, runtime: RuntimeConfig) -> dict[str, Any]:
    """`serve --engine vllm|torch-replica`: rollout replicas on each trained policy's Hugging
    Face folder (no learner, no weight sync), as gateway backends; closing a backend's engine
    stops its replicas."""
    from mas_trainer.engines.chat import HFChatFormat
    from mas_trainer.engines.models import load_tokenizer
    from mas_trainer.gateway import PolicyBackend
    from mas_trainer.replicas.config import ReplicaConfig, first_replica_ranks, require_vllm
    from mas_trainer.replicas.fleet import RolloutFleet

    if kind == "vllm":
        require_vllm()
    device = decide_device(runtime.device)
    cfg: ReplicaConfig = runtime.replica.model_copy(update={"placement": "separate"})
    init_ray_for(device, runtime, cfg.replicas * len(checkpoints))
    backends: dict[str, Any] = {}
    fleets: list[RolloutFleet] = []
    try:
        first = first_replica_ranks({name: cfg.replicas for name in checkpoints})
        for name, folder in checkpoints.items():
            fleet = RolloutFleet(name, str(folder), kind, cfg, device=device, settings=EngineSettings.of(runtime),
                                 first_rank=first[name], place=_placer(runtime)).start()
            fleets.append(fleet)
            tokenizer = load_tokenizer(str(folder))
            backends[name] = PolicyBackend(fleet.engine(tokenizer, owned=True), HFChatFormat(tokenizer))
    except BaseException:
        for fleet in fleets:
            fleet.close()
        raise
    return backends
