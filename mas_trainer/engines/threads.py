"""How many torch threads an embedded engine computes with: the cores this process may use,
shared out among the engines running in it.

torch's default is one OpenMP thread per physical core of the machine, for every thread that
runs torch ops. That is wrong twice over for the verbs' engines (`serve`, `trace`, `eval`, the
Python API, `fit`'s in-process policies): each engine's worker thread brings a pool of its own,
so three policies served from one process ran three pools of every core; and a process pinned to
fewer cores (affinity, a container's CPU quota) still got a pool of the machine's. Pools larger
than the cores left to them collapse: libgomp's waiting threads spin for a descheduled one at every
parallel region, and one decode step holds dozens (docs/results/engine_threads.md: 8 concurrent
requests 5x slower than with one thread on 2 loaded cores).

So an engine asks here, on its own worker thread, for `runtime.torch_threads` when set, else
$OMP_NUM_THREADS when set, else `available_cores() // engines` (the engines that share this
process now: `ProcessShare`), at least one; and asks again whenever an engine starts or closes.
`fit`'s plan shares a machine's cores among Ray worker processes with the same `share`.
Importing this module does not import torch.
"""

from __future__ import annotations

import collections
import math
import os
import threading
from pathlib import Path

__all__ = ["available_cores", "share", "ProcessShare", "PROCESS", "threads_from_env"]

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


class ProcessShare:
    """The engines running in one process: those built without a fixed thread count share its
    cores; `version` changes whenever one joins or leaves, so each engine's worker thread knows
    when to ask `threads()` again. Engines with a fixed count (`runtime.torch_threads`) are only
    listed, for `summary`."""

    def __init__(self, cores: int | None = None) -> None:
        self._cores = cores  # None: available_cores(), asked each time (tests pass their own)
        self._lock = threading.Lock()
        self.engines = 0  # those sharing
        self.fixed: collections.Counter[int] = collections.Counter()  # fixed thread count -> engines
        self.version = 0

    def join(self, fixed: int | None = None) -> None:
        with self._lock:
            if fixed is None:
                self.engines += 1
                self.version += 1
            else:
                self.fixed[fixed] += 1

    def leave(self, fixed: int | None = None) -> None:
        with self._lock:
            if fixed is None:
                self.engines = max(0, self.engines - 1)
                self.version += 1
            else:
                self.fixed[fixed] -= 1
                self.fixed += collections.Counter()  # drops the counts at zero

    def threads(self) -> tuple[int, str]:
        """Threads for each engine now, and where the number comes from (for the log)."""
        env = threads_from_env()
        if env is not None:
            return env, "$OMP_NUM_THREADS"
        cores = self._cores or available_cores()
        engines = max(1, self.engines)
        return share(cores, engines), f"{cores} core(s) this process may use / {engines} engine(s) in it; runtime.torch_threads sets it"

    def summary(self) -> str:
        """The running engines' torch threads and where they come from, for a verb's output."""
        parts = [f"{n} torch thread(s) an engine ({why})" for n, why in [self.threads()] if self.engines]
        parts += [f"{n} torch thread(s) an engine (runtime.torch_threads)" for n in sorted(self.fixed)]
        return "; ".join(parts)


PROCESS = ProcessShare()  # this process's engines
