"""The gateway's requests in flight, so that a run can end without leaving any behind.

A rollout that times out is cancelled on the controller's loop, but the LLM call its node
made keeps going: sync nodes run in executor threads that cannot be interrupted, and their
HTTP request stays open on the gateway. Left alone, such calls hold engine rows after their
rollout is over, and when the run ends the engines close under them ("engine ... is closed"
and an ASGI traceback per call). So the gateway keeps a `Flight` per request and its owner
stops them in order:

- `end_rollouts(ids)` when rollouts end unfinished: their calls in flight are answered 503
  now (their engine rows are dropped), and later calls naming them are refused the same way;
- `close()` when the run ends: every call is refused from now on, those in flight are answered
  503, and it returns once they have been, so the engines can close with nothing running.

The 503s carry `x-should-retry: false`: the OpenAI client would otherwise retry them.
Every method but `open` may be called from any thread; the work is done on the server's loop,
where requests open their flights, so a request is either stopped or refused, never missed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from typing import Any, Awaitable, Iterable, TypeVar

__all__ = ["Flight", "Flights", "Stopped"]

log = logging.getLogger(__name__)
T = TypeVar("T")

CLOSED = "the gateway is shutting down (its run ended); the call was not answered"


class Stopped(Exception):
    """A call refused or stopped because its rollout ended or the gateway closed (a 503)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Flight:
    """One request between admission and its last byte."""

    __slots__ = ("rollout", "stopped", "done", "__weakref__")

    def __init__(self, rollout: str | None) -> None:
        self.rollout = rollout
        self.stopped: asyncio.Future[Stopped] = asyncio.get_running_loop().create_future()
        self.done = False

    def stop(self, reason: Stopped) -> None:
        if not self.stopped.done():
            self.stopped.set_result(reason)

    def reason(self) -> Stopped:
        return self.stopped.result()

    async def until_stopped(self, work: Awaitable[T]) -> T:
        """`work`'s result, unless the flight is stopped first: then `work` is cancelled (the
        engine drops its rows) and `Stopped` is raised."""
        task = asyncio.ensure_future(work)
        try:
            racers: set[asyncio.Future[Any]] = {task, self.stopped}
            await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():  # stopped, or our caller was cancelled (the client hung up)
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()  # raises the work's own error
        await asyncio.wait({task})  # the cancellation reached the engine before we answer
        raise self.reason()


class Flights:
    def __init__(self) -> None:
        # weak: a streamed response that Starlette never starts cannot finish its flight
        self._open: weakref.WeakSet[Flight] = weakref.WeakSet()
        self._ended: set[str] = set()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # guards _loop and, before any request, _ended/_closed

    # --- on the server's loop ------------------------------------------------------------
    def open(self, rollout: str | None) -> Flight:
        """Register a request (raises `Stopped` when its rollout ended or the gateway closed)."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            if self._closed:
                raise Stopped(CLOSED, "shutting_down")
            if rollout is not None and rollout in self._ended:
                raise Stopped(_ended(rollout), "rollout_ended")
        flight = Flight(rollout)
        self._open.add(flight)
        return flight

    def _stop(self, rollouts: set[str] | None) -> list[Flight]:
        with self._lock:
            if rollouts is None:
                self._closed = True
            else:
                self._ended |= rollouts
        hit = [f for f in list(self._open) if not f.done and (rollouts is None or f.rollout in rollouts)]
        for f in hit:
            f.stop(Stopped(CLOSED, "shutting_down") if rollouts is None else Stopped(_ended(str(f.rollout)), "rollout_ended"))
        return hit

    # --- from any thread -------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def end_rollouts(self, ids: Iterable[str]) -> None:
        """Stop the calls of these rollouts now and refuse their later ones (returns at once)."""
        ids = {str(i) for i in ids}
        if not ids:
            return
        with self._lock:
            loop = self._loop
            if not _serving(loop):  # nothing is being served, so nothing is in flight
                self._ended |= ids
                return
        loop.call_soon_threadsafe(self._stop, ids)  # type: ignore[union-attr]

    def close(self, timeout_s: float = 5.0) -> int:
        """Refuse every new call, stop those in flight and wait (up to `timeout_s`) until they
        are answered. Returns how many were stopped. Not from the server's own thread."""
        with self._lock:
            loop = self._loop
            if not _serving(loop):
                self._closed = True
                return 0

        async def stop_and_wait() -> int:
            hit = self._stop(None)
            deadline = time.monotonic() + timeout_s
            while any(not f.done for f in hit) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return len(hit)

        future = asyncio.run_coroutine_threadsafe(stop_and_wait(), loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout_s + 1.0)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:  # the server stopped meanwhile
            log.debug("gateway close: %s", exc)
            self._closed = True
            return 0


def _serving(loop: asyncio.AbstractEventLoop | None) -> bool:
    return loop is not None and loop.is_running() and not loop.is_closed()


def _ended(rollout: str) -> str:
    return f"rollout {rollout[:64]!r} has ended (timed out or failed); its calls are no longer answered"
