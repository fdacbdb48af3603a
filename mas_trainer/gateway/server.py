"""The OpenAI-compatible front: `/v1/chat/completions`, `/v1/responses` and `/v1/models`.

Each request is routed (graph baggage, else model name) to its policy's engine; the chosen
tokens, with their log-probs, go back in the response (vLLM-style `token_ids`,
`prompt_token_ids`, `logprobs`) and are filed in the ledger under the caller's span id so
the controller can join them to the rollout's node calls. How rollout requests sample (the
step's seed, a temperature override) is not the gateway's state: it reads the
`RolloutSampling` of whoever drives the rollouts (the `Session`).

Who may call. A training gateway (`rollouts=True`, the Session's) files a call only when its
baggage carries the token the run's instrumentation signs that one call with
(`trace.instrument.rollout_token`, over the rollout, node, role and the call's span id from
its traceparent); a call that names a rollout without it is a 403 and never reaches the
ledger or the engine. Each signed call id is taken once (`Ledger.claim`): a token replayed
from the wire is a 409. Calls naming no rollout need the API key, when one
is set (a Session sets a fresh one per run and hands it to the app as OPENAI_API_KEY). A
serving gateway (`rollouts=False`) has no rollouts: rollout baggage is ignored and nothing
is kept per request.

Staying responsive. Bodies are size-capped (413 before they are read, from Content-Length)
and read under a deadline; parsing large bodies, chat templating and tokenisation run off
the event loop; `max_tokens` is capped by the model's context; a client that hangs up
cancels its generation (the engine drops its rows); streams send tokens as they are sampled.

Ending with calls in flight (`flights.py`). The owner ends unfinished rollouts with
`end_rollouts` (their calls in flight are answered 503 and later ones refused) and the run
with `close()` (every call answered or refused with a 503, before the engines close), so a
run that ends with calls in flight prints no tracebacks.

Refused requests (4xx, and the 503s above) are logged at INFO on `mas_trainer.gateway.server`.
`serve --record`'s own endpoints (feedback, graph runs) are in `recording.py`; the Responses
API, answered on the chat path, in `responses.py`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import baggage, propagate, trace
from pydantic import ValidationError

from mas_trainer.errors import nested_too_deep
from mas_trainer.engines.base import (ChatFormat, Delta, Engine, EngineUnavailable, Generation, SamplingParams, choice_id, max_context,
                                      stream_generation)
from mas_trainer.gateway.recording import FEEDBACK, GRAPH_RUN, Endpoint
from mas_trainer.gateway.flights import Flight, Flights, Stopped
from mas_trainer.gateway.ledger import Ledger, Replayed
from mas_trainer.gateway.protocol import (MAX_DEPTH, ChatRequest, Refused, bound_schema, describe_errors, error_body,
                                          json_schema_of, token_logprobs)
from mas_trainer.gateway.responses import parse_request as parse_responses
from mas_trainer.gateway.router import RouteDecision, Router, UnknownModel, UnknownNode
from mas_trainer.gateway.sampling import RolloutSampling
from mas_trainer.gateway.transport import GatewayServer, ServerLimits
from mas_trainer.trace import attributes as A
from mas_trainer.trace.instrument import BAGGAGE_TOKEN, rollout_token_ok
from mas_trainer.production.record import Recorder
from mas_trainer.trace.schema import LLMCall

__all__ = ["PolicyBackend", "Gateway", "GatewayServer", "RequestLimits", "ServerLimits", "key_matches", "POLICY_HEADER", "RUN_HEADER"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Names the policy that answered, on every completion (streamed or not).
POLICY_HEADER = "x-mas-policy"
# With a recorder (serve --record): the recorded run a completion belongs to.
RUN_HEADER = "x-mas-run-id"
# Bodies up to this size are parsed and validated on the event loop: cheaper than a thread
# hop, and over in microseconds. Larger ones go to a thread so they delay nobody.
_INLINE_BODY_BYTES = 64 * 1024
# No tokenizer averages this many characters per token on real text: a prompt longer than
# this times the context is refused before it is tokenised.
_MAX_CHARS_PER_TOKEN = 32


@dataclass
class PolicyBackend:
    engine: Engine
    chat: ChatFormat


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 32 * 1024  # h11 bounds only headers that arrive in pieces
    body_timeout_s: float = 30.0
    max_depth: int = MAX_DEPTH


class _ClientGone(Exception):
    pass


def key_matches(authorization: str | None, key: str) -> bool:
    """`Authorization: Bearer KEY`, compared in constant time."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


@dataclass
class _Call:
    """One accepted request, routed, rendered and ready for its engine."""

    req: ChatRequest
    decision: RouteDecision
    backend: PolicyBackend
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    params: SamplingParams
    call_id: str
    start: float
    run_id: str | None = None  # set when the gateway records served calls

    @property
    def turn_id(self) -> str | None:
        # only rollout calls are kept by engines that train (worker groups buffer by turn id)
        return self.call_id if self.decision.rollout_id else None

    def content(self, gen: Generation) -> tuple[str | None, list[dict[str, Any]]]:
        if self.tools and not self.req.structured():  # structured output is content, never a tool call
            return self.backend.chat.parse(gen.text, self.tools)
        return gen.text, []


class _Stream(Protocol):
    """The server-sent events of one streamed call, delta by delta; its choices as they end."""

    gens: list[Generation | None]
    parsed: list[tuple[str | None, list[dict]]]

    def events(self, d: Delta) -> str: ...

    def failed(self, message: str, code: str | None) -> str: ...

    def end(self) -> str: ...


class _Wire(Protocol):
    """How an endpoint answers an accepted call: chat completions (`_ChatWire`), or the Responses API
    (`responses.ResponsesWire`); everything before the answer is one path."""

    def body(self, call: _Call, gens: list[Generation], parsed: list[tuple[str | None, list[dict]]]) -> dict[str, Any]: ...

    def stream(self, call: _Call) -> _Stream: ...


class _ChatWire:
    def body(self, call: _Call, gens: list[Generation], parsed: list[tuple[str | None, list[dict]]]) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{call.call_id}", "object": "chat.completion", "created": int(call.start), "model": call.req.model,
            "choices": [_choice(i, gen, *parsed[i]) for i, gen in enumerate(gens)],
            "prompt_token_ids": list(call.prompt_ids),
            "usage": _usage(call, sum(len(g.token_ids) for g in gens)),
            "system_fingerprint": f"mas-trainer:{call.decision.policy}",
            "policy": call.decision.policy,  # which policy answered: `model` echoes what the client asked for
            **({"run_id": call.run_id} if call.run_id else {}),
        }

    def stream(self, call: _Call) -> _Chunks:
        return _Chunks(call)


def _chat_request(body: dict[str, Any]) -> tuple[ChatRequest, _Wire]:
    return ChatRequest.model_validate(body), _ChatWire()


class _Chunks:
    """The server-sent events of one streamed call, choice by choice: the role, the text, then the
    tool calls and the finish with the token ids and log-probs."""

    def __init__(self, call: _Call) -> None:
        self.call = call
        self.base = {"id": f"chatcmpl-{call.call_id}", "object": "chat.completion.chunk", "created": int(call.start),
                     "model": call.req.model}
        # tool calls are known only once the whole text is: buffer it when tools are active
        self.buffered = bool(call.tools) and not call.req.structured()
        self.gens: list[Generation | None] = [None] * call.params.n
        self.parsed: list[tuple[str | None, list[dict]]] = [(None, [])] * call.params.n
        self.started: set[int] = set()

    def chunk(self, choices: list[dict], **extra: Any) -> str:
        return f"data: {json.dumps({**self.base, 'choices': choices, **extra})}\n\n"

    def events(self, d: Delta) -> str:
        i, out = d.index, []
        if i not in self.started:
            self.started.add(i)
            out.append(self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
        if d.text and not self.buffered:
            out.append(self.chunk([{"index": i, "delta": {"content": d.text}, "finish_reason": None}]))
        if d.generation is not None:
            gen = self.gens[i] = d.generation
            content, tool_calls = self.parsed[i] = self.call.content(gen)
            if self.buffered and content:
                out.append(self.chunk([{"index": i, "delta": {"content": content}, "finish_reason": None}]))
            for k, tc in enumerate(tool_calls):
                out.append(self.chunk([{"index": i, "delta": {"tool_calls": [{"index": k, **tc}]}, "finish_reason": None}]))
            c = _choice(i, gen, content, tool_calls)
            out.append(self.chunk([{"index": i, "delta": {}, "finish_reason": c["finish_reason"], "token_ids": c["token_ids"],
                                    "logprobs": c["logprobs"]}]))
        return "".join(out)

    def failed(self, message: str, code: str | None) -> str:
        return f"data: {json.dumps(error_body(message, code=code, kind='server_error'))}\n\n"

    def end(self) -> str:
        usage = _usage(self.call, sum(len(g.token_ids) for g in self.gens if g is not None))
        return (self.chunk([], usage=usage) if self.call.req.include_usage() else "") + "data: [DONE]\n\n"


class Gateway:
    def __init__(self, router: Router | None = None, ledger: Ledger | None = None, *, default_max_tokens: int = 256,
                 max_string_length: int = 200, max_items: int = 16, api_key: str | None = None,
                 sampling: RolloutSampling | None = None, rollouts: bool = False, limits: RequestLimits | None = None) -> None:
        self.router = router or Router()
        self.ledger = ledger or Ledger()
        self.backends: dict[str, PolicyBackend] = {}
        self.default_max_tokens = default_max_tokens
        self.max_string_length = max_string_length
        self.max_items = max_items
        self.api_key = api_key
        self.rollouts = rollouts
        self.limits = limits or RequestLimits()
        # Owned by the session when there is one; a gateway alone (serve) never reseeds it.
        self.sampling = sampling or RolloutSampling()
        self.flights = Flights()
        # set by the HTTP server: told which connections carried an admitted request
        self.on_admitted: Callable[[Any], None] | None = None
        # serve --record: keeps each served call (mas_trainer.production.record.Recorder); None keeps nothing
        self.recorder: Recorder | None = None
        self.app = self._build_app()

    def add_policy(self, name: str, backend: PolicyBackend) -> None:
        self.backends[name] = backend

    def end_rollouts(self, rollout_ids: Any) -> None:
        """These rollouts ended unfinished: answer their calls in flight 503 now and refuse
        their later ones (from any thread; returns at once)."""
        self.flights.end_rollouts(rollout_ids)

    def close(self, timeout_s: float = 5.0) -> int:
        """Stop accepting calls and answer those in flight 503, waiting until they are answered
        (from any thread but the server's); then the engines can close. Returns how many."""
        return self.flights.close(timeout_s)

    def protection(self) -> str:
        """One line saying who this gateway answers, for the verbs to print."""
        if self.rollouts:
            rest = "the run's key (the app's OPENAI_API_KEY)" if self.api_key else "no key"
            return f"records only calls signed for this run's rollouts (per-run secret); other calls need {rest}"
        return "API key required" if self.api_key else "no API key: anyone who can connect may call it"

    # --- admission -------------------------------------------------------------------------
    def _key_ok(self, request: Request) -> bool:
        return not self.api_key or key_matches(request.headers.get("authorization"), self.api_key)

    def _admit(self, request: Request, bag: dict[str, object], call_id: str | None) -> bool:
        """Whether the call is one of this run's rollout calls; raises for callers refused."""
        rollout = bag.get(A.BAGGAGE_ROLLOUT)
        if self.rollouts and rollout is not None:
            node, node_call, role = (None if bag.get(k) is None else str(bag.get(k))
                                     for k in (A.BAGGAGE_NODE, A.BAGGAGE_NODE_CALL, A.BAGGAGE_ROLE))
            if call_id is None or not rollout_token_ok(bag.get(BAGGAGE_TOKEN), str(rollout), node, node_call, role, call_id):
                raise Refused(403, f"the call names rollout {str(rollout)[:64]!r} without its token: this gateway takes "
                                    "only the calls of rollouts its own run started", kind="permission_error",
                               code="invalid_rollout_token")
        elif not self._key_ok(request):
            raise _unauthorised()
        if self.on_admitted is not None:
            self.on_admitted(request.scope.get("client"))
        return rollout is not None and self.rollouts

    async def _read_body(self, request: Request, limit: int, what: str = "request body") -> bytes:
        declared = request.headers.get("content-length")
        too_large = Refused(413, f"{what} over {limit} bytes", code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:  # h11 checked its form
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        raise _ClientGone
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise Refused(408, f"request body not received within {self.limits.body_timeout_s:g} s", close=True) from None

    def _decode(self, raw: bytes, parse: Callable[[dict[str, Any]], tuple[ChatRequest, _Wire]]) -> tuple[ChatRequest, _Wire]:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise Refused(400, "request body is not valid JSON") from None
        except RecursionError:
            body = None
        if body is None or nested_too_deep(body, self.limits.max_depth):
            raise Refused(400, f"request body nests JSON deeper than {self.limits.max_depth} levels")
        if not isinstance(body, dict):
            raise Refused(400, "request body must be a JSON object")
        try:
            return parse(body)
        except ValidationError as exc:
            raise Refused.invalid(exc) from None

    # --- one request -----------------------------------------------------------------------
    def _params(self, req: ChatRequest) -> SamplingParams:
        schema = json_schema_of(req)
        if schema is not None:
            schema = bound_schema(schema, max_string_length=self.max_string_length, max_items=self.max_items)
        return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p,
                              max_tokens=req.max_completion_tokens or req.max_tokens or self.default_max_tokens,
                              stop=req.stops(), n=req.n, seed=req.seed, json_schema=schema)

    async def _prepare(self, req: ChatRequest, call_id: str, bag: dict[str, object], rollout: bool) -> _Call:
        decision = self.router.route(bag, req.model, self.backends)
        if not rollout:  # only calls tied to one of the run's rollouts are filed or reseeded
            decision = replace(decision, rollout_id=None)
        backend = self.backends.get(decision.policy)
        if backend is None:
            raise UnknownModel(f"policy {decision.policy!r} has no engine; available: {', '.join(sorted(self.backends))}")
        params = self._params(req)
        messages = req.message_dicts()
        tools = req.active_tools()
        context = max_context(backend.engine)
        if context is not None:
            chars = sum(len(json.dumps(m["content"])) if isinstance(m.get("content"), list) else len(m.get("content") or "")
                        for m in messages)
            if chars > context * _MAX_CHARS_PER_TOKEN:
                raise Refused(400, f"messages: {chars} characters cannot fit the model's context of {context} tokens",
                               param="messages", code="context_length_exceeded")
        try:
            prompt_ids = list(await asyncio.to_thread(backend.chat.render, messages, tools))
        except Exception as exc:  # noqa: BLE001 - templates raise anything on odd input; it is the request's fault
            raise Refused(400, f"messages: cannot be rendered by the chat template: {exc}", param="messages") from None
        context = max_context(backend.engine) if context is None else context  # a lazy engine knows it once loaded
        if context is not None:
            room = context - len(prompt_ids)
            if room < 1:
                raise Refused(400, f"messages: the prompt is {len(prompt_ids)} tokens; the model's context is {context} "
                                    "(prompt + completion)", param="messages", code="context_length_exceeded")
            if params.max_tokens > room:
                params = replace(params, max_tokens=room)
        params = self.sampling.apply(params, decision.rollout_id, decision.node or decision.role, branch=decision.branch,
                                     prompt_ids=prompt_ids, call_id=call_id)
        return _Call(req, decision, backend, messages, tools, prompt_ids, params, call_id, time.time())

    async def _complete(self, call: _Call, wire: _Wire) -> dict[str, Any]:
        gens = await call.backend.engine.generate(call.prompt_ids, call.params, turn_id=call.turn_id)
        parsed = [call.content(gen) for gen in gens]
        await self._keep(call, gens, parsed)
        return wire.body(call, gens, parsed)

    async def _keep(self, call: _Call, gens: list[Generation], parsed: list[tuple[str | None, list[dict]]]) -> None:
        """A rollout call's choices go to the ledger; with serve --record, a served call's go on
        disk (fsync'ed, so off the event loop) before the answer goes. Serving keeps nothing else."""
        rollout_id, recorder, run_id = call.decision.rollout_id, self.recorder, call.run_id
        if not rollout_id and (recorder is None or run_id is None):
            return
        end = time.time()
        calls = [_llm_call(call, i, gen, *parsed[i], end) for i, gen in enumerate(gens)]
        if rollout_id:
            for c in calls:
                self.ledger.file(rollout_id, c, claim=call.call_id)
        elif recorder is not None and run_id is not None:
            await asyncio.to_thread(_record, recorder, run_id, calls)

    async def _sse(self, call: _Call, first: Delta, deltas: AsyncGenerator[Delta, None], flight: Flight,
                   chunks: _Stream) -> AsyncIterator[str]:
        try:
            yield chunks.events(first)
            while True:
                try:
                    d = await flight.until_stopped(deltas.__anext__())
                except StopAsyncIteration:
                    break
                yield chunks.events(d)
            done = [g for g in chunks.gens if g is not None]
            await self._keep(call, done, chunks.parsed)
        except Stopped as exc:  # the rollout ended or the gateway is closing: end the stream
            log.info("stream %s stopped: %s", call.call_id, exc)
            yield chunks.failed(str(exc), exc.code)
            return
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            if flight.stopped.done():  # the engine closed under a stopped stream: not a failure
                log.info("stream %s stopped: %s", call.call_id, flight.reason())
            else:
                log.warning("stream %s failed: %s", call.call_id, exc)
            yield chunks.failed(str(exc), None)
            return
        finally:
            flight.done = True
            self._release(call.decision.rollout_id, call.call_id)  # a no-op once filed
            await deltas.aclose()  # on a hang-up too: the engine stops generating now
        yield chunks.end()

    async def _chat(self, request: Request, parse: Callable[[dict[str, Any]], tuple[ChatRequest, _Wire]] = _chat_request) -> Response:
        if sum(len(k) + len(v) for k, v in request.scope["headers"]) > self.limits.max_header_bytes:
            raise Refused(431, f"request headers over {self.limits.max_header_bytes} bytes", code="headers_too_large")
        ctx = propagate.extract(request.headers)
        bag = dict(baggage.get_all(ctx))
        span_ctx = trace.get_current_span(ctx).get_span_context()
        signed_id = format(span_ctx.span_id, "016x") if span_ctx.is_valid else None
        # a graph invocation's calls share its trace id: one recorded run
        trace_id = format(span_ctx.trace_id, "032x") if span_ctx.is_valid else uuid.uuid4().hex
        rollout = self._admit(request, bag, signed_id)
        # a call outside the run's rollouts is filed nowhere: its id is the gateway's own
        call_id = signed_id if rollout and signed_id else uuid.uuid4().hex[:16]
        rollout_id = str(bag.get(A.BAGGAGE_ROLLOUT)) if rollout else None
        try:
            flight = self.flights.open(rollout_id)
        except Stopped as exc:
            raise _stopped(exc) from None
        if rollout_id is not None:
            try:
                self.ledger.claim(rollout_id, call_id)
            except Replayed as exc:
                flight.done = True
                raise Refused(409, str(exc), kind="permission_error", code="rollout_call_replayed", retry=False) from None
        streaming = False
        try:
            raw = await self._read_body(request, self.limits.max_body_bytes)
            req, wire = self._decode(raw, parse) if len(raw) <= _INLINE_BODY_BYTES else await asyncio.to_thread(self._decode, raw, parse)
            response = await _unless_gone(request, flight.until_stopped(self._answer(req, wire, call_id, bag, rollout, flight,
                                                                                     trace_id)))
            streaming = isinstance(response, StreamingResponse)  # its flight ends with the stream
            return response
        except Stopped as exc:  # its rollout ended, or the gateway is closing
            raise _stopped(exc) from None
        except ValidationError as exc:
            raise Refused.invalid(exc) from None
        except UnknownNode as exc:
            raise Refused(404, str(exc), code="node_not_found") from None
        except UnknownModel as exc:
            raise Refused(404, str(exc), param="model", code="model_not_found") from None
        except EngineUnavailable as exc:  # the policy's replica is gone: the caller may retry elsewhere
            raise Refused(503, str(exc), code="engine_unavailable", kind="server_error") from None
        except ValueError as exc:
            raise Refused(400, str(exc)) from None
        except (Refused, _ClientGone):
            raise
        except Exception:
            if flight.stopped.done():  # the engine closed under a call that was being stopped
                raise _stopped(flight.reason()) from None
            raise
        finally:
            if not streaming:
                flight.done = True
                self._release(rollout_id, call_id)

    def _release(self, rollout_id: str | None, call_id: str) -> None:
        if rollout_id is not None:
            self.ledger.release(rollout_id, call_id)

    async def _answer(self, req: ChatRequest, wire: _Wire, call_id: str, bag: dict[str, object], rollout: bool, flight: Flight,
                      trace_id: str) -> Response:
        call = await self._prepare(req, call_id, bag, rollout)
        headers = {POLICY_HEADER: call.decision.policy}
        if self.recorder is not None and not call.decision.rollout_id:
            call.run_id = headers[RUN_HEADER] = trace_id
        if not req.stream:
            return JSONResponse(await self._complete(call, wire), headers=headers)
        deltas = stream_generation(call.backend.engine, call.prompt_ids, call.params, turn_id=call.turn_id)
        try:
            # the first token before the status line: an engine that refuses the request (a
            # bad schema) is still a 4xx, and the time to the first byte is the first token's
            first = await deltas.__anext__()
        except BaseException:
            await deltas.aclose()
            raise
        # from here Starlette cancels the stream when the client hangs up
        return StreamingResponse(self._sse(call, first, deltas, flight, wire.stream(call)), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", **headers})

    # --- HTTP --------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        # /openapi.json is served below, behind the key like everything but the bare health probe
        app = FastAPI(title="mas-trainer gateway", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            return _refuse(Refused(400, describe_errors(exc.errors())))

        @app.exception_handler(Exception)
        async def _crashed(_: Request, exc: Exception) -> JSONResponse:
            log.error("request failed", exc_info=exc)
            return JSONResponse(error_body(f"internal error: {type(exc).__name__}", kind="server_error"), status_code=500)

        @app.get("/health")
        async def _health(request: Request) -> dict:
            # a bare liveness probe for anyone; what is served only for key holders
            if not self._key_ok(request):
                return {"status": "ok"}
            return {"status": "ok", "policies": sorted(self.backends)}

        @app.get("/openapi.json")
        async def _openapi(request: Request):  # type: ignore[no-untyped-def]
            return app.openapi() if self._key_ok(request) else _refuse(_unauthorised())

        @app.get("/v1/models")
        async def _models(request: Request):  # type: ignore[no-untyped-def]
            if not self._key_ok(request):
                return _refuse(_unauthorised())
            names = sorted(set(self.backends) | set(self.router.model_routes))
            return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "mas-trainer", "created": 0} for n in names]}

        @app.post("/v1/chat/completions")
        async def _chat(request: Request) -> Response:
            return await _answered(self._chat(request))

        @app.post("/v1/responses")
        async def _responses(request: Request) -> Response:
            return await _answered(self._chat(request, parse_responses))

        @app.post("/v1/feedback")
        async def _feedback(request: Request) -> Response:
            return await _answered(self._recording(request, FEEDBACK))

        @app.post("/v1/runs")
        async def _runs(request: Request) -> Response:
            return await _answered(self._recording(request, GRAPH_RUN))

        return app

    async def _recording(self, request: Request, endpoint: Endpoint) -> Response:
        """One of serve --record's endpoints, behind the key like everything else."""
        if not self._key_ok(request):
            raise _unauthorised()
        if self.recorder is None:
            raise Refused(404, "this server records nothing (start it with --record)", code="not_recording")
        body = await self._read_body(request, endpoint.max_bytes, endpoint.what)
        return JSONResponse(await endpoint.handle(self.recorder, body))


async def _answered(work: Awaitable[Response]) -> Response:
    """The response, or the one for a refusal; a client gone gets no answer."""
    try:
        return await work
    except Refused as exc:
        return _refuse(exc)
    except _ClientGone:
        log.info("client went away; its request was dropped")
        return Response(status_code=499)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects meanwhile (then _ClientGone).

    Starlette cancels nothing when a client of a plain response hangs up; without this an
    abandoned request would keep its rows in the engine's batch to the last token.
    """
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    watcher.add_done_callback(lambda w: None if w.cancelled() or w.exception() else task.cancel())
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            task.uncancel()
            raise _ClientGone from None
        raise
    finally:
        watcher.cancel()


def _refuse(refused: Refused) -> JSONResponse:
    # The client gets the reason, but apps and their libraries often swallow errors (a
    # retry, a fallback): the log is where a user sees why calls went unanswered.
    log.info("refused a request (%d): %s", refused.status, refused.body["error"]["message"])
    # close: the connection's deadline is past. A refused body that was not read is drained by
    # the server (bounded by the read deadline): closing at once would reset the connection
    # and the client could lose the response before it finished sending.
    # retry=False: `x-should-retry: false`, which the OpenAI client obeys (it retries 5xx by default)
    headers = {**({"connection": "close"} if refused.close else {}), **({} if refused.retry else {"x-should-retry": "false"})}
    return JSONResponse(refused.body, status_code=refused.status, headers=headers or None)


def _unauthorised() -> Refused:
    return Refused(401, "invalid or missing API key", kind="authentication_error", code="invalid_api_key")


def _stopped(exc: Stopped) -> Refused:
    # retrying cannot help: the rollout is over, or the whole run is
    return Refused(503, str(exc), code=exc.code, kind="server_error", retry=False)


def _record(recorder: Recorder, run_id: str, calls: list[LLMCall]) -> None:
    for c in calls:
        recorder.record(run_id, c)


def _usage(call: _Call, completion_tokens: int) -> dict[str, int]:
    n = len(call.prompt_ids)
    return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}


def _finish_reason(gen: Generation, tool_calls: list[dict]) -> str | None:
    # a call cut by max_tokens says so, as OpenAI's do: its arguments may be incomplete JSON
    return "tool_calls" if tool_calls and gen.finish_reason != "length" else gen.finish_reason


def _choice(i: int, gen: Generation, content: str | None, tool_calls: list[dict]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": i,
        "message": message,
        "finish_reason": _finish_reason(gen, tool_calls),
        "token_ids": list(gen.token_ids),
        "logprobs": {"content": token_logprobs(gen.token_ids, gen.logprobs)},
    }


def _llm_call(call: _Call, i: int, gen: Generation, content: str | None, tool_calls: list[dict], end: float) -> LLMCall:
    d = call.decision
    return LLMCall(id=choice_id(call.call_id, i), node_id=d.node_call_id, node=d.node, role=d.role, policy=d.policy,
                   trainable=d.trainable, messages=call.messages, output_text=content, tool_calls=tool_calls,
                   tools=list(call.tools or []), prompt_ids=list(call.prompt_ids), response_ids=list(gen.token_ids),
                   response_logprobs=list(gen.logprobs), finish_reason=_finish_reason(gen, tool_calls),
                   model=call.req.model, start_time=call.start, end_time=end)
