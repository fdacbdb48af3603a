"""Roles, policies and the policy map, validated against an app's node names.

Framework-free: an adapter lists the app's nodes (qualified as ``parent:child`` for nodes
inside subgraphs, as LangGraph's ``get_graph(xray=True)`` names them) and this module decides,
for every node call, which role it plays and which policy serves it. A node that holds a
subgraph (an agent made by `create_agent`, `create_supervisor`, `create_swarm`, ...) is a node
too: naming it maps every node inside it that is not named itself.

Agents are named too: an adapter lists each agent found inside another agent's node as a
node entry whose last segment is ``@<agent name>`` (``tools:@researcher``, a sub-agent run by
the main agent's ``tools`` node), and the app's own agent as ``@<name>``; a node call made
inside a sub-agent has that segment in its path (``tools:@researcher:model``). A key may name
an agent by its bare name. A sub-agent is a role of its own: it never inherits the mapping of
the node or agent it runs in, and an agent nothing maps is refused at resolution (where the
adapter found it) rather than frozen without a word.

An agent the adapter cannot find before the app runs (one made inside a tool's function) is
named with its mark (``"@helper"``, or its path ``"tools:@helper"``): such a key is *pending*,
checked when the agent's calls arrive, and an agent that turns up at run time with nothing
mapping it fails the call in one line (`unmapped_agent_error`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Iterable, Mapping

from mas_trainer.errors import UserError, did_you_mean

__all__ = ["FROZEN_POLICY", "AGENT_MARK", "PolicySpec", "TrainSpec", "ResolvedSpec", "SpecError", "Route", "qualified_nodes",
           "node_path", "agent_path"]

# Policy that serves nodes nobody asked to train: the base model, never updated.
FROZEN_POLICY = "frozen"
# Marks a path segment that is an agent, not a node: never the start of a LangGraph node's name in
# the apps this serves, and kept through the run directory's node list (app.json) as any node is.
AGENT_MARK = "@"
_NAMED_LOCK = threading.Lock()


class SpecError(UserError):
    """A decorator argument names something that does not exist; the message lists what does."""


@dataclass(frozen=True)
class PolicySpec:
    name: str
    base_model: str = "default"
    trainable: bool = True


@dataclass(frozen=True)
class Route:
    role: str
    policy: str
    trainable: bool
    unmapped: bool = False  # frozen only because nothing maps it (no key, no default_policy)


@dataclass(frozen=True)
class TrainSpec:
    """What `@trainable` was told, before it is checked against a graph.

    roles: node -> policy. role_names: node -> role, to group several nodes into one logical
    agent (default: each node is its own role). frozen: nodes served by the base model and
    never trained. default_policy: the policy of LLM-calling nodes not listed in `roles`
    (default: frozen).
    """

    roles: Mapping[str, str]
    policies: Mapping[str, PolicySpec]
    role_names: Mapping[str, str] = field(default_factory=dict)
    frozen: frozenset[str] = frozenset()
    default_policy: str | None = None
    reward: Callable[..., Any] | None = None
    role_rewards: Any = None  # callable or role -> callable: (task, role's calls, trajectory) -> float | None
    turn_rewards: Any = None  # callable or role -> callable: (task, llm call, trajectory) -> float | None

    @classmethod
    def build(
        cls,
        roles: Mapping[str, str] | None = None,
        policies: Mapping[str, str] | None = None,
        *,
        role_names: Mapping[str, str] | None = None,
        frozen: Iterable[str] = (),
        default_policy: str | None = None,
        reward: Callable[..., Any] | None = None,
        role_rewards: Any = None,
        turn_rewards: Any = None,
    ) -> "TrainSpec":
        roles = dict(roles or {})
        if policies is None:
            policies = {p: "default" for p in roles.values()}
        if not isinstance(policies, Mapping):
            raise SpecError(f"policies must be a dict of policy name -> base model, got {type(policies).__name__}")
        pols = {name: PolicySpec(name, str(model)) for name, model in policies.items()}
        if FROZEN_POLICY in pols:
            raise SpecError(f"policy name {FROZEN_POLICY!r} is reserved for frozen nodes; rename it")
        for node, pol in roles.items():
            if pol not in pols:
                raise SpecError(f"role {node!r} maps to unknown policy {pol!r}; {did_you_mean(str(pol), pols)}"
                                f"valid policies: {', '.join(sorted(pols)) or '(none)'}")
        if default_policy is not None and default_policy not in pols:
            raise SpecError(f"default_policy {default_policy!r} is not a policy; {did_you_mean(default_policy, pols)}"
                            f"valid policies: {', '.join(sorted(pols)) or '(none)'}")
        frozen = frozenset(frozen)
        both = sorted(frozen & set(roles))
        if both:
            raise SpecError(f"node(s) {', '.join(both)} are both trained (roles=) and frozen (frozen=); pick one")
        if reward is not None and not callable(reward):
            raise SpecError(f"reward must be a callable (task, final_state, trajectory) -> float, got {reward!r}")
        return cls(roles, pols, dict(role_names or {}), frozen, default_policy, reward, role_rewards, turn_rewards)

    @classmethod
    def one_policy_per_graph(cls, base_model: str = "default") -> "TrainSpec":
        """For graphs that were not decorated: every node is its own role, all on one policy."""
        return cls({}, {"default": PolicySpec("default", base_model)}, default_policy="default")

    def with_base_model(self, model: str) -> "TrainSpec":
        """`--model` overrides the base model of every policy."""
        pols = {n: PolicySpec(n, model, p.trainable) for n, p in self.policies.items()}
        return replace(self, policies=pols)

    def resolve(self, node_names: Iterable[str]) -> "ResolvedSpec":
        """Check every name against the graph's nodes; raise SpecError listing the valid ones."""
        nodes = qualified_nodes(node_names)
        keys = [*self.roles, *self.frozen, *self.role_names]
        matched = {key: _match(key, nodes) for key in keys}
        qualified = {key: node for key, node in matched.items() if node is not None}
        pending = tuple(dict.fromkeys(key for key, node in matched.items() if node is None))
        resolved = ResolvedSpec(self, tuple(nodes), qualified, pending)
        resolved.check_agents_mapped()
        for what, rewards in (("role_rewards", self.role_rewards), ("turn_rewards", self.turn_rewards)):
            if isinstance(rewards, Mapping):
                resolved.check_reward_roles(what, rewards)
        return resolved


def node_path(checkpoint_ns: str) -> str:
    """``outer:<task id>|inner:<task id>`` -> ``outer:inner`` (the xray name of the node): a node
    call's path from LangGraph's checkpoint namespace (live in the tracer, imported in otel_import)."""
    return ":".join(seg.rsplit(":", 1)[0] for seg in checkpoint_ns.split("|") if seg)


def agent_path(enclosing: str, enclosing_agent: str | None, agent: str | None, node: str) -> str:
    """The path of a node call in `enclosing` (a path) made by `agent`: a sub-agent's own segment
    comes between where an agent runs another inside one of its nodes (deepagents' `task` tool),
    not where an agent is a node of a graph (a supervisor's, a swarm's: the node names it)."""
    if agent and enclosing_agent and agent != enclosing_agent and agent not in (node, enclosing.rsplit(":", 1)[-1]):
        return f"{enclosing}:{AGENT_MARK}{agent}:{node}"
    return f"{enclosing}:{node}"


_ENDPOINTS = ("__start__", "__end__")


def qualified_nodes(names: Iterable[str]) -> list[str]:
    """The nodes a policy map may name, from qualified names (``outer:inner``).

    Every enclosing node is listed, just before the first node inside it (``outer`` is a node
    of the app even where a listing shows only what is inside it); the graphs' own start and
    end points (``__start__``, ``outer:__end__``) are not nodes. Order is kept, repeats dropped.
    """
    out: dict[str, None] = {}
    for name in names:
        parts = name.split(":")
        if any(p in _ENDPOINTS for p in parts):
            continue
        for depth in range(1, len(parts) + 1):
            out.setdefault(":".join(parts[:depth]), None)
    return list(out)


def _match(key: str, nodes: list[str]) -> str | None:
    """The node or agent entry `key` names; None: an agent key (``@helper``, ``tools:@helper``)
    found nowhere yet, pending until the app runs. Anything else unknown is refused here."""
    if key in nodes:
        return key
    plain = [n for n in nodes if not _is_agent(n)]
    agents = [n for n in nodes if _is_agent(n)]
    # a bare child name is accepted when exactly one node (at any depth) has it; else one agent
    mark = key if key.startswith(AGENT_MARK) else AGENT_MARK + key
    hits = ([] if key.startswith(AGENT_MARK) else [n for n in plain if n.rsplit(":", 1)[-1] == key]) or \
        [n for n in agents if n.rsplit(":", 1)[-1] == mark]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise SpecError(f"node name {key!r} is ambiguous ({', '.join(hits)}); use the qualified name")
    if _is_agent(key):
        return None
    if not agents:
        raise SpecError(f"unknown node {key!r}; {did_you_mean(key, nodes)}valid nodes: {', '.join(nodes) or '(none)'}")
    names = [_agent_name(a) for a in agents]
    raise SpecError(f"unknown agent or node {key!r}; {did_you_mean(key, [*names, *plain])}valid agents: {', '.join(names)}; "
                    f"valid nodes: {', '.join(plain) or '(none)'}; an agent made only at run time is named with its mark "
                    f"({AGENT_MARK}{key}) and checked when it runs")


def _is_agent(path: str) -> bool:
    return path.rsplit(":", 1)[-1].startswith(AGENT_MARK)


def _agent_name(path: str) -> str:
    return path.rsplit(":", 1)[-1][len(AGENT_MARK):]


@dataclass(frozen=True)
class ResolvedSpec:
    """A TrainSpec checked against one graph: routes node paths to (role, policy)."""

    declared: TrainSpec  # as the decorator declared it, before the graph's nodes were known
    nodes: tuple[str, ...]
    qualified: Mapping[str, str]  # user's key -> qualified node name
    pending: tuple[str, ...] = ()  # agent keys (`@helper`) the graph does not show: matched as calls arrive

    @property
    def policies(self) -> dict[str, PolicySpec]:
        pols = dict(self.declared.policies)
        if self._needs_frozen():
            base = next(iter(pols.values())).base_model if pols else "default"
            pols[FROZEN_POLICY] = PolicySpec(FROZEN_POLICY, base, trainable=False)
        return pols

    def describe_policies(self) -> str:
        """``lead=tiny, crew=tiny``: the policies and their base models, the frozen policy only
        where a node is served by it (it also answers calls that name no node, which is no news)."""
        parts = [f"{name}={p.base_model}" for name, p in self.policies.items() if name != FROZEN_POLICY]
        frozen = [n for n in self.nodes if self.route(n).policy == FROZEN_POLICY]
        if frozen:
            parts.append(f"{FROZEN_POLICY}={self.policies[FROZEN_POLICY].base_model} ({', '.join(frozen)})")
        return ", ".join(parts) or "(none)"

    @cached_property
    def roles(self) -> list[str]:
        """The roles the app's nodes play (what role_rewards and turn_rewards are keyed by), in node
        order, then those of the pending agents."""
        return list(dict.fromkeys([*(self.route(n).role for n in self.nodes), *(self._pending_role(k) for k in self.pending)]))

    def check_reward_roles(self, what: str, rewards: Mapping[str, Any]) -> None:
        """A reward keyed by a name that is no role would never run: refuse it, naming the key,
        the roles and the closest one (a policy name given for a role is said to be one)."""
        roles = self.roles
        for key in rewards:
            if key in roles or self._unlisted_inner_node(key):
                continue
            node = self.qualified.get(key) or (key if key in self.nodes else None)
            if node is not None:
                raise SpecError(f"{what} key {key!r} is a node that plays role {self.route(node).role!r}: rewards are keyed "
                                f"by role; the app's roles: {', '.join(roles) or '(none)'}")
            if key in self.declared.policies or key == FROZEN_POLICY:
                played = [r for r in roles if self._policy_of_role(r) == key]
                raise SpecError(f"{what} key {key!r} is a policy, not a role: rewards are keyed by role (the roles it "
                                f"serves: {', '.join(played) or 'none'}); the app's roles: {', '.join(roles) or '(none)'}")
            raise SpecError(f"{what} key {key!r} is not a role of the app, so that reward would never run; "
                            f"{did_you_mean(str(key), roles)}the app's roles: {', '.join(roles) or '(none)'}")

    def _policy_of_role(self, role: str) -> str:
        routes = [*(self.route(n) for n in self.nodes), *(self._pending_route(k) for k in self.pending)]
        return next(r.policy for r in routes if r.role == role)

    def _unlisted_inner_node(self, key: Any) -> bool:
        """``outer:inner`` below a node of the graph, not shown by the graph's listing (a subgraph
        invoked inside a node's function), where it is a role of its own (nothing above it listed)."""
        return (isinstance(key, str) and ":" in key and key.split(":", 1)[0] in self.nodes and key not in self.nodes
                and self.route(key).role == key)

    def _needs_frozen(self) -> bool:
        return self.declared.default_policy is None or bool(self.declared.frozen)

    def route(self, node_path: str) -> Route:
        """Role and policy of a node call; `node_path` is qualified (``outer:inner``).

        A node inside a subgraph that is not listed itself inherits the mapping of the
        nearest enclosing node that is.
        """
        route = self._routes.get(node_path)
        if route is None:
            route = self._routes[node_path] = self._route(node_path)
        return route

    @cached_property
    def _routes(self) -> dict[str, Route]:
        return {}  # asked once per node call and once per LLM call: memoised

    @cached_property
    def _by_node(self) -> dict[str, str]:
        # a key in roles/frozen wins over the same node named again in role_names
        keys = [*self.declared.role_names, *self.declared.frozen, *self.declared.roles]
        return {self.qualified[k]: k for k in keys if k in self.qualified}

    @cached_property
    def _role_names(self) -> dict[str, str]:
        return {self.qualified[k]: role for k, role in self.declared.role_names.items() if k in self.qualified}

    def _route(self, node_path: str) -> Route:
        by_node = self._by_node
        parts = node_path.split(":")
        for depth in range(len(parts), 0, -1):
            q = ":".join(parts[:depth])
            key = by_node.get(q)
            if key is not None and (key in self.declared.roles or key in self.declared.frozen):
                return self._keyed(q, key)
            if parts[depth - 1].startswith(AGENT_MARK):  # a sub-agent is a role of its own: nothing above it maps it
                pending = next((k for k in self.pending if k == q or k == parts[depth - 1]), None)
                if pending is not None:
                    with _NAMED_LOCK:
                        self._pending_seen.add(pending)
                    return self._pending_route(pending)
                return self._unmapped(node_path, parts[depth - 1][len(AGENT_MARK):])
        root = next((n for n in self.nodes if ":" not in n and n.startswith(AGENT_MARK)), None)
        key = by_node.get(root) if root is not None else None
        if root is not None and key is not None and (key in self.declared.roles or key in self.declared.frozen):
            return self._keyed(root, key)  # the app's own agent, named by its name
        return self._unmapped(node_path, None)

    def _keyed(self, node: str, key: str) -> Route:
        role = self._role_names.get(node, key)
        if key in self.declared.frozen:
            return Route(role, FROZEN_POLICY, False)
        return Route(role, self.declared.roles[key], True)

    def route_of_key(self, key: str) -> Route:
        """The route of what a key of the map names (a node, an agent, a pending agent)."""
        return self.route(self.qualified[key]) if key in self.qualified else self._pending_route(key)

    def _pending_role(self, key: str) -> str:
        return self.declared.role_names.get(key, _agent_name(key))

    def _pending_route(self, key: str) -> Route:
        if key in self.declared.frozen:
            return Route(self._pending_role(key), FROZEN_POLICY, False)
        if key in self.declared.roles:
            return Route(self._pending_role(key), self.declared.roles[key], True)
        return self._unmapped(key, _agent_name(key))  # named in role_names only

    @cached_property
    def _pending_seen(self) -> set[str]:
        return set()

    def unseen_pending(self) -> list[str]:
        """The pending agent keys no call has matched yet."""
        with _NAMED_LOCK:
            return [k for k in self.pending if k not in self._pending_seen]

    def describe_names(self) -> str:
        """``agents: ...; nodes: ...``: what a key may name, for a one-line error."""
        plain = [n for n in self.nodes if not _is_agent(n)]
        return f"agents: {', '.join(self.agents) or '(none found)'}; nodes: {', '.join(plain) or '(none)'}"

    def unmapped_agent_error(self, node_path: str) -> SpecError | None:
        """The one-line error for an LLM call made inside an agent that nothing maps (only an
        agent the adapter could not find before the app ran gets here); None for any other call."""
        route = self.route(node_path)
        agents = [seg[len(AGENT_MARK):] for seg in node_path.split(":") if seg.startswith(AGENT_MARK)]
        if not route.unmapped or not agents:
            return None
        agent = agents[-1]
        where = node_path[: node_path.rindex(AGENT_MARK + agent) + len(AGENT_MARK + agent)]
        hint = did_you_mean(AGENT_MARK + agent, self.pending) if self.pending else ""
        return SpecError(f"agent {agent!r} ({where}), seen only at run time, makes LLM calls nothing maps: map it in roles= as "
                         f"{AGENT_MARK + agent!r}, list it in frozen= to serve it the base model untrained, or set "
                         f"default_policy=; {hint}{self.describe_names()}")

    def _unmapped(self, node_path: str, agent: str | None) -> Route:
        role = agent if agent is not None else node_path
        if self.declared.default_policy is not None:
            return Route(role, self.declared.default_policy, True)
        return Route(role, FROZEN_POLICY, False, unmapped=True)

    def first_time_unmapped(self, node_path: str) -> bool:
        """True the first time it is asked about `node_path`: a node nothing maps is named once, not once a call."""
        with _NAMED_LOCK:
            if node_path in self._named_unmapped:
                return False
            self._named_unmapped.add(node_path)
            return True

    @cached_property
    def _named_unmapped(self) -> set[str]:
        return set()

    @property
    def agents(self) -> list[str]:
        """The agents found in the app (the app's own first), by name."""
        return [_agent_name(n) for n in self.nodes if _is_agent(n)]

    def check_agents_mapped(self) -> None:
        """An agent makes LLM calls: one that nothing maps (no key for it or for a node inside it,
        no default_policy) would be served frozen without a word, so it is refused, in one line."""
        if self.declared.default_policy is not None:
            return
        keyed = {self.qualified[k] for k in [*self.declared.roles, *self.declared.frozen] if k in self.qualified}
        missing = []
        for entry in (n for n in self.nodes if _is_agent(n)):
            if ":" in entry:
                covered = any(k == entry or k.startswith(entry + ":") for k in keyed)
            else:  # the app's own agent: a key for it or for one of its nodes outside every sub-agent
                covered = any(not any(seg.startswith(AGENT_MARK) for seg in k.split(":")) or k == entry for k in keyed)
            if not covered:
                missing.append(_agent_name(entry))
        if missing:
            raise SpecError(f"agent(s) {', '.join(missing)} make LLM calls nothing maps: map each in roles= (by its name), "
                            f"list it in frozen= to serve it the base model untrained, or set default_policy=; "
                            f"the app's agents: {', '.join(self.agents)}")
