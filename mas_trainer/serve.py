"""`mas-trainer serve RUN_DIR`: the run's trained policies behind one OpenAI-compatible endpoint;
`mas-trainer serve app.py:graph`: the app's base policies (before any training: the first half of
the loop from served runs back to training, docs/serving.md).

The unedited app, run with OPENAI_BASE_URL pointing here, gets each node's answer from the
policy that node was trained as: `@trainable` makes the app's OpenAI calls name their node
(W3C baggage), and the gateway routes the node with the run's policy map (`app.json`).
Calls that name no node are served by `model`: a policy name, or a name mapped with
`--route NAME=POLICY`; any other model is a 404, never a silent fallback to an untrained model.
A call naming a node that is not in the run's map is a 404 too.

The API key (`--api-key`, `--api-key-file`, or $MAS_TRAINER_API_KEY) guards everything but a
bare liveness probe (`/health` says only `{"status": "ok"}` without it).
The engines are configured as the run's (`runtime` in its config.yaml), so the policies
answer as `fit` and `eval --run` measured them. The weights are the run's best checkpoint where
it kept one, else its last (`--checkpoint best|last` asks for one).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from mas_trainer.config import ConfigError
from mas_trainer.engines.threads import RUNNING
from mas_trainer.errors import did_you_mean
from mas_trainer.gateway import Gateway, GatewayServer, Router
from mas_trainer.production.record import Recorder, load_redactor
from mas_trainer.loop.backends import adapters_by_base, policy_backends, shared_base_backends, shared_policies
from mas_trainer.run.rundir import RunDir, run_config, trained_checkpoint
from mas_trainer.spec import FROZEN_POLICY

__all__ = ["build_gateway", "serve", "resolve_api_key", "API_KEY_ENV"]

log = logging.getLogger(__name__)
API_KEY_ENV = "MAS_TRAINER_API_KEY"


def resolve_api_key(api_key: str | None = None, api_key_file: str | Path | None = None) -> str | None:
    """The key from --api-key, else --api-key-file (first line), else $MAS_TRAINER_API_KEY.

    A key on the command line is visible to every local user (ps, /proc); a file or the
    environment is not."""
    if api_key is not None and api_key_file is not None:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        path = Path(api_key_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--api-key-file {path}: {exc.strerror or exc}") from None
        api_key = lines[0].strip() if lines else ""
        if not api_key:
            raise ConfigError(f"--api-key-file {path} is empty")
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise ConfigError("the API key is empty")
    return api_key


def build_gateway(run_dir: str | Path, *, routes: Mapping[str, str] | None = None, api_key: str | None = None,
                  max_tokens: int = 256, engine: str = "embedded", model: str | None = None,
                  checkpoint: str | None = None) -> Gateway:
    """`run_dir`: a `fit` run directory (its trained policies), or an app `path.py:attr` (its base
    policies, engines configured by the defaults; `model` replaces every policy's base model).
    `engine`: `embedded` (the torch engine,
    configured as the run's), or `vllm` / `torch-replica`: rollout replicas on each trained
    policy's checkpoint (docs/vllm.md); frozen policies keep the embedded engine.
    Policies a run trained as adapters of a shared base (``learner.shared_base``) share one engine
    on one copy of the base, each answering with its adapter (with `vllm`: vLLM's multi-LoRA in
    this process), and a frozen policy on that base gets its bare base (embedded engine only).
    `checkpoint`: a run's "best" or "last" (default: the best where the run kept one)."""
    if _is_app_ref(run_dir):
        from mas_trainer.apps import app_runner, load_object
        from mas_trainer.config import load_config

        # only the app's spec is read here; an app that builds its OpenAI client at import needs a key to import
        unset = "OPENAI_API_KEY" not in os.environ
        os.environ.setdefault("OPENAI_API_KEY", "unused-by-mas-trainer-serve")
        try:
            spec, trained, cfg = app_runner(load_object(str(run_dir)), base_model=model).spec, {}, load_config()
        finally:
            if unset:
                os.environ.pop("OPENAI_API_KEY", None)
        if engine != "embedded":
            raise ConfigError(f"--engine {engine} serves a run's trained checkpoints: serve a run directory, "
                              "or the app's base policies with --engine embedded")
        if checkpoint is not None:
            raise ConfigError(f"--checkpoint {checkpoint} chooses among a run's checkpoints: serve a run directory")
    else:
        if model is not None:
            raise ConfigError("--model replaces an app's base model; a run directory serves the models it trained")
        chosen = trained_checkpoint(run_dir, checkpoint)
        log.info("serving the %s checkpoint of %s, step %d", chosen.which, run_dir, chosen.step)
        trained, spec, cfg = chosen.policies, RunDir(run_dir).app().resolved(), run_config(run_dir)
    routes = dict(routes or {})
    unknown = sorted(set(routes.values()) - set(spec.policies))
    if unknown:
        raise ConfigError(f"--route names unknown policy {unknown[0]!r}; {did_you_mean(unknown[0], spec.policies)}"
                          f"policies of this run: {', '.join(sorted(spec.policies))}")
    untrained = sorted(p for p, pol in spec.policies.items() if pol.trainable and p not in trained)
    if untrained and not _is_app_ref(run_dir):
        raise ConfigError(f"policy {untrained[0]!r} has no checkpoint folder in {RunDir(run_dir).checkpoint / 'policies'}")
    # known_nodes_only: a node the run never saw gets a 404, not the untrained base model
    gateway = Gateway(Router(spec, model_routes=routes, known_nodes_only=True), api_key=api_key, default_max_tokens=max_tokens)
    # policies trained as adapters of one base are served as they trained: one base, each its adapter
    shared = shared_policies(cfg, trained) if not _is_app_ref(run_dir) else set()
    served = _served(spec, trained, shared, engine, cfg) if engine != "embedded" else {}
    for name, backend in policy_backends(spec.policies, cfg.runtime, seed=cfg.seed, checkpoints=trained,
                                         served=served, shared=shared).items():
        gateway.add_policy(name, backend)
    return gateway


def _served(spec: Any, trained: Mapping[str, Path], shared: set[str], engine: str, cfg: Any) -> dict[str, Any]:
    """`--engine vllm|torch-replica`: the trained policies' backends. On vLLM the adapters of one
    base (LoRA policies, a shared base's or not) are one vLLM engine's multi-LoRA, in this
    process; torch-replica replicas load each merged, as before."""
    from mas_trainer.cluster.workers import serving_backends
    from mas_trainer.engines.models import is_adapter
    from mas_trainer.replicas.config import require_vllm

    if engine == "vllm":
        require_vllm()  # one line saying how to install it, before any model loads
    served: dict[str, Any] = {}
    # on vLLM every trained adapter is served by multi-LoRA on its base, shared or not: vLLM cannot load an adapter
    # folder as a model, and adapters of one base then share its engine
    adapters = {p: trained[p] for p, pol in spec.policies.items() if pol.trainable and is_adapter(trained[p])} \
        if engine == "vllm" else {}
    try:
        for base, group in adapters_by_base(adapters).items():
            served.update(shared_base_backends(group, base, cfg.runtime, seed=cfg.seed, engine="vllm"))
        alone = {p: trained[p] for p, pol in spec.policies.items() if pol.trainable and p not in adapters}
        if alone:
            served.update(serving_backends(alone, engine, cfg.runtime))
    except BaseException:
        for backend in served.values():
            backend.engine.close()
        raise
    return served


def _is_app_ref(source: str | Path) -> bool:
    """`path.py:attr` or `package.module:attr`, not a folder (a run directory)."""
    text = str(source)
    return not Path(text).is_dir() and ":" in text and not text.endswith(":")


def serve(run_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000, routes: Mapping[str, str] | None = None,
          api_key: str | None = None, ready: threading.Event | None = None, stop: threading.Event | None = None,
          engine: str = "embedded", record: str | Path | None = None, record_file_mb: float = 64,
          record_max_mb: float = 1024, redact: str | Callable[[str], str] | None = None, model: str | None = None,
          checkpoint: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set); with `record`, keep each served run there."""
    recorder = None
    if record is not None:  # checked before the engines load
        hook = load_redactor(redact) if isinstance(redact, str) else redact
        recorder = Recorder(record, file_mb=record_file_mb, max_mb=record_max_mb, redact=hook)
    elif redact is not None:
        raise ConfigError("--redact applies to what --record keeps: give --record DIR too")
    gateway = build_gateway(run_dir, routes=routes, api_key=api_key, engine=engine, model=model, checkpoint=checkpoint)
    gateway.recorder = recorder
    stop = stop or threading.Event()
    previous: dict[int, Any] = {}  # put back when serving ends: a notebook's or script's Ctrl-C must work again afterwards
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        _serve_until(gateway, recorder, stop, host, port, api_key, ready)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _served_policies(gateway: Any) -> str:
    """``crew, lead``: the frozen policy named only where nodes are served by it (with them),
    or as what answers calls that name no trained policy where it is the fallback."""
    spec, names = gateway.router.spec, sorted(gateway.backends)
    frozen = [n for n in spec.nodes if spec.route(n).policy == FROZEN_POLICY] if spec is not None else None
    if FROZEN_POLICY not in names or frozen is None:
        return ", ".join(names) or "nothing"
    text = ", ".join(n for n in names if n != FROZEN_POLICY) or "nothing"
    if frozen:
        text += f", {FROZEN_POLICY} ({', '.join(frozen)})"
    if gateway.router.fallback == FROZEN_POLICY:
        text += f"; calls that name no policy: {FROZEN_POLICY}, the base model"
    return text


def _serve_until(gateway: Any, recorder: Any, stop: threading.Event, host: str, port: int, api_key: str | None,
                 ready: threading.Event | None) -> None:
    if api_key is None and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("serving on %s without an API key: anyone who can reach it can use the models "
                    "(set %s or --api-key-file)", host, API_KEY_ENV)
    with GatewayServer(gateway, host, port) as server:
        kept = f"; recording runs in {recorder.folder}" if recorder is not None else ""
        print(f"serving {_served_policies(gateway)} at {server.base_url} ({gateway.protection()}{kept})", flush=True)
        if RUNNING.summary():  # where the engines' threads come from (docs/engine.md, "Threads")
            print(f"engines in this process: {RUNNING.summary()}", flush=True)
        if ready is not None:
            ready.set()
        stop.wait()
    for backend in gateway.backends.values():
        backend.engine.close()
