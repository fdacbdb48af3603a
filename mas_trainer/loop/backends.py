"""Which engine answers each policy's calls, built one way for every verb.

`fit` (its frozen policies, next to the worker groups' engines), `eval`, `serve` and `trace`
all wire policies to engines with `policy_backends`, configured by the `runtime` section of a
config (`engine_bf16`, `max_batch_size`, `batch_wait_ms`, `device`): a held-out score that
`fit` reports is the score `eval --run` measures on the same checkpoint, and what `serve`
answers with. bf16 autocast and the batch a row shares change the sampled tokens, so two
verbs with differently configured engines would not agree.
"""

from __future__ import annotations

import logging
import threading
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

from mas_trainer.config import RuntimeConfig
from mas_trainer.engines.config import EngineSettings
from mas_trainer.gateway import PolicyBackend
from mas_trainer.cluster.plan import decide_device
from mas_trainer.spec import PolicySpec

__all__ = ["policy_backends", "torch_backend", "lazy_backend"]

log = logging.getLogger(__name__)


def torch_backend(model: str, *, seed: int = 0, settings: EngineSettings | None = None, device: str = "cpu") -> PolicyBackend:
    """The embedded engine on `model` (tiny | default | folder), its own copy of the weights."""
    from mas_trainer.engines.chat import HFChatFormat
    from mas_trainer.engines.torch_engine import load_engine

    built = load_engine(model, name=model, seed=seed, settings=settings, device=device)
    return PolicyBackend(built, HFChatFormat(built.tokenizer))


class _LazyEngine:
    """Builds its backend on first use. The frozen policy serves nodes nobody listed, and most
    such nodes (tools, routers) never call an LLM: no model is loaded for them unless one does."""

    def __init__(self, factory: Callable[[], PolicyBackend], name: str) -> None:
        self.model_name = name
        self._factory = factory
        self._backend: PolicyBackend | None = None
        self._lock = threading.Lock()

    def get(self) -> PolicyBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._factory()
            return self._backend

    async def generate(self, prompt_ids: Any, params: Any, *, turn_id: str | None = None) -> Any:
        return await self.get().engine.generate(prompt_ids, params, turn_id=turn_id)

    async def stream(self, prompt_ids: Any, params: Any, *, turn_id: str | None = None) -> Any:
        from mas_trainer.engines.base import stream_generation

        async with aclosing(stream_generation(self.get().engine, prompt_ids, params, turn_id=turn_id)) as deltas:
            async for delta in deltas:
                yield delta

    @property
    def max_context(self) -> int | None:
        # known once the model is loaded (the gateway asks again after rendering, which loads it)
        from mas_trainer.engines.base import max_context

        return max_context(self._backend.engine) if self._backend is not None else None

    def close(self) -> None:
        if self._backend is not None:
            self._backend.engine.close()


class _LazyChat:
    def __init__(self, lazy: _LazyEngine) -> None:
        self.lazy = lazy

    def render(self, messages: Any, tools: Any = None) -> list[int]:
        return self.lazy.get().chat.render(messages, tools)

    def parse(self, text: str, tools: Any = None) -> Any:
        return self.lazy.get().chat.parse(text, tools)


def lazy_backend(name: str, factory: Callable[[], PolicyBackend]) -> PolicyBackend:
    lazy = _LazyEngine(factory, name)
    return PolicyBackend(lazy, _LazyChat(lazy))


def policy_backends(
    policies: Mapping[str, PolicySpec],
    runtime: RuntimeConfig,
    *,
    seed: int = 0,
    checkpoints: Mapping[str, str | Path] | None = None,
    served: Mapping[str, PolicyBackend] | None = None,
    factory: Callable[[str], PolicyBackend] | None = None,
) -> dict[str, PolicyBackend]:
    """One backend per policy of an app's spec (`spec.policies`).

    A policy in `served` keeps the backend given there (fit: its worker group's engine).
    Any other gets the embedded engine, configured by `runtime` (its engine settings and device), on its weights: the folder in
    `checkpoints` (trained), else its base model built with `seed` (which only `tiny` reads).
    Trainable policies start now; frozen ones on their first call. `factory` (model -> backend)
    replaces the embedded engine, e.g. with fake engines in tests.
    """

    settings, device = EngineSettings.of(runtime), decide_device(runtime.device)

    def build(name: str, model: str) -> PolicyBackend:
        if factory is not None:
            return factory(model)
        log.info("policy %s: engine on %s (%s, bf16 %s, %d rows a batch)", name, model, device, settings.engine_bf16,
                 settings.max_batch_size)
        return torch_backend(model, seed=seed, settings=settings, device=device)

    served, checkpoints = served or {}, checkpoints or {}
    out: dict[str, PolicyBackend] = {}
    for name, policy in policies.items():
        model = str(checkpoints.get(name, policy.base_model))
        if name in served:
            out[name] = served[name]
        elif policy.trainable:
            out[name] = build(name, model)
        else:
            out[name] = lazy_backend(name, partial(build, name, model))
    return out
