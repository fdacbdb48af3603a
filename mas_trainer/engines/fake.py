"""A deterministic engine and chat format without torch, for tests and overhead benchmarks.

They let the gateway, tracer and controller be exercised end to end in milliseconds and
on machines without torch, while keeping the shapes the real engine produces (token ids,
one log-prob per id, finish reasons, `n` choices). `FakeChatFormat` parses with the very
function `HFChatFormat` uses, so tool-call handling is tested once, for both.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Callable, Sequence

from mas_trainer.engines.base import Delta, FinishReason, Generation, SamplingParams, cut_at_stop
from mas_trainer.engines.chat import parse_tool_calls
from mas_trainer.engines.streaming import TextStream

__all__ = ["FakeEngine", "FakeChatFormat", "byte_ids", "byte_text"]

_OFFSET = 3  # ids 0-2 are reserved (pad, begin, end of turn), as in ChatML vocabularies
END_OF_TURN_ID = 2


def byte_ids(text: str) -> list[int]:
    """A toy tokenisation: one id per UTF-8 byte, shifted past the reserved ids."""
    return [b + _OFFSET for b in text.encode("utf-8")]


def byte_text(ids: Sequence[int]) -> str:
    """Inverse of `byte_ids` (reserved ids are dropped, broken UTF-8 replaced)."""
    return bytes(i - _OFFSET for i in ids if _OFFSET <= i < 256 + _OFFSET).decode("utf-8", errors="replace")


class FakeEngine:
    """`Engine` that answers after `latency_s` with a fixed or prompt-derived reply.

    `reply` is a string, or a callable `(prompt_ids, params, choice_index) -> str` for
    replies that depend on the prompt (e.g. to script tool calls). With a `tokenizer` the
    reply is tokenised by it, otherwise by `byte_ids`. Every token gets log-prob -0.5 and
    the reply ends with the end-of-turn id, like a real model that stopped by itself;
    `max_tokens` cuts it (finish "length") and `stop` strings cut the text (finish "stop").
    `token_latency_s` adds that much per generated token, as a real decoder does: `stream`
    hands each token out as its time comes, so tests can tell streaming from buffering.
    `max_context`, when set, is the context the gateway caps requests by.
    """

    def __init__(
        self,
        model_name: str = "fake",
        latency_s: float = 0.001,
        reply: str | Callable[[Sequence[int], SamplingParams, int], str] = "Hello from the fake engine.",
        tokenizer: Any = None,
        token_latency_s: float = 0.0,
        max_context: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.latency_s = latency_s
        self.token_latency_s = token_latency_s
        if max_context is not None:
            self.max_context = max_context
        self.reply = reply
        self.tokenizer = tokenizer
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.closed = False

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return byte_ids(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return byte_text(ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _eos(self) -> int:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        return END_OF_TURN_ID

    def _one(self, prompt_ids: Sequence[int], params: SamplingParams, index: int) -> Generation:
        text = self.reply(prompt_ids, params, index) if callable(self.reply) else self.reply
        ids = self._encode(text) + [self._eos()]
        reason: FinishReason = "stop"
        if len(ids) > params.max_tokens:
            ids, reason = ids[: params.max_tokens], "length"
        out, cut = cut_at_stop(self._decode([i for i in ids if i != self._eos()]), params.stop)
        if cut:
            reason = "stop"
        return Generation(ids, [-0.5] * len(ids), out, reason, list(prompt_ids))

    def _choices(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[Generation]:
        """The call's `params.n` choices, the call counted in `calls`."""
        if self.closed:
            raise RuntimeError(f"engine {self.model_name!r} is closed")
        self.calls.append((list(prompt_ids), params))
        return [self._one(prompt_ids, params, i) for i in range(params.n)]

    def generate_sync(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[Generation]:
        """Blocking variant (sleeps `latency_s`)."""
        gens = self._choices(prompt_ids, params)
        time.sleep(self.latency_s)
        return gens

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None
    ) -> list[Generation]:
        """`params.n` identical-shaped choices after `latency_s` (non-blocking sleep)."""
        gens = self._choices(prompt_ids, params)
        await asyncio.sleep(self.latency_s + self.token_latency_s * max(len(g.token_ids) for g in gens))
        return gens

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None
    ) -> AsyncIterator[Delta]:
        """The same choices as `generate`, token by token (all choices advance together)."""
        gens = self._choices(prompt_ids, params)
        texts = [TextStream(self._decode, params.stop, frozenset({self._eos()})) for _ in gens]
        await asyncio.sleep(self.latency_s)
        for step in range(max(len(g.token_ids) for g in gens)):
            await asyncio.sleep(self.token_latency_s)
            for i, gen in enumerate(gens):
                if step < len(gen.token_ids) - 1:
                    yield Delta(i, [gen.token_ids[step]], texts[i].push(gen.token_ids[step]))
                elif step == len(gen.token_ids) - 1:
                    yield Delta(i, [gen.token_ids[step]], texts[i].finish(gen.text), gen)

    def close(self) -> None:
        self.closed = True


class FakeChatFormat:
    """`ChatFormat` without a tokenizer: the prompt ids are the bytes of the messages' JSON.

    Rendering is deterministic and prefix-friendly enough for routing and ledger tests;
    parsing is the production `parse_tool_calls`.
    """

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        payload = {"messages": messages, "tools": tools} if tools else {"messages": messages}
        return byte_ids(json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str))

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
        return parse_tool_calls(text, tools)
