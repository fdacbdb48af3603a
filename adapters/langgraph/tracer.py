"""LangChain callback handler that turns one LangGraph run into spans and node/tool records.

Attached through the run config (`config["callbacks"]`), it sees every chain run: the ones
whose metadata opens a new LangGraph task (`langgraph_checkpoint_ns` gains a segment named
after the run) are node calls. Each node call becomes an OTel span under the rollout's root
span (or under the enclosing node call, for subgraph nodes). LLM calls themselves are
recorded by the OpenAI instrumentation and the gateway; this handler only tells the
instrumentation which node call, role and span the current code runs under, and the node
call's *branch*: what identifies it in every run of the rollout (task ids and checkpoint
namespaces hash the checkpoint id, a fresh uuid each run; superstep and task path do not: a
`Send` task's path holds its index among the step's sends, in the order the graph wrote them,
not the order the branches ran). The gateway derives sampling seeds from it (`branch_segment`).

Agents: a node call whose runs carry an `lc_agent_name` other than the enclosing node call's
is a sub-agent's (deepagents runs each sub-agent inside the main agent's `tools` node), and
its path gains the agent's segment: ``tools:@researcher:model``, not ``tools:model``, so the
policy map tells the sub-agents apart. `lc_agent_name` is the identity LangChain itself gives
an agent (`create_agent(name=...)` binds it; deepagents binds each sub-agent's name) and the
one LangGraph's own stream transformer takes for a sub-agent boundary; no newer field exists.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables.config import var_child_runnable_config
from langgraph.types import Command
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from mas_trainer.spec import AGENT_MARK, ResolvedSpec, agent_path, node_path
from mas_trainer.trace import attributes as A
from mas_trainer.trace.instrument import CallContext, register_resolver, span_hex
from mas_trainer.trace.otel import get_tracer
from mas_trainer.trace.schema import NodeCall, ToolCall

from .serving import ServingRuns
from .serving import install as install_serving_runs

__all__ = ["GraphTracer", "node_path", "branch_segment"]

log = logging.getLogger(__name__)

# Exceptions LangGraph uses for control flow, not failures.
_CONTROL_FLOW = {"GraphInterrupt", "NodeInterrupt", "ParentCommand", "GraphBubbleUp"}


def branch_segment(node: str, metadata: Mapping[str, Any], attempt: int = 1) -> str:
    """One node call's part of its branch, from what LangGraph decided, never from timing:
    ``worker@2(__pregel_push,1,False)`` is the second `Send` of superstep 1, run in step 2;
    ``planner@1(__pregel_pull,planner)`` a plain node; ``#2`` follows a retry's second attempt.
    A subgraph's node calls append theirs to the enclosing node call's branch (``|``)."""
    segment = f"{node}@{metadata.get('langgraph_step')}{_path_text(metadata.get('langgraph_path'))}"
    return segment if attempt == 1 else f"{segment}#{attempt}"


def _path_text(path: object) -> str:
    if isinstance(path, (tuple, list)):
        return "(" + ",".join(_path_text(p) for p in path) + ")"
    return str(path)


@dataclass
class _NodeRun:
    record: NodeCall
    span: trace.Span
    role: str
    ns: str
    ctx: Any = field(default=None)
    branch: str = ""
    agent: str | None = None  # the `lc_agent_name` its runs carry
    unmapped: bool = False  # served frozen only because nothing maps it


class GraphTracer(BaseCallbackHandler):
    """Records one rollout. Not shared between rollouts: each gets its own instance.

    Node calls are keyed by their checkpoint namespace, which LangGraph gives each task
    and which every run inside the task inherits through its metadata: so an LLM or tool
    call finds its node call by one dict lookup, with no run tree kept.
    """

    run_inline = True  # keep callbacks on the caller's thread/task: ordering and cost
    raise_error = False
    ignore_llm = True  # LLM calls are recorded at the HTTP boundary instead
    ignore_chat_model = True
    ignore_retriever = True
    ignore_custom_event = True

    def __init__(self, rollout_id: str, spec: ResolvedSpec) -> None:
        self.rollout_id = rollout_id
        self.spec = spec
        self._lock = threading.Lock()
        self._nodes: list[_NodeRun] = []
        self._open: dict[str, _NodeRun] = {}  # checkpoint ns -> running node call
        self._opened_by: dict[UUID, _NodeRun] = {}  # the run that opened each node call
        # node calls cancelled with their rollout: a sync node's thread runs on, and its later
        # LLM calls must still name this rollout, so that the gateway refuses them
        self._cancelled: dict[str, _NodeRun] = {}
        self._tool_calls: list[ToolCall] = []
        self._open_tools: dict[UUID, tuple[ToolCall, trace.Span]] = {}
        self._attempts: dict[str, int] = {}
        # (call id, node) of every non-streamed LLM call answered in this rollout: the
        # controller fails the rollout when its trajectory lacks one (a call sent past the gateway)
        self.answered: list[tuple[str, str]] = []
        self.refused: Exception | None = None  # a call from an agent nothing maps (`ResolvedSpec.unmapped_agent_error`)
        self.root = get_tracer().start_span(
            "invoke_agent graph",
            kind=SpanKind.INTERNAL,
            attributes={A.KIND: "rollout", A.ROLLOUT_ID: rollout_id, A.GEN_AI_OPERATION: "invoke_agent"},
        )
        self._root_ctx = trace.set_span_in_context(self.root)
        self.trace_id = format(self.root.get_span_context().trace_id, "032x")

    # --- what the OpenAI instrumentation asks -------------------------------------------
    def node_for(self, ns: str | None) -> _NodeRun | None:
        if not ns:
            return None
        with self._lock:
            return self._open.get(ns) or self._cancelled.get(ns)

    def call_context(self, ns: str | None) -> CallContext | None:
        node = self.node_for(ns)
        if node is None:
            return None
        name = node.record.name
        if node.unmapped and (refused := self.spec.unmapped_agent_error(name)) is not None:
            self.refused = refused  # kept too: an app that catches its tools' errors must not hide it
            raise refused  # into the app's LLM call: the rollout fails with this line, nothing is served frozen
        if node.unmapped and self.spec.first_time_unmapped(name):
            agent = f" (agent {node.agent!r})" if node.agent else ""
            log.warning("LLM calls of node %r%s are served by the frozen base model because nothing maps them: map it in "
                        "roles=, list it in frozen=, or set default_policy=", name, agent)
        return CallContext(self.rollout_id, name, node.record.id, node.role, node.ctx, branch=node.branch,
                           on_answer=lambda call_id: self.answered.append((call_id, name)))

    # --- node calls ------------------------------------------------------------------------
    def _maybe_open(self, run_id: UUID, metadata: dict | None, name: str | None) -> None:
        md = metadata or {}
        ns = md.get("langgraph_checkpoint_ns")
        node = md.get("langgraph_node")
        # a task's own run is named after its node and its namespace ends in "<node>:<task id>";
        # runs inside it (conditional edges, a subgraph's graph run) share the namespace
        if not ns or name != node or not ns.rsplit("|", 1)[-1].startswith(f"{node}:"):
            return
        with self._lock:
            if ns in self._open:
                return
            enclosing = self._open.get(ns.rsplit("|", 1)[0]) if "|" in ns else None
            opened = self._open_node(ns, md, enclosing)
            self._open[ns] = opened
            self._opened_by[run_id] = opened

    def _open_node(self, ns: str, md: dict, enclosing: _NodeRun | None) -> _NodeRun:
        agent = md.get("lc_agent_name")
        agent = str(agent) if agent else None
        node_name = str(md.get("langgraph_node"))
        path = agent_path(enclosing.record.name, enclosing.agent, agent, node_name) if enclosing else node_path(ns)
        attempt = self._attempts.get(ns, 0) + 1
        self._attempts[ns] = attempt
        route = self.spec.route(path)
        own = branch_segment(node_name, md, attempt)
        branch = f"{enclosing.branch}|{own}" if enclosing else own
        parent_ctx = enclosing.ctx if enclosing else self._root_ctx
        span = get_tracer().start_span(
            f"node {path}",
            context=parent_ctx,
            attributes={
                A.KIND: "node",
                A.ROLLOUT_ID: self.rollout_id,
                A.NODE: path,
                A.STEP: md.get("langgraph_step", -1),
                A.CHECKPOINT_NS: ns,
                A.ATTEMPT: attempt,
                A.BRANCH: branch,
                A.ROLE: route.role,
                A.POLICY: route.policy,
                A.GEN_AI_AGENT_NAME: route.role,
            },
        )
        record = NodeCall(
            id=span_hex(span),
            name=path,
            step=md.get("langgraph_step"),
            parent_id=enclosing.record.id if enclosing else None,
            status="ok",
            attempt=attempt,
            start_time=time.time(),
            branch=branch,
        )
        if enclosing:
            span.set_attribute(A.PARENT_NODE_CALL_ID, enclosing.record.id)
        span.set_attribute(A.NODE_CALL_ID, record.id)
        node = _NodeRun(record, span, route.role, ns, trace.set_span_in_context(span), branch, agent, route.unmapped)
        self._nodes.append(node)
        return node

    def _close(self, run_id: UUID, error: BaseException | None) -> None:
        with self._lock:
            node = self._opened_by.pop(run_id, None)
            if node is None:
                return
            if self._open.get(node.ns) is node:
                del self._open[node.ns]
        if node.record.end_time is not None:
            return
        node.record.end_time = time.time()
        kind = type(error).__name__ if error is not None else None
        if kind in ("GraphInterrupt", "NodeInterrupt"):
            node.record.status = "interrupted"
        elif kind == "CancelledError":  # the rollout was stopped (timeout) while this node ran
            node.record.status = "cancelled"
            with self._lock:
                self._cancelled[node.ns] = node
            node.span.set_status(StatusCode.ERROR, "cancelled")
        elif error is not None and kind not in _CONTROL_FLOW:
            node.record.status = "error"
            node.record.error = f"{type(error).__name__}: {error}"
            node.span.record_exception(error)
            node.span.set_status(StatusCode.ERROR, node.record.error)
        node.span.end()

    # --- LangChain callbacks ---------------------------------------------------------------
    def on_chain_start(self, serialized, inputs, *, run_id, parent_run_id=None, tags=None, metadata=None, **kw):
        self._maybe_open(run_id, metadata, kw.get("name") or (serialized or {}).get("name"))

    def on_chain_end(self, outputs, *, run_id, **kw):
        self._close(run_id, None)

    def on_chain_error(self, error, *, run_id, **kw):
        self._close(run_id, error)

    def on_tool_start(self, serialized, input_str, *, run_id, parent_run_id=None, metadata=None, inputs=None, **kw):
        node = self.node_for((metadata or {}).get("langgraph_checkpoint_ns"))
        name = kw.get("name") or (serialized or {}).get("name") or "tool"
        call = ToolCall(
            id=str(kw.get("tool_call_id") or run_id),
            node_id=node.record.id if node else None,
            name=name,
            input=inputs if inputs is not None else input_str,
        )
        span = get_tracer().start_span(
            f"execute_tool {name}",
            context=node.ctx if node else self._root_ctx,
            attributes={
                A.KIND: "tool",
                A.ROLLOUT_ID: self.rollout_id,
                A.GEN_AI_OPERATION: "execute_tool",
                A.GEN_AI_TOOL_NAME: name,
                A.GEN_AI_TOOL_CALL_ID: call.id,
            },
        )
        with self._lock:
            self._tool_calls.append(call)
            self._open_tools[run_id] = (call, span)

    def on_tool_end(self, output, *, run_id, **kw):
        if isinstance(output, Command):
            with self._lock:
                entry = self._open_tools.get(run_id)
            output = _command_output(output, entry[0].id if entry else None)
        else:
            output = getattr(output, "content", output)
        self._end_tool(run_id, output=output)

    def on_tool_error(self, error, *, run_id, **kw):
        self._end_tool(run_id, error=error)

    def _end_tool(self, run_id: UUID, *, output: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            entry = self._open_tools.pop(run_id, None)
        if entry is None:
            return
        call, span = entry
        if error is None:
            call.output = output
        else:
            call.status, call.error = "error", f"{type(error).__name__}: {error}"
            span.set_status(StatusCode.ERROR, call.error)
        span.end()

    # --- results -------------------------------------------------------------------------
    def finish(self, status: str, error: str | None = None) -> tuple[list[NodeCall], list[ToolCall]]:
        """End the rollout: node calls still open (timeout, cancellation) are closed as cancelled."""
        now = time.time()
        with self._lock:
            nodes = list(self._nodes)
            tools = list(self._tool_calls)
            still_running = list(self._open_tools)
        for run_id in still_running:
            self._end_tool(run_id, error=TimeoutError("cancelled before the tool returned"))
        for node in nodes:
            if node.record.end_time is None:
                node.record.end_time = now
                node.record.status = "cancelled"
                node.span.set_status(StatusCode.ERROR, "cancelled")
                node.span.end()
        if status != "ok":
            self.root.set_status(StatusCode.ERROR, error or status)
        self.root.end()
        return [n.record for n in nodes], tools


def _command_output(command: Command, call_id: str | None) -> dict[str, Any]:
    """What a tool that returned a `Command` (a hand-off: `transfer_to_<agent>`) did, without
    the message history its update carries: where it sent the run, and its tool message."""
    out: dict[str, Any] = {}
    goto = command.goto
    if goto:
        names = [getattr(g, "node", g) for g in (goto if isinstance(goto, (list, tuple)) else [goto])]
        out["goto"] = names[0] if len(names) == 1 else names
    if command.graph:
        out["graph"] = command.graph
    update = command.update
    messages = update.get("messages") if isinstance(update, dict) else None
    replies = [m for m in messages or [] if getattr(m, "type", None) == "tool"]
    replies = [m for m in replies if getattr(m, "tool_call_id", None) == call_id] or replies
    if replies:
        out["content"] = getattr(replies[-1], "content", None)
    if isinstance(update, dict):
        out["update_keys"] = sorted(str(k) for k in update)
    return out


def _resolve_from_langchain_context() -> CallContext | None:
    config = var_child_runnable_config.get()
    if not config:
        return None
    ns = (config.get("metadata") or {}).get("langgraph_checkpoint_ns")
    manager = config.get("callbacks")
    handlers = getattr(manager, "handlers", None) or (manager if isinstance(manager, list) else [])
    for handler in handlers:
        if isinstance(handler, GraphTracer):
            return handler.call_context(ns)
    if ns and _serving_propagation:
        # Outside a rollout (the app run as usual against `mas-trainer serve`): name the node,
        # so the server can route the call to the policy that node was trained as, under the
        # trace of the graph invocation, so a recording server keeps the invocation as one run.
        path = _serving_path(ns, (config.get("metadata") or {}).get("lc_agent_name"))
        runs = next((h for h in handlers if isinstance(h, ServingRuns)), None)
        found = runs.parent_of(getattr(manager, "parent_run_id", None)) if runs is not None else None
        parent, on_result = found if found is not None else (None, None)
        return CallContext(rollout_id="", node=path, node_call_id="", role=path, parent=parent, on_result=on_result)
    return None


def _serving_path(ns: str, agent: object) -> str:
    """A node call's path outside a rollout, from the call's own namespace and agent only (no
    enclosing node call is known): a sub-agent one level down, as deepagents runs them, gets its
    segment as in a rollout; deeper nesting (a sub-agent's sub-agent) is routed by what encloses it."""
    segments = [seg.rsplit(":", 1)[0] for seg in ns.split("|") if seg]
    if len(segments) >= 2 and agent and str(agent) not in segments:
        return ":".join([*segments[:-1], f"{AGENT_MARK}{agent}", segments[-1]])
    return ":".join(segments)


_serving_propagation = False


def enable_serving_propagation() -> None:
    """Let a decorated app's LLM calls name their node when run outside mas-trainer.

    Called by `@trainable` unless MAS_TRAINER_PROPAGATE=0. The calls then carry W3C
    `traceparent` (one trace per graph invocation, see serving.py) and `baggage`
    (`mas.node`) headers, which any other endpoint ignores.
    """
    global _serving_propagation
    import os

    from mas_trainer.trace.instrument import instrument_openai

    if os.environ.get("MAS_TRAINER_PROPAGATE", "1") != "0":
        _serving_propagation = True
        instrument_openai()
        install_serving_runs()


register_resolver(_resolve_from_langchain_context)
