"""Starts the worker groups and presents them to the gateway as engines and to the trainer
as async handles.

Two learners, one protocol (`WorkerGroupHandle`: generate, discard, train, save, load, close):

- `verl` (`runtime.learner=verl`): each trainable policy is a verl `RayWorkerGroup` of
  `PolicyWorker`s (`runtime/verl_group.py`) on its own `RayResourcePool`, world size
  `nodes x procs_per_node`: FSDP2 over NCCL on GPUs, over gloo on CPU. This is the path that
  runs on clusters.
- `torch` (`runtime.learner=torch`): one process per policy, the embedded torch learner
  (`runtime/worker_group.py`), as a Ray actor or, with `runtime.backend=local`, an object in
  the controller's process. On 2 CPU cores it updates faster (bench/bench_learner_verl.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Iterator, Protocol, Sequence

from mas_trainer.engines.base import Generation, SamplingParams, choice_id
from mas_trainer.errors import UserError
from mas_trainer.runtime.plan import WorkerPlan
from mas_trainer.runtime.ray_init import init_ray, init_ray_for

__all__ = ["WorkerGroupHandle", "WorkerHandle", "VerlGroupHandle", "ReplicaGroupHandle", "WorkerEngine", "start_workers",
           "resolve_device", "serving_backends"]

log = logging.getLogger(__name__)


class WorkerGroupHandle(Protocol):
    """What the trainer and the gateway need of a policy's worker group, whichever learner:
    `call("generate", prompt_ids, params, turn_id)`, `call("discard")`, `call("train", records)`,
    `call("save", hf_folder, learner_dir)`, `call("load", learner_dir)`, and `close()`."""

    policy: str

    async def call(self, method: str, *args: Any) -> Any: ...

    def close(self) -> None: ...


class WorkerHandle:
    """Uniform async calls on a torch-learner worker group, wherever it lives."""

    def __init__(self, policy: str, target: Any, remote: bool) -> None:
        self.policy = policy
        self._target = target
        self._remote = remote

    async def call(self, method: str, *args: Any) -> Any:
        if self._remote:
            with _user_errors():
                return await _cancellable(getattr(self._target, method).remote(*args))
        result = getattr(self._target, method)(*args)
        if hasattr(result, "__await__"):
            result = await result
        return result

    def close(self) -> None:
        if self._remote:
            import ray

            try:
                ray.get(self._target.close.remote(), timeout=30)
            finally:
                ray.kill(self._target)
        else:
            self._target.close()


class VerlGroupHandle:
    """The same calls on a verl worker group: serving goes to rank 0 (engine and turn
    buffer), training and checkpoints to every rank (verl's ONE_TO_ALL dispatch)."""

    _RANK0 = ("generate", "discard")

    def __init__(self, policy: str, group: Any, pool: Any = None) -> None:
        self.policy = policy
        self.group = group
        self.pool = pool  # its placement groups are released on close (none when shared)

    async def call(self, method: str, *args: Any) -> Any:
        if method in self._RANK0:
            return await _cancellable(getattr(self.group.workers[0], method).remote(*args))
        refs = getattr(self.group, method)(*args)
        with _user_errors():
            results = await asyncio.gather(*refs)
        return results[0]

    def close(self) -> None:
        import ray

        try:
            ray.get(self.group.close(), timeout=30)
        finally:
            for w in self.group.workers:
                ray.kill(w)
            for pg in (self.pool.pgs or []) if self.pool is not None else []:
                ray.util.remove_placement_group(pg)


class ReplicaGroupHandle:
    """The same calls when rollout replicas serve the policy (`engine: vllm | torch-replica`):
    generation goes to the replicas through verl's client, the turns' tokens stay here until
    the update, which gets them with the records; after each update verl's weight sync sends
    the new weights to every replica before the next rollout starts (the step's
    `time/weight_sync_s`). Each answer carries the weights version that produced it: turns of
    stale weights are counted (`replica/stale_turns`, 0 when the order holds)."""

    def __init__(self, policy: str, learner: VerlGroupHandle, fleet: Any, tokenizer: Any) -> None:
        self.policy = policy
        self.learner = learner
        self.fleet = fleet
        self._versions: dict[str, int] = {}
        self.engine = fleet.engine(tokenizer, on_output=self._answered)
        self.turns: dict[str, tuple[list[int], list[int], list[float]]] = {}
        self._seen = (0, 0, 0.0)

    def _answered(self, request_id: str, out: Any) -> None:
        self._versions[request_id] = int(out.extra_fields.get("global_steps") or 0)

    async def call(self, method: str, *args: Any) -> Any:
        if method == "generate":
            prompt_ids, params, turn_id = args
            gens = await self.engine.generate(prompt_ids, params, turn_id=turn_id)
            if turn_id is not None:
                for i, g in enumerate(gens):
                    self.turns[choice_id(turn_id, i)] = (list(prompt_ids), g.token_ids, g.logprobs)
            return gens
        if method == "discard":
            n = len(self.turns)
            self.turns.clear()
            self._versions.clear()
            self._stats()
            return n
        if method == "train":
            if self.engine.failure is not None:  # never train on a step a dead replica cut short
                raise self.engine.failure
            (records,) = args
            turns = {r.turn_id: self.turns[r.turn_id] for r in records if r.turn_id in self.turns}
            stale = sum(1 for t in turns if self._versions.get(t, 0) != self.fleet.version)
            self.turns.clear()
            self._versions.clear()
            await self.fleet.sleep(self.learner.group)
            metrics = await self.learner.call("train", records, turns)
            try:
                metrics.update(await self.fleet.sync_weights(self.learner.group, int(metrics.get("updates", 0))))
            except Exception as exc:  # a replica gone during the sync: stop here, resumable
                raise self.engine.fail(f"weight sync: {type(exc).__name__}: {str(exc).strip()[:200]}") from exc
            metrics["replica/stale_turns"] = float(stale)
            return {**metrics, **self._stats()}
        if method == "load":
            updates = await self.learner.call("load", *args)
            await self.fleet.set_version(int(updates))  # the replicas started from the checkpoint's weights
            return updates
        return await self.learner.call(method, *args)

    def _stats(self) -> dict[str, float]:
        """Engine figures since the last call (as the embedded engine reports them)."""
        e = self.engine
        req, tok, busy = e.requests - self._seen[0], e.tokens - self._seen[1], e.busy_s - self._seen[2]
        self._seen = (e.requests, e.tokens, e.busy_s)
        return {"engine/requests": float(req), "engine/tokens": float(tok), "engine/busy_s": busy}

    def close(self) -> None:
        try:
            self.fleet.close()
        finally:
            self.learner.close()


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """A UserError raised in a Ray worker reaches the CLI as its one line, not as Ray's
    traceback-laden wrapper (which is also an instance of the cause's type)."""
    try:
        yield
    except UserError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, UserError) and cause is not exc:
            raise UserError(str(cause)) from None
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


class WorkerEngine:
    """The gateway's `Engine` for a policy served by a worker group."""

    def __init__(self, handle: WorkerGroupHandle) -> None:
        self.handle = handle
        self.model_name = handle.policy

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None) -> list[Generation]:
        return await self.handle.call("generate", list(prompt_ids), params, turn_id)

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
    from mas_trainer.runtime.worker_group import WorkerGroup

    handles: dict[str, Any] = {}
    if runtime.backend == "local":
        for name, plan in plans.items():
            handles[name] = WorkerHandle(name, WorkerGroup(plan), remote=False)
        return handles
    import ray

    init_ray(runtime, 0, {})
    actor_cls = ray.remote(WorkerGroup)
    for name, plan in plans.items():
        gpus = plan.resources.gpus_per_proc if plan.device == "cuda" else 0
        actor = actor_cls.options(num_cpus=runtime.worker_cpus, num_gpus=gpus, max_concurrency=1000).remote(plan)
        handles[name] = WorkerHandle(name, actor, remote=True)
    # fail here, not at the first request, if an actor cannot start (e.g. a bad model path)
    ray.get([h._target.discard.remote() for h in handles.values()])
    return handles


def _start_verl(plans: dict[str, WorkerPlan], runtime: Any) -> dict[str, Any]:
    import ray

    if any(p.engine == "vllm" for p in plans.values()):  # before minutes of start-up, not after
        from mas_trainer.rollout.fleet import require_vllm

        require_vllm()

    devices = {p.device for p in plans.values()}
    cpu = devices == {"cpu"}
    # one logical CPU per rank and per CPU rollout replica
    replicas = sum(p.replica.replicas for p in plans.values() if p.engine != "embedded") if cpu else 0
    env = init_ray_for("cpu" if cpu else "cuda", runtime, sum(p.resources.world_size for p in plans.values()) + replicas)
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from mas_trainer.runtime.verl_group import PolicyWorker

    def pool(r: Any, colocate: int) -> Any:
        return RayResourcePool(process_on_nodes=[r.procs_per_node] * r.nodes, use_gpu=not cpu,
                               max_colocate_count=colocate, name_prefix=None)

    shared = None  # the plan checked that the policies' resources agree
    if any(p.offload_between_phases for p in plans.values()):
        shared = pool(next(iter(plans.values())).resources, len(plans))
    handles: dict[str, VerlGroupHandle] = {}
    first_rank = 0  # replica ranks are unique across policies: verl names servers and sockets by rank alone
    for name, plan in plans.items():
        # one rank per GPU bundle: NCCL refuses two ranks of one group on one GPU (a share below 1
        # is refused when the config loads, see config._check_learner)
        own = None if shared else pool(plan.resources, 1)
        replica_ranks = 0
        if plan.engine != "embedded":
            from mas_trainer.rollout.fleet import replica_count

            replica_ranks = replica_count(plan.replica, plan.device, plan.resources.world_size)
        plan = plan.model_copy(update={"replica_first_rank": first_rank})
        first_rank += replica_ranks
        cls = RayClassWithInitArgs(cls=ray.remote(PolicyWorker), plan=plan)
        group = RayWorkerGroup(resource_pool=shared or own, ray_cls_with_init=cls, device_name=plan.device, worker_env=env)
        handles[name] = VerlGroupHandle(name, group, own)
        log.info("policy %s: verl worker group of %d rank(s) on %s", name, plan.resources.world_size, plan.device)
        if plan.engine != "embedded":
            handles[name] = _with_replicas(plan, handles[name])
    return handles


def _with_replicas(plan: WorkerPlan, learner: VerlGroupHandle) -> ReplicaGroupHandle:
    """Start the policy's rollout replicas on its base (or resumed) weights."""
    from mas_trainer.engines.models import load_tokenizer, materialize
    from mas_trainer.rollout.fleet import RolloutFleet

    model_dir = str(materialize(plan.model, seed=plan.seed))
    opts = {"max_batch_size": plan.max_batch_size, "batch_wait_ms": plan.batch_wait_ms, "bf16": plan.engine_bf16,
            "torch_threads": plan.torch_threads}
    try:
        fleet = RolloutFleet(plan.policy, model_dir, plan.engine, plan.replica,
                             device=plan.device, torch_opts=opts, first_rank=plan.replica_first_rank).start(learner.group)
    except BaseException:
        learner.close()
        raise
    return ReplicaGroupHandle(plan.policy, learner, fleet, load_tokenizer(model_dir))


def serving_backends(checkpoints: dict[str, Any], kind: str, runtime: Any) -> dict[str, Any]:
    """`serve --engine vllm|torch-replica`: rollout replicas on each trained policy's Hugging
    Face folder (no learner, no weight sync), as gateway backends; closing a backend's engine
    stops its replicas."""
    from mas_trainer.engines.chat import HFChatFormat
    from mas_trainer.engines.models import load_tokenizer
    from mas_trainer.gateway import PolicyBackend
    from mas_trainer.rollout.config import ReplicaConfig
    from mas_trainer.rollout.fleet import RolloutFleet, require_vllm

    if kind == "vllm":
        require_vllm()
    device = resolve_device(runtime.device)
    cfg: ReplicaConfig = runtime.replica.model_copy(update={"placement": "separate"})
    init_ray_for(device, runtime, cfg.replicas * len(checkpoints))
    opts = {"max_batch_size": runtime.max_batch_size, "batch_wait_ms": runtime.batch_wait_ms, "bf16": runtime.engine_bf16}
    backends: dict[str, Any] = {}
    fleets: list[RolloutFleet] = []
    try:
        for i, (name, folder) in enumerate(checkpoints.items()):
            fleet = RolloutFleet(name, str(folder), kind, cfg, device=device, torch_opts=opts,
                                 first_rank=i * cfg.replicas).start()
            fleets.append(fleet)
            tokenizer = load_tokenizer(str(folder))
            backends[name] = PolicyBackend(fleet.engine(tokenizer, owned=True), HFChatFormat(tokenizer))
    except BaseException:
        for fleet in fleets:
            fleet.close()
        raise
    return backends
