"""Where a run meets the cluster's limits at run time: a placement Ray cannot grant within
`runtime.placement_timeout_s` (`place_pool`), and a worker lost with its node (`WorkerLost`).
Both end the run in one line naming what, for whom and where; nothing waits in silence.
"""

from __future__ import annotations

from typing import Any

from mas_trainer.config import ConfigError
from mas_trainer.errors import RunStopped, where_lost

__all__ = ["WorkerLost", "lost_worker", "place_pool"]


class WorkerLost(RunStopped):
    """A worker group's process died with its node, or by itself, during the run."""


def lost_worker(exc: BaseException, policy: str, who: str) -> WorkerLost | None:
    """The run's one line for Ray's `RayActorError` `exc` (the actor `who` of `policy`'s worker
    group is gone), naming the node it ran on and why it died as Ray reports them; None for any
    other error (a worker's own exception stays what it is)."""
    try:
        from ray.exceptions import OutOfMemoryError, RayActorError
    except ImportError:  # pragma: no cover - Ray is there whenever a Ray actor was
        return None
    if isinstance(exc, OutOfMemoryError):  # Ray's memory monitor killed it: not a RayActorError, and not the user's bug
        return WorkerLost(f"policy {policy}: {who} was killed by Ray's memory monitor, its node out of memory "
                          f"({_memory_said(str(exc))}); lower runtime.max_batch_size or rollout.max_in_flight, or give the "
                          "node more memory; the run stopped, resumable from its last checkpoint")
    if not isinstance(exc, RayActorError):
        return None
    return WorkerLost(f"policy {policy}: {who} was lost ({where_lost(str(exc))}); the run stopped, resumable from its "
                      "last checkpoint (the workers' output is in the run's workers.log)")


def _memory_said(message: str) -> str:
    """`on node IP: USED used / LIMIT limit` from the text of Ray's `OutOfMemoryError`, as far as it says."""
    import re

    ip = re.search(r"\(IP: ([^,)\s]+)", message)
    used = re.search(r"was (\d[\d.]*GB used / \d[\d.]*GB limit)", message)  # Ray 2.60's raylet says it so
    return f"on node {ip.group(1) if ip else 'unknown'}" + (f": {used.group(1)}" if used else "")


def place_pool(pool: Any, *, policy: str, what: str, timeout_s: float, address: str | None) -> None:
    """Create the placement groups of verl's `RayResourcePool` `pool` as verl's
    `get_placement_groups` does (one strict-pack group per node of `procs_per_node` bundles, a CPU
    each times `max_colocate_count`, and a GPU each on GPUs), and wait at most `timeout_s` for Ray
    to place them; verl then uses them as they are. verl itself waits for ever: on a cluster whose
    other jobs hold the resources, or one that autoscales and cannot grow, the run would hang."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from verl.single_controller.ray.base import sort_placement_group_by_node_ip
    from verl.plugin.platform import get_platform

    if pool.pgs is not None:
        return
    bundle: dict[str, float] = {"CPU": pool.max_colocate_count}
    if pool.use_gpu:
        bundle[get_platform().ray_resource_name()] = 1
    prefix = f"{pool.name_prefix}verl_group_{'_'.join(str(n) for n in pool.store)}:"
    pgs = [placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK", name=f"{prefix}{i}")
           for i, n in enumerate(pool.store)]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if len(ready) < len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        shown = "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(bundle.items())) + "}"
        raise ConfigError(f"policy {policy}: Ray placed {len(ready)} of the {len(pgs)} placement group(s) of its {what} "
                          f"({pool.store} bundle(s) of {shown} per node) within runtime.placement_timeout_s={timeout_s:g} s on "
                          f"the cluster{f' at {address}' if address else ''} (now {_free_now()}): other jobs hold the "
                          "resources, or the cluster did not grow; free them or add nodes, or lower runtime.resources or the replicas")
    pool.pgs = sort_placement_group_by_node_ip(pgs)


def _free_now() -> str:
    """What the cluster has free now, summed over its alive nodes (Ray's own figures)."""
    import ray

    free = ray.available_resources()
    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    return f"CPU {free.get('CPU', 0.0):g}, GPU {free.get('GPU', 0.0):g} free over {alive} node(s)"
