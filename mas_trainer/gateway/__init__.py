"""The OpenAI-compatible gateway that routes each call to its policy's engine."""

from .ledger import Ledger
from .router import Router
from .sampling import RolloutSampling
from .server import Gateway, GatewayServer, PolicyBackend, RequestLimits, ServerLimits

__all__ = ["Gateway", "GatewayServer", "PolicyBackend", "Router", "Ledger", "RolloutSampling", "RequestLimits", "ServerLimits"]
