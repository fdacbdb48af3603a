"""Which engine answers each policy's calls, built one way for every verb.

`fit` (its frozen policies, next to the worker groups' engines), `eval`, `serve` and `trace`
all wire policies to engines with `policy_backends`, configured by the `runtime` section of a
config (`engine_bf16`, `max_batch_size`, `batch_wait_ms`, `device`): a held-out score that
`fit` reports is the score `eval --run` measures on the same checkpoint, and what `serve`
answers with. bf16 autocast and the batch a row shares change the sampled tokens, so two
verbs with differently configured engines would not agree. The engines started together share
this process's cores (`engines/threads.py`: one share per engine, fixed before any starts), unless
`runtime.torch_threads` sets their threads.

Policies a run trained as adapters of one shared base (``learner.shared_base``: their
checkpoints are peft adapters of one base model) are served as they were trained, by one
engine on one copy of the base holding every adapter (`shared_base_backends`); each policy's
backend names its own adapter, and a frozen policy on that same base gets the bare base.
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Collection, Mapping, Sequence

from mas_trainer.config import RuntimeConfig
from mas_trainer.engines.config import EngineSettings
from mas_trainer.engines.threads import Threads, decide
from mas_trainer.gateway import PolicyBackend
from mas_trainer.cluster.plan import decide_device
from mas_trainer.spec import PolicySpec

__all__ = ["policy_backends", "torch_backend", "lazy_backend", "shared_base_backends", "shared_policies", "adapters_by_base",
           "AdapterEngine"]

log = logging.getLogger(__name__)


def torch_backend(model: str, *, seed: int = 0, settings: EngineSettings | None = None, device: str = "cpu",
                  threads: Threads | None = None) -> PolicyBackend:
    """The embedded engine on `model` (tiny | default | folder), its own copy of the weights;
    `threads`: its torch threads (None: as if alone in this process, `engines/threads.py`)."""
    from mas_trainer.engines.chat import HFChatFormat
    from mas_trainer.engines.torch_engine import load_engine

    built = load_engine(model, name=model, seed=seed, settings=settings, device=device, threads=threads)
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
    shared: Collection[str] = (),
) -> dict[str, PolicyBackend]:
    """One backend per policy of an app's spec (`spec.policies`).

    A policy in `served` keeps the backend given there (fit: its worker group's engine).
    Any other gets the embedded engine, configured by `runtime` (its engine settings and device), on its weights: the folder in
    `checkpoints` (trained), else its base model built with `seed` (which only `tiny` reads).
    Trainable policies start now; frozen ones on their first call. `factory` (model -> backend)
    replaces the embedded engine, e.g. with fake engines in tests.
    `shared`: policies whose checkpoints are adapters trained on a shared base (`shared_policies`):
    those of one base share one engine (`shared_base_backends`), and so does every frozen policy on that base.
    Threads (`runtime.torch_threads`, else `engines/threads.py`): the engines started now share this process's cores
    with the in-process worker groups in `served` (`runtime.execution=local`); one started on its first call gets the
    share it would have if every engine had started, so that an unused frozen policy takes nothing from the others.
    """

    settings, device = EngineSettings.of(runtime), decide_device(runtime.device)
    served, checkpoints = served or {}, checkpoints or {}
    bases: dict[str, tuple[dict[str, Path], list[str]]] = {}  # base -> (adapter folders, frozen policies on it)
    if factory is None:  # a factory's engines hold no adapters
        adapters = {p: checkpoints[p] for p in shared if p in checkpoints and p not in served}
        bases = {base: (group, [p for p, pol in policies.items()
                                if not pol.trainable and p not in served and _same_model(pol.base_model, base)])
                 for base, group in adapters_by_base(adapters).items()}
    on_bases = {p for group, frozen in bases.values() for p in (*group, *frozen)}
    alone = [p for p in policies if p not in served and p not in on_bases]
    # both decided now, not as engines come and go: a count that moved with them would change a run's sums (and its resume's)
    beside = len(served) if runtime.execution == "local" else 0
    now = decide(runtime.torch_threads, len(bases) + sum(policies[p].trainable for p in alone) + beside)
    later = decide(runtime.torch_threads, len(bases) + len(alone) + beside)

    def build(name: str, model: str, threads: Threads) -> PolicyBackend:
        if factory is not None:
            return factory(model)
        log.info("policy %s: engine on %s (%s, bf16 %s, %d rows a batch, %d torch thread(s): %s)", name, model, device,
                 settings.engine_bf16, settings.max_batch_size, *threads)
        return torch_backend(model, seed=seed, settings=settings, device=device, threads=threads)

    out: dict[str, PolicyBackend] = {}
    for base, (group, frozen) in bases.items():
        out.update(shared_base_backends(group, base, runtime, seed=seed, frozen=frozen, threads=now))
    for name, policy in policies.items():
        if name in out:
            continue
        model = str(checkpoints.get(name, policy.base_model))
        if name in served:
            out[name] = served[name]
        elif policy.trainable:
            out[name] = build(name, model, now)
        else:
            out[name] = lazy_backend(name, partial(build, name, model, later))
    return out


# --- adapters of a shared base (learner.shared_base) ---------------------------------------------

def shared_policies(cfg: Any, checkpoints: Mapping[str, str | Path]) -> set[str]:
    """The policies of `checkpoints` that a run's config (`FitConfig`) trained as adapters of a
    shared base (``learner.shared_base``) and whose checkpoints are adapter folders."""
    from mas_trainer.engines.models import is_adapter

    return {p for p, folder in checkpoints.items() if cfg.learner_for(p).shared_base and is_adapter(folder)}


def adapters_by_base(adapters: Mapping[str, str | Path]) -> dict[str, dict[str, Path]]:
    """Adapter folders grouped by the base model reference each names."""
    from mas_trainer.engines.models import adapter_base

    groups: dict[str, dict[str, Path]] = {}
    for name, folder in adapters.items():
        groups.setdefault(adapter_base(folder), {})[name] = Path(folder)
    return groups


def _same_model(a: str, b: str) -> bool:
    """Two model references to one model: the same text, or one local folder written two ways."""
    if a == b:
        return True
    left, right = Path(a).expanduser(), Path(b).expanduser()
    return left.is_dir() and right.is_dir() and left.resolve() == right.resolve()


def shared_base_backends(adapters: Mapping[str, str | Path], base: str, runtime: RuntimeConfig, *, seed: int = 0,
                         frozen: Sequence[str] = (), engine: str = "embedded", threads: Threads | None = None
                         ) -> dict[str, PolicyBackend]:
    """Backends for the policies whose checkpoints (`adapters`: policy -> adapter folder) are LoRA
    adapters of `base`, all on one engine holding one copy of the base and every adapter: the
    embedded engine (`engine="embedded"`, every row its adapter: `engines/adapter_batch.py`) or vLLM's multi-LoRA
    (`"vllm"`, in this process). Each policy's engine is an `AdapterEngine` naming its adapter;
    the `frozen` policies (on `base` too) get the bare base. The engine closes with its last user.
    `threads`: the embedded engine's (None: `runtime.torch_threads`, else as if alone in this process)."""
    from mas_trainer.engines.chat import HFChatFormat

    # peft matches adapter names as substrings of its own prefixes ("lora_"): policy names cannot be them
    keys = {name: f"adapter_{i}" for i, name in enumerate(adapters)}
    folders = {keys[name]: Path(folder) for name, folder in adapters.items()}
    settings, device = EngineSettings.of(runtime), decide_device(runtime.device)
    log.info("policies %s: adapters of one %s engine on %s (%s)", ", ".join(adapters), engine, base, device)
    if engine == "vllm":
        built = _vllm_shared(base, folders, runtime, seed=seed, device=device)
    elif engine == "embedded":
        built = _torch_shared(base, folders, seed=seed, settings=settings, device=device,
                              threads=threads or decide(runtime.torch_threads, 1))
    else:
        raise ValueError(f"engine {engine!r}: a shared base is served by the embedded engine or vllm")
    users = _Users(built)
    chat = HFChatFormat(built.tokenizer)
    out = {name: PolicyBackend(AdapterEngine(users, keys[name], str(folder)), chat) for name, folder in adapters.items()}
    out.update({name: PolicyBackend(AdapterEngine(users, None, base), chat) for name in frozen})
    return out


def _adapter_config(folder: Path) -> dict[str, Any]:
    from mas_trainer.engines.models import ADAPTER_CONFIG

    return json.loads((folder / ADAPTER_CONFIG).read_text())


def _torch_shared(base: str, folders: Mapping[str, Path], *, seed: int, settings: EngineSettings, device: str,
                  threads: Threads) -> Any:
    from mas_trainer.engines.models import load_model
    from mas_trainer.engines.torch_engine import TorchEngine
    from mas_trainer.learners.lora import add_named_adapter

    model, tokenizer = load_model(base, seed=seed)
    for key, folder in folders.items():
        lora = _adapter_config(folder)  # the folder's own config decides; these only fill the signature
        model = add_named_adapter(model, key, rank=lora["r"], alpha=lora["lora_alpha"], target_modules=lora["target_modules"],
                                  base_model=base, folder=folder)
    return TorchEngine(model, tokenizer, model_name=base, settings=settings, device=device, adapters=list(folders),
                       threads=threads)


def _vllm_shared(base: str, folders: Mapping[str, Path], runtime: RuntimeConfig, *, seed: int, device: str) -> Any:
    from mas_trainer.engines.models import load_tokenizer, materialize
    from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

    # the largest adapter's rank: the engine rounds it up to one vLLM takes
    need = max(int(_adapter_config(folder)["r"]) for folder in folders.values())
    engine = VllmEngine(materialize(base, seed=seed), model_name=base, tokenizer=load_tokenizer(base),
                        settings=VllmSettings.of(runtime.replica, device=device, seed=seed), adapters=list(folders),
                        max_lora_rank=need)
    try:
        for key, folder in folders.items():
            engine.load_adapter(key, folder).result()
    except BaseException:
        engine.close()
        raise
    return engine


class _Users:
    """An engine several backends answer with; it closes when the last of them closes."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._open: set[object] = set()
        self._lock = threading.Lock()

    def join(self, user: object) -> None:
        with self._lock:
            self._open.add(user)

    def leave(self, user: object) -> None:
        with self._lock:
            if user not in self._open:  # closed twice (the gateway, then its owner): counted once
                return
            self._open.discard(user)
            last = not self._open
        if last:
            self.engine.close()


class AdapterEngine:
    """One policy's engine on a shared base: the shared engine, every call naming the policy's
    adapter (None: the bare base). `model_name` is what the policy was loaded from."""

    def __init__(self, users: _Users, adapter: str | None, model_name: str) -> None:
        self.users, self.adapter, self.model_name = users, adapter, model_name
        users.join(self)

    @property
    def engine(self) -> Any:
        return self.users.engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_context(self) -> int | None:
        from mas_trainer.engines.base import max_context

        return max_context(self.engine)

    async def generate(self, prompt_ids: Any, params: Any, *, turn_id: str | None = None) -> Any:
        return await self.engine.generate(prompt_ids, params, turn_id=turn_id, adapter=self.adapter)

    async def stream(self, prompt_ids: Any, params: Any, *, turn_id: str | None = None) -> AsyncIterator[Any]:
        from mas_trainer.engines.base import Delta

        if getattr(self.engine, "stream", None) is None:  # vLLM's engine answers whole: one delta per choice
            for i, gen in enumerate(await self.generate(prompt_ids, params, turn_id=turn_id)):
                yield Delta(i, list(gen.token_ids), gen.text, gen)
            return
        async with aclosing(self.engine.stream(prompt_ids, params, turn_id=turn_id, adapter=self.adapter)) as deltas:
            async for delta in deltas:
                yield delta

    def close(self) -> None:
        self.users.leave(self)
