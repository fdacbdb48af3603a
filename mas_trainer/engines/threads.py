"""How many torch threads an embedded engine computes with: the cores this process may use,
shared out among the engines that start in it.

torch's default is one OpenMP thread per physical core of the machine, for every thread that
runs torch ops. That is wrong twice over for the verbs' engines (`serve`, `trace`, `eval`, the
Python API, `fit`'s in-process policies): each engine's worker thread brings a pool of its own,
so three policies served from one process ran three pools of every core; and a process pinned to
fewer cores (affinity, a container's CPU quota) still got a pool of the machine's.

So each engine's count is decided once, before it starts, by whoever starts it (`decide`):
`runtime.torch_threads` when set, else $OMP_NUM_THREADS when set, else `available_cores() //`
the engines it starts (`loop/backends.py`: one per policy; `fit`'s plan: one per policy process,
`cluster/plan.py`), at least one. Never from the engines running at the moment: a count that moved
with them would change a run's floating-point sums (torch's reductions split by thread), so a run
and its resume from a checkpoint would differ. `RUNNING` lists the running engines' counts for a
verb's output. Importing this module does not import torch.
"""

from __future__ import annotations

import collections
import math
import os
import threading
from pathlib import Path
from typing import NamedTuple

__all__ = ["available_cores", "share", "Threads", "decide", "threads_from_env", "set_torch_threads", "RUNNING"]

CGROUP = Path("/sys/fs/cgroup")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset),
    bounded by its cgroup's CPU quota (a container's `--cpus`), rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_quota() -> float | None:
    """CPUs the process's cgroup may use per period (v2 `cpu.max`, v1 `cpu.cfs_quota_us`); None: no quota."""
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: "0::/path", its quota in cpu.max as "QUOTA PERIOD" or "max PERIOD"
            quota, _, period = (_read(CGROUP / path.lstrip("/") / "cpu.max") or _read(CGROUP / "cpu.max") or "max").partition(" ")
            if quota != "max":
                return int(quota) / int(period)
        elif "cpu" in controllers.split(","):  # v1: a quota of -1 is none
            folder = CGROUP / controllers / path.lstrip("/")
            folder = folder if folder.is_dir() else CGROUP / "cpu"
            quota_us, period_us = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            if quota_us and period_us and int(quota_us) > 0:
                return int(quota_us) / int(period_us)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def share(cores: int, users: int) -> int:
    """Threads each of `users` processes or engines gets of `cores`: an equal share, at least one."""
    return max(1, cores // max(1, users))


def threads_from_env() -> int | None:
    """$OMP_NUM_THREADS when set to a positive number (what torch itself would use); else None."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def set_torch_threads(n: int) -> None:
    """This thread's torch (OpenMP) threads, for good.

    torch sizes a thread's pool lazily, at its first torch op, from the count set last anywhere
    in the process: a count set before that op was lost as soon as another engine's thread set
    its own (a vLLM engine then built its attention metadata for one count and ran its kernel on
    the other's, and stopped: "thread_num 3 vs. 2"). So the lazy sizing is forced first.
    Through torch's own setter: once a vLLM engine has run in a process, vLLM's CPU worker has
    replaced `torch.set_num_threads` with a no-op that logs a warning."""
    import torch

    torch.get_num_threads()  # the thread's lazy sizing, done now so it cannot override `n` later
    torch._C.set_num_threads(n)


class Threads(NamedTuple):
    """An engine's torch threads and where the number comes from (for the log and `serve`'s output)."""

    n: int
    source: str


def decide(torch_threads: int | None, engines: int) -> Threads:
    """The threads of each of `engines` engines started together in this process."""
    if torch_threads is not None:
        return Threads(torch_threads, "runtime.torch_threads")
    env = threads_from_env()
    if env is not None:
        return Threads(env, "$OMP_NUM_THREADS")
    cores = available_cores()
    return Threads(share(cores, engines), f"{cores} core(s) this process may use / {engines} engine(s); runtime.torch_threads sets it")


class Running:
    """The engines running in this process, by their `Threads`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: collections.Counter[Threads] = collections.Counter()

    def join(self, threads: Threads) -> None:
        with self._lock:
            self._engines[threads] += 1

    def leave(self, threads: Threads) -> None:
        with self._lock:
            self._engines[threads] -= 1
            self._engines += collections.Counter()  # drops the counts at zero

    def summary(self) -> str:
        with self._lock:
            return "; ".join(f"{n} with {t.n} torch thread(s) ({t.source})" for t, n in sorted(self._engines.items()))


RUNNING = Running()
