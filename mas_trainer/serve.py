"""`mas-trainer serve RUN_DIR`: the run's trained policies behind one OpenAI-compatible endpoint.

The unedited app, run with OPENAI_BASE_URL pointing here, gets each node's answer from the
policy that node was trained as: `@trainable` makes the app's OpenAI calls name their node
(W3C baggage), and the gateway routes the node with the run's policy map (`app.json`).
Calls that name no node are served by `model`: a policy name, or a name mapped with
`--route NAME=POLICY`; any other model is a 404, never a silent fallback to an untrained model.
The engines are configured as the run's (`runtime` in its config.yaml), so the policies
answer as `fit` and `eval --run` measured them.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Mapping

from mas_trainer.config import ConfigError
from mas_trainer.gateway import Gateway, GatewayServer, Router
from mas_trainer.runtime.backends import policy_backends, run_config, trained_policies
from mas_trainer.runtime.rundir import RunDir
from mas_trainer.spec import ResolvedSpec

__all__ = ["load_run_spec", "build_gateway", "serve"]


def load_run_spec(run_dir: str | Path) -> ResolvedSpec:
    return RunDir(run_dir).app().resolved()


def build_gateway(run_dir: str | Path, *, routes: Mapping[str, str] | None = None, api_key: str | None = None,
                  max_tokens: int = 256) -> Gateway:
    trained = trained_policies(run_dir)
    spec = load_run_spec(run_dir)
    routes = dict(routes or {})
    unknown = sorted(set(routes.values()) - set(spec.policies))
    if unknown:
        raise ConfigError(f"--route names unknown policy {unknown[0]!r}; policies of this run: {', '.join(sorted(spec.policies))}")
    untrained = sorted(p for p, pol in spec.policies.items() if pol.trainable and p not in trained)
    if untrained:
        raise ConfigError(f"policy {untrained[0]!r} has no checkpoint folder in {RunDir(run_dir).checkpoint / 'policies'}")
    cfg = run_config(run_dir)
    gateway = Gateway(Router(spec, model_routes=routes), api_key=api_key, default_max_tokens=max_tokens)
    for name, backend in policy_backends(spec.policies, cfg.runtime, seed=cfg.seed, checkpoints=trained).items():
        gateway.add_policy(name, backend)
    return gateway


def serve(run_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000, routes: Mapping[str, str] | None = None,
          api_key: str | None = None, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set)."""
    gateway = build_gateway(run_dir, routes=routes, api_key=api_key)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    with GatewayServer(gateway, host, port) as server:
        print(f"serving {', '.join(sorted(gateway.backends))} at {server.base_url}", flush=True)
        if ready is not None:
            ready.set()
        stop.wait()
    for backend in gateway.backends.values():
        backend.engine.close()
