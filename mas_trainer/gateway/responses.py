"""The Responses API (`POST /v1/responses`) on the chat completions path.

A Responses request becomes the `ChatRequest` the chat path takes (instructions and input items
become chat messages, flat function tools the chat tools, `text.format` the `response_format`),
so routing, sampling seeds, the engine and the records filed for training are the chat path's:
a turn is the same turn whichever endpoint asked for it. Only the answer is spoken differently:
a `response` object (a message item, function_call items), or its event stream. Like a chat
completion, it carries the engine's own tokens as extra fields (`prompt_token_ids`, `token_ids`,
`logprobs`) and the policy that answered.

The gateway keeps nothing between requests: `previous_response_id`, `conversation`, stored
prompts and `background` are refused in one line (send the whole input); `store` is accepted
and nothing is stored. Reasoning items in the input are left out of the prompt (this server
gives none back), and `reasoning` and `include` ask for nothing it has.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from mas_trainer.engines.base import Delta, Generation
from mas_trainer.gateway.protocol import (ChatRequest, FunctionCallItem, FunctionCallOutputItem, InputMessage, Refused,
                                          ResponsesRequest, token_logprobs)
from mas_trainer.gateway.router import RouteDecision

__all__ = ["parse_request", "ResponsesWire", "ResponseEvents"]

Parsed = tuple[str | None, list[dict[str, Any]]]

# the API's stateful parts: why each is refused and what to send instead
_STATEFUL = {
    "previous_response_id": "this gateway keeps no responses (it is stateless): send the whole conversation as input",
    "conversation": "this gateway keeps no conversations (it is stateless): send the whole conversation as input",
    "prompt": "this gateway keeps no stored prompts: send instructions and input instead",
    "background": "this gateway answers within the request: leave background out",
}


class Call(Protocol):
    """What an answer needs of an accepted call (server.py's `_Call`)."""

    req: ChatRequest
    decision: RouteDecision
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    call_id: str
    start: float
    run_id: str | None

    def content(self, gen: Generation) -> Parsed: ...


def parse_request(body: dict[str, Any]) -> tuple[ChatRequest, ResponsesWire]:
    """The chat request a Responses request body asks for, and how to answer it. Raises pydantic's
    ValidationError (the gateway's 400 naming the field) or Refused."""
    req = ResponsesRequest.model_validate(body)
    for name, why in _STATEFUL.items():
        if getattr(req, name) not in (None, False):
            raise Refused(400, f"{name}: {why}", param=name, code="unsupported_parameter", retry=False)
    messages = _messages(req)
    if not messages:
        raise Refused(400, "input: no message or function call item (reasoning items alone are no prompt)", param="input")
    fmt = req.text.format if req.text is not None else None
    choice = req.tool_choice
    return ChatRequest.model_validate({
        "model": req.model, "messages": messages, "temperature": req.temperature, "top_p": req.top_p,
        "max_completion_tokens": req.max_output_tokens, "seed": req.seed, "stream": req.stream,
        "tools": [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters", "strict"},
                                                                exclude_none=True)} for t in req.tools or []] or None,
        "tool_choice": choice if choice is None or isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}},
        "response_format": None if fmt is None else {"type": fmt.type} if fmt.type != "json_schema" else {
            "type": "json_schema", "json_schema": fmt.model_dump(include={"name", "description", "schema_", "strict"}, by_alias=True,
                                                                 exclude_none=True)},
    }), ResponsesWire(req)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's instructions and input as chat messages: function_call items join the assistant
    message before them (as the chat API puts text and tool calls in one message), outputs are tool messages."""
    out: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for item in [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input:
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": _content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output)})
    return out


def _content(content: str | list[Any]) -> str | list[dict[str, Any]]:
    return content if isinstance(content, str) else [p.model_dump(include={"type", "text", "refusal"}) for p in content]


def _message(call_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": f"msg_{call_id}", "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _function_call(tool_call: dict[str, Any]) -> dict[str, Any]:
    fn = tool_call["function"]
    return {"id": "fc_" + tool_call["id"].removeprefix("call_"), "type": "function_call", "call_id": tool_call["id"],
            "name": fn["name"], "arguments": fn["arguments"], "status": "completed"}


class ResponsesWire:
    """How one Responses request is answered: the response object, or its event stream."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req

    def response(self, call: Call, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The response object around `output`, echoing the request as OpenAI does."""
        req = self.req
        fmt = req.text.format if req.text is not None else None
        choice = req.tool_choice
        return {
            "id": f"resp_{call.call_id}", "object": "response", "created_at": int(call.start), "status": status,
            "completed_at": None if status == "in_progress" else int(time.time()), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "model": req.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature, "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
            "store": False,  # whatever was asked: nothing is kept
            "policy": call.decision.policy,  # which policy answered: `model` echoes what the client asked for
            **({"run_id": call.run_id} if call.run_id else {}),
        }

    def body(self, call: Call, gens: list[Generation], parsed: list[Parsed]) -> dict[str, Any]:
        (gen,), ((content, tool_calls),) = gens, parsed  # the API has no `n`: one choice
        status = "incomplete" if gen.finish_reason == "length" else "completed"  # cut by max_output_tokens, as chat says
        output = [_message(call.call_id, content, status)] if content is not None and (content or not tool_calls) else []
        output += [_function_call(tc) for tc in tool_calls]
        n, m = len(call.prompt_ids), len(gen.token_ids)
        return {**self.response(call, status, output),
                "usage": {"input_tokens": n, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                          "output_tokens": m, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n + m},
                "prompt_token_ids": list(call.prompt_ids), "token_ids": list(gen.token_ids),
                "logprobs": {"content": token_logprobs(gen.token_ids, gen.logprobs)}}

    def stream(self, call: Call) -> ResponseEvents:
        return ResponseEvents(self, call)


class ResponseEvents:
    """The server-sent events of one streamed response: created, the message's text as it is sampled
    (with tools active, once the whole text is known: only then are the function calls), each
    function call, then `response.completed` (or `.incomplete`) with the whole response."""

    def __init__(self, wire: ResponsesWire, call: Call) -> None:
        self.wire, self.call = wire, call
        self.gens: list[Generation | None] = [None]
        self.parsed: list[Parsed] = [(None, [])]
        self.buffered = bool(call.tools) and not call.req.structured()
        self.sequence = 0
        self.started = self.opened = False

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _open(self) -> list[str]:
        self.opened = True
        item = {**_message(self.call.call_id, "", "in_progress"), "content": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=item["id"], output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]

    def _delta(self, text: str) -> str:
        return self._event("response.output_text.delta", item_id=f"msg_{self.call.call_id}", output_index=0, content_index=0,
                           delta=text, logprobs=[])

    def events(self, d: Delta) -> str:
        out: list[str] = []
        if not self.started:
            self.started = True
            shell = self.wire.response(self.call, "in_progress", [])
            out += [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]
        if not self.buffered:
            out += [] if self.opened else self._open()
            out += [self._delta(d.text)] if d.text else []
        if d.generation is not None:
            gen = self.gens[0] = d.generation
            parsed = self.parsed[0] = self.call.content(gen)
            body = self.wire.body(self.call, [gen], [parsed])
            for index, item in enumerate(body["output"]):
                out += self._message_done(index, item) if item["type"] == "message" else self._call_done(index, item)
            out.append(self._event(f"response.{body['status']}", response=body))
        return "".join(out)

    def _message_done(self, index: int, item: dict[str, Any]) -> list[str]:
        part = item["content"][0]
        out = [] if self.opened else [*self._open(), *([self._delta(part["text"])] if part["text"] else [])]
        return out + [
            self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                        logprobs=[]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
            self._event("response.output_item.done", output_index=index, item=item)]

    def _call_done(self, index: int, item: dict[str, Any]) -> list[str]:
        return [self._event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"],
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def failed(self, message: str, code: str | None) -> str:
        return self._event("error", code=code, message=message, param=None)

    def end(self) -> str:
        return ""  # a Responses stream ends with its last event, no [DONE]
