"""`@trainable`: attach a policy map to a LangGraph app without changing how it runs.

The decorator returns the very object it was given (builder or compiled graph) with the
spec stored on it, so invoke/stream/async/checkpointers/interrupts behave exactly as
before. A function returning a graph is wrapped so that what it returns is marked too.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, Mapping

from langgraph.graph import StateGraph
from langgraph.pregel import Pregel

from mas_trainer.rewards.levels import check_arity
from mas_trainer.spec import AGENT_MARK, ResolvedSpec, SpecError, TrainSpec, qualified_nodes

__all__ = ["trainable", "spec_of", "as_graph", "node_names", "agent_entries", "no_fork_of"]

SPEC_ATTR = "__mas_trainer_spec__"
NO_FORK_ATTR = "__mas_trainer_no_fork__"


def node_names(graph: Pregel) -> list[str]:
    """Qualified node names, subgraph nodes included (``outer:inner``, as xray names them).

    A node that holds a subgraph (an agent from `create_agent` / `create_react_agent`, the
    supervisor of `create_supervisor`, the agents of `create_swarm`) is listed too, before
    the nodes inside it: xray shows only those, but the outer name is what users map.
    """
    return qualified_nodes(graph.get_graph(xray=True).nodes)


def agent_entries(graph: Pregel) -> list[str]:
    """The agents a policy map may name, as spec.py lists them: the graph's own (``@lead``,
    where `create_agent(name=...)` or deepagents named it) and each sub-agent one of its tools
    runs (``tools:@researcher``, and that one's own sub-agents below it): deepagents' `task`
    tool's, and a named agent a tool's function refers to (LangChain's sub-agents as tools). Sub-agents run by other
    means are not found here: their calls still carry their segment at run time."""
    own = _agent_name(graph)
    return ([AGENT_MARK + own] if own else []) + _subagents(graph, "")


def _agent_name(runnable: Any) -> str | None:
    name = ((getattr(runnable, "config", None) or {}).get("metadata") or {}).get("lc_agent_name")
    return str(name) if name else None


def _subagents(graph: Pregel, prefix: str) -> list[str]:
    found: list[str] = []
    for node, task_node in graph.nodes.items():
        tools = getattr(task_node.bound, "tools_by_name", None) or {}  # a ToolNode
        for tool in tools.values():
            for name, runnable in _tool_agents(tool).items():
                path = f"{prefix}{node}:{AGENT_MARK}{name}"
                found.append(path)
                inner = runnable if isinstance(runnable, Pregel) else getattr(runnable, "bound", None)
                if isinstance(inner, Pregel):
                    _refuse_own_map(inner, f"sub-agent {name!r}", name)
                    found += _subagents(inner, path + ":")
    return found


def _refuse_own_map(inner: Pregel, what: str, key: str) -> None:
    """A sub-agent or subgraph decorated with a `trainable` of its own: only the app's map
    routes calls, so that map would be ignored without a word."""
    if spec_of(inner) is not None:
        raise SpecError(f"{what} carries a @trainable map of its own, which would be ignored: only the app's map routes "
                        f"calls; drop the inner trainable(...) and map it in the app's roles= (e.g. {key!r})")


def _tool_agents(tool: Any) -> dict[str, Any]:
    """The named agents a tool may run: deepagents' `task` tool's sub-agents, and any compiled
    agent with a name that the tool's function refers to (a global or a closure variable)."""
    found = _task_tool_agents(tool)
    func = getattr(tool, "func", None) or getattr(tool, "coroutine", None)
    if not inspect.isfunction(func):
        return found
    try:
        refs = inspect.getclosurevars(func)
    except (TypeError, ValueError):
        return found
    for value in [*refs.nonlocals.values(), *refs.globals.values()]:
        name = _agent_name(value) if isinstance(value, Pregel) else None
        if name is not None:
            found.setdefault(name, value)
    return found


def _task_tool_agents(tool: Any) -> dict[str, Any]:
    """deepagents' `task` tool's sub-agents by name. deepagents keeps them nowhere public (the
    `SubAgentMiddleware` that built the tool is not reachable from the compiled graph), only in
    the tool function's closure; a version that moves them leaves the check to run time."""
    func = getattr(tool, "func", None)
    if getattr(tool, "name", None) != "task" or not inspect.isfunction(func):
        return {}
    graphs = inspect.getclosurevars(func).nonlocals.get("subagent_graphs")
    return dict(graphs) if isinstance(graphs, dict) else {}


def trainable(
    app: Any = None,
    /,
    *,
    roles: Mapping[str, str] | None = None,
    policies: Mapping[str, str] | None = None,
    reward: Callable[..., Any] | None = None,
    role_rewards: Any = None,
    turn_rewards: Any = None,
    frozen: list[str] | tuple[str, ...] = (),
    role_names: Mapping[str, str] | None = None,
    default_policy: str | None = None,
    no_fork: Iterable[str] = (),
    **unknown: Any,
) -> Any:
    """Mark a LangGraph app as trainable.

    roles: node or agent -> policy name (nodes in subgraphs: ``"parent:child"`` or the bare
    child name when unique; an agent by its `create_agent(name=...)` / deep agent sub-agent
    name, see docs/agents.md). policies: policy name -> base model (``"default"`` is the bundled
    model, or a local path / HF id; default: every policy in `roles` on ``"default"``).
    reward: trajectory-level reward ``(task, final_state, trajectory) -> float | None``.
    role_rewards / turn_rewards: one callable, or role -> callable, called as
    ``(task, role's calls, trajectory)`` / ``(task, llm_call, trajectory)``; None means
    "not applicable". An allocator (config ``reward.allocator``) mixes the three levels.
    frozen: nodes served by the base model and never trained. role_names: node -> role,
    to group several nodes into one logical agent. default_policy: the policy of LLM
    calls made by nodes not listed (default: frozen, each such node named once at its first call; an agent
    nothing maps is refused). no_fork: nodes with outside side effects
    (an email sent, a database written) that must not run again in a forked continuation:
    counterfactual credit then refuses the app. Works as ``@trainable(...)`` or
    ``trainable(graph, ...)`` on a `StateGraph`, a compiled graph, or a function returning either.
    """
    from .tracer import enable_serving_propagation

    if unknown:  # a misspelt keyword would otherwise leave, say, a reward silently unset
        raise SpecError(_unknown_keywords(sorted(unknown)))
    enable_serving_propagation()
    spec = TrainSpec.build(
        roles, policies, role_names=role_names, frozen=frozen, default_policy=default_policy, reward=reward,
        role_rewards=role_rewards, turn_rewards=turn_rewards,
    )
    # a reward that cannot take (task, subject, trajectory) is said now, not after a step of rollouts
    for what, given in (("reward", reward), ("role_rewards", role_rewards), ("turn_rewards", turn_rewards)):
        for fn in (given.values() if isinstance(given, Mapping) else [given] if given is not None else []):
            check_arity(what, fn)
    mark = _marker(spec, frozenset(no_fork))
    return mark if app is None else mark(app)


def _marker(spec: TrainSpec, unforkable: frozenset[str]) -> Callable[[Any], Any]:
    """What marks a builder, a compiled graph, or a function returning either, with `spec`."""

    def mark(obj: Any) -> Any:
        if isinstance(obj, (StateGraph, Pregel)):
            graph = obj.compile() if isinstance(obj, StateGraph) else obj
            names = node_names(graph)
            spec.resolve([*names, *agent_entries(graph)])
            for path, sub in graph.get_subgraphs(recurse=True):
                _refuse_own_map(sub, f"subgraph {path!r}", path.replace("|", ":"))
            unknown_nodes = sorted(unforkable - set(names))
            if unknown_nodes:
                raise SpecError(f"no_fork names unknown node(s) {', '.join(map(repr, unknown_nodes))}; "
                                f"the graph's nodes are {', '.join(names)}")
            setattr(obj, SPEC_ATTR, spec)
            setattr(obj, NO_FORK_ATTR, unforkable)
            if isinstance(obj, Pregel) and isinstance(getattr(obj, "builder", None), StateGraph):
                # copies of the graph (`with_config`, as deepagents makes of a compiled sub-agent) keep the builder, not the mark
                setattr(obj.builder, SPEC_ATTR, spec)
            return obj
        if callable(obj):

            @functools.wraps(obj)
            def build(*args: Any, **kwargs: Any) -> Any:
                return mark(obj(*args, **kwargs))

            setattr(build, SPEC_ATTR, spec)
            return build
        raise SpecError(
            f"@trainable expects a StateGraph, a compiled graph or a function returning one, got {type(obj).__name__}"
        )

    return mark


def spec_of(obj: Any) -> TrainSpec | None:
    """The spec attached by @trainable, looking through a compiled graph to its builder."""
    spec = getattr(obj, SPEC_ATTR, None)
    if spec is None and isinstance(obj, Pregel):
        spec = getattr(getattr(obj, "builder", None), SPEC_ATTR, None)
    return spec


def no_fork_of(graph: Pregel) -> frozenset[str]:
    """The nodes declared with ``trainable(..., no_fork=...)``, looking through a compiled graph to its builder."""
    names = getattr(graph, NO_FORK_ATTR, None)
    if names is None:
        names = getattr(getattr(graph, "builder", None), NO_FORK_ATTR, None)
    return frozenset(names or ())


def as_graph(obj: Any) -> tuple[Pregel, TrainSpec | None]:
    """Turn whatever APP names into a compiled graph plus its spec (None if undecorated)."""
    spec = spec_of(obj)
    if isinstance(obj, StateGraph):
        obj = obj.compile()
    elif not isinstance(obj, Pregel) and callable(obj):
        obj = obj()
        spec = spec_of(obj) or spec
        if isinstance(obj, StateGraph):
            obj = obj.compile()
    if not isinstance(obj, Pregel):
        raise SpecError(f"expected a LangGraph graph, got {type(obj).__name__}")
    return obj, spec or spec_of(obj)


def resolve(obj: Any, base_model: str | None = None) -> tuple[Pregel, ResolvedSpec]:
    """Compiled graph and its spec checked against its nodes; undecorated graphs get one policy."""
    graph, spec = as_graph(obj)
    if spec is None:
        spec = TrainSpec.one_policy_per_graph(base_model or "default")
    elif base_model:
        spec = spec.with_base_model(base_model)
    return graph, spec.resolve([*node_names(graph), *agent_entries(graph)])


_KEYWORDS = ("roles", "policies", "reward", "role_rewards", "turn_rewards", "frozen", "role_names", "default_policy",
             "no_fork")


def _unknown_keywords(names: list[str]) -> str:
    import difflib

    guesses = [f"{n!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(n, _KEYWORDS, n=1)) else repr(n)
               for n in names]
    return f"@trainable got unknown keyword(s) {', '.join(guesses)}; it takes {', '.join(_KEYWORDS)}"
