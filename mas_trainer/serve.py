"""`mas-trainer serve RUN_DIR`: the run's trained policies behind one OpenAI-compatible endpoint.

The unedited app, run with OPENAI_BASE_URL pointing here, gets each node's answer from the
policy that node was trained as: `@trainable` makes the app's OpenAI calls name their node
(W3C baggage), and the gateway routes the node with the run's policy map (`app.json`).
Calls that name no node are served by `model`: a policy name, or a name mapped with
`--route NAME=POLICY`; any other model is a 404, never a silent fallback to an untrained model.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Mapping

from mas_trainer.config import ConfigError
from mas_trainer.gateway import Gateway, GatewayServer, Router
from mas_trainer.runtime.rundir import RunDir
from mas_trainer.runtime.session import lazy_backend, torch_backend
from mas_trainer.spec import FROZEN_POLICY, ResolvedSpec, TrainSpec

__all__ = ["load_run_spec", "build_gateway", "serve"]


def load_run_spec(run_dir: str | Path) -> ResolvedSpec:
    path = Path(run_dir) / "app.json"
    if not path.exists():
        raise ConfigError(f"{run_dir} has no app.json (is it a `mas-trainer fit` run directory?)")
    doc = json.loads(path.read_text())
    pols = {p: v["base_model"] for p, v in doc["policies"].items() if p != FROZEN_POLICY}
    spec = TrainSpec.build(doc["roles"], pols, role_names=doc.get("role_names"), frozen=doc.get("frozen", ()),
                           default_policy=doc.get("default_policy"))
    return spec.resolve(doc["nodes"])


def build_gateway(run_dir: str | Path, *, routes: Mapping[str, str] | None = None, api_key: str | None = None,
                  max_tokens: int = 256) -> Gateway:
    run = RunDir(run_dir)
    if run.load_state() is None:
        raise ConfigError(f"{run_dir} has no checkpoint to serve; train it with `mas-trainer fit` first")
    spec = load_run_spec(run_dir)
    routes = dict(routes or {})
    unknown = sorted(set(routes.values()) - set(spec.policies))
    if unknown:
        raise ConfigError(f"--route names unknown policy {unknown[0]!r}; policies of this run: {', '.join(sorted(spec.policies))}")
    gateway = Gateway(Router(spec, model_routes=routes), api_key=api_key, default_max_tokens=max_tokens)
    for name, policy in spec.policies.items():
        folder = run.policy_dir(name)
        if policy.trainable:
            if not folder.exists():
                raise ConfigError(f"policy {name!r} has no checkpoint folder {folder}")
            gateway.add_policy(name, torch_backend(str(folder)))
        else:
            gateway.add_policy(name, lazy_backend(name, lambda m=policy.base_model: torch_backend(m)))
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
