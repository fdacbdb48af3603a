"""Throughput of the embedded engine against plain `model.generate`, in one process.

Rollouts of a multi-agent app issue many chat calls at once, so what matters is the
aggregate tokens/s of the engine under concurrent requests, compared with the naive
baseline of calling `transformers`' `generate` one request at a time. Both decode greedily
and ignore the end of turn, so every request produces exactly `--max-tokens` tokens.

    python bench/bench_engine.py [--model default|tiny|PATH] [--max-tokens 64] [--concurrency 8]

Prints one line per measurement and a final JSON line; the goal is a ratio >= 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from mas_trainer.engines.base import SamplingParams
from mas_trainer.engines.chat import HFChatFormat
from mas_trainer.engines.models import load_model
from mas_trainer.engines.torch_engine import TorchEngine
from mas_trainer.engines.config import EngineSettings

__all__ = ["main"]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 100.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a name for a grey cat.",
    "Summarise the plot of Hamlet briefly.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
]


def raw_generate(model, prompts: list[list[int]], max_tokens: int) -> float:
    """Tokens/s of `model.generate` at batch 1, one prompt after another."""
    tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, pad_token_id=model.config.pad_token_id,
            )
        tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - start)


async def engine_generate(engine: TorchEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """Aggregate tokens/s of the engine with all prompts in flight at once."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(len(g.token_ids) for r in results for g in r) / elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default (bundled SmolLM2-135M), tiny, or a path")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--raw-prompts", type=int, default=3, help="prompts decoded one by one for the baseline")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s; torch threads {torch.get_num_threads()}")
    fmt = HFChatFormat(tok)
    prompts = [fmt.render([{"role": "user", "content": q}]) for q in QUESTIONS]
    batch = [prompts[i % len(prompts)] for i in range(args.concurrency)]

    with TorchEngine(model, tok, model_name=args.model, settings=EngineSettings(max_batch_size=args.concurrency, engine_bf16=False)) as engine:
        # The baseline runs on the engine's own thread: torch compute on a second thread
        # (here: main) would give this process two OpenMP pools on 2 cores, and libgomp then
        # throttles spinning for both, which slows whichever runs second by ~25%.
        engine.run_exclusive(lambda m: raw_generate(m, prompts[:1], 4)).result()  # warm-up
        raw = engine.run_exclusive(lambda m: raw_generate(m, prompts[: args.raw_prompts], args.max_tokens)).result()
        print(f"raw model.generate, batch 1:          {raw:7.1f} tokens/s")
        asyncio.run(engine_generate(engine, prompts[:1], 4))  # warm-up
        single = asyncio.run(engine_generate(engine, prompts[:1], args.max_tokens))
        print(f"engine, 1 request:                    {single:7.1f} tokens/s")
        batched = asyncio.run(engine_generate(engine, batch, args.max_tokens))
        print(f"engine, {args.concurrency} concurrent requests:         {batched:7.1f} tokens/s")
        sizes = dict(sorted(engine.stats["batch_sizes"].items()))
    ratio = batched / raw
    print(f"ratio engine_batched / raw_generate = {ratio:.2f} (goal >= 3) -> {'OK' if ratio >= 3 else 'BELOW GOAL'}")
    summary = {
        "model": args.model, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
        "raw_generate_tokens_per_s": round(raw, 1), "engine_single_tokens_per_s": round(single, 1),
        "engine_batched_tokens_per_s": round(batched, 1), "ratio": round(ratio, 2), "batch_sizes": sizes,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
