"""Worker groups on Ray: their actors' start and stop, and the typed proxies (the
`WorkerGroupHandle` contract) the trainer and the gateway call. `ActorGroup`: one
`LocalPolicy` actor (the torch learner). `VerlGroup`: a verl `RayWorkerGroup` of
`PolicyWorker`s; serving goes to rank 0 (engine, turns), training and checkpoints to every
rank. Both forward the contract the same way (`_RayGroup`): an abandoned await cancels its
Ray task, and a worker's `UserError` arrives as its own line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from mas_trainer.engines.base import Generation, SamplingParams
from mas_trainer.config import ConfigError
from mas_trainer.errors import RunStopped, UserError
from mas_trainer.policy.contract import StepResult, WarmStartExample, WorkerPlan
from mas_trainer.policy.turns import BufferedTurn
from mas_trainer.cluster.placement import WorkerLost, lost_worker, place_pool
from mas_trainer.cluster.ray_init import init_ray, init_ray_for

if TYPE_CHECKING:
    from mas_trainer.algo.advantages import TurnRecord
    from mas_trainer.config import WarmStartConfig

__all__ = ["ActorGroup", "VerlGroup", "start_actor_groups", "start_verl_groups"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """A UserError raised in a Ray worker reaches the CLI as its one line, not as Ray's
    traceback-laden wrapper (which is also an instance of the cause's type)."""
    try:
        yield
    except UserError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, UserError) and cause is not exc:  # a run stopped stays one (exit 1, the resume hint)
            raise (RunStopped if isinstance(cause, RunStopped) else UserError)(str(cause)) from None
        raise


async def _cancellable(ref: Any) -> Any:
    """Await a Ray task; if the awaiting request is cancelled (its client hung up), cancel the
    task too: an abandoned generation must not keep the engine busy."""
    try:
        return await ref
    except asyncio.CancelledError:
        import ray

        ray.cancel(ref)
        raise


class _RayGroup:
    """The `WorkerGroupHandle` contract forwarded to Ray: serving calls to the actor that
    serves (`_serve`), training and checkpoint calls to every process of the group (`_all`:
    the one actor, unless a subclass has more)."""

    policy: str
    server: Any  # the Ray actor that serves
    lost: WorkerLost | None = None  # the first of its processes found gone: the run's one error line

    async def _serve(self, method: str, *args: Any) -> Any:
        with _user_errors(), self._losses():
            return await _cancellable(getattr(self.server, method).remote(*args))

    async def _all(self, method: str, *args: Any) -> Any:
        return await self._serve(method, *args)

    def _who(self, actor_id: str | None) -> str:
        return "its worker process (the torch learner and engine)"

    @contextlib.contextmanager
    def _losses(self) -> Iterator[None]:
        """A process of the group gone (its node lost, killed) is said once, as `WorkerLost`."""
        try:
            yield
        except Exception as exc:
            if self.lost is None:
                actor = getattr(exc, "actor_id", None)
                self.lost = lost_worker(exc, self.policy, self._who(actor if isinstance(actor, str) else None))
            if self.lost is not None:
                raise self.lost from exc
            raise

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None = None) -> list[Generation]:
        return await self._serve("generate", list(prompt_ids), params, turn_id)

    async def discard(self) -> int:
        return await self._serve("discard")

    async def train(self, records: Sequence[TurnRecord], turns: dict[str, BufferedTurn] | None = None) -> StepResult:
        """`turns`: the records' turns, when rollout replicas generated them (`ReplicaGroupHandle`)."""
        return await self._all("train", records, *([turns] if turns is not None else []))

    async def warm_start(self, examples: Sequence[WarmStartExample], config: WarmStartConfig) -> dict[str, float]:
        return await self._all("warm_start", list(examples), config)

    async def save(self, folder: str, learner_dir: str) -> None:
        await self._all("save", folder, learner_dir)

    async def load(self, learner_dir: str) -> int | None:
        return await self._all("load", learner_dir)

    def failure(self) -> BaseException | None:
        return self.lost


class ActorGroup(_RayGroup):
    """A torch-learner worker group running as one Ray actor (`LocalPolicy`)."""

    def __init__(self, policy: str, actor: Any) -> None:
        self.policy = policy
        self.actor = self.server = actor

    def close(self) -> None:
        import ray

        try:
            ray.get(self.actor.close.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:  # lost, or stuck: killed below
            log.debug("policy %s: closing its actor: %s", self.policy, type(exc).__name__)
        finally:
            ray.kill(self.actor)


class SharedActorGroup(ActorGroup):
    """One policy of a shared base (`policy/shared_base.py`) whose Ray actor hosts every adapter
    of that base: each call names the policy; the actor stops with its last policy's close."""

    def __init__(self, policy: str, actor: Any, open_policies: set[str]) -> None:
        super().__init__(policy, actor)
        self.open = open_policies  # the base's policies not closed yet (one set for the whole base)

    async def _serve(self, method: str, *args: Any) -> Any:
        with _user_errors(), self._losses():
            return await _cancellable(getattr(self.server, method).remote(self.policy, *args))

    def _who(self, actor_id: str | None) -> str:
        return "its worker process (the shared base's engine and learners)"

    def close(self) -> None:
        self.open.discard(self.policy)
        if not self.open:
            super().close()


class VerlGroup(_RayGroup):
    """A verl worker group of one policy; `plan` is the plan its ranks started with. Rank 0
    serves; every rank trains (verl's ONE_TO_ALL) and rank 0 answers."""

    def __init__(self, plan: WorkerPlan, group: Any, pool: Any = None) -> None:
        self.policy = plan.policy
        self.plan = plan
        self.group, self.server = group, group.workers[0]
        self.pool = pool  # its placement groups are released on close (none when shared)

    async def _all(self, method: str, *args: Any) -> Any:
        with _user_errors(), self._losses():  # the first rank to fail ends the wait: a lost one leaves the others in a collective
            try:
                return (await asyncio.gather(*getattr(self.group, method)(*args)))[0]
            except Exception as exc:
                # a rank's own error may arrive before its peer's death does (gloo's "connection closed"):
                # if a rank of the group is gone, that is what happened
                dead = None if isinstance(exc, UserError) else await asyncio.to_thread(self._dead_rank)
                if dead is not None:
                    raise dead from exc
                raise

    def _dead_rank(self, wait_s: float = 30.0) -> BaseException | None:
        """Ray's error for the first rank found gone: a call to a dead actor fails at once (or once
        Ray's health check has found its node gone); a live one answers, or is busy and counts as alive."""
        import ray

        refs = [w.__ray_ready__.remote() for w in self.group.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                return err
        return None

    def _who(self, actor_id: str | None) -> str:
        ranks = [i for i, w in enumerate(self.group.workers) if actor_id and w._actor_id.hex() == actor_id]
        rank = f"rank {ranks[0]}" if ranks else "a rank"
        return f"{rank} of its verl worker group of {len(self.group.workers)}" + (" (it serves the rollouts)" if ranks == [0] else "")

    def close(self) -> None:
        import ray

        try:
            ray.get(self.group.close(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:  # a rank lost, or the others stuck
            log.debug("policy %s: closing its worker group: %s", self.policy, type(exc).__name__)  # in a collective with it
        finally:
            for w in self.group.workers:
                ray.kill(w)
            for pg in (self.pool.pgs or []) if self.pool is not None else []:
                ray.util.remove_placement_group(pg)


def start_actor_groups(plans: dict[str, WorkerPlan], runtime: Any) -> dict[str, ActorGroup]:
    """One `LocalPolicy` actor per policy, one `SharedBase` actor per shared base (its policies'
    adapters); returns once every one has started."""
    import ray

    from mas_trainer.policy.local import LocalPolicy
    from mas_trainer.policy.shared_base import SharedBase, shared_groups

    init_ray(runtime, 0, {})
    bases, alone = shared_groups(plans)

    def start(cls: Any, plan: WorkerPlan, *args: Any) -> Any:  # the plan decided each process's torch threads
        gpus = plan.resources.gpus_per_proc if plan.device == "cuda" else 0
        return ray.remote(cls).options(num_cpus=runtime.worker_cpus, num_gpus=gpus, max_concurrency=1000).remote(*args)

    groups: dict[str, ActorGroup] = {name: ActorGroup(name, start(LocalPolicy, plan, plan)) for name, plan in alone.items()}
    for group in bases.values():
        actor, open_policies = start(SharedBase, next(iter(group.values())), group), set(group)
        groups.update({name: SharedActorGroup(name, actor, open_policies) for name in group})
    # fail here, not at the first request, if an actor cannot start (e.g. a bad model path), and say
    # so if Ray cannot place one (its CPUs or GPU share) within the bound
    waits = {g.actor.__ray_ready__.remote(): name for name, g in groups.items()}
    ready, pending = ray.wait(list(waits), num_returns=len(waits), timeout=runtime.placement_timeout_s)
    if pending:
        for g in groups.values():
            ray.kill(g.actor)
        first = waits[pending[0]]
        raise ConfigError(f"policy {first}: Ray did not start its torch learner actor ({runtime.worker_cpus:g} CPU, "
                          f"{plans[first].resources.gpus_per_proc if plans[first].device == 'cuda' else 0:g} GPU) within "
                          f"runtime.placement_timeout_s={runtime.placement_timeout_s:g} s: other jobs hold the resources, or the "
                          "cluster did not grow; free them or add nodes, or lower runtime.worker_cpus or resources.gpus_per_proc")
    ray.get(ready)
    return groups


_PORT_ATTEMPTS = 3


def _verl_group(plan: WorkerPlan, pool: Any, env: dict, cls_with_args: Any, group_cls: Any) -> tuple[WorkerPlan, Any, Any]:
    import ray

    from mas_trainer.policy.verl_rank import PolicyWorker

    cls = cls_with_args(cls=ray.remote(PolicyWorker), plan=plan)
    return plan, group_cls(resource_pool=pool, ray_cls_with_init=cls, device_name=plan.device, worker_env=env), pool


def _port_lost(started: dict[str, tuple[WorkerPlan, Any, Any]]) -> set[str]:
    """Wait for every rank of every group to start; the groups whose rank 0 found its master
    port taken. verl picks the port by binding port 0 and letting it go, so until rank 0 binds
    it any process on the node (an outgoing connection, another run) can take it. Rank 0 is
    waited for first: the other ranks would wait for its store until torch's timeout. Any
    other start-up failure is raised."""
    import ray

    lost = set()
    for name, (_plan, group, _pool) in started.items():
        try:
            ray.get(group.workers[0].__ray_ready__.remote())
        except Exception as exc:
            if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc):
                raise
            lost.add(name)
            continue
        ray.get([w.__ray_ready__.remote() for w in group.workers[1:]])
    return lost


def _kill(group: Any, pool: Any = None) -> None:
    import ray

    for w in group.workers:
        ray.kill(w)
    for pg in (pool.pgs or []) if pool is not None else []:
        ray.util.remove_placement_group(pg)


def start_verl_groups(plans: dict[str, WorkerPlan], runtime: Any) -> dict[str, VerlGroup]:
    """One verl worker group per policy, world size `nodes x procs_per_node`: FSDP2 over NCCL
    on GPUs, over gloo on CPU; with `runtime.share_gpus`, all on one pool."""

    devices = {p.device for p in plans.values()}
    cpu = devices == {"cpu"}
    # one logical CPU per rank and per CPU rollout replica
    replicas = sum(p.replica.replicas for p in plans.values() if p.engine != "embedded") if cpu else 0
    env = init_ray_for("cpu" if cpu else "cuda", runtime, sum(p.resources.world_size for p in plans.values()) + replicas)
    import ray
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    def pool(r: Any, colocate: int) -> Any:
        return RayResourcePool(process_on_nodes=[r.procs_per_node] * r.nodes, use_gpu=not cpu,
                               max_colocate_count=colocate, name_prefix=None)

    shared = None  # the plan checked that the policies' resources agree
    if any(p.offload_between_phases for p in plans.values()):
        shared = pool(next(iter(plans.values())).resources, len(plans))
    # one rank per GPU bundle: NCCL refuses two ranks of one group on one GPU (a share below 1
    # is refused when the config loads, see config._check_learner)
    pools = {name: shared or pool(plan.resources, 1) for name, plan in plans.items()}
    try:  # every pool placed, within the bound, before any rank starts
        for name in plans:
            place_pool(pools[name], policy=name, what="verl worker group", timeout_s=runtime.placement_timeout_s,
                       address=runtime.ray_address)
    except BaseException:
        for placed in {id(p): p for p in pools.values()}.values():
            for pg in placed.pgs or []:
                ray.util.remove_placement_group(pg)
        raise
    # each plan has its own replica ranks (resolve_plan)
    started = {name: _verl_group(plan, pools[name], env, RayClassWithInitArgs, RayWorkerGroup) for name, plan in plans.items()}
    groups: dict[str, VerlGroup] = {}
    try:
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            lost = _port_lost(started)
            for name in started.keys() - lost:
                plan, group, own = started[name]
                groups[name] = VerlGroup(plan, group, None if shared else own)
            if not lost:
                break
            if attempt == _PORT_ATTEMPTS:
                raise UserError(f"the verl worker group of {', '.join(sorted(lost))} found its master port taken "
                                f"{_PORT_ATTEMPTS} times: another process on this node keeps taking free ports; stop it or run again")
            restarted = {}
            for name in sorted(lost):  # another process took the port between verl's probe and rank 0's bind
                plan, group, own = started[name]
                log.warning("policy %s: its group's master port was taken before rank 0 bound it; "
                            "starting the group again on a new port (try %d of %d)", name, attempt + 1, _PORT_ATTEMPTS)
                _kill(group)
                restarted[name] = _verl_group(plan, own, env, RayClassWithInitArgs, RayWorkerGroup)
            started = restarted
    except BaseException:
        for handle in groups.values():
            handle.close()
        for name, (_plan, group, own) in started.items():
            if name not in groups:
                _kill(group, None if shared else own)
        raise
    for name, group in groups.items():
        log.info("policy %s: verl worker group of %d rank(s) on %s", name, group.plan.resources.world_size, group.plan.device)
    return groups
