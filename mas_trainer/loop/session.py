"""One process hosting a gateway, the policies' engines and a controller.

Order matters: the gateway starts and OPENAI_BASE_URL points at it *before* the app is
imported, because apps build their OpenAI clients at import time; the engines start after,
since which policies exist is only known once the app's spec is read.

Ending has an order too. A rollout that times out is cancelled, but an LLM call made from a
sync node runs on in its executor thread; so the gateway is told as soon as a rollout ends
unfinished (its calls are answered 503 and its engine rows freed). A session ends by
refusing new calls, cancelling the rollouts still running (an interrupted `run`) and
answering the calls still in flight, and only then closes the engines: otherwise every call
still running fails with "engine ... is closed" and prints a traceback.

The session's loop runs in the calling thread, unless that thread already runs an event loop
(a Jupyter notebook's cells do): then it runs in a thread of its own while the caller waits
(`Session.complete`), so that the synchronous API works there too.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, TypeVar

from mas_trainer.apps import AppRunner, app_runner, load_object
from mas_trainer.config import RuntimeConfig
from mas_trainer.gateway import Gateway, GatewayServer, Ledger, PolicyBackend, RolloutSampling, Router

from mas_trainer.loop.backends import policy_backends
from mas_trainer.loop.controller import Controller
from mas_trainer.spec import FROZEN_POLICY
from mas_trainer.trace import otel
from mas_trainer.trace.instrument import instrument_openai, route_rollouts
from mas_trainer.trace.schema import Trajectory

__all__ = ["Session"]

log = logging.getLogger(__name__)

T = TypeVar("T")


_loop: asyncio.AbstractEventLoop | None = None


def _rollout_loop() -> asyncio.AbstractEventLoop:
    """One event loop for every rollout of the process, never closed: clients that apps or
    their libraries create once (langchain-openai shares one async HTTP client per base URL)
    stay bound to the first loop that used them."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _complete_in_thread(loop: asyncio.AbstractEventLoop, awaitable: Awaitable[T], on_interrupt: Callable[[], None],
                        timeout_s: float = 10.0) -> T:
    """Run `loop` until `awaitable` is done, in a thread of its own (with the caller's context
    variables), while this thread waits. Interrupted while waiting (a notebook's "interrupt
    the kernel"), it calls `on_interrupt`, cancels the work, waits up to `timeout_s` for the
    loop to stop, and raises the interruption."""
    box: dict[str, Any] = {}
    started, finished = threading.Event(), threading.Event()

    def target() -> None:
        try:
            task = box["task"] = asyncio.ensure_future(awaitable, loop=loop)
            started.set()
            box["result"] = loop.run_until_complete(task)
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc
        finally:
            started.set()
            finished.set()

    thread = threading.Thread(target=contextvars.copy_context().run, args=(target,), name="mas-rollout-loop", daemon=True)
    thread.start()
    try:  # waits on an Event: a Thread.join interrupted in its lock may report the thread finished when it is not
        while not finished.wait(0.1):
            pass
    except BaseException:
        on_interrupt()
        started.wait(timeout_s)
        task = box.get("task")
        if task is not None:
            loop.call_soon_threadsafe(task.cancel)
        if not finished.wait(timeout_s):
            log.warning("the rollout loop did not stop within %g s of being cancelled", timeout_s)
        raise
    if "error" in box:
        raise box["error"]
    return box["result"]


class Session:
    """`engine_settings` configure the engines `load_app` starts (default: `fit`'s defaults) and
    `seed` builds their base models; `backend_factory` (model -> backend) replaces the
    embedded engine, e.g. with fake engines in tests. `max_in_flight` rollouts run at once
    (default: `engine_settings.max_batch_size`, one engine batch: more would only queue for a row
    and spend their `timeout_s` waiting)."""

    def __init__(
        self,
        *,
        model: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_in_flight: int | None = None,
        timeout_s: float | None = 300.0,
        otel_exporter: str | None = None,
        default_max_tokens: int = 256,
        engine_settings: RuntimeConfig | None = None,
        seed: int = 0,
        backend_factory: Callable[[str], PolicyBackend] | None = None,
    ) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self.engine_settings = engine_settings or RuntimeConfig()
        self.max_in_flight = max_in_flight or self.engine_settings.max_batch_size
        self.seed = seed
        self.backend_factory = backend_factory
        self.ledger = Ledger()
        # The sampling of the current batch of rollouts is the session's: it runs them. The
        # gateway only reads it, on its own thread.
        self.sampling = RolloutSampling()
        otel.configure(otel_exporter)
        # Only this run's rollouts reach the ledger (their calls carry a token the run's
        # instrumentation signs); other calls need this key, which the app gets as
        # OPENAI_API_KEY: another local process can neither inject turns nor use the engines.
        self.api_key = "mas-" + secrets.token_urlsafe(24)
        self.gateway = Gateway(Router(), self.ledger, default_max_tokens=default_max_tokens, sampling=self.sampling,
                               api_key=self.api_key, rollouts=True)
        self.server = GatewayServer(self.gateway, host, port)
        self.app: AppRunner | None = None
        self._saved_env: dict[str, str | None] = {}
        self.loop = _rollout_loop()
        # Sync nodes run in the loop's default executor (LangGraph's run_in_executor). Its
        # default size (cores + 4) would cap the LLM calls in flight, and with them the
        # engine's batch, far below max_in_flight.
        self.loop.set_default_executor(ThreadPoolExecutor(max_workers=self.max_in_flight, thread_name_prefix="mas-node"))

    def __enter__(self) -> "Session":
        self.server.start()
        for key, value in (("OPENAI_BASE_URL", self.server.base_url), ("OPENAI_API_KEY", self.api_key)):
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        instrument_openai()
        # an app's clients made before this (at its import, in a notebook) are sent here too
        route_rollouts(self.server.base_url, self.api_key)
        log.info("gateway %s", self.describe_gateway())
        return self

    def describe_gateway(self) -> str:
        """Where the gateway listens and whom it answers (the verbs print it)."""
        return f"{self.server.base_url} ({self.gateway.protection()})"

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_calls()
            for backend in self.gateway.backends.values():
                backend.engine.close()
        finally:
            route_rollouts(None)
            self.server.stop()
            self._restore_env()

    def complete(self, awaitable: Awaitable[T]) -> T:
        """Run the session's loop until `awaitable` is done and return its result: in this
        thread, or, where this thread already runs an event loop (a notebook), in a thread of
        its own while this one waits."""
        if not _loop_running_here():
            return self.loop.run_until_complete(awaitable)
        return _complete_in_thread(self.loop, awaitable, self.stop_calls)

    def _cancel(self, tasks: Iterable[asyncio.Task], timeout_s: float = 10.0) -> None:
        tasks = [t for t in tasks if not t.done()]
        for t in tasks:
            t.cancel()
        if not tasks:
            return
        waiter = asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + timeout_s
        while not waiter.done() and time.monotonic() < deadline:
            try:
                self.complete(asyncio.wait({waiter}, timeout=max(0.0, deadline - time.monotonic())))
            except (KeyboardInterrupt, SystemExit):
                pass  # the interruption again, from a task that awaited the one it was raised in
        if not waiter.done():
            log.warning("%d rollouts did not stop within %g s of being cancelled", sum(not t.done() for t in tasks), timeout_s)

    def stop_calls(self, timeout_s: float = 5.0) -> None:
        """Refuse every new LLM call and answer those in flight (503) before engines close:
        call it before closing engines that the session did not start (worker groups)."""
        stopped = self.gateway.close(timeout_s)
        if stopped:
            log.info("answered %d LLM calls still in flight at the end of the session (503)", stopped)

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def load_app(self, ref_or_obj: Any, *, start_engines: bool = True, recursion_limit: int | None = None,
                 recursion_limit_from: str = "recursion_limit",
                 checkpoints: Mapping[str, str | Path] | None = None) -> AppRunner:
        """Import the app (after the gateway is up), then start one engine per policy, on
        the weights in `checkpoints` (policy -> folder) where given (or leave that to the
        caller, who attaches backends with `attach`). `recursion_limit`: the user's (named
        `recursion_limit_from` in what the verbs print), else None, the app's own."""
        obj = load_object(ref_or_obj) if isinstance(ref_or_obj, str) else ref_or_obj
        app = app_runner(obj, base_model=self.model, recursion_limit=recursion_limit, recursion_limit_from=recursion_limit_from)
        if start_engines:
            backends = policy_backends(app.spec.policies, self.engine_settings, seed=self.seed, checkpoints=checkpoints,
                                       factory=self.backend_factory)
            for name, backend in backends.items():
                self.attach(name, backend)
        fallback = app.spec.declared.default_policy or (FROZEN_POLICY if FROZEN_POLICY in app.spec.policies else None)
        self.gateway.router = Router(app.spec, fallback=fallback)
        self.app = app
        return app

    def attach(self, policy: str, backend: PolicyBackend) -> None:
        self.gateway.add_policy(policy, backend)

    def reseed(self, seed: int | None, *, temperature: float | None = None) -> None:
        """Seed the requests of the next batch of rollouts (None: unseeded) and override
        their temperature (None: each request's own)."""
        self.sampling.reseed(seed, temperature=temperature)

    async def rollouts(
        self,
        tasks: list[dict[str, Any]],
        *,
        n: int = 1,
        ids: list[str] | None = None,
        on_done: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """Run every task n times on the session's loop (see `run` for the blocking form)."""
        if self.app is None:
            raise RuntimeError("load_app() first")
        check = getattr(self.app, "check_tasks", None)  # an adapter that knows what its framework needs as input
        if check is not None:
            check(tasks)
        controller = Controller(self.app, self.ledger, max_in_flight=self.max_in_flight, timeout_s=self.timeout_s)

        def done(traj: Trajectory) -> None:
            if traj.status != "ok":  # timed out or failed: calls its threads still make are not its own any more
                self.gateway.end_rollouts([traj.rollout_id])
            if on_done is not None:
                on_done(traj)

        return await controller.run(tasks, n=n, ids=ids, on_done=done)

    def run(self, tasks: Iterable[dict[str, Any]], *, n: int = 1, ids: list[str] | None = None,
            on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Run every task n times (`ids`: one rollout id each, task-major) and return their
        trajectories. If the run is interrupted, its rollouts are cancelled and the gateway
        answers no more calls: the session is over."""
        before = asyncio.all_tasks(self.loop)
        try:
            return self.complete(self.rollouts(list(tasks), n=n, ids=ids, on_done=on_done))
        except BaseException:
            # Interrupted (Ctrl-C, or on_done raised): the session is ending. Stop accepting
            # calls and answer those in flight first (a cancelled rollout waits for the threads
            # of its sync nodes, and they wait for their calls), then cancel this run's
            # rollouts rather than leave them pending on the loop.
            self.stop_calls()
            self._cancel(t for t in asyncio.all_tasks(self.loop) if t not in before)
            raise
