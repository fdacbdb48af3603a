"""Text of a growing token sequence, released as soon as it is final.

Shared by the engines that stream: decoding token by token would split multi-byte
characters and, with SentencePiece-style tokenizers, drop the spaces a token carries at its
start. So each new token is decoded together with a few before it (as vLLM does) and only
the text beyond theirs is new. Text that could be the start of a stop string is held back
until the next tokens show it is not one, since the final text ends before the stop.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["TextStream"]


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = (), skip: frozenset[int] = frozenset()) -> None:
        self._decode = decode
        self._stops = [s for s in stops if s]
        self._skip = skip  # end-of-turn ids: sampled, never text
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] is the context new tokens are decoded after
        self._read = 0
        self._text = ""  # decoded so far
        self._sent = 0  # characters of _text already released

    def push(self, token: int) -> str:
        """Add one sampled token; return the text now known to be final ('' if none)."""
        if token in self._skip:
            return ""
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):  # else: a character still incomplete
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        end = self._final_end()
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent:end], end
        return out

    def finish(self, final_text: str) -> str:
        """The rest of the choice's final text (the engine's own decode, stop strings cut)."""
        sent = self._text[: self._sent]
        self._sent = len(final_text)
        # The final decode can differ from the incremental one only in how it cleans up
        # spaces; what was sent cannot be taken back, so only a consistent rest is added.
        return final_text[len(sent):] if final_text.startswith(sent) else ""

    def _final_end(self) -> int:
        """How much of the text is final: all of it but a tail that begins some stop string,
        and nothing from the first complete stop string on (the final text ends there)."""
        text, end = self._text, len(self._text)
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0:
                end = min(end, at)
                continue
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    end = min(end, len(text) - k)
                    break
        return end
