"""The gateway refuses output schemas too large to compile (400, one line naming the limit)
before any engine sees them; real schemas (tool calls, pydantic models, small enums) pass."""

from __future__ import annotations

import httpx
import pytest

from mas_trainer.engines.fake import FakeChatFormat, FakeEngine
from mas_trainer.gateway import Gateway, GatewayServer, PolicyBackend
from mas_trainer.gateway.protocol import ChatRequest, bound_schema, json_schema_of

BOUNDS = {"max_string_length": 200, "max_items": 16}
MSG = [{"role": "user", "content": "hi"}]


def enum(n: int, width: int = 40) -> dict:
    return {"type": "object", "properties": {"v": {"type": "string", "enum": [f"{i:0{width}d}" for i in range(n)]}}}


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing with a query", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                                         "mode": {"enum": ["fast", "slow", "exact"]}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["query"]}}}


@pytest.mark.parametrize("schema, limit", [
    (enum(8000), "1000 enum/const values"),  # the report's 421 KB schema, which compiled for 64 s
    (enum(1001, 2), "1000 enum/const values"),
    ({"anyOf": [{"const": i} for i in range(1001)]}, "1000 enum/const values"),
    ({"type": "object", "description": "x" * 70_000}, "65536 bytes"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}, "65536 bytes"),
    # under the limit as sent, over it once every string gets its maxLength
    ({"type": "object", "properties": {f"p{i:04d}": {"type": "string"} for i in range(2200)}}, "65536 bytes"),
])
def test_oversized_schemas_are_refused_naming_the_limit(schema, limit):
    with pytest.raises(ValueError) as err:
        bound_schema(schema, **BOUNDS)
    assert limit in str(err.value) and "\n" not in str(err.value)


def test_the_limits_are_the_engines():
    from mas_trainer.engines.grammar import MAX_SCHEMA_BYTES, MAX_SCHEMA_VALUES
    from mas_trainer.gateway.protocol import MAX_SCHEMA_BYTES as GW_BYTES
    from mas_trainer.gateway.protocol import MAX_SCHEMA_VALUES as GW_VALUES

    assert (GW_BYTES, GW_VALUES) == (MAX_SCHEMA_BYTES, MAX_SCHEMA_VALUES) == (65536, 1000)


@pytest.mark.parametrize("schema", [
    enum(1000, 2),
    {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "number", "boolean"][i % 4]} for i in range(60)}},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}}}},
])
def test_real_schemas_pass(schema):
    assert bound_schema(schema, **BOUNDS)["type"] == "object"


def test_forced_tool_calls_over_many_tools_pass_and_too_many_are_refused():
    many = ChatRequest.model_validate({"model": "m", "messages": MSG, "tools": [tool(i) for i in range(128)], "tool_choice": "required"})
    assert len(bound_schema(json_schema_of(many), **BOUNDS)["anyOf"]) == 128  # the most a request may carry
    wide = tool(0)
    wide["function"]["parameters"]["properties"]["mode"]["enum"] = [f"m{i}" for i in range(2000)]
    req = ChatRequest.model_validate({"model": "m", "messages": MSG, "tools": [wide], "tool_choice": "required"})
    with pytest.raises(ValueError, match="1000 enum/const values"):
        bound_schema(json_schema_of(req), **BOUNDS)


def test_the_gateway_answers_400_before_the_engine_sees_the_schema():
    engine = FakeEngine(model_name="fake", latency_s=0.0, reply='{"v": "1"}')  # keeps its calls
    gw = Gateway(api_key=None)
    gw.add_policy("p", PolicyBackend(engine, FakeChatFormat()))
    with GatewayServer(gw) as server:
        url = f"{server.base_url}/chat/completions"

        def post(schema):
            return httpx.post(url, json={"model": "p", "messages": MSG, "response_format": {
                "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}, timeout=60)

        r = post(enum(8000))
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "1000 enum/const values" in message and "\n" not in message
        r = post({"type": "object", "description": "x" * 70_000})
        assert r.status_code == 400 and "65536 bytes" in r.json()["error"]["message"]
        wide = tool(0)
        wide["function"]["parameters"]["properties"]["mode"]["enum"] = [f"m{i}" for i in range(2000)]
        r = httpx.post(url, json={"model": "p", "messages": MSG, "tools": [wide], "tool_choice": "required"}, timeout=60)
        assert r.status_code == 400 and "1000 enum/const values" in r.json()["error"]["message"]
        assert not engine.calls
        r = post(enum(20))
        assert r.status_code == 200 and len(engine.calls) == 1
