"""OpenAI chat-completion and Responses API wire types the gateway accepts, validated with pydantic.

Unknown fields are accepted and ignored (clients send many); every known field is typed
down to its leaves (`response_format.json_schema.schema`, `tool_choice.function.name`,
`messages[i].tool_calls[j].function.arguments`), so a malformed but valid-JSON request is
a 400 naming the field, never an AttributeError deep in the server (a 500).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Mapping, Sequence, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from mas_trainer.engines.grammar import MAX_SCHEMA_BYTES, MAX_SCHEMA_VALUES, check_schema

__all__ = ["ChatMessage", "ChatRequest", "ResponsesRequest", "InputMessage", "FunctionCallItem", "FunctionCallOutputItem",
           "MAX_MESSAGES", "Refused", "error_body", "token_logprobs", "describe_errors", "json_schema_of", "bound_schema",
           "MAX_DEPTH", "MAX_SCHEMA_BYTES", "MAX_SCHEMA_VALUES"]

# JSON nested deeper than this is refused before validation: real requests (tool schemas
# included) stay far below, and deeper values would only exercise recursion limits.
MAX_DEPTH = 64

_Name = Annotated[str, Field(min_length=1, max_length=256)]
# Messages one request may carry (a Responses request's items and instructions count as its messages)
MAX_MESSAGES = 4096


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _TextPart(_Open):
    type: Literal["text", "input_text", "output_text"]
    text: str


class _RefusalPart(_Open):
    type: Literal["refusal"]
    refusal: str


_Part = Annotated[Union[_TextPart, _RefusalPart], Field(discriminator="type")]


class _CalledFunction(_Open):
    name: _Name
    # OpenAI sends a JSON string; a dict is tolerated (some clients replay parsed calls)
    arguments: str | dict[str, Any] = ""


class _ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _CalledFunction


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[_Part] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = None


class _FunctionDef(_Open):
    name: _Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(_Open):
    type: Literal["function"]
    function: _FunctionDef


class _NamedFunction(_Open):
    name: _Name


class _NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: _NamedFunction


class _JsonSchema(_Open):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class _FormatText(_Open):
    type: Literal["text"]


class _FormatJsonObject(_Open):
    type: Literal["json_object"]


class _FormatJsonSchema(_Open):
    type: Literal["json_schema"]
    json_schema: _JsonSchema


_ResponseFormat = Annotated[Union[_FormatText, _FormatJsonObject, _FormatJsonSchema], Field(discriminator="type")]


class _StreamOptions(_Open):
    include_usage: bool | None = None


class ChatRequest(_Open):
    model: _Name
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: Annotated[str, Field(max_length=256)] | list[Annotated[str, Field(max_length=256)]] | None = Field(None)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: _StreamOptions | None = None
    tools: list[_Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | _NamedToolChoice | None = None
    response_format: _ResponseFormat | None = None
    logprobs: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def active_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def structured(self) -> bool:
        """Structured output: the text is the content, never parsed for tool calls."""
        return self.response_format is not None and self.response_format.type != "text"

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# --- the Responses API (`POST /v1/responses`); gateway/responses.py turns it into a ChatRequest

class InputMessage(_Open):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_Part]


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: _Name
    name: _Name
    arguments: str


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: _Name
    output: str | list[_Part]


class _ReasoningItem(_Open):
    type: Literal["reasoning"]


def _item_type(item: Any) -> str:
    # a message may leave out its type (EasyInputMessage)
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if isinstance(kind, str) else "message"


_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
_Item = Annotated[Union[Annotated[InputMessage, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                        Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[_ReasoningItem, Tag("reasoning")]],
                  Discriminator(_item_type)]


class _ResponsesTool(_FunctionDef):
    """The Responses API's function tool: chat's function definition, flat, with its type."""

    type: Literal["function"]


class _ResponsesNamedTool(_NamedFunction):
    type: Literal["function"]


class _TextJsonSchema(_Open):
    type: Literal["json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class _TextConfig(_Open):
    format: Annotated[Union[_FormatText, _FormatJsonObject, _TextJsonSchema], Field(discriminator="type")] | None = None


class ResponsesRequest(_Open):
    """What the gateway takes of a Responses API request; the stateful fields are typed only for
    gateway/responses.py to refuse them by name."""

    model: _Name
    # instructions, when given, are one more message
    input: str | Annotated[list[_Item], Field(min_length=1, max_length=MAX_MESSAGES - 1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # not OpenAI's, vLLM's: sampled runs reproduce
    stream: bool = False
    tools: list[_ResponsesTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | _ResponsesNamedTool | None = None
    text: _TextConfig | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, v: Any) -> Any:
        # before the union: its own error would list every member's complaint about the one item
        for i, item in enumerate(v if isinstance(v, list) else []):
            kind = _item_type(item)
            if kind == "item_reference":
                raise PydanticCustomError("item_reference", "item {i} is an item_reference: this gateway keeps no items "
                                          "(it is stateless); send the item itself", {"i": i})
            if kind not in _ITEMS:
                raise PydanticCustomError("item_type", "item {i} has type {kind}: this gateway takes message, function_call, "
                                          "function_call_output and reasoning items", {"i": i, "kind": repr(kind[:64])})
        return v


def error_body(message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def token_logprobs(token_ids: Sequence[int], logprobs: Sequence[float]) -> list[dict[str, Any]]:
    """The sampled tokens' log-probs in vLLM's `return_tokens_as_token_ids` spelling: exact, and
    read without a tokenizer on the client."""
    return [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in zip(token_ids, logprobs)]


class Refused(Exception):
    """A refused request: its HTTP status and error body. `close`: the connection is closed after
    the answer; `retry=False`: retrying cannot help, and the answer says so."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", close: bool = False, retry: bool = True) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, param=param, code=code, kind=kind)
        self.close, self.retry = close, retry

    @classmethod
    def invalid(cls, exc: ValidationError, status: int = 400, *, retry: bool = True) -> Refused:
        """A body that failed validation: what is wrong, the deepest error's field as `param`."""
        errors = exc.errors()
        deepest = max(errors, key=lambda e: len(e.get("loc", ())), default=None)
        return cls(status, describe_errors(errors), param=None if deepest is None else _loc(deepest), retry=retry)


def _loc(err: Mapping[str, Any]) -> str:
    # pydantic names union members in the location ("str", "list[...]"): not fields
    parts = [str(p) for p in err.get("loc", ()) if p != "body" and not (isinstance(p, str) and ("[" in p or p == "str"))]
    return ".".join(parts) or "body"


def describe_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    # the deepest locations first: for a union they say which member came closest
    parts: list[str] = []
    for err in sorted(errors, key=lambda e: -len(e.get("loc", ()))):
        part = f"{_loc(err)}: {err.get('msg')}"
        if part not in parts:
            parts.append(part)
        if len(parts) == 3:
            break
    return "; ".join(parts)


def json_schema_of(req: ChatRequest) -> dict[str, Any] | None:
    """The schema the output must follow: structured output, or a forced tool call."""
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        return {"type": "object"}
    if rf is not None and rf.type == "json_schema":
        return rf.json_schema.schema_
    tools = req.active_tools()
    choice = req.tool_choice
    if not tools or choice in (None, "auto"):
        return None
    if isinstance(choice, _NamedToolChoice):
        name = choice.function.name
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise ValueError(f"tool_choice.function.name: {name!r} is not one of the request's tools")
    elif choice != "required":  # pragma: no cover - the Literal above admits nothing else
        raise ValueError(f"tool_choice must be none, auto, required or a function, got {json.dumps(choice)}")
    calls = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def bound_schema(schema: Any, *, max_string_length: int, max_items: int) -> Any:
    """Add maxLength / maxItems where a schema leaves strings and arrays unbounded.

    Constrained decoding guarantees valid JSON only if generation ends; an untrained model
    can keep a string open until max_tokens. Bounds the schema already sets are kept.

    Raises ValueError (one line naming the limit; the gateway answers 400) for a schema
    over `MAX_SCHEMA_BYTES` of compact JSON once bounded, or with more than
    `MAX_SCHEMA_VALUES` enum/const values: its grammar would take too long to compile.
    """
    check_schema(schema)  # before copying it: a hostile schema costs no more than the limit
    out = _bounded(schema, max_string_length, max_items)
    check_schema(out)  # the bounds add a few bytes per string and array
    return out


def _bounded(schema: Any, max_string_length: int, max_items: int) -> Any:
    if isinstance(schema, list):
        return [_bounded(s, max_string_length, max_items) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded(v, max_string_length, max_items) for k, v in schema.items()}
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds and "maxLength" not in schema and "enum" not in schema and "const" not in schema:
        out["maxLength"] = max_string_length
    if "array" in kinds and "maxItems" not in schema:
        out["maxItems"] = max_items
    return out
