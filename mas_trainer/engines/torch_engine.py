"""The embedded engine: one thread owns a torch model and batches concurrent requests.

Every turn of every rollout comes through here, so throughput decides how fast training
runs on a CPU. Requests are split into rows (one per choice) and decoded together with a
shared KV cache; rows join the running batch as soon as there is room (continuous
batching) and leave it the step they finish, so a long answer never holds short ones back.
Each row keeps its own sampling parameters, seed generator and JSON-schema matcher, while
the sampling itself stays vectorised across rows.

Returned log-probs are `log_softmax(raw logits)` at the sampled token: temperature 1, no
top-p and no grammar mask. That is the policy's own probability of the token, which is
what a PPO learner needs as the old log-prob; it is not the probability of the (possibly
warped) distribution the token was drawn from.

Thread model: only the worker thread touches the model. `generate` (async, any event loop)
and `generate_sync` (any thread) enqueue rows and wait on a future; `stream` also gets each
token as it is sampled (pushed onto the caller's loop). A request whose future is cancelled
(its caller's await or stream was cancelled: e.g. the HTTP client hung up) leaves the batch
at the next step, and if still waiting is never admitted; `run_exclusive` runs a
function on the model between batches (admission pauses, running rows finish first), which
is how a learner swaps weights without a response mixing two policies.

Adapters of one base (`adapters=`, `policy/shared_base.py`): the model is a peft model holding
one LoRA adapter per policy, never merged; each request names its adapter (None: the bare
base) and a batch mixes rows of different adapters: the base's matmuls run once for the whole
batch and every row gets its own adapter's low-rank update (`engines/adapter_batch.py`).
Prompts are prefilled and their prefixes cached per adapter (its K/V differ from the base's).

Keep a process's torch compute on one thread where possible (e.g. run learner steps through
`run_exclusive`): every thread that runs torch ops gets its own OpenMP pool, and with more
pool threads than cores libgomp stops spinning between parallel regions, which cost ~25%
of decode speed on the 2-core reference machine (95 instead of 120 tokens/s at batch 8).
The worker thread sizes its own pool once, as it starts (`threads=`, decided by whoever starts
the engine: `engines/threads.py`), since `torch.set_num_threads` on another thread does not reach
a thread that already ran torch ops.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Callable, Sequence

import torch

from mas_trainer.engines.threads import set_torch_threads
from mas_trainer.engines.config import EngineSettings
from mas_trainer.engines.base import Delta, FinishReason, Generation, SamplingParams, cut_at_stop
from mas_trainer.engines.grammar import COMPILE_TIMEOUT_S, SchemaGrammars
from mas_trainer.engines.prefix_cache import PrefixCache
from mas_trainer.engines.streaming import TextStream
from mas_trainer.engines.threads import RUNNING, Threads, decide

__all__ = ["TorchEngine", "TOP_K_FIRST", "load_engine", "top_p_filter"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    grammar: Any = None
    results: list[Generation | None] = field(default_factory=list)
    remaining: int = 0
    adapter: str | None = None  # the LoRA adapter whose rows these are (adapters of one base); None: the base
    # Called on the worker thread with (choice index, token, Generation when it finished).
    listener: Callable[[int, int, Generation | None], None] | None = None


@dataclass(eq=False)
class _Row:
    req: _Request
    index: int
    limit: int  # max tokens for this row (max_tokens, bounded by the context window)
    generator: torch.Generator | None = None
    matcher: Any = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def _row_seed(seed: int, index: int) -> int:
    """Distinct, reproducible seeds for the n choices of one seeded request (any int)."""
    return (seed if index == 0 else seed * 0x9E3779B97F4A7C15 + index) & (2**63 - 1)


class TorchEngine:
    """`Engine` over a Hugging Face causal LM, batching concurrent requests on one thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str,
        settings: EngineSettings | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_grammars: int = 64,
        grammar_timeout_s: float = COMPILE_TIMEOUT_S,
        adapters: Sequence[str] = (),
        threads: int | Threads | None = None,
    ) -> None:
        """`settings`: how it batches, caches and computes (`EngineSettings`: the prefix cache is
        `engines/prefix_cache.py`, fast decode `engines/kv.py` and `top_p_filter`); `max_grammars`:
        compiled JSON-schema grammars kept; `grammar_timeout_s`: how long one schema may compile
        before its request fails (`engines/grammar.py`); `adapters`: the LoRA adapters of `model`, a
        peft model, that requests may name (`generate(..., adapter=)`); `threads`: the worker's torch
        threads (`engines/threads.py`; None: $OMP_NUM_THREADS, else every core this process may use)."""
        # a bare engine (tests, benchmarks) computes in fp32, so its log-probs match an fp32 forward
        settings = settings or EngineSettings(engine_bf16=False)
        self.model_name, self.settings = model_name, settings
        # bf16 autocast while decoding (CPU: ~1.5x faster). Log-probs then carry bf16 rounding,
        # like a learner's bf16 forward. "auto": where bf16 is fast on the device (not on AVX2-only CPUs)
        if settings.engine_bf16 == "auto":
            from mas_trainer.engines.models import bf16_is_fast

            self.bf16 = bf16_is_fast(device)
        else:
            self.bf16 = bool(settings.engine_bf16)
        self.tokenizer = tokenizer
        self.adapters = frozenset(adapters)
        self.max_batch_size = settings.max_batch_size
        self.batch_wait_s = settings.batch_wait_ms / 1000
        self.device = torch.device(device)
        self._model = model.to(device=self.device, dtype=dtype).eval()
        self._lora: Any = None
        self._net = self._model  # what a forward calls: with adapters, the peft model's base, hooked per row
        if self.adapters:
            from mas_trainer.engines.adapter_batch import BatchedLora

            self._lora, self._net = BatchedLora(self._model, sorted(self.adapters)), self._model.get_base_model()
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.eos_ids = _end_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self.stats: dict[str, Any] = {"decode_steps": 0, "prefills": 0, "tokens": 0, "requests": 0, "busy_s": 0.0,
                                      "prompt_tokens": 0, "cached_tokens": 0, "batch_sizes": collections.Counter()}
        self._rng = torch.Generator(device=self.device).manual_seed(0)
        # Compiled grammars by schema, bounded in number, compiled off the event loop's default
        # executor under a deadline (probed in a child process that can be killed).
        self._grammars = SchemaGrammars(self._tokenizer_info, max_grammars=max_grammars, timeout_s=grammar_timeout_s)
        # State shared with callers, guarded by _cond.
        self._cond = threading.Condition()
        self._pending: collections.deque[_Row] = collections.deque()
        self._controls: collections.deque[tuple[Callable[[Any], Any], concurrent.futures.Future]] = collections.deque()
        self._closed = False
        # Batch state, touched only by the worker thread.
        self._rows: list[_Row] = []
        self._cache: Any = None
        # a running batch's attention mask, next positions and next input tokens; None with no rows
        self._mask: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._next: torch.Tensor | None = None
        self._decode_paths(settings)
        if not isinstance(threads, Threads):  # None: as if alone in this process; a number: as its builder set it
            threads = decide(None, 1) if threads is None else Threads(threads, "runtime.torch_threads, or fit's plan")
        self.threads = threads
        RUNNING.join(threads)
        self._thread = threading.Thread(target=self._work, name=f"TorchEngine[{model_name}]", daemon=True)
        self._thread.start()

    def _decode_paths(self, settings: EngineSettings) -> None:
        """Continuous batching, the prefix cache and fast decode, where the model allows them."""
        # Joining rows to a running batch edits the KV cache per layer, which is only sound
        # for full-attention layers; models with sliding windows fall back to static batches.
        from transformers import DynamicCache

        layers = DynamicCache(config=self._model.config).layers
        self._continuous = bool(layers) and all(type(l).__name__ == "DynamicLayer" for l in layers)
        # Cached prefixes are laid into a batch's K/V per layer, as joining rows is: full attention only.
        self._prefix = PrefixCache(int(settings.prefix_cache_mb * 2**20)) if settings.prefix_cache_mb > 0 and self._continuous else None
        self.fast_decode = settings.fast_decode
        # Growing layers replace DynamicLayers, so they too need full attention everywhere.
        self._grow = settings.fast_decode and self._continuous
        if self._grow:
            from mas_trainer.engines.kv import use_decode_attention

            use_decode_attention(self._model)

    # ---------------------------------------------------------------- public API

    @property
    def model(self) -> Any:
        """The model; read freely, but change it only through `run_exclusive`."""
        return self._model

    def metrics(self) -> dict[str, float]:
        """Running totals under `engines.base.ENGINE_METRICS`' names (`stats` has more), and with
        the prefix cache on, the prompt tokens asked for and those it saved prefilling."""
        keys = ("requests", "tokens", "busy_s") + (("prompt_tokens", "cached_tokens") if self._prefix is not None else ())
        return {k: float(self.stats[k]) for k in keys}

    @property
    def max_context(self) -> int:
        """Prompt + completion tokens the model takes (its position embeddings)."""
        return self.max_positions

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None, adapter: str | None = None
    ) -> list[Generation]:
        """`params.n` choices for one prompt (by `adapter`, one of `adapters`; None: the base);
        cancelling the await frees the rows (or stops compiling its schema, when nobody else waits for it)."""
        self._check_adapter(adapter)
        grammar = await self._grammars.compile(params.json_schema) if params.json_schema is not None else None
        return await asyncio.wrap_future(self._submit(prompt_ids, params, grammar, adapter=adapter))

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, turn_id: str | None = None, adapter: str | None = None
    ) -> AsyncIterator[Delta]:
        """The `params.n` choices as deltas, token by token; closing the iterator (or
        cancelling its task) frees the rows."""
        self._check_adapter(adapter)
        grammar = await self._grammars.compile(params.json_schema) if params.json_schema is not None else None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, int, Generation | None] | None] = asyncio.Queue()

        def post(item: tuple[int, int, Generation | None] | None) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the caller's loop is gone: nobody reads these tokens
                pass

        future = self._submit(prompt_ids, params, grammar, listener=lambda i, token, gen: post((i, token, gen)), adapter=adapter)
        future.add_done_callback(lambda _: post(None))  # failure or cancellation ends the stream
        texts = [TextStream(self._detokenize, params.stop, self.eos_ids) for _ in range(params.n)]
        left = params.n
        try:
            while left:
                item = await events.get()
                if item is None:
                    if future.cancelled():
                        raise asyncio.CancelledError
                    if future.exception() is not None:
                        raise future.exception()  # type: ignore[misc]
                    continue
                i, token, gen = item
                if gen is None:
                    yield Delta(i, [token], texts[i].push(token))
                else:
                    left -= 1
                    yield Delta(i, [token], texts[i].finish(gen.text), gen)
        finally:
            future.cancel()  # a no-op once it is done

    def _detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate_sync(self, prompt_ids: Sequence[int], params: SamplingParams, *, adapter: str | None = None) -> list[Generation]:
        """Blocking `generate` for threads without an event loop (never the worker itself)."""
        self._check_adapter(adapter)
        return self._submit(prompt_ids, params, adapter=adapter).result()

    def _check_adapter(self, adapter: str | None) -> None:
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"engine {self.model_name!r} has no adapter {adapter!r}; its adapters: "
                             f"{', '.join(sorted(self.adapters)) or 'none (a plain model)'}")

    def run_exclusive(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(model)` on the worker once running rows finish; new rows wait meanwhile.

        Returns a concurrent future (`await asyncio.wrap_future(...)` from async code). The
        function runs outside inference mode, so it may train, load weights or score.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"engine {self.model_name!r} is closed")
            self._controls.append((fn, fut))
            self._cond.notify()
        return fut

    def update_weights(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load new weights between batches (blocks until they are in place)."""

        def load(model: Any) -> None:
            with torch.no_grad():
                model.load_state_dict(state_dict, strict=strict)

        self.run_exclusive(load).result()

    def close(self) -> None:
        """Stop the worker; requests still waiting or running fail with RuntimeError (those
        waiting for their schema's grammar too: its compile is killed)."""
        self._grammars.close()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "TorchEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- submission

    def _tokenizer_info(self) -> Any:
        """xgrammar's view of the tokenizer (built once, by the grammar compiler, on first need)."""
        import xgrammar as xgr

        vocab = self._model.get_output_embeddings().weight.shape[0]
        return xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=vocab, stop_token_ids=sorted(self.eos_ids))

    def _grammar_for(self, schema: dict[str, Any]) -> Any:
        """The compiled grammar of a JSON schema (xgrammar, no free-form whitespace), blocking."""
        return self._grammars.compile_sync(schema)

    def _submit(self, prompt_ids: Sequence[int], params: SamplingParams, grammar: Any = None,
                listener: Callable[[int, int, Generation | None], None] | None = None,
                adapter: str | None = None) -> concurrent.futures.Future:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if params.n < 1 or params.max_tokens < 1:
            raise ValueError("n and max_tokens must be >= 1")
        room = self.max_positions - len(prompt)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in a {self.max_positions}-token context")
        if params.json_schema is not None and grammar is None:  # generate_sync: async callers compiled it already
            grammar = self._grammar_for(params.json_schema)
        req = _Request(prompt, params, concurrent.futures.Future(), grammar, [None] * params.n, params.n, listener=listener, adapter=adapter)
        rows = [
            _Row(req, i, min(params.max_tokens, room),
                 torch.Generator(device=self.device).manual_seed(_row_seed(params.seed, i)) if params.seed is not None else None)
            for i in range(params.n)
        ]
        with self._cond:
            if self._closed:
                raise RuntimeError(f"engine {self.model_name!r} is closed")
            self._pending.extend(rows)
            self.stats["requests"] += 1
            self._cond.notify()
        return req.future

    # ---------------------------------------------------------------- worker loop

    def _work(self) -> None:
        set_torch_threads(self.threads.n)
        log.info("engine %s: %d torch thread(s) (%s)", self.model_name, *self.threads)
        while True:
            with self._cond:
                admit = self._wait_for_work()
                if admit is None:
                    break
                controls = [] if self._rows or admit else list(self._controls)
                if controls:
                    self._controls.clear()
            if controls and self._prefix is not None:
                self._prefix.clear()  # the weights may change: no K/V computed with the old ones is reused
            if controls and self._lora is not None:
                self._lora.refresh()  # so may the adapters': stacked again before the next forward
            for fn, fut in controls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self._model))
                    except BaseException as err:  # handed to the caller
                        fut.set_exception(err)
            t0 = time.perf_counter()
            try:
                self._iteration(admit)
            except Exception as err:  # fail the affected requests, keep serving others
                for row in self._rows + admit:
                    self._fail(row.req, err)
                self._rows, self._cache = [], None
            self.stats["busy_s"] += time.perf_counter() - t0
        self._shutdown()

    def _wait_for_work(self) -> list[_Row] | None:
        """Under the lock: rows to admit now ([] = just decode), or None to stop."""
        while not self._closed and not self._rows and not self._pending and not self._controls:
            self._cond.wait()
        if self._closed:
            return None
        if self._controls or (self._rows and not self._continuous):
            return []  # drain first: exclusive calls wait for an empty batch; so do static batches
        if not self._rows and self._pending:  # idle: give concurrent callers a moment to join
            deadline = time.monotonic() + self.batch_wait_s
            while len(self._pending) < self.max_batch_size and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        admit: list[_Row] = []
        while self._pending and len(self._rows) + len(admit) < self.max_batch_size:
            row = self._pending.popleft()
            if not row.req.future.done():  # cancelled while waiting
                admit.append(row)
        return admit

    def _shutdown(self) -> None:
        RUNNING.leave(self.threads)
        with self._cond:
            rows = self._rows + list(self._pending)
            controls = list(self._controls)
            self._pending.clear()
            self._controls.clear()
        err = RuntimeError(f"engine {self.model_name!r} is closed")
        for row in rows:
            self._fail(row.req, err)
        for _, fut in controls:
            if not fut.done():
                fut.set_exception(err)
        self._rows, self._cache = [], None

    @staticmethod
    def _fail(req: _Request, err: BaseException) -> None:
        if not req.future.done():
            try:
                req.future.set_exception(err)
            except concurrent.futures.InvalidStateError:
                pass

    # ---------------------------------------------------------------- one step

    @torch.inference_mode()
    def _iteration(self, admit: list[_Row]) -> None:
        """Prefill newly admitted rows into the batch, then decode one token for all rows."""
        if any(row.req.future.done() for row in self._rows):  # cancelled by the caller
            self._keep([i for i, row in enumerate(self._rows) if not row.req.future.done()])
        if admit:
            self._prefill(admit)
        if self._rows:
            self._decode()

    def _prefill(self, rows: list[_Row]) -> None:
        """Run the new prompts (each distinct prompt once; with the prefix cache, only what
        follows each one's cached prefix) in one batch and merge them into the running batch."""
        from mas_trainer.engines.kv import new_cache

        distinct: dict[tuple[str | None, tuple[int, ...]], int] = {}  # (adapter, prompt): a prompt's K/V are its adapter's
        which = [distinct.setdefault((r.req.adapter, tuple(r.req.prompt_ids)), len(distinct)) for r in rows]
        prompts = [p for _, p in distinct]
        adapters = [a for a, _ in distinct]
        self.stats["prompt_tokens"] += sum(len(p) for p in prompts)
        hits = [self._prefix.lookup(p, a) if self._prefix is not None else (0, []) for a, p in distinct]
        self.stats["cached_tokens"] += sum(n for n, _ in hits)
        # Each row is [pad | cached prefix | pad | rest of the prompt]; the mask hides the pads and
        # positions count real tokens only, so a row computes what it would alone.
        width_p = max(n for n, _ in hits)
        width_s = max(len(p) - n for p, (n, _) in zip(prompts, hits))
        ids = torch.full((len(prompts), width_s), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width_p + width_s), dtype=torch.long)
        for i, (p, (n, _)) in enumerate(zip(prompts, hits)):
            ids[i, width_s - (len(p) - n):] = torch.tensor(p[n:])
            mask[i, width_p - n:width_p] = 1
            mask[i, width_p + width_s - (len(p) - n):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = new_cache(self._model.config, self._cached_prefixes(hits, width_p) if width_p else None, grow=self._grow)
        with self._autocast(), self._rows_of(adapters):
            out = self._net(
                input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, width_p:],
                past_key_values=cache, use_cache=True, logits_to_keep=1,
            )
        if self._prefix is not None:
            for i, (a, p) in enumerate(distinct):
                real = mask[i].bool()  # the row's own tokens: prefix and rest, without the pads
                self._prefix.store(p, partial(_row_kv, cache, i, real), a)
        index = torch.tensor(which, device=self.device)
        if len(prompts) != len(rows):
            cache.batch_select_indices(index)
        for row in rows:
            if row.req.grammar is not None:
                import xgrammar as xgr

                row.matcher = xgr.GrammarMatcher(row.req.grammar)
        self.stats["prefills"] += 1
        running = (self._rows, self._cache, self._mask, self._pos, self._next)
        kept = mask[index]
        self._rows, self._cache, self._mask, self._pos, self._next = rows, cache, kept, kept.sum(-1), None
        first = self._sample(out.logits[index, -1])
        fresh = (self._rows, self._cache, self._mask, self._pos, first)
        self._rows, self._cache, self._mask, self._pos, self._next = running
        if not fresh[0]:
            return
        if self._rows:
            self._merge(*fresh)
        else:
            self._rows, self._cache, self._mask, self._pos, self._next = fresh

    @staticmethod
    def _cached_prefixes(hits: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]], width: int
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the batch's cached K/V right-aligned in `width` columns (zeros where a row has less)."""
        some = next(kv for n, kv in hits if n)
        out = []
        for layer, (k0, v0) in enumerate(some):
            keys = k0.new_zeros((len(hits), k0.shape[0], width, k0.shape[-1]))
            values = v0.new_zeros((len(hits), v0.shape[0], width, v0.shape[-1]))
            for i, (n, kv) in enumerate(hits):
                if n:
                    keys[i, :, width - n:], values[i, :, width - n:] = kv[layer]
            out.append((keys, values))
        return out

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def _rows_of(self, adapters: list[str | None]) -> Any:
        """Within: the forward gives each batch row its adapter's output (a plain model: nothing to do)."""
        return self._lora.rows(adapters) if self._lora is not None else contextlib.nullcontext()

    def _decode(self) -> None:
        mask, pos, nxt = self._mask, self._pos, self._next
        if mask is None or pos is None or nxt is None:
            raise RuntimeError("decode step without a running batch")
        ones = torch.ones((len(self._rows), 1), dtype=torch.long, device=self.device)
        self._mask = mask = torch.cat([mask, ones], dim=1)
        with self._autocast(), self._rows_of([r.req.adapter for r in self._rows]):
            out = self._net(
                input_ids=nxt[:, None], attention_mask=mask, position_ids=pos[:, None],
                past_key_values=self._cache, use_cache=True,
            )
        self._pos, self._next = pos + 1, None
        self.stats["decode_steps"] += 1
        self.stats["batch_sizes"][len(self._rows)] += 1
        self._next = self._sample(out.logits[:, -1])

    def _merge(self, rows: list[_Row], cache: Any, mask: torch.Tensor, pos: torch.Tensor, nxt: torch.Tensor) -> None:
        """Append freshly prefilled rows (and their cache) to the running batch.

        Both caches are left-aligned to the same length by left padding, which the
        attention mask hides; positions stay per row, so the math is unchanged.
        """
        mine_mask, mine_pos, mine_next = self._mask, self._pos, self._next
        if mine_mask is None or mine_pos is None or mine_next is None:
            raise RuntimeError("merge into no running batch")
        width = max(mask.shape[1], mine_mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self._cache.layers, cache.layers):
            mine.keys = torch.cat([pad(mine.keys, 2), pad(theirs.keys, 2)])
            mine.values = torch.cat([pad(mine.values, 2), pad(theirs.values, 2)])
        self._mask = torch.cat([pad(mine_mask, 1), pad(mask, 1)])
        self._pos = torch.cat([mine_pos, pos])
        self._next = torch.cat([mine_next, nxt])
        self._rows = self._rows + rows

    def _keep(self, keep: list[int]) -> None:
        """Drop finished rows from the batch and the padding columns nobody needs anymore."""
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache = self._mask = self._pos = self._next = None
            return
        if self._mask is None or self._pos is None:
            raise RuntimeError("rows kept of no running batch")
        index = torch.tensor(keep, device=self.device)
        mask = self._mask[index]
        self._pos = self._pos[index]
        if self._next is not None:
            self._next = self._next[index]
        if not self._continuous:
            self._mask = mask
            self._cache.batch_select_indices(index)
            return
        start = int(mask.any(0).to(torch.int8).argmax())
        self._mask = mask[:, start:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]

    # ---------------------------------------------------------------- sampling

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Pick one token per row with its own parameters; record it and retire finished rows."""
        rows = self._rows
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
        if constrained:
            import xgrammar as xgr

            bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
            for i in constrained:
                rows[i].matcher.fill_next_token_bitmask(bitmask, i)
            logits = logits.clone()
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=constrained)
        hot = [i for i, r in enumerate(rows) if r.req.params.temperature > 0]
        if len(hot) == len(rows):
            tokens = self._draw(logits, rows)
        else:
            tokens = logits.argmax(-1)
            if hot:
                tokens[hot] = self._draw(logits[hot], [rows[i] for i in hot])
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        token_list = tokens.tolist()
        # counted before any row finishes: a caller that has its answer reads complete figures (a late count
        # would land in the next step's metrics, as it did under load after a held-out evaluation)
        self.stats["tokens"] += len(rows)
        keep = []
        for i, row in enumerate(rows):
            row.tokens.append(token_list[i])
            row.logprobs.append(chosen[i])
            if row.matcher is not None:
                row.matcher.accept_token(token_list[i])
            finished = self._finished(row)
            if row.req.listener is not None:
                row.req.listener(row.index, token_list[i], row.req.results[row.index] if finished else None)
            if not finished:
                keep.append(i)
        if len(keep) < len(rows):
            self._keep(keep)
            tokens = tokens[keep] if keep else tokens[:0]
        return tokens

    def _draw(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Sample with temperature and top-p by an exponential race (the Gumbel-max trick).

        Each row draws one Exp(1) number E_i per token of the vocabulary (``-log U``, U uniform)
        and picks ``argmax_i(log p_i - log E_i)``, p the softmax of ``logits / temperature``
        restricted to the top-p nucleus (a token top-p removed scores -inf: never picked). This
        samples exactly that distribution (up to the 2**-24 steps of a float uniform number):
        ``E_i / p_i`` is Exp(p_i)-distributed, and the smallest of independent exponentials is
        token j's with probability ``p_j / sum(p)``. ``log p`` is taken as
        ``logits / temperature``: the softmax's normaliser is the same for every token of a row, so
        it cannot change the argmax, and it is not computed unless top-p needs the probabilities.

        Unseeded rows share the engine's generator; a seeded row draws its numbers from its own,
        always a whole vocabulary's worth (whatever top-p keeps), so a seeded sample does not
        depend on what else is in the batch. Nor does it on the float rounding that another batch
        shape gives its logits, but for a near-tie: the two best perturbed scores of the row must
        lie within that rounding of each other, which is rare even for a near-uniform distribution
        (an inverse-CDF draw flips whenever the rounding of a 49k-long cumulative sum moves a token
        boundary across its one uniform number: about one draw in a thousand of the tiny model's
        distribution with its logits moved by 1e-6, so batched same-seed runs parted within a few calls).
        """
        scores = logits.float() / torch.tensor([r.req.params.temperature for r in rows], device=logits.device)[:, None]
        nucleus = [i for i, r in enumerate(rows) if r.req.params.top_p < 1]
        if nucleus:
            top_p = torch.tensor([rows[i].req.params.top_p for i in nucleus], device=logits.device)
            kept = top_p_filter(torch.softmax(scores[nucleus], dim=-1), top_p,
                                first_k=TOP_K_FIRST if self.fast_decode else ())
            scores[nucleus] = scores[nucleus].masked_fill(kept <= 0, float("-inf"))
        # E = -log U from uniform numbers: a fifth of the time of torch's exponential_ on a CPU
        uniform = torch.empty_like(scores)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if len(shared) == len(rows):
            uniform.uniform_(generator=self._rng)
        else:
            if shared:
                uniform[shared] = torch.rand((len(shared), scores.shape[-1]), generator=self._rng, device=logits.device)
            for i, row in enumerate(rows):
                if row.generator is not None:
                    uniform[i].uniform_(generator=row.generator)
        # U in [tiny, 1): E in (0, 88], so log E is finite and a token scored -inf stays out (never a NaN)
        race = uniform.clamp_min_(torch.finfo(uniform.dtype).tiny).log_().neg_()
        return (scores - race.log_()).argmax(-1)

    def _finished(self, row: _Row) -> bool:
        """Decide whether `row` is done; if so, file its Generation."""
        params, token = row.req.params, row.tokens[-1]
        reason: FinishReason | None = None
        if token in self.eos_ids and not params.ignore_eos:
            reason = "stop"
        elif row.matcher is not None and row.matcher.is_terminated():
            reason = "stop"
        elif params.stop and self._hit_stop(row):
            reason = "stop"
        elif len(row.tokens) >= row.limit:
            reason = "length"
        if reason is None:
            return False
        ids = row.tokens[:-1] if token in self.eos_ids and reason == "stop" else row.tokens
        text, cut = cut_at_stop(self.tokenizer.decode(ids, skip_special_tokens=True), params.stop)
        if cut:
            reason = "stop"
        req = row.req
        req.results[row.index] = Generation(row.tokens, row.logprobs, text, reason, list(req.prompt_ids))
        req.remaining -= 1
        if req.remaining == 0 and not req.future.done():
            try:
                req.future.set_result(list(req.results))
            except concurrent.futures.InvalidStateError:
                pass
        return True

    def _hit_stop(self, row: _Row) -> bool:
        """Does a stop string end in the last tokens? (decodes only a short tail)."""
        stops = row.req.params.stop
        tail = max(len(s) for s in stops) + 2
        text = self.tokenizer.decode(row.tokens[-tail:], skip_special_tokens=True)
        return any(s and s in text for s in stops)


TOP_K_FIRST = (256, 4096)  # top-k sizes tried before sorting the whole vocabulary for top-p


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor, first_k: Sequence[int] = TOP_K_FIRST) -> torch.Tensor:
    """Top-p (nucleus) filtering: probs (rows, vocab) with every token zeroed whose more likely
    tokens already hold `top_p` (rows,) of the mass; a row's most likely token is always kept.

    Sorting the whole vocabulary took about a fifth of a decode step (16 rows of SmolLM2's 49k
    tokens, 2 cores), and the nucleus is nearly always among the few hundred most likely tokens:
    so the `first_k` most likely are taken first, and only if they do not hold `top_p` of every
    row's mass is a larger k (at last the whole sort) tried. Same result: a token outside the
    top k has at least their mass above it. (`first_k=()`: the full sort at once, the reference.)
    """
    vocab = probs.shape[-1]
    for k in (*(k for k in first_k if k < vocab), vocab):
        top, order = probs.topk(k, dim=-1) if k < vocab else probs.sort(dim=-1, descending=True)
        mass = top.cumsum(-1)
        if k < vocab and not bool((mass[:, -1] >= top_p).all()):
            continue
        drop = mass - top >= top_p[:, None]  # the mass strictly above each token
        drop[:, 0] = False  # top_p=0 means the single most likely token
        return torch.zeros_like(probs).scatter_(1, order, top.masked_fill(drop, 0.0))
    raise AssertionError("unreachable: the last k is the whole vocabulary")


def _row_kv(cache: Any, i: int, real: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row `i`'s K/V per layer in `cache`, only the columns of its own tokens (`real`: no pads)."""
    return [(layer.keys[i][:, real], layer.values[i][:, real]) for layer in cache.layers]


def _end_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a response: the tokenizer's, the config's and the generation config's eos."""
    eos = {tokenizer.eos_token_id, model.config.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
    eos |= set(gen_eos) if isinstance(gen_eos, (list, tuple)) else {gen_eos}
    return frozenset(i for i in eos if i is not None)


def load_engine(model: str, *, name: str, seed: int = 0, settings: EngineSettings | None = None,
                device: str | torch.device = "cpu", threads: int | Threads | None = None) -> TorchEngine:
    """The embedded engine on `model` (tiny | default | folder | hub id) with its own copy of
    the weights: the one way worker groups, verl's rank 0, rollout replicas and the verbs'
    engines build it, so all of them batch and sample alike. `threads`: `TorchEngine`'s."""
    from mas_trainer.engines.models import load_model

    weights, tokenizer = load_model(model, seed=seed)
    # the engine places the weights itself: a model moved beforehand would be moved back to its default, the CPU
    return TorchEngine(weights, tokenizer, model_name=name, settings=settings, device=device, threads=threads)
