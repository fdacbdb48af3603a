"""What the gateway needs from an engine: token ids in, token ids and log-probs out.

An engine generates for one policy. It knows nothing about HTTP, roles or graphs; the
gateway turns chat requests into prompt ids (with `ChatFormat`) and back.

Two optional parts, found with `getattr` so engines written before them keep working:
`stream` (tokens as they are sampled; `stream_generation` falls back to `generate`) and
`max_context` (prompt + completion tokens the model takes; the gateway caps `max_tokens`
by it and refuses longer prompts before they reach the engine). Cancellation is asyncio's:
an engine must stop spending compute on a request whose `generate` await (or `stream`
iteration) is cancelled, which is how a client that hangs up frees its rows.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Literal, Protocol, Sequence, runtime_checkable

__all__ = ["SamplingParams", "choice_id", "FinishReason", "Generation", "Delta", "Engine", "StreamingEngine", "ChatFormat", "stream_generation",
           "max_context", "cut_at_stop", "EngineUnavailable", "ENGINE_METRICS", "EngineMeter"]


class EngineUnavailable(RuntimeError):
    """The engine cannot answer now (e.g. its rollout replica died): the gateway answers 503."""


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


FinishReason = Literal["stop", "length"]  # an end-of-turn token or a stop string; max_tokens


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
    finish_reason: FinishReason
    prompt_ids: list[int] = field(default_factory=list)


@dataclass
class Delta:
    """What one choice gained since its last delta: new token ids and the text they complete.

    `text` may lag the tokens (an incomplete UTF-8 character, the start of a stop string is
    held back until it is known not to be one); the deltas of a choice add up to its final
    `Generation.text`. Its last delta carries `generation`, the complete choice.
    """

    index: int
    token_ids: list[int]
    text: str
    generation: Generation | None = None


def choice_id(call_id: str, i: int) -> str:
    """The id of choice `i` of one LLM call: the call's own id for the first, `"{id}-{i}"` after
    (the gateway answers with these ids; worker groups file a choice's tokens under them)."""
    return call_id if i == 0 else f"{call_id}-{i}"


@runtime_checkable
class Engine(Protocol):
    """Generates for one policy. Concurrent `generate` calls are batched together."""

    model_name: str

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None
    ) -> list[Generation]:
        """Return `params.n` generations for one prompt.

        `turn_id` names the LLM call (choice i is `choice_id(turn_id, i)`): an engine that
        trains later (a worker group) keeps the turn's tokens under it; others ignore it.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class StreamingEngine(Engine, Protocol):
    """An engine that can also hand out tokens as they are sampled (optional)."""

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None
    ) -> AsyncIterator[Delta]:
        """Deltas of the `params.n` choices, interleaved, as they are sampled; closing the
        iterator (or cancelling the task iterating it) stops the generation."""
        ...


async def stream_generation(
    engine: Engine, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None
) -> AsyncGenerator[Delta, None]:
    """`engine.stream(...)` where the engine has it, else one delta per choice from `generate`."""
    stream = getattr(engine, "stream", None)
    if stream is not None:
        # aclosing: when our consumer stops early, the engine's stream is closed now (and
        # frees its rows), not whenever the garbage collector finalises it
        async with aclosing(stream(prompt_ids, params, turn_id=turn_id)) as deltas:
            async for delta in deltas:
                yield delta
        return
    for i, gen in enumerate(await engine.generate(prompt_ids, params, turn_id=turn_id)):
        yield Delta(i, list(gen.token_ids), gen.text, gen)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """OpenAI's `stop`: the text before the earliest stop string, which is not returned; and
    whether one was found. Every engine applies it to its decoded text the same way."""
    cuts = [text.find(s) for s in stop if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def max_context(engine: Engine) -> int | None:
    """Tokens (prompt + completion) the engine's model takes, where the engine says."""
    value = getattr(engine, "max_context", None)
    return value if isinstance(value, int) and value > 0 else None


ENGINE_METRICS = {"requests": "engine/requests", "tokens": "engine/tokens", "busy_s": "time/engine_busy_s"}
"""The running totals every engine that serves a worker group reports in `metrics()` (LLM
calls answered, tokens sampled, seconds spent generating), and their step metric names
(a duration is a `time/` metric: runs that differ only in timing compare equal without it)."""


class EngineMeter:
    """An engine's figures since the last `read`, as a step's metrics: the same keys on
    every path (embedded engine, rollout replicas)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seen: dict[str, float] = dict(engine.metrics())

    def read(self) -> dict[str, float]:
        now = self.engine.metrics()
        delta = {k: float(now[k] - self.seen.get(k, 0)) for k in now}
        out = {key: delta[k] for k, key in ENGINE_METRICS.items()}
        if "cached_tokens" in now:  # the embedded engine's prefix cache (runtime.prefix_cache_mb)
            out["engine/prompt_tokens"] = delta["prompt_tokens"]
            out["engine/prefill_tokens_saved"] = delta["cached_tokens"]
            out["engine/prefix_hit_rate"] = delta["cached_tokens"] / delta["prompt_tokens"] if delta["prompt_tokens"] else 0.0
        self.seen = dict(now)
        return out


@runtime_checkable
class ChatFormat(Protocol):
    """Turns OpenAI chat messages into prompt ids and model output back into a message."""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]: ...

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
        """Return (content, tool_calls); tool_calls are OpenAI `{id, type, function: {name, arguments}}`."""
        ...
