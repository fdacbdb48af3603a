"""The local Ray instance's life: started once per driver, with a watchdog that ends every
process it started as soon as the driver is gone (`cluster/watchdog.py` says why and how),
or joined at `runtime.ray_address`. `fit` sends the workers' output (Ray streams it to the
driver) to a file of the run instead of the console (`send_worker_output_to`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from mas_trainer.cluster import watchdog

__all__ = ["RAY_OWNER_ENV", "start_watchdog", "init_ray", "init_ray_for", "send_worker_output_to"]

log = logging.getLogger(__name__)

RAY_OWNER_ENV = "MAS_TRAINER_RAY_OWNER"  # marks the processes `ray.init` starts (their environment)
_watchdog: Any = None  # (process, mark); its pipe stays open for the driver's life
_worker_output: Any = None  # the open file the workers' output goes to, once `send_worker_output_to` was called


def send_worker_output_to(path: str | os.PathLike[str] | None) -> None:
    """What every worker prints (their logs and tracebacks, as Ray streams them to the driver)
    is appended to `path` from now on, each line prefixed with its process and node, instead of
    being printed on the console, where a run's few lines of progress and its one error line
    would drown in them (a lost node: every worker's traceback). Applies to Ray once started;
    None: back to Ray's console printing."""
    global _worker_output
    routed = _worker_output is not None
    if routed:
        _worker_output.close()
    _worker_output = None if path is None else open(path, "a", encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115
    if path is not None or routed:
        _route_worker_output()


def _route_worker_output() -> None:
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    # Ray's own hook for the stream (ray.init(log_to_driver=True) installs "ray_print_logs" on it)
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as streams
    from ray._private.worker import print_to_stdstream

    streams.remove_handler("ray_print_logs")
    if _worker_output is None:
        streams.add_handler("ray_print_logs", functools.partial(print_to_stdstream, ignore_prefix=False))
        return

    sink = _worker_output

    def write(batch: dict[str, Any]) -> None:
        who = batch.get("actor_name") or batch.get("task_name") or ""
        head = f"({who + ' ' if who else ''}pid={batch.get('pid')}, ip={batch.get('ip')}) "
        try:
            sink.writelines(head + line + "\n" for line in batch.get("lines", []))
        except ValueError:  # closed: the run is over
            pass

    streams.add_handler("ray_print_logs", write)


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
        # "local": a new instance of our own; None would join any cluster `ray start` (or a test's) left on this host
        address=runtime.ray_address or "local",
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
        except ConnectionError as exc:
            if local:
                raise
            raise _join_failed(runtime.ray_address, exc) from exc
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
    if _worker_output is not None:
        _route_worker_output()


def _join_failed(address: str, exc: ConnectionError) -> BaseException:
    """Joining a cluster failed: one line, with the usual cause when this process is not in Ray's token
    mode (a cluster Ray 2.60 starts turns token authentication on, and refuses a client without the token)."""
    from mas_trainer.errors import UserError

    token = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    hint = ("" if token else "; if the cluster uses token authentication (Ray's default for a cluster it starts), "
            "set RAY_AUTH_MODE=token here, with the cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN")
    return UserError(f"runtime.ray_address={address}: could not join the Ray cluster ({' '.join(str(exc).split())}){hint}")


def init_ray_for(device: str, runtime: Any, needed_cpus: int) -> dict[str, str]:
    """Ray for verl worker groups and rollout replicas; on CPU with verl's platform for CPUs
    (its environment, returned, goes to every worker)."""
    env: dict[str, str] = {}
    if device == "cpu":
        from verl.plugin.platform import platform_manager

        from mas_trainer.learners.verl_cpu import PlatformCPU, worker_env

        env = worker_env()
        if not isinstance(platform_manager._current_platform, PlatformCPU):  # once (joining a cluster came first)
            platform_manager.set_platform(PlatformCPU())  # the controller places CPU bundles, not GPU ones
    init_ray(runtime, needed_cpus, env)
    return env
