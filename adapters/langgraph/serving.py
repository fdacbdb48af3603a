"""A decorated app run outside training (against `mas-trainer serve`): one run per graph invocation.

Each outermost LangChain run (a graph's `invoke`/`ainvoke`/`stream`) gets a W3C trace id
made from its LangChain run id, and every LLM call under it carries that trace id, so a
recording server files them as one run whose id is the run id's 32 hex digits (pass
`config={"run_id": uuid}` to know it before the call). When the server answered a call of the
run with a `run_id` (it records), the graph's input, output and status go to its
`POST /v1/runs` once the invocation ends, so the run can become a task; nothing is sent to a
server that does not record.

The handler is added to every callback manager through LangChain's configure hook (the
mechanism LangSmith's tracer uses), so the app's code stays unedited.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

__all__ = ["ServingRuns", "serving_runs", "install"]

log = logging.getLogger(__name__)
_MAX_SENT_BYTES = 1024 * 1024 - 4096  # the server's bound on a graph run, less the envelope


@dataclass
class _Root:
    input: Any
    parent: Context  # the invocation's trace, as the parent of its chat spans
    client: Any = None  # the OpenAI client of a call the server recorded (its URL and key)
    run_id: str = ""
    members: set[UUID] = field(default_factory=set)


def _json(value: Any) -> Any:
    """`value` as JSON data: pydantic models (LangChain messages) dumped, anything else as text."""
    def default(obj: Any) -> Any:
        dump = getattr(obj, "model_dump", None)
        return dump(mode="json") if callable(dump) else str(obj)

    return json.loads(json.dumps(value, default=default))


class ServingRuns(BaseCallbackHandler):
    """Maps every LangChain run to its outermost run; one per process (see `install`)."""

    run_inline = True  # bookkeeping only: keep callback order in async graphs

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._roots: dict[UUID, _Root] = {}
        self._root_of: dict[UUID, UUID] = {}
        self._senders: list[threading.Thread] = []

    # --- the run tree ----------------------------------------------------------------------
    def _start(self, run_id: UUID, parent_run_id: UUID | None, inputs: Any = None) -> None:
        with self._lock:
            if parent_run_id is None:
                span = NonRecordingSpan(SpanContext(trace_id=run_id.int, span_id=secrets.randbits(63) + 1,
                                                    is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)))
                self._roots[run_id] = _Root(input=inputs, parent=trace.set_span_in_context(span), members={run_id})
                self._root_of[run_id] = run_id
            elif (root := self._root_of.get(parent_run_id)) is not None:
                self._root_of[run_id] = root
                self._roots[root].members.add(run_id)

    def _end(self, run_id: UUID, outputs: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            root_id = self._root_of.pop(run_id, None)
            root = self._roots.get(root_id) if root_id is not None else None
            if root is not None:
                root.members.discard(run_id)
            if root is None or run_id != root_id:
                return
            del self._roots[root_id]
            for member in root.members:  # runs that never ended (cancelled): forget them with their root
                self._root_of.pop(member, None)
        if root.client is not None:
            self._send(root, outputs, error)

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       **kwargs: Any) -> None:
        self._start(run_id, parent_run_id, inputs)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id, outputs)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id, error=error)

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                            **kwargs: Any) -> None:
        self._start(run_id, parent_run_id)

    def on_llm_start(self, serialized: Any, prompts: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                     **kwargs: Any) -> None:
        self._start(run_id, parent_run_id)

    def on_tool_start(self, serialized: Any, input_str: str, *, run_id: UUID, parent_run_id: UUID | None = None,
                      **kwargs: Any) -> None:
        self._start(run_id, parent_run_id)

    def on_retriever_start(self, serialized: Any, query: str, *, run_id: UUID, parent_run_id: UUID | None = None,
                           **kwargs: Any) -> None:
        self._start(run_id, parent_run_id)

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id)

    on_tool_end = on_retriever_end = on_llm_end  # type: ignore[assignment]
    on_tool_error = on_retriever_error = on_llm_error  # type: ignore[assignment]

    # --- what the instrumentation asks -------------------------------------------------------
    def parent_of(self, run_id: UUID | None) -> tuple[Context, Any] | None:
        """The trace context of the invocation `run_id` belongs to, and the hook that sees each
        of its calls' results; None outside a tracked invocation."""
        with self._lock:
            root_id = self._root_of.get(run_id) if run_id is not None else None
            root = self._roots.get(root_id) if root_id is not None else None
        if root is None:
            return None
        return root.parent, lambda resource, result: self._answered(root, resource, result)

    def _answered(self, root: _Root, resource: Any, result: Any) -> None:
        # the server records this run: tell it the graph's input later (LangChain asks for raw responses: a header)
        run_id = getattr(result, "run_id", None)
        headers = getattr(result, "headers", None)
        if run_id is None and headers is not None and hasattr(headers, "get"):
            run_id = headers.get("x-mas-run-id")
        if isinstance(run_id, str) and root.client is None:
            root.client, root.run_id = getattr(resource, "_client", None), run_id

    def _send(self, root: _Root, outputs: Any, error: BaseException | None) -> None:
        body = {"run_id": root.run_id, "input": _json(root.input), "output": None if error else _json(outputs),
                "status": "error" if error else "ok", "error": f"{type(error).__name__}: {error}"[:2000] if error else None}
        raw = json.dumps(body)
        if len(raw) > _MAX_SENT_BYTES and body["output"] is not None:  # the input is what makes a task: keep it
            body["output"], raw = None, json.dumps({**body, "output": None})
        if len(raw) > _MAX_SENT_BYTES:
            log.warning("run %s: its graph input is over %d bytes; the server keeps its calls but not its input",
                        root.run_id, _MAX_SENT_BYTES)
            return
        client = root.client
        sender = threading.Thread(target=_post, args=(client, raw), name="mas-trainer-run", daemon=False)
        with self._lock:
            self._senders = [t for t in self._senders if t.is_alive()] + [sender]
        sender.start()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait for the graph records being sent (tests; a process exiting waits anyway)."""
        with self._lock:
            senders = list(self._senders)
        for t in senders:
            t.join(timeout_s)


def _post(client: Any, raw: str) -> None:
    import httpx

    url = str(client.base_url).rstrip("/") + "/runs"
    headers = {"content-type": "application/json"}
    if getattr(client, "api_key", None):
        headers["authorization"] = f"Bearer {client.api_key}"
    try:
        reply = httpx.post(url, content=raw, headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        log.warning("could not send a graph run to %s: %s", url, exc)
        return
    if reply.status_code != 200:
        log.warning("%s refused a graph run (%d): %s", url, reply.status_code, reply.text[:200])


_handler: ServingRuns | None = None
_lock = threading.Lock()


def install() -> ServingRuns:
    """Add one `ServingRuns` to every LangChain callback manager of this process (idempotent)."""
    global _handler
    with _lock:
        if _handler is None:
            from langchain_core.tracers.context import register_configure_hook

            _handler = ServingRuns()
            # a default, not a value set in one context: graphs run in threads and tasks started later see it too
            register_configure_hook(ContextVar("mas_trainer_serving_runs", default=_handler), inheritable=True)
        return _handler


def serving_runs() -> ServingRuns | None:
    return _handler
