"""The OpenAI-compatible gateway that routes each call to its policy's engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_trainer._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.gateway.ledger import Ledger
    from mas_trainer.gateway.router import Router
    from mas_trainer.gateway.sampling import RolloutSampling
    from mas_trainer.gateway.server import Gateway, GatewayServer, PolicyBackend, RequestLimits, ServerLimits

__all__ = ["Ledger", "Router", "RolloutSampling", "Gateway", "GatewayServer", "PolicyBackend", "RequestLimits", "ServerLimits"]

__getattr__ = lazy_exports(__name__, {
    "mas_trainer.gateway.ledger": ["Ledger"],
    "mas_trainer.gateway.router": ["Router"],
    "mas_trainer.gateway.sampling": ["RolloutSampling"],
    "mas_trainer.gateway.server": ["Gateway", "GatewayServer", "PolicyBackend", "RequestLimits", "ServerLimits"],
})
