"""One process hosting a gateway, the policies' engines and a controller.

Order matters: the gateway starts and OPENAI_BASE_URL points at it *before* the app is
imported, because apps build their OpenAI clients at import time; the engines start after,
since which policies exist is only known once the app's spec is read.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable

from mas_trainer.apps import load_object
from mas_trainer.gateway import Gateway, GatewayServer, Ledger, PolicyBackend, Router
from mas_trainer.runtime.controller import AppRunner, Controller
from mas_trainer.spec import FROZEN_POLICY
from mas_trainer.trace import otel
from mas_trainer.trace.instrument import instrument_openai
from mas_trainer.trace.schema import Trajectory

__all__ = ["Session", "torch_backend", "lazy_backend"]


def torch_backend(base_model: str, *, seed: int = 0, max_batch_size: int = 8, bf16: bool = False,
                  batch_wait_ms: float = 5.0, device: str = "cpu") -> PolicyBackend:
    """The embedded engine for one policy: its own copy of the base model's weights."""
    from mas_trainer.engines.chat import HFChatFormat
    from mas_trainer.engines.models import load_model
    from mas_trainer.engines.torch_engine import TorchEngine

    model, tokenizer = load_model(base_model, seed=seed)
    model = model.to(device)
    engine = TorchEngine(model, tokenizer, model_name=base_model, max_batch_size=max_batch_size, bf16_autocast=bf16,
                         batch_wait_ms=batch_wait_ms)
    return PolicyBackend(engine, HFChatFormat(tokenizer))


class _Lazy:
    """Builds a backend on first use. The frozen policy serves nodes nobody listed, and most
    such nodes (tools, routers) never call an LLM: no model is loaded for them unless one does."""

    def __init__(self, factory: Callable[[], PolicyBackend]) -> None:
        self._factory = factory
        self._backend: PolicyBackend | None = None
        self._lock = threading.Lock()

    def get(self) -> PolicyBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._factory()
            return self._backend


class _LazyEngine:
    def __init__(self, lazy: _Lazy, name: str) -> None:
        self._lazy, self.model_name = lazy, name

    async def generate(self, prompt_ids: Any, params: Any, *, turn_id: str | None = None) -> Any:
        return await self._lazy.get().engine.generate(prompt_ids, params, turn_id=turn_id)

    def close(self) -> None:
        if self._lazy._backend is not None:
            self._lazy._backend.engine.close()


class _LazyChat:
    def __init__(self, lazy: _Lazy) -> None:
        self._lazy = lazy

    def render(self, messages: Any, tools: Any = None) -> list[int]:
        return self._lazy.get().chat.render(messages, tools)

    def parse(self, text: str, tools: Any = None) -> Any:
        return self._lazy.get().chat.parse(text, tools)


def lazy_backend(name: str, factory: Callable[[], PolicyBackend]) -> PolicyBackend:
    lazy = _Lazy(factory)
    return PolicyBackend(_LazyEngine(lazy, name), _LazyChat(lazy))


_loop: asyncio.AbstractEventLoop | None = None


def _rollout_loop() -> asyncio.AbstractEventLoop:
    """One event loop for every rollout of the process, never closed: clients that apps or
    their libraries create once (langchain-openai shares one async HTTP client per base URL)
    stay bound to the first loop that used them."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


class Session:
    def __init__(
        self,
        *,
        model: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_in_flight: int = 64,
        timeout_s: float | None = 300.0,
        otel_exporter: str | None = None,
        default_max_tokens: int = 256,
        backend_factory: Callable[[str], PolicyBackend] = torch_backend,
    ) -> None:
        self.model = model
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.backend_factory = backend_factory
        self.ledger = Ledger()
        otel.configure(otel_exporter)
        self.gateway = Gateway(Router(), self.ledger, default_max_tokens=default_max_tokens)
        self.server = GatewayServer(self.gateway, host, port)
        self.app: AppRunner | None = None
        self._saved_env: dict[str, str | None] = {}
        self.loop = _rollout_loop()
        # Sync nodes run in the loop's default executor (LangGraph's run_in_executor). Its
        # default size (cores + 4) would cap the LLM calls in flight, and with them the
        # engine's batch, far below max_in_flight.
        self.loop.set_default_executor(ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="mas-node"))

    def __enter__(self) -> "Session":
        self.server.start()
        for key, value in (("OPENAI_BASE_URL", self.server.base_url), ("OPENAI_API_KEY", os.environ.get("OPENAI_API_KEY") or "mas-trainer")):
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        instrument_openai()
        return self

    def __exit__(self, *exc: object) -> None:
        for backend in self.gateway.backends.values():
            backend.engine.close()
        self.server.stop()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def load_app(self, ref_or_obj: Any, *, start_engines: bool = True, recursion_limit: int = 50) -> AppRunner:
        """Import the app (after the gateway is up), then start one engine per policy
        (or leave that to the caller, who attaches backends with `attach`)."""
        from mas_trainer.adapters.langgraph import LangGraphApp

        obj = load_object(ref_or_obj) if isinstance(ref_or_obj, str) else ref_or_obj
        app = LangGraphApp(obj, base_model=self.model, recursion_limit=recursion_limit)
        if start_engines:
            for name, policy in app.spec.policies.items():
                if policy.trainable:
                    self.attach(name, self.backend_factory(policy.base_model))
                else:
                    self.attach(name, lazy_backend(name, lambda m=policy.base_model: self.backend_factory(m)))
        fallback = app.spec.spec.default_policy or (FROZEN_POLICY if FROZEN_POLICY in app.spec.policies else None)
        self.gateway.router = Router(app.spec, fallback=fallback)
        self.app = app
        return app

    def attach(self, policy: str, backend: PolicyBackend) -> None:
        self.gateway.add_policy(policy, backend)

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
        controller = Controller(self.app, self.ledger, max_in_flight=self.max_in_flight, timeout_s=self.timeout_s)
        return await controller.run(tasks, n=n, ids=ids, on_done=on_done)

    def run(self, tasks: Iterable[dict[str, Any]], *, n: int = 1, on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        return self.loop.run_until_complete(self.rollouts(list(tasks), n=n, on_done=on_done))
