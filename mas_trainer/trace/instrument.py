"""OpenAI SDK instrumentation: every chat completion and Responses API call carries the caller's
graph context.

The wrapped `create`/`parse` methods (sync and async) of `chat.completions` and `responses`
(whose `stream` goes through `create`) open a GenAI "chat" span under the
current node call and inject W3C `traceparent` + `baggage` (rollout, node, node call, role,
and the node call's branch: its run-independent identity, which sampling seeds derive from)
as request headers through OTel's propagators. The gateway routes on that baggage and files
the engine's token ids under the span id. openai 3.x sends through `httpx2`, so patching
httpx transports would miss these calls; wrapping the resource methods does not.

Which node is calling is framework knowledge: an adapter registers a resolver.

Calls made inside a rollout go to the run's gateway whatever client makes them: an app that
built its `ChatOpenAI` at import, before the gateway existed (the usual app, trained from a
notebook by object), holds a client aimed at api.openai.com or its own OPENAI_BASE_URL. The
call is sent through a copy of that client aimed at the gateway (`route_rollouts`), so its
retries, timeouts and headers stay the app's. Each non-streamed call answered in a rollout is
reported to the rollout (`CallContext.on_answer`), which fails a rollout whose trajectory
lacks one of them rather than train on part of its turns.

Calls made inside a rollout also carry `mas.token`: an HMAC, under a secret drawn once per
process (one run), of the routing fields of the baggage. The run's gateway files and trains
only calls whose token checks out: ids are predictable, the secret is not, so another local
process cannot inject turns into a rollout, nor relabel a call's node or role.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from opentelemetry import baggage, propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from mas_trainer.trace import attributes as A
from mas_trainer.trace.otel import get_tracer

__all__ = ["CallContext", "register_resolver", "instrument_openai", "current_call", "span_hex", "rollout_token",
           "rollout_token_ok", "route_rollouts", "BAGGAGE_TOKEN"]

BAGGAGE_TOKEN = "mas.token"
# Never leaves the process: the gateway that checks tokens runs next to the controller that
# starts the rollouts and the instrumentation that signs their calls.
_RUN_SECRET = secrets.token_bytes(32)


@dataclass(frozen=True)
class CallContext:
    """Where an LLM call is made from: the rollout, node call and role, plus the node's span."""

    rollout_id: str
    node: str
    node_call_id: str
    role: str
    parent: Context | None = None
    # sees (the SDK resource, its result) of each call that succeeded: serving learns the run ids a server records
    on_result: Callable[[Any, Any], None] | None = None
    # the node call's identity in its rollout, the same in every run of it (`Send` branches
    # told apart by what the graph decided, not by which ran first): the gateway seeds from it
    branch: str = ""
    # told the call id (its chat span's id) of each call answered in the rollout, streams aside
    on_answer: Callable[[str], None] | None = None


Resolver = Callable[[], "CallContext | None"]
_resolvers: list[Resolver] = []
_lock = threading.Lock()
_installed = False
_gateway: tuple[str, str] | None = None  # (base URL, key) rollout calls are sent to


def route_rollouts(base_url: str | None, api_key: str = "") -> None:
    """Send every call made inside a rollout to `base_url` with `api_key` (None: as the client
    says). A Session sets it while its gateway is up."""
    global _gateway
    with _lock:
        _gateway = (base_url.rstrip("/"), api_key) if base_url else None


def register_resolver(resolver: Resolver) -> None:
    """Add a function that says which graph context the current thread/task is in."""
    with _lock:
        if resolver not in _resolvers:
            _resolvers.append(resolver)


def current_call() -> CallContext | None:
    for resolver in _resolvers:
        ctx = resolver()
        if ctx is not None:
            return ctx
    return None


def span_hex(span: trace.Span) -> str:
    return format(span.get_span_context().span_id, "016x")


def rollout_token(rollout_id: str, node: str | None, node_call_id: str | None, role: str | None, call_id: str) -> str:
    """The token that ties one LLM call (`call_id`: its chat span's id, sent as the W3C
    traceparent) to a rollout this process started. The gateway takes each call id once, so a
    token seen on the wire cannot sign another call, nor the same one twice."""
    message = "\x1f".join((rollout_id, node or "", node_call_id or "", role or "", call_id)).encode()
    return hmac.digest(_RUN_SECRET, message, "sha256")[:16].hex()


def rollout_token_ok(token: object, rollout_id: str, node: str | None, node_call_id: str | None, role: str | None,
                     call_id: str) -> bool:
    """Constant-time check of a token received in baggage."""
    if not isinstance(token, str):
        return False
    return hmac.compare_digest(token.encode(), rollout_token(rollout_id, node, node_call_id, role, call_id).encode())


def _headers_for(call: CallContext, span: trace.Span) -> dict[str, str]:
    ctx = trace.set_span_in_context(span)
    token = rollout_token(call.rollout_id, call.node, call.node_call_id, call.role, span_hex(span)) if call.rollout_id else None
    for key, value in (
        (A.BAGGAGE_ROLLOUT, call.rollout_id),
        (A.BAGGAGE_NODE, call.node),
        (A.BAGGAGE_NODE_CALL, call.node_call_id),
        (A.BAGGAGE_ROLE, call.role),
        (A.BAGGAGE_BRANCH, call.branch if call.rollout_id else ""),
        (BAGGAGE_TOKEN, token),
    ):
        if value:  # outside a rollout only the node is known
            ctx = baggage.set_baggage(key, value, context=ctx)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def _start_span(call: CallContext, kwargs: dict[str, Any]) -> trace.Span:
    model = kwargs.get("model")
    attrs = {
        A.KIND: "llm",
        A.GEN_AI_OPERATION: "chat",
        A.GEN_AI_PROVIDER: "openai",
        A.ROLLOUT_ID: call.rollout_id,
        A.NODE: call.node,
        A.NODE_CALL_ID: call.node_call_id,
        A.ROLE: call.role,
        A.GEN_AI_AGENT_NAME: call.role,
    }
    if isinstance(model, str):
        attrs[A.GEN_AI_REQUEST_MODEL] = model
    if call.branch:
        attrs[A.BRANCH] = call.branch
    return get_tracer().start_span(f"chat {model or ''}".strip(), context=call.parent, kind=SpanKind.CLIENT, attributes=attrs)


def _with_headers(kwargs: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    extra = dict(kwargs.get("extra_headers") or {})
    extra.update(headers)
    return {**kwargs, "extra_headers": extra}


def _ours(headers: Any) -> bool:
    """The headers carry this project's baggage: an outer wrapped method (parse calling create)
    added them. A `traceparent` alone says nothing: other instrumentations (OpenLLMetry's)
    put their own into `extra_headers`, and taking it for ours left the call unrouted."""
    if not isinstance(headers, dict):
        return False
    value = next((v for k, v in headers.items() if isinstance(k, str) and k.lower() == "baggage"), "")
    return isinstance(value, str) and f"{A.BAGGAGE_NODE}=" in value


def _routed(resource: Any, call: CallContext | None) -> Any:
    """`resource`, or the same resource on a copy of its client aimed at the run's gateway
    when a rollout's call would go elsewhere."""
    gateway = _gateway
    client = getattr(resource, "_client", None)
    if call is None or not call.rollout_id or gateway is None or client is None:
        return resource
    if str(getattr(client, "base_url", "")).rstrip("/") == gateway[0]:
        return resource
    return type(resource)(client.with_options(base_url=gateway[0], api_key=gateway[1]))


def _begin(kwargs: dict[str, Any]) -> tuple[trace.Span | None, dict[str, Any], CallContext | None]:
    """The call's span and its kwargs with trace headers (ours replace another instrumentation's
    `traceparent` and `baggage`: the gateway routes and records by them); (None, kwargs) outside a
    graph, or when an outer wrapped method (parse calling create) already added them."""
    call = current_call()
    if call is None or _ours(kwargs.get("extra_headers")):
        return None, kwargs, None
    span = _start_span(call, kwargs)
    return span, _with_headers(kwargs, _headers_for(call, span)), call


def _finished(span: trace.Span | None, call: CallContext | None, client: Any, result: Any, stream: bool = False) -> Any:
    """`result`, once its span has the token counts and the rollout has the answer."""
    if span is None:
        return result
    if call is not None and call.on_answer is not None and not stream:
        call.on_answer(span_hex(span))
    usage = getattr(result, "usage", None)
    if usage is not None:
        # chat completions count prompt/completion tokens, the Responses API input/output tokens
        span.set_attribute(A.GEN_AI_INPUT_TOKENS, getattr(usage, "prompt_tokens", None) or getattr(usage, "input_tokens", 0) or 0)
        span.set_attribute(A.GEN_AI_OUTPUT_TOKENS,
                           getattr(usage, "completion_tokens", None) or getattr(usage, "output_tokens", 0) or 0)
    span.end()
    if call is not None and call.on_result is not None:
        call.on_result(client, result)
    return result


@contextlib.contextmanager
def _failing(span: trace.Span | None) -> Iterator[None]:
    """Ends `span` as failed with whatever the call raises, a cancellation included."""
    try:
        yield
    except BaseException as exc:
        if span is not None:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, str(exc))
            span.end()
        raise


def _wrap_sync(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        span, kwargs, call = _begin(kwargs)
        with _failing(span):
            result = method(_routed(self, call), *args, **kwargs)
        return _finished(span, call, self, result, kwargs.get("stream") is True)

    create.__mas_trainer_wrapped__ = method  # type: ignore[attr-defined]
    return create


def _wrap_async(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        span, kwargs, call = _begin(kwargs)
        with _failing(span):
            result = await method(_routed(self, call), *args, **kwargs)
        return _finished(span, call, self, result, kwargs.get("stream") is True)

    create.__mas_trainer_wrapped__ = method  # type: ignore[attr-defined]
    return create


def instrument_openai() -> None:
    """Wrap `create`/`parse` of chat completions and of the Responses API in the installed openai
    SDK (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        from openai.resources.chat.completions import completions as chat
        from openai.resources.responses import responses

        for cls, wrap in ((chat.Completions, _wrap_sync), (chat.AsyncCompletions, _wrap_async),
                          (responses.Responses, _wrap_sync), (responses.AsyncResponses, _wrap_async)):
            for name in ("create", "parse"):
                method = getattr(cls, name, None)
                if method is not None and not hasattr(method, "__mas_trainer_wrapped__"):
                    setattr(cls, name, wrap(method))
        _installed = True
