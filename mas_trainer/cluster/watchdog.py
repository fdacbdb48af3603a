"""The watchdog of a local Ray instance: run as a script (`python -I -S watchdog.py MARK`),
standard library only, by `runtime.ray_init.start_watchdog`.

Ray's own processes of a local instance die with the driver (parent-death signal), and its
actors are not detached, so they follow; but its dashboard and runtime-env agents, when the
driver is killed (-9), wait about a minute on the dead GCS before they exit. The watchdog
ends everything the local instance started as soon as the driver is gone, however it died.
A process is the instance's when the mark is in its environment or when its parent is the
instance's: Ray's agents retitle themselves (setproctitle), which may overwrite the part of
the environment block the kernel shows, and once the raylet is dead they are orphans, so the
watchdog remembers them (pid and start time) while the driver lives.

MARK is `NAME=VALUE` as it appears in the marked processes' environment; the driver's end of
this process's stdin closes when the driver dies.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time


def scan(tag: bytes, me: int, known: dict[int, bytes]) -> dict[int, tuple[int, bytes]]:
    """Every process (pid -> parent pid, start time); `known` gains the marked ones and their
    descendants, and loses those that are gone or whose pid was reused."""
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                procs[int(name)] = (int(fields[1]), fields[19])  # ppid, start time: fields 4 and 22 of proc(5)
            except (OSError, IndexError, ValueError):
                pass
    for pid in [p for p, start in known.items() if procs.get(p, (0, None))[1] != start]:
        del known[pid]  # gone, or its pid was reused
    for pid, (_, start) in procs.items():
        if pid not in known:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if tag in f.read():
                        known[pid] = start
            except OSError:
                pass
    grown = True
    while grown:
        grown = False
        for pid, (ppid, start) in procs.items():
            if pid not in known and ppid in known:
                known[pid] = start
                grown = True
    return procs


def main(mark: str) -> None:
    tag = mark.encode() + b"\0"
    parent, me = os.getppid(), os.getpid()
    known: dict[int, bytes] = {}  # pid -> start time
    # the driver is gone when its end of the pipe closes, or when this process is re-parented (a
    # forked child of the driver could keep the pipe open after the driver died)
    while os.getppid() == parent:
        if select.select([sys.stdin], [], [], 1.0)[0] and not os.read(sys.stdin.fileno(), 4096):
            break
        scan(tag, me, known)
    quiet = 0
    for _ in range(40):  # sweep until two passes in a row find nothing: Ray may still be starting one
        procs = scan(tag, me, known)
        hit = False
        for pid, start in list(known.items()):
            if procs.get(pid, (0, None))[1] == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                    hit = True
                except OSError:
                    pass
        quiet = 0 if hit else quiet + 1
        if quiet >= 2:
            break
        time.sleep(0.25)


if __name__ == "__main__":
    main(sys.argv[1])
