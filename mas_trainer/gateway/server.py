"""The OpenAI-compatible front: `/v1/chat/completions` and `/v1/models`.

Each request is routed (graph baggage, else model name) to its policy's engine; the chosen
tokens, with their log-probs, go back in the response (vLLM-style `token_ids`,
`prompt_token_ids`, `logprobs`) and are filed in the ledger under the caller's span id so
the controller can join them to the rollout's node calls. How rollout requests sample (the
step's seed, a temperature override) is not the gateway's state: it reads the
`RolloutSampling` of whoever drives the rollouts (the `Session`).

Refused requests (4xx) are logged at INFO on `mas_trainer.gateway.server`.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import baggage, propagate, trace
from pydantic import ValidationError

from mas_trainer.engines.base import ChatFormat, Engine, Generation, SamplingParams
from mas_trainer.gateway.ledger import Ledger
from mas_trainer.gateway.protocol import ChatRequest, bound_schema, error_body, json_schema_of
from mas_trainer.gateway.router import RouteDecision, Router, UnknownModel
from mas_trainer.gateway.sampling import RolloutSampling
from mas_trainer.trace.schema import LLMCall

__all__ = ["PolicyBackend", "Gateway", "GatewayServer"]

log = logging.getLogger(__name__)


@dataclass
class PolicyBackend:
    engine: Engine
    chat: ChatFormat


class Gateway:
    def __init__(
        self,
        router: Router | None = None,
        ledger: Ledger | None = None,
        *,
        default_max_tokens: int = 256,
        max_string_length: int = 200,
        max_items: int = 16,
        api_key: str | None = None,
        sampling: RolloutSampling | None = None,
    ) -> None:
        self.router = router or Router()
        self.ledger = ledger or Ledger()
        self.backends: dict[str, PolicyBackend] = {}
        self.default_max_tokens = default_max_tokens
        self.max_string_length = max_string_length
        self.max_items = max_items
        self.api_key = api_key
        # Owned by the session when there is one; a gateway alone (serve) never reseeds it.
        self.sampling = sampling or RolloutSampling()
        self.app = self._build_app()

    def add_policy(self, name: str, backend: PolicyBackend) -> None:
        self.backends[name] = backend

    # --- one request -----------------------------------------------------------------------
    def _params(self, req: ChatRequest) -> SamplingParams:
        schema = json_schema_of(req)
        if schema is not None:
            schema = bound_schema(schema, max_string_length=self.max_string_length, max_items=self.max_items)
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_tokens=req.max_completion_tokens or req.max_tokens or self.default_max_tokens,
            stop=req.stops(),
            n=req.n,
            seed=req.seed,
            json_schema=schema,
        )

    async def complete(self, req: ChatRequest, headers: dict[str, str]) -> dict[str, Any]:
        ctx = propagate.extract(headers)
        decision = self.router.route(baggage.get_all(ctx), req.model, self.backends)
        backend = self.backends.get(decision.policy)
        if backend is None:
            raise UnknownModel(f"policy {decision.policy!r} has no engine; available: {', '.join(sorted(self.backends))}")
        params = self._params(req)
        messages = req.message_dicts()
        tools = req.active_tools()
        prompt_ids = backend.chat.render(messages, tools)
        start = time.time()
        span_ctx = trace.get_current_span(ctx).get_span_context()
        call_id = format(span_ctx.span_id, "016x") if span_ctx.is_valid else uuid.uuid4().hex[:16]
        params = self.sampling.apply(params, decision.rollout_id, decision.node or decision.role)
        gens = await backend.engine.generate(prompt_ids, params, turn_id=call_id)
        end = time.time()
        choices = []
        for i, gen in enumerate(gens):
            content, tool_calls = backend.chat.parse(gen.text, tools)
            if req.response_format:  # structured output is content, never a tool call
                content, tool_calls = gen.text, []
            choices.append(_choice(i, gen, content, tool_calls))
            if decision.rollout_id:
                self.ledger.file(decision.rollout_id, _llm_call(call_id, i, decision, req, messages, prompt_ids, gen, content, tool_calls, start, end))
        completion_tokens = sum(len(g.token_ids) for g in gens)
        return {
            "id": f"chatcmpl-{call_id}",
            "object": "chat.completion",
            "created": int(start),
            "model": req.model,
            "choices": choices,
            "prompt_token_ids": list(prompt_ids),
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
            "system_fingerprint": f"mas-trainer:{decision.policy}",
        }

    # --- HTTP --------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="mas-trainer gateway", docs_url=None, redoc_url=None)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            return _refuse(400, error_body(_describe(exc.errors())))

        @app.get("/health")
        async def _health() -> dict:
            return {"status": "ok", "policies": sorted(self.backends)}

        def authorised(request: Request) -> JSONResponse | None:
            # a check in the handlers, not a middleware: BaseHTTPMiddleware costs every call
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return _refuse(401, error_body("invalid or missing API key", kind="authentication_error", code="invalid_api_key"))
            return None

        @app.get("/v1/models")
        async def _models(request: Request):  # type: ignore[no-untyped-def]
            if (denied := authorised(request)) is not None:
                return denied
            names = sorted(set(self.backends) | set(self.router.model_routes))
            return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "mas-trainer", "created": 0} for n in names]}

        @app.post("/v1/chat/completions")
        async def _chat(request: Request):  # type: ignore[no-untyped-def]
            if (denied := authorised(request)) is not None:
                return denied
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                return _refuse(400, error_body("request body is not valid JSON"))
            if not isinstance(body, dict):
                return _refuse(400, error_body("request body must be a JSON object"))
            try:
                req = ChatRequest.model_validate(body)
                result = await self.complete(req, dict(request.headers))
            except ValidationError as exc:
                return _refuse(400, error_body(_describe(exc.errors())))
            except UnknownModel as exc:
                return _refuse(404, error_body(str(exc), param="model", code="model_not_found"))
            except ValueError as exc:
                return _refuse(400, error_body(str(exc)))
            if req.stream:
                include_usage = bool((req.stream_options or {}).get("include_usage"))
                return StreamingResponse(_sse(result, include_usage), media_type="text/event-stream")
            return result

        return app


def _refuse(status: int, body: dict[str, Any]) -> JSONResponse:
    # The client gets the reason, but apps and their libraries often swallow errors (a
    # retry, a fallback): the log is where a user sees why calls went unanswered.
    log.info("refused a request (%d): %s", status, body["error"]["message"])
    return JSONResponse(body, status_code=status)


def _describe(errors: list[dict[str, Any]]) -> str:
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts)


def _choice(i: int, gen: Generation, content: str | None, tool_calls: list[dict]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": i,
        "message": message,
        "finish_reason": "tool_calls" if tool_calls else gen.finish_reason,
        "token_ids": list(gen.token_ids),
        # vLLM's `return_tokens_as_token_ids` spelling: exact, needs no tokenizer on the client
        "logprobs": {
            "content": [
                {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(gen.token_ids, gen.logprobs)
            ]
        },
    }


def _llm_call(call_id, i, decision: RouteDecision, req, messages, prompt_ids, gen, content, tool_calls, start, end) -> LLMCall:
    return LLMCall(
        id=call_id if i == 0 else f"{call_id}-{i}",
        node_id=decision.node_call_id,
        node=decision.node,
        role=decision.role,
        policy=decision.policy,
        trainable=decision.trainable,
        messages=messages,
        output_text=content,
        tool_calls=tool_calls,
        prompt_ids=list(prompt_ids),
        response_ids=list(gen.token_ids),
        response_logprobs=list(gen.logprobs),
        finish_reason="tool_calls" if tool_calls else gen.finish_reason,
        model=req.model,
        start_time=start,
        end_time=end,
    )


async def _sse(result: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    base = {"id": result["id"], "object": "chat.completion.chunk", "created": result["created"], "model": result["model"]}

    def chunk(choices: list[dict], **extra: Any) -> str:
        return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

    for c in result["choices"]:
        i, msg = c["index"], c["message"]
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        if msg.get("content"):
            yield chunk([{"index": i, "delta": {"content": msg["content"]}, "finish_reason": None}])
        for k, call in enumerate(msg.get("tool_calls") or []):
            yield chunk([{"index": i, "delta": {"tool_calls": [{"index": k, **call}]}, "finish_reason": None}])
        yield chunk([{"index": i, "delta": {}, "finish_reason": c["finish_reason"], "token_ids": c["token_ids"], "logprobs": c["logprobs"]}])
    if include_usage:
        yield chunk([], usage=result["usage"])
    yield "data: [DONE]\n\n"


class GatewayServer:
    """Runs a gateway with uvicorn on a background thread (127.0.0.1 unless told otherwise)."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.gateway = gateway
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit this; without it a keep-alive response written in two
        # parts waits for the client's delayed ACK (~40 ms a call).
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(gateway.app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, name="mas-gateway", daemon=True)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout_s: float = 10.0) -> "GatewayServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"gateway did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> "GatewayServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
