"""The local Ray instance's life: started once per driver, with a watchdog that ends every
process it started as soon as the driver is gone (`cluster/watchdog.py` says why and how),
or joined at `runtime.ray_address`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mas_trainer.cluster import watchdog

__all__ = ["RAY_OWNER_ENV", "start_watchdog", "init_ray", "init_ray_for"]

log = logging.getLogger(__name__)

RAY_OWNER_ENV = "MAS_TRAINER_RAY_OWNER"  # marks the processes `ray.init` starts (their environment)
_watchdog: Any = None  # (process, mark); its pipe stays open for the driver's life


def start_watchdog() -> str | None:
    """The value of RAY_OWNER_ENV that marks the processes the watchdog will end (the local Ray
    instance's, which inherit the driver's environment at `ray.init`); starts it once per driver."""
    global _watchdog
    import subprocess
    import sys
    import uuid

    if not os.path.isdir("/proc"):
        return None
    if _watchdog is None or _watchdog[0].poll() is not None:
        mark = f"{os.getpid()}-{uuid.uuid4().hex}"
        proc = subprocess.Popen([sys.executable, "-I", "-S", watchdog.__file__, f"{RAY_OWNER_ENV}={mark}"],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        _watchdog = (proc, mark)
    return _watchdog[1]


def init_ray(runtime: Any, needed_cpus: int, env: dict[str, str]) -> None:
    import ray

    if ray.is_initialized():
        return
    local = runtime.ray_address is None
    mark = start_watchdog() if local else None
    if mark:  # only the processes ray.init starts carry it, not the driver's other children
        os.environ[RAY_OWNER_ENV] = mark
    args = dict(
        address=runtime.ray_address,
        # a local instance offers at least one logical CPU per rank: ranks mostly wait on each other
        num_cpus=(runtime.num_cpus or max(os.cpu_count() or 1, needed_cpus)) if local else None,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
        runtime_env={"env_vars": env} if env else None,
    )
    try:
        try:
            ray.init(**args)
        except RuntimeError as exc:
            # Ray forks its head processes from a driver that already runs threads (the gateway,
            # torch's pools); seen once in CI: the GCS server died before writing its port file
            # ("double free or corruption"), so a local head gets one more try. A cluster address
            # is not retried: its failure is the user's to see.
            if not local:
                raise
            log.warning("the local Ray instance did not start (%s); trying once more", str(exc).splitlines()[0])
            ray.shutdown()
            ray.init(**args)
    finally:
        if mark:
            os.environ.pop(RAY_OWNER_ENV, None)


def init_ray_for(device: str, runtime: Any, needed_cpus: int) -> dict[str, str]:
    """Ray for verl worker groups and rollout replicas; on CPU with verl's platform for CPUs
    (its environment, returned, goes to every worker)."""
    env: dict[str, str] = {}
    if device == "cpu":
        from verl.plugin.platform.platform_manager import set_platform

        from mas_trainer.learners.verl_cpu import PlatformCPU, worker_env

        env = worker_env()
        set_platform(PlatformCPU())  # the controller places CPU bundles, not GPU ones
    init_ray(runtime, needed_cpus, env)
    return env
