"""OpenAI chat messages <-> prompt ids and model text <-> OpenAI tool calls.

Small models such as SmolLM2 have plain ChatML templates that know nothing of tools, so
tool use is taught in the system message and spoken as Hermes-style `<tool_call>` tags,
which Qwen-style templates use natively as well. The parsing half is shared with
`FakeChatFormat`, so tests of the gateway see exactly the production parser; this module
therefore imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

__all__ = ["HFChatFormat", "parse_tool_calls", "unparsed_tool_calls", "normalize_messages", "tools_system_prompt",
           "render_tool_call", "new_call_id"]

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# How a call object starts, as the grammar of a forced call writes it: `{"name": "NAME", "arguments": `
_CALL_NAME_RE = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)')  # the name, and its closing quote unless cut
_CALL_ARGUMENTS_RE = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    """An OpenAI-looking tool call id (`call_` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _as_call(obj: Any) -> dict[str, Any] | None:
    """An OpenAI tool call from a decoded `{"name", "arguments"}` object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        arguments = args
    elif isinstance(args, dict):
        arguments = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return _call(obj["name"], arguments)


def _cut_call(text: str, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A call object whose JSON does not parse (cut by max_tokens, or a control character in a
    string) as an OpenAI tool call whose `arguments` are the raw text the model wrote for them
    (empty when it was cut before them; a name cut short counts where one tool's name alone
    starts so). None where text other than the call would be lost."""
    head = _CALL_NAME_RE.match(text)
    if head is None:
        return None
    try:
        name = json.loads(f'"{head.group(1)}"')
    except ValueError:  # cut inside an escape
        return None
    names = [t.get("function", t).get("name") for t in tools]
    if not head.group(2):  # cut inside the name
        started = [n for n in names if isinstance(n, str) and n.startswith(name)]
        return _call(started[0], "") if head.end() == len(text) and len(started) == 1 else None
    if name not in names:
        return None
    rest = text[head.end():]
    arguments = _CALL_ARGUMENTS_RE.match(rest)
    if arguments is None:  # cut between the name and the arguments
        return _call(name, "") if ', "arguments": '.startswith(rest) else None
    rest = rest[arguments.end():]
    try:  # where the model closed the arguments, leniently: only the call's own "}" may follow
        end = json.JSONDecoder(strict=False).raw_decode(rest)[1]
    except ValueError:
        return _call(name, rest)  # never closed
    return _call(name, rest[:end]) if rest[end:].strip() in ("", "}") else None


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into (content, OpenAI tool_calls).

    Every well-formed `<tool_call>{...}</tool_call>` becomes a call and leaves the content;
    a tag whose JSON does not parse stays in the content, so nothing the model said is lost.
    With `tools` given, an output that is nothing but a `{"name", "arguments"}` object is a
    call too (small models often drop the tags; a forced call's grammar writes exactly that),
    even one whose JSON does not parse, if it names one of the tools: its `arguments` are then
    the raw text, as OpenAI hands back arguments that are not valid JSON (`unparsed_tool_calls`
    counts them). Content is None when it is empty and there are calls, as OpenAI returns it.
    """
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        try:
            call = _as_call(json.loads(match.group(1)))
        except ValueError:
            call = None
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    rest = _TOOL_CALL_RE.sub(take, text).strip()
    if not calls and tools and rest.startswith("{"):
        try:
            obj = json.loads(rest)
        except ValueError:
            obj = None
        call = _as_call(obj) if isinstance(obj, dict) and ("arguments" in obj or "parameters" in obj) else None
        if obj is None:
            call = _cut_call(rest, tools)
        if call is not None:
            calls.append(call)
            rest = ""
    if calls and not rest:
        return None, calls
    return rest, calls


def unparsed_tool_calls(output_text: str | None, tool_calls: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
    """How many of one answer's tool calls did not parse: calls whose arguments strict JSON
    refuses (empty ones too: `parse_tool_calls` leaves them empty only for a call cut before
    them), and `<tool_call>` tags or a call object left in the text (only where tools were offered)."""
    bad = 0
    for call in tool_calls:
        arguments = call.get("function", call).get("arguments")
        try:
            if not isinstance(arguments, dict):  # a trace written by other tools may hold them decoded
                json.loads(arguments)
        except (ValueError, TypeError):
            bad += 1
    text = (output_text or "").strip()
    left = text.count("<tool_call>") + bool(text.startswith("{") and _CALL_NAME_RE.match(text))
    return bad + left * bool(tools)


def _text_of(content: Any) -> str:
    """OpenAI content (string, None, or list of parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict) and part.get("type") == "refusal":
                parts.append(str(part.get("refusal", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"unsupported message content part {kind!r}: only text is supported")
        return "\n".join(parts)
    raise ValueError(f"unsupported message content of type {type(content).__name__}")


def render_tool_call(call: dict[str, Any]) -> str:
    """An OpenAI tool call as the `<tool_call>` text the model is asked to produce."""
    fn = call.get("function", call)
    args: Any = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # keep the raw string: the history must show what was really sent
    return "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "</tool_call>"


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tool instructions for templates that cannot render `tools` themselves."""
    functions = [t.get("function", t) for t in tools]
    return (
        "You can call functions. Available functions (JSON schema):\n"
        + json.dumps(functions, ensure_ascii=False)
        + "\nTo call a function, answer with "
        '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>'
        " and nothing else; the result will be given back to you in <tool_response> tags."
    )


def normalize_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[dict[str, str]]:
    """OpenAI messages as plain ChatML `{role, content}` strings.

    `developer` becomes `system`; assistant tool calls become `<tool_call>` text; runs of
    tool results become one `user` message of `<tool_response>` blocks (ChatML templates
    know no `tool` role); tool instructions extend the first system message.
    """
    out: list[dict[str, str]] = []
    pending_tool: list[str] = []

    def flush_tools() -> None:
        if pending_tool:
            out.append({"role": "user", "content": "\n".join(pending_tool)})
            pending_tool.clear()

    for msg in messages:
        role = msg.get("role")
        text = _text_of(msg.get("content"))
        if role == "tool" or role == "function":
            pending_tool.append(f"<tool_response>\n{text}\n</tool_response>")
            continue
        flush_tools()
        if role == "developer":
            role = "system"
        if role == "assistant" and msg.get("tool_calls"):
            calls = "\n".join(render_tool_call(c) for c in msg["tool_calls"])
            text = f"{text}\n{calls}" if text else calls
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"unsupported message role {role!r}")
        out.append({"role": role, "content": text})
    flush_tools()
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that handles tools itself: text content, dict arguments."""
    out = []
    for msg in messages:
        m = dict(msg)
        m["content"] = _text_of(msg.get("content"))
        if m.get("role") == "developer":
            m["role"] = "system"
        if msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                fn = dict(call.get("function", call))
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except ValueError:
                        pass
                calls.append({**call, "type": "function", "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


class HFChatFormat:
    """`ChatFormat` over a Hugging Face tokenizer's chat template.

    Templates that mention `tools` and `tool_calls` (Qwen, Llama 3, ...) get the messages
    and tools natively; plain ChatML templates (SmolLM2) get `normalize_messages`.
    The text is rendered first and encoded without extra special tokens, so the ids are
    exactly the template's text, with no second BOS.
    """

    def __init__(self, tokenizer: Any, *, native_tools: bool | None = None) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        if isinstance(template, dict):
            template = " ".join(template.values())
        self.native_tools = native_tools if native_tools is not None else ("tool_calls" in template and "tools" in template)

    def _template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, prompt: bool) -> str:
        """The chat template's text of `messages` (`prompt`: ending with the assistant prefix)."""
        if self.native_tools:
            return self.tokenizer.apply_chat_template(_native_messages(messages), tools=tools or None,
                                                      add_generation_prompt=prompt, tokenize=False)
        return self.tokenizer.apply_chat_template(normalize_messages(messages, tools), add_generation_prompt=prompt,
                                                  tokenize=False)

    def render_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt as text (what `render` encodes), ending with the assistant prefix."""
        return self._template(messages, tools, prompt=True)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt ids for `messages`, ending with the assistant generation prompt."""
        text = self.render_text(messages, tools)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render_turn(self, messages: list[dict[str, Any]], completion: dict[str, Any],
                    tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids) of one turn, for supervised training: the prompt exactly as
        `render` gives it to the engine; the completion as the tokens the template puts for that
        assistant message (tool calls included), up to and with its end-of-turn token, which is
        where the engine stops generating."""
        prompt = self.render_text(messages, tools)
        full = self._template([*messages, {**completion, "role": "assistant"}], tools, prompt=False)
        if not full.startswith(prompt):  # a template that rewrites earlier turns (e.g. drops reasoning): the content alone
            content, calls = _text_of(completion.get("content")), completion.get("tool_calls") or []
            full = prompt + "\n".join([content] * bool(content) + [render_tool_call(c) for c in calls]) + (self.tokenizer.eos_token or "")
        ids = list(self.tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"])
        eos = self.tokenizer.eos_token_id
        if eos in ids:  # what the template writes after the end of turn (a newline) is not the model's to say
            ids = ids[: len(ids) - ids[::-1].index(eos)]
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]), ids

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) from generated text; see `parse_tool_calls`."""
        return parse_tool_calls(text, tools)
