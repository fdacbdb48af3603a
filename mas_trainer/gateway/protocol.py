"""OpenAI chat-completion wire types the gateway accepts, validated with pydantic.

Unknown top-level fields are accepted and ignored (clients send many); malformed known
fields are a 400 with an OpenAI-style error body naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["ChatMessage", "ChatRequest", "error_body", "json_schema_of", "bound_schema"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in v or []:
            if tool.get("type") != "function" or not isinstance(tool.get("function"), dict) or "name" not in tool["function"]:
                raise ValueError("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
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
        return self.tools


def error_body(message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_schema_of(req: ChatRequest) -> dict[str, Any] | None:
    """The schema the output must follow: structured output, or a forced tool call."""
    rf = req.response_format or {}
    if rf.get("type") == "json_object":
        return {"type": "object"}
    if rf.get("type") == "json_schema":
        spec = rf.get("json_schema") or {}
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return schema
    tools = req.active_tools()
    choice = req.tool_choice
    if not tools or choice in (None, "auto"):
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise ValueError(f"tool_choice names unknown function {name!r}")
    elif choice != "required":
        raise ValueError(f"tool_choice must be none, auto, required or a function, got {json.dumps(choice)}")
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def bound_schema(schema: Any, *, max_string_length: int, max_items: int) -> Any:
    """Add maxLength / maxItems where a schema leaves strings and arrays unbounded.

    Constrained decoding guarantees valid JSON only if generation ends; an untrained model
    can keep a string open until max_tokens. Bounds the schema already sets are kept.
    """
    if isinstance(schema, list):
        return [bound_schema(s, max_string_length=max_string_length, max_items=max_items) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_schema(v, max_string_length=max_string_length, max_items=max_items) for k, v in schema.items()}
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds and "maxLength" not in schema and "enum" not in schema and "const" not in schema:
        out["maxLength"] = max_string_length
    if "array" in kinds and "maxItems" not in schema:
        out["maxItems"] = max_items
    return out
