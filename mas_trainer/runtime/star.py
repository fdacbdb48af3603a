"""Starts the worker groups (Ray actors, or objects in this process) and presents them
to the gateway as engines and to the trainer as async handles.

Ray is the default: one actor per policy, so two policies generate and update side by
side, each in its own process, and an actor can be placed on another node of a Ray
cluster (`runtime.ray_address`). `local` keeps everything in one process (tests, debugging).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from mas_trainer.engines.base import Generation, SamplingParams
from mas_trainer.runtime.worker_group import WorkerGroup

__all__ = ["WorkerHandle", "WorkerEngine", "start_workers"]


class WorkerHandle:
    """Uniform async calls on a worker group, wherever it lives."""

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


class WorkerEngine:
    """The gateway's `Engine` for a policy served by a worker group."""

    def __init__(self, handle: WorkerHandle) -> None:
        self.handle = handle
        self.model_name = handle.policy

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None) -> list[Generation]:
        return await self.handle.call("generate", list(prompt_ids), params, turn_id)

    def close(self) -> None:  # the trainer closes worker groups; the gateway must not
        pass


def _torch_threads(n_policies: int, configured: int | None) -> int:
    return configured or max(1, (os.cpu_count() or 1) // max(1, n_policies))


def start_workers(
    policies: dict[str, tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]],
    runtime: Any,
    *,
    seed: int,
) -> dict[str, WorkerHandle]:
    """policies (trainable ones): name -> (model spec, learner, advantage and critic configs)."""
    threads = _torch_threads(len(policies), runtime.torch_threads)
    handles: dict[str, WorkerHandle] = {}
    if runtime.backend == "local":
        for name, (model, learner, adv, critic) in policies.items():
            wg = WorkerGroup(name, model, learner=learner, advantage=adv, critic=critic, seed=seed,
                             max_batch_size=runtime.max_batch_size, torch_threads=None, bf16=runtime.engine_bf16,
                             batch_wait_ms=runtime.batch_wait_ms)
            handles[name] = WorkerHandle(name, wg, remote=False)
        return handles

    import ray

    if not ray.is_initialized():
        ray.init(
            address=runtime.ray_address,
            num_cpus=runtime.num_cpus if runtime.ray_address is None else None,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    actor_cls = ray.remote(WorkerGroup)
    for name, (model, learner, adv, critic) in policies.items():
        actor = actor_cls.options(num_cpus=runtime.worker_cpus, max_concurrency=1000, name=None).remote(
            name, model, learner=learner, advantage=adv, critic=critic, seed=seed, max_batch_size=runtime.max_batch_size,
            torch_threads=threads, bf16=runtime.engine_bf16, batch_wait_ms=runtime.batch_wait_ms
        )
        handles[name] = WorkerHandle(name, actor, remote=True)
    # fail here, not at the first request, if an actor cannot start (e.g. a bad model path)
    ray.get([h._target.discard.remote() for h in handles.values()])
    return handles
