"""The gateway's `Engine` for a policy served by rollout replicas (vLLM, or the embedded
engine behind the same interface), through verl's `LLMServerClient`.

Token in, token out: the gateway renders the prompt with the policy's chat template and
sends the ids (`generate(request_id, prompt_ids=..., sampling_params=...)`); each replica
answers a verl `TokenOutput(token_ids, log_probs, stop_reason)`. The sampling dict holds
vLLM `SamplingParams` fields (vLLM 0.24), which verl's vLLM server passes to
`SamplingParams(max_tokens=..., **sampling_params)`; `logprobs=True` becomes `logprobs=0`
there: the log-prob of each sampled token, from the distribution vLLM's `logprobs_mode`
names (the fleet starts replicas with `raw_logprobs`: temperature 1, no top-p, as the
embedded engine reports).

A JSON schema (`response_format`, forced tool calls) is probed here first, on every fleet: a
schema that does not compile within the embedded engines' deadline (`engines/grammar.py`'s
`SchemaGrammars`, a killable probe process) fails its request with the embedded engine's one-line
ValueError (the gateway answers 400) and never reaches a replica. A replica that refused it
instead would answer with an error, and a replica's error fails the engine: the run, or the server,
would stop on one request. verl's vLLM servers (GPUs) are then sent the grammar the embedded
engines use (`json_schema_grammar`, EBNF text in `StructuredOutputsParams(grammar=...)`), never
the schema, which vLLM would compile with xgrammar's own rule for length-bounded strings: raw
control characters inside a string, which strict `json.loads` refuses. The project's own servers
(`mas-torch`, `mas-vllm`) are sent the schema (`{"json": schema}`): their embedded engine compiles
that same grammar itself, under the same deadline. Should one still refuse a schema the probe
passed (its compile ran past the deadline there, on a busier CPU), that refusal fails the request
alone, as here.

`n` choices are `n` requests with seeds `seed, seed+1, ...` (verl's server returns one
sequence a request). A replica that dies or does not answer within `timeout_s` fails the
call with `ReplicaError` and marks the engine failed: the trainer stops the run there,
resumable from its last checkpoint, instead of training on a partial step.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable, Literal, Protocol, Sequence

from mas_trainer.engines.base import EngineUnavailable, FinishReason, Generation, SamplingParams, choice_id, cut_at_stop
from mas_trainer.engines.grammar import SchemaGrammars, SchemaRefused
from mas_trainer.errors import RunStopped, where_lost

__all__ = ["ReplicaClient", "ReplicaEngine", "ReplicaError", "vllm_sampling"]

log = logging.getLogger(__name__)


class ReplicaError(RunStopped, EngineUnavailable):
    """A rollout replica died, timed out or aborted a request."""


class ReplicaClient(Protocol):
    """verl's `LLMServerClient.generate`, the one call the engine makes."""

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> Any: ...


def vllm_sampling(params: SamplingParams, index: int, structured: Any = None) -> dict[str, Any]:
    """vLLM `SamplingParams` keyword arguments for choice `index` of a request; `structured`: its
    `structured_outputs`, what the replica takes for `params.json_schema` (see the module docstring)."""
    out: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "logprobs": True,
        "ignore_eos": params.ignore_eos,
        # the gateway strips stop strings from the text itself; the ids keep them, as the embedded engine's do
        "include_stop_str_in_output": False,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:
        out["seed"] = params.seed + index
    if structured is not None:
        out["structured_outputs"] = structured
    return out


def _schema_refusal(exc: BaseException) -> str | None:
    """The embedded engine's refusal of a request's schema, which a replica's error carries (Ray
    delivers an actor's exception as a `RayTaskError` whose `cause` is the one raised there), else None."""
    cause = getattr(exc, "cause", None) or exc
    return str(cause) if isinstance(cause, SchemaRefused) else None


class ReplicaEngine:
    """`Engine` over a policy's rollout replicas (see the module docstring).

    `decode(ids) -> str` and `eos_ids` come from the policy's tokenizer: replicas answer
    ids only (verl starts them without detokenising outputs), the text is decoded here.
    `grammars` (text=True, built on that tokenizer) probe each schema before a replica sees it;
    `send`: what the replicas take for it, its strict grammar (verl's vLLM servers) or the schema
    itself (the project's own servers, which compile it). Without `grammars` the schema goes out
    unprobed. The engine closes them.
    """

    def __init__(self, client: ReplicaClient, *, model_name: str, decode: Callable[[list[int]], str],
                 eos_ids: Sequence[int], grammars: SchemaGrammars | None = None,
                 send: Literal["grammar", "schema"] = "grammar",
                 timeout_s: float = 600.0, on_output: Callable[[str, Any], None] | None = None,
                 on_close: Callable[[], None] | None = None, max_model_len: int | None = None) -> None:
        self.client = client
        # the replicas' context (prompt + completion); the gateway reads it (`engines.base.max_context`) to cap
        # max_tokens and to refuse a prompt that leaves no room, which verl's server answers with an error
        self.max_context = max_model_len
        self.model_name = model_name
        self._decode = decode
        self._eos = set(int(e) for e in eos_ids)
        self._grammars = grammars
        self._send = send
        self.timeout_s = timeout_s
        self._on_output = on_output  # (request id, TokenOutput): e.g. which weights version answered
        self._on_close = on_close  # serve: the engine owns its replicas; fit: the trainer does
        self.failure: ReplicaError | None = None
        self.requests = 0
        self.tokens = 0
        self.busy_s = 0.0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None) -> list[Generation]:
        if self.failure is not None:
            raise self.failure
        rid = turn_id or uuid.uuid4().hex
        structured = None if params.json_schema is None else await self._structured(params.json_schema)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(self._one(choice_id(rid, i), list(prompt_ids), params, i, structured)
                                      for i in range(params.n)))
        self.requests += 1
        self.busy_s += time.perf_counter() - t0
        return outs

    async def _structured(self, schema: dict[str, Any]) -> Any:
        """A request's `structured_outputs` (see the module docstring); a schema that does not
        compile within the deadline raises ValueError, for this request only."""
        if self._grammars is None:
            return {"json": schema}
        grammar = await self._grammars.compile(schema)
        if self._send == "schema":
            return {"json": schema}
        from vllm.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams(grammar=grammar)

    async def _one(self, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int,
                   structured: Any) -> Generation:
        sampling = vllm_sampling(params, index, structured)
        try:
            out = await asyncio.wait_for(
                self.client.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling), self.timeout_s)
        except asyncio.TimeoutError:
            raise self.fail(f"no answer within {self.timeout_s:g} s (rollout.replica.timeout_s)") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead actor, a refused request: the run cannot go on with this policy
            refusal = _schema_refusal(exc) if params.json_schema is not None else None
            if refusal is not None:  # the replica is fine; the request's schema is not (module docstring)
                raise SchemaRefused(refusal) from None
            from ray.exceptions import RayActorError

            text, lost = str(exc).strip(), isinstance(exc, RayActorError)
            raise self.fail(f"{type(exc).__name__}: " + (f"its server was lost ({where_lost(text)})" if lost else
                                                         text.splitlines()[0] if text else "")) from exc
        if out.stop_reason in ("aborted", "abort"):
            raise self.fail("the replica aborted the request")
        ids = [int(t) for t in out.token_ids]
        logprobs = [float(x) for x in (out.log_probs or [])]
        if len(logprobs) != len(ids):
            raise self.fail(f"{len(ids)} tokens but {len(logprobs)} log-probs (is calculate_log_probs off?)")
        self.tokens += len(ids)
        if self._on_output is not None:
            self._on_output(request_id, out)
        return self._generation(ids, logprobs, params, prompt_ids)

    def budget(self, params: SamplingParams, prompt_len: int) -> int:
        """The tokens a replica may sample for the request: verl's vLLM server clamps `max_tokens` to
        the context left, `max(1, min(max_tokens, max_model_len - prompt_len))` (vllm_async_server.py
        `generate`), so an answer cut by the context limit is shorter than `max_tokens`."""
        if self.max_context is None:
            return params.max_tokens
        return max(1, min(params.max_tokens, self.max_context - prompt_len))

    def _generation(self, ids: list[int], logprobs: list[float], params: SamplingParams, prompt_ids: list[int]) -> Generation:
        # verl reports "completed" for both of vLLM's "stop" and "length": tell them apart here. vLLM checks
        # end-of-turn and stop strings before the length, so an answer ending on one at the budget is a stop
        ended = bool(ids) and ids[-1] in self._eos and not params.ignore_eos
        text, cut = cut_at_stop(self._decode(ids[:-1] if ended else ids), params.stop)
        reason: FinishReason = "stop" if ended or cut or len(ids) < self.budget(params, len(prompt_ids)) else "length"
        return Generation(ids, logprobs, text, reason, list(prompt_ids))

    def metrics(self) -> dict[str, float]:
        """Running totals under `engines.base.ENGINE_METRICS`' names."""
        return {"requests": float(self.requests), "tokens": float(self.tokens), "busy_s": self.busy_s}

    def fail(self, why: str) -> ReplicaError:
        """Record the replica failure `why` (the run's one error line) and return it to raise."""
        why = " ".join(why.split())  # one line
        err = ReplicaError(f"policy {self.model_name}: rollout replica failed: {why}; "
                           "the run stops here and `mas-trainer fit --resume` continues from the last checkpoint")
        if self.failure is None:  # the trainer raises it at the step's update: the run's one error line
            self.failure = err
        return err

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
