"""What the gateway needs from an engine: token ids in, token ids and log-probs out.

An engine generates for one policy. It knows nothing about HTTP, roles or graphs; the
gateway turns chat requests into prompt ids (with `ChatFormat`) and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

__all__ = ["SamplingParams", "Generation", "Engine", "ChatFormat"]


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI sampling fields, already validated by the gateway."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    # A JSON schema the output must satisfy (response_format json_schema, forced tool
    # choice). None means free text.
    json_schema: dict[str, Any] | None = None
    # Keep generating past the end-of-turn token until max_tokens or a stop string (as in
    # vLLM); for benchmarks that must produce a fixed number of tokens.
    ignore_eos: bool = False


@dataclass
class Generation:
    """One sampled choice.

    `token_ids` are exactly the ids the engine sampled (the stop sequence and the end-of-turn
    token included when they were generated); `logprobs[i]` is log p(token_ids[i]) under the
    policy's raw distribution (temperature 1, no top-p), so a learner can use them as old
    log-probs without a second forward pass. `text` is the decoded text with the stop
    sequence and end-of-turn token removed.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length"]
    prompt_ids: list[int] = field(default_factory=list)


@runtime_checkable
class Engine(Protocol):
    """Generates for one policy. Concurrent `generate` calls are batched together."""

    model_name: str

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None
    ) -> list[Generation]:
        """Return `params.n` generations for one prompt.

        `turn_id` names the LLM call (choice i > 0 is `f"{turn_id}-{i}"`): an engine that
        trains later (a worker group) keeps the turn's tokens under it; others ignore it.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class ChatFormat(Protocol):
    """Turns OpenAI chat messages into prompt ids and model output back into a message."""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]: ...

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
        """Return (content, tool_calls); tool_calls are OpenAI `{id, type, function: {name, arguments}}`."""
        ...
