"""Chat rendering over the bundled ChatML template and tool-call parsing."""

from __future__ import annotations

import json

import pytest

from mas_trainer.engines.chat import HFChatFormat, normalize_messages, parse_tool_calls, unparsed_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": "and Rome?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
]


@pytest.fixture(scope="module")
def fmt():
    pytest.importorskip("transformers")
    from mas_trainer.engines.models import load_tokenizer

    return HFChatFormat(load_tokenizer("tiny"))


def test_render_full_conversation(fmt):
    text = fmt.render_text(CONVERSATION, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\nYou can call functions.")
    assert '"name": "get_weather"' in text and "<tool_call>" in text  # the tools section
    assert "<|im_start|>user\nWeather in Paris\nand Rome?<|im_end|>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call><|im_end|>'
    ) in text
    # consecutive tool results become one user turn the ChatML model understands
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = fmt.render(CONVERSATION, TOOLS)
    assert ids == fmt.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(1) == text.count("<|im_start|>")  # no extra BOS


def test_render_without_tools_keeps_default_system_prompt(fmt):
    text = fmt.render_text([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "You can call functions" not in text


def test_tools_without_system_message_and_developer_role():
    msgs = normalize_messages([{"role": "user", "content": "Hi"}], TOOLS)
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    msgs = normalize_messages([{"role": "developer", "content": "Rules"}, {"role": "user", "content": "Hi"}])
    assert msgs == [{"role": "system", "content": "Rules"}, {"role": "user", "content": "Hi"}]


def test_unsupported_content_is_rejected():
    with pytest.raises(ValueError, match="image_url"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_native_tool_templates_get_tools_passed_through():
    class Tok:
        chat_template = "{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}[{{ c.function.arguments.city }}]{% endfor %};{% endfor %}{{ tools | length }}"

        def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False):
            import jinja2

            return jinja2.Template(self.chat_template).render(messages=messages, tools=tools or [])

    fmt = HFChatFormat(Tok())
    assert fmt.native_tools
    text = fmt.render_text(CONVERSATION[2:3], TOOLS)
    assert text == "assistant:[Paris][Rome];1"  # arguments handed to the template as objects


def test_parse_extracts_calls_with_unique_ids():
    text = (
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert all(isinstance(c["function"]["arguments"], str) for c in calls)


def test_parse_only_calls_gives_none_content():
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": "{}"}


def test_parse_keeps_malformed_calls_as_content():
    text = 'Oops <tool_call>{"name": "f", "arguments": {</tool_call> done'
    assert parse_tool_calls(text, TOOLS) == (text, [])
    assert parse_tool_calls("<tool_call>[1, 2]</tool_call>") == ("<tool_call>[1, 2]</tool_call>", [])
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    assert parse_tool_calls("") == ("", [])


def test_parse_bare_json_call_only_with_tools():
    bare = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    content, calls = parse_tool_calls(bare, TOOLS)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parse_tool_calls(bare) == (bare, [])
    assert parse_tool_calls('{"name": "Bob", "age": 3}', TOOLS) == ('{"name": "Bob", "age": 3}', [])


def test_a_call_object_that_does_not_parse_is_a_call_with_its_raw_arguments():
    """What a forced call's grammar writes, cut by max_tokens (or holding a raw control character):
    the app gets the tool call with the arguments as written, never the call as plain text."""
    def parsed(text: str) -> tuple[str | None, list]:
        content, calls = parse_tool_calls(text, TOOLS)
        return content, [c["function"] for c in calls]

    weather = {"name": "get_weather"}
    assert parsed('{"name": "get_weather", "arguments": {"city": "Par') == (None, [{**weather, "arguments": '{"city": "Par'}])
    assert parsed('{"name": "get_weather", "arguments": {"city": "a\tb"}}') == (None, [{**weather, "arguments": '{"city": "a\tb"}'}])
    assert parsed('{"name": "get_weather", "arguments": {"city": "Oslo"}') == (None, [{**weather, "arguments": '{"city": "Oslo"}'}])
    for before_arguments in ('{"name": "get_weather", "argu', '{"name": "get_weather"', '{"name": "get_w'):
        assert parsed(before_arguments) == (None, [{**weather, "arguments": ""}])
    # text that is not one call object of one of the tools stays text
    for text in ('{"name": "other", "arguments": {"x": 1', '{"name": "get_weather", "arguments": {}} and more',
                 '{"name": "get_weather"} and more', '{"name": "Bob", "age": 3'):
        assert parsed(text) == (text, [])


def test_unparsed_tool_calls_are_counted():
    def count(text: str, tools=TOOLS) -> int:
        return unparsed_tool_calls(*parse_tool_calls(text, tools), tools or [])

    assert count('{"name": "get_weather", "arguments": {"city": "Oslo"}}') == 0
    assert count('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>') == 0
    assert count('{"name": "get_weather", "arguments": {"city": "Par') == 1
    assert count('{"name": "get_weather", "arguments": {"city": "a\tb"}}') == 1
    assert count('{"name": "get_w') == 1  # cut before the arguments: none written
    assert count('Oops <tool_call>{"name": "f", "arguments": {</tool_call> and <tool_call>{') == 2
    assert count('{"name": "other", "arguments": {"x": 1') == 1  # a call object left as text
    assert count("plain answer") == count("a <tool_call> in prose, no tools offered", None) == 0


def test_hf_format_parse_is_the_shared_parser(fmt):
    content, calls = fmt.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert content is None and calls[0]["function"]["arguments"] == '{"x": 1}'
