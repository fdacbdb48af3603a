"""Constrained output is JSON that strict `json.loads` accepts (issue 42, point 3).

xgrammar 0.2.9 writes a string with minLength/maxLength (the gateway bounds every free string)
as a run of any character but quote, backslash and line breaks: a raw tab or U+0001 could end
up in a forced tool call, which strict JSON then refused. Each schema shape is checked two ways,
both through the gateway's own bounding (`bound_schema`): exhaustively, character by character,
with xgrammar's matcher; and by sampling from a tiny model made to prefer control characters.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.chat import HFChatFormat  # noqa: E402
from mas_trainer.engines.grammar import check_schema, json_schema_grammar, schema_key  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.engines.torch_engine import TorchEngine  # noqa: E402
from mas_trainer.gateway.protocol import bound_schema  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from grammar_cases import BOUNDS, SEARCH, forced  # noqa: E402

TOOLS = [SEARCH, {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 6}}, "required": ["text"]}}}]
FORCED = forced(TOOLS)

# shape -> (schema, a prefix that ends inside a string, where any character may come next)
SHAPES = {
    "string": ({"type": "string"}, '"a'),
    "string with its own bounds": ({"type": "string", "minLength": 2, "maxLength": 8}, '"a'),
    "strings in an array": ({"type": "array", "items": {"type": "string"}}, '["a'),
    "nested property": ({"type": "object", "required": ["a"], "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}}}, '{"a": {"b": "x'),
    "nullable string": ({"type": ["string", "null"]}, '"a'),
    "enum holding a tab": ({"enum": ["a\tb", "a c"]}, '"a'),
    "pattern": ({"type": "string", "pattern": "[a-z .]{1,8}"}, '"a'),
    "bounded keys": ({"type": "object", "propertyNames": {"maxLength": 6}, "additionalProperties": {"type": "integer", "maximum": 9},
                      "maxProperties": 2}, '{"a'),
    "forced tool call": (FORCED, '{"name": "search", "arguments": {"query": "a'),
}
CONTROL = [chr(c) for c in range(0x20)]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def compiler(tiny):
    model, tok = tiny
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.get_output_embeddings().weight.shape[0])
    return xgr.GrammarCompiler(info, cache_enabled=False)


@pytest.mark.parametrize("shape", SHAPES)
def test_no_grammar_admits_a_raw_control_character_in_a_string(compiler, shape):
    schema, prefix = SHAPES[shape]
    grammar = compiler.compile_grammar(json_schema_grammar(schema_key(bound_schema(schema, **BOUNDS))))

    def admits(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(prefix), prefix
        return matcher.accept_string(text)

    assert admits(" ")  # the prefix is inside a string that goes on
    assert [hex(ord(c)) for c in CONTROL if admits(c)] == []
    # the enum's tab is written escaped; bounded strings write no escapes at all (as before)
    assert admits("\\t") == (shape == "enum holding a tab")


def test_the_json_object_mode_writes_control_characters_escaped(compiler):
    grammar = compiler.compile_grammar(json_schema_grammar(schema_key(bound_schema({"type": "object"}, **BOUNDS))))
    for c in CONTROL:
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string('{"a": "x') and not matcher.accept_string(c)
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string('{"a": "x\\ty\\u0001"}')


def test_a_pattern_naming_a_control_character_is_refused_in_one_line():
    for pattern in ("a\\tb", "[\\x00-\\x1f]+", "\\n"):
        with pytest.raises(ValueError, match=r"^json_schema pattern .* names a control character .*leave it out$"):
            check_schema({"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}})
    for pattern in ("[\\w\\s]+", "[^\\t]", ".{1,5}", "^\\d+$"):  # classes xgrammar keeps control characters out of
        check_schema({"type": "string", "pattern": pattern})


# --- sampling: a model that prefers control characters -------------------------------------------

@pytest.fixture(scope="module")
def engine():
    """The tiny model with a bias of +12 on every token holding a control character: left free,
    it writes them nearly everywhere; under a grammar, wherever the grammar lets it."""
    model, tok = load_model("tiny", seed=0)
    vocab = model.get_output_embeddings().weight.shape[0]
    control = [i for i in range(len(tok)) if any(ord(ch) < 0x20 for ch in tok.decode([i]))]
    head = torch.nn.Linear(model.config.hidden_size, vocab, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[control] = 12.0
    model.config.tie_word_embeddings = False
    model.lm_head = head
    eng = TorchEngine(model, tok, model_name="tiny", grammar_timeout_s=120)
    yield eng, HFChatFormat(tok)
    eng.close()


def test_the_model_writes_control_characters_when_free(engine):
    eng, chat = engine
    gens = eng.generate_sync(chat.render([{"role": "user", "content": "hi"}]), SamplingParams(n=8, max_tokens=8, seed=0))
    assert all(sum(ord(c) < 0x20 for c in g.text) >= 4 for g in gens), [g.text for g in gens]


def test_every_sampled_output_passes_strict_json_and_its_schema(engine):
    eng, chat = engine
    prompt = chat.render([{"role": "user", "content": "hi"}])

    async def sample(schema: dict) -> list:
        return await eng.generate(prompt, SamplingParams(n=12, max_tokens=48, seed=1, temperature=1.5, json_schema=schema))

    async def everything() -> list:
        return await asyncio.gather(*(sample(bound_schema(s, **BOUNDS)) for s, _ in SHAPES.values()))

    for shape, gens in zip(SHAPES, asyncio.run(everything())):
        schema = bound_schema(SHAPES[shape][0], **BOUNDS)
        for g in gens:
            assert g.finish_reason == "stop", (shape, g.text)
            value = json.loads(g.text)  # strict: a raw control character raises
            jsonschema.validate(value, schema)


def test_a_forced_tool_call_comes_back_as_a_tool_call_cut_or_whole(engine):
    """Whole: arguments that strict JSON accepts, finish_reason tool_calls. Cut by max_tokens: still
    a tool call (never plain text), its arguments the raw text the model wrote, finish_reason length."""
    from mas_trainer.gateway import Gateway, GatewayServer, PolicyBackend

    eng, chat = engine
    gw = Gateway(api_key=None, max_string_length=BOUNDS["max_string_length"])
    gw.add_policy("tiny", PolicyBackend(eng, chat))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required",
            "n": 4, "seed": 3}
    with GatewayServer(gw) as server:
        whole = httpx.post(f"{server.base_url}/chat/completions", json={**body, "max_tokens": 64}, timeout=120).json()
        cut = httpx.post(f"{server.base_url}/chat/completions", json={**body, "max_tokens": 9}, timeout=120).json()
    for choice in whole["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in ("search", "note")
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    for choice in cut["choices"]:
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in ("search", "note")
        with pytest.raises(ValueError):
            json.loads(call["function"]["arguments"])
