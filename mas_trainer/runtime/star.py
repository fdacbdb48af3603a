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
import logging
import os
from typing import Any, Protocol, Sequence

from mas_trainer.engines.base import Generation, SamplingParams
from mas_trainer.runtime.plan import WorkerPlan

__all__ = ["WorkerGroupHandle", "WorkerHandle", "VerlGroupHandle", "WorkerEngine", "start_workers", "resolve_device"]

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
            return await getattr(self._target, method).remote(*args)
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
            return await getattr(self.group.workers[0], method).remote(*args)
        refs = getattr(self.group, method)(*args)
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


def _torch_threads(n_policies: int, configured: int | None) -> int:
    return configured or max(1, (os.cpu_count() or 1) // max(1, n_policies))


def _init_ray(runtime: Any, needed_cpus: int, env: dict[str, str]) -> None:
    import ray

    if ray.is_initialized():
        return
    local = runtime.ray_address is None
    ray.init(
        address=runtime.ray_address,
        # a local instance offers at least one logical CPU per rank: ranks mostly wait on each other
        num_cpus=(runtime.num_cpus or max(os.cpu_count() or 1, needed_cpus)) if local else None,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
        runtime_env={"env_vars": env} if env else None,
    )


def start_workers(plans: dict[str, WorkerPlan], runtime: Any) -> dict[str, WorkerGroupHandle]:
    """One worker group per trainable policy, as `runtime.learner` and `runtime.backend` say."""
    if runtime.learner == "verl":
        return _start_verl(plans, runtime)
    from mas_trainer.runtime.worker_group import WorkerGroup

    handles: dict[str, Any] = {}
    if runtime.backend == "local":
        for name, plan in plans.items():
            handles[name] = WorkerHandle(name, WorkerGroup(plan.model_copy(update={"torch_threads": None})), remote=False)
        return handles
    import ray

    _init_ray(runtime, 0, {})
    threads = _torch_threads(len(plans), runtime.torch_threads)
    actor_cls = ray.remote(WorkerGroup)
    for name, plan in plans.items():
        gpus = plan.resources.gpus_per_proc if plan.device == "cuda" else 0
        actor = actor_cls.options(num_cpus=runtime.worker_cpus, num_gpus=gpus, max_concurrency=1000).remote(
            plan.model_copy(update={"torch_threads": threads}))
        handles[name] = WorkerHandle(name, actor, remote=True)
    # fail here, not at the first request, if an actor cannot start (e.g. a bad model path)
    ray.get([h._target.discard.remote() for h in handles.values()])
    return handles


def _start_verl(plans: dict[str, WorkerPlan], runtime: Any) -> dict[str, VerlGroupHandle]:
    import ray

    devices = {p.device for p in plans.values()}
    cpu = devices == {"cpu"}
    env: dict[str, str] = {}
    if cpu:
        from verl.plugin.platform.platform_manager import set_platform

        from mas_trainer.learners.verl_cpu import PlatformCPU, worker_env

        env = worker_env()
        set_platform(PlatformCPU())  # the controller places CPU bundles, not GPU ones
    _init_ray(runtime, sum(p.resources.world_size for p in plans.values()), env)
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from mas_trainer.runtime.verl_group import PolicyWorker

    def pool(r: Any, colocate: int) -> Any:
        return RayResourcePool(process_on_nodes=[r.procs_per_node] * r.nodes, use_gpu=not cpu,
                               max_colocate_count=colocate, name_prefix=None)

    shared = None
    if runtime.share_gpus and not cpu:
        sizes = {(p.resources.nodes, p.resources.procs_per_node) for p in plans.values()}
        if len(sizes) > 1:
            from mas_trainer.config import ConfigError

            raise ConfigError("runtime.share_gpus needs the same resources for every policy; set runtime.resources only")
        shared = pool(next(iter(plans.values())).resources, len(plans))
    handles: dict[str, VerlGroupHandle] = {}
    threads = None if not cpu else max(1, (os.cpu_count() or 1) // max(1, sum(p.resources.world_size for p in plans.values())))
    for name, plan in plans.items():
        colocate = max(1, round(1 / plan.resources.gpus_per_proc)) if not cpu else 1
        own = None if shared else pool(plan.resources, colocate)
        plan = plan.model_copy(update={"torch_threads": threads, "offload_between_phases": shared is not None})
        cls = RayClassWithInitArgs(cls=ray.remote(PolicyWorker), plan=plan)
        group = RayWorkerGroup(resource_pool=shared or own, ray_cls_with_init=cls, device_name=plan.device, worker_env=env)
        handles[name] = VerlGroupHandle(name, group, own)
        log.info("policy %s: verl worker group of %d rank(s) on %s", name, plan.resources.world_size, plan.device)
    return handles
