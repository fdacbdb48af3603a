"""The OpenAI-compatible gateway that routes each call to its policy's engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.gateway.ledger import Ledger
    from mas_trainer.gateway.router import Router
    from mas_trainer.gateway.sampling import RolloutSampling
    from mas_trainer.gateway.server import Gateway, GatewayServer, PolicyBackend, RequestLimits, ServerLimits

__all__ = ["Ledger", "Router", "RolloutSampling", "Gateway", "GatewayServer", "PolicyBackend", "RequestLimits", "ServerLimits"]

# imported on first use: `import mas_trainer.config` (every CLI command) must not pay for
# FastAPI, OpenTelemetry or Ray through a package's __init__
_LAZY = {
    "Ledger": "mas_trainer.gateway.ledger",
    "Router": "mas_trainer.gateway.router",
    "RolloutSampling": "mas_trainer.gateway.sampling",
    "Gateway": "mas_trainer.gateway.server",
    "GatewayServer": "mas_trainer.gateway.server",
    "PolicyBackend": "mas_trainer.gateway.server",
    "RequestLimits": "mas_trainer.gateway.server",
    "ServerLimits": "mas_trainer.gateway.server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
