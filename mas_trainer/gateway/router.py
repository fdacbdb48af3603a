"""Decides which policy answers a request: by graph baggage first, then by model name.

A request served by the fallback policy (no baggage, a model name that is neither a policy
nor a route) is logged once per model name, at WARNING on `mas_trainer.gateway.router`:
during training such a call belongs to no rollout, so nobody trains on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Mapping

from mas_trainer.spec import ResolvedSpec
from mas_trainer.trace import attributes as A

__all__ = ["Router", "RouteDecision", "UnknownModel", "UnknownNode"]

log = logging.getLogger(__name__)
_LOGGED_MODELS = 256  # fallback warnings: once per model name, for this many names at most


class UnknownModel(LookupError):
    pass


class UnknownNode(UnknownModel):
    """The call names a graph node the policy map does not know (serve: never answered by a
    model the node was not trained as)."""


@dataclass(frozen=True)
class RouteDecision:
    policy: str
    role: str
    node: str | None
    trainable: bool
    rollout_id: str | None
    node_call_id: str | None
    branch: str | None = None  # the node call's run-independent identity (baggage `mas.branch`): seeds derive from it


class Router:
    """`spec` maps graph nodes to policies; `model_routes` maps model names a client asks for
    (e.g. "gpt-4o-mini") to policies for calls that carry no graph baggage; `fallback` is the
    policy such calls get when their model name is unknown (None: they are refused).
    `known_nodes_only`: a node that is not one of the spec's nodes (nor inside one) is refused
    rather than given the frozen or default policy (serve)."""

    def __init__(self, spec: ResolvedSpec | None = None, model_routes: Mapping[str, str] | None = None,
                 fallback: str | None = None, *, known_nodes_only: bool = False) -> None:
        self.spec = spec
        self.model_routes = dict(model_routes or {})
        self.fallback = fallback
        self.known_nodes_only = known_nodes_only
        self._nodes = frozenset(spec.nodes) if spec is not None else frozenset()
        self._fell_back: set[str] = set()  # model names already logged
        self._role_policy: dict[str, tuple[str, bool]] = {}
        if spec is not None:
            for key in list(spec.declared.roles) + list(spec.declared.frozen):
                route = spec.route_of_key(key)
                self._role_policy[route.role] = (route.policy, route.trainable)

    def route(self, bag: Mapping[str, object], model: str, policies: Iterable[str]) -> RouteDecision:
        policies = set(policies)
        rollout = _s(bag.get(A.BAGGAGE_ROLLOUT))
        node = _s(bag.get(A.BAGGAGE_NODE))
        role = _s(bag.get(A.BAGGAGE_ROLE))
        call = _s(bag.get(A.BAGGAGE_NODE_CALL))
        branch = _s(bag.get(A.BAGGAGE_BRANCH))
        if node and self.spec is not None:
            if self.known_nodes_only and not self._known(node):
                nodes = ", ".join(self.spec.nodes) or "(none)"
                raise UnknownNode(f"node {node[:100]!r} is not in this run's policy map; its nodes: {nodes}")
            r = self.spec.route(node)
            return RouteDecision(r.policy, role or r.role, node, r.trainable, rollout, call, branch)
        if role and role in self._role_policy:
            role_policy, trainable = self._role_policy[role]
            return RouteDecision(role_policy, role, node, trainable, rollout, call, branch)
        policy = model if model in policies else self.model_routes.get(model)
        if policy is None and self.fallback is not None:
            policy = self.fallback
            if model not in self._fell_back and len(self._fell_back) < _LOGGED_MODELS:
                self._fell_back.add(model)
                log.warning("calls with no graph node asking for model %r are served by the fallback policy %r "
                            "(name a policy, or map the model to one)", model, policy)
        if policy is not None:
            return RouteDecision(policy, role or model, node, False, rollout, call, branch)
        names = sorted(policies | set(self.model_routes))
        raise UnknownModel(f"model {model!r} is not served here; available models: {', '.join(names)}")

    def _known(self, node: str) -> bool:
        """The node, or a subgraph node inside it (`outer:inner`), is one of the app's."""
        parts = node.split(":")
        return any(":".join(parts[:depth]) in self._nodes for depth in range(len(parts), 0, -1))


def _s(value: object) -> str | None:
    return str(value) if value is not None else None
