"""The embedded engine's prefill and decode speed beside this machine's matmul limit.

Measures, in one process: the machine's fp32 matmul FLOP/s (torch.mm on square matrices, the
best of a few sizes), then the engine's prefill tokens/s (a batch of prompts, one forward) and
decode tokens/s (a full batch of rows sampled at temperature 0.7 and `--top-p`, end of turn
ignored, timed from every row's first token to the last), for the reference path
(`fast_decode=False`) and the engine's default, with their ratio. A token costs about
2 x (parameters outside the embedding) FLOPs plus the attention's 4 x layers x hidden x
context; the share of the matmul limit each phase reaches is the roofline share: how far the
engine is from what the hardware can do (decode is memory-bound at small batches, so its share
is expected to be low).

    .venv/bin/python bench/bench_roofline.py [--model default|tiny|PATH] [--batch 16] [--prompt 256] [--tokens 32] [--top-p 0.95] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import time

import torch

from mas_trainer.engines.base import SamplingParams
from mas_trainer.engines.models import load_model
from mas_trainer.engines.torch_engine import TorchEngine
from mas_trainer.engines.config import EngineSettings


def matmul_flops(sizes: tuple[int, ...] = (512, 1024, 2048), repeats: int = 5) -> float:
    """The best fp32 FLOP/s of torch.mm over `sizes` (n x n times n x n: 2 n^3 FLOPs)."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def flops_per_token(model, context: int, head_share: float = 1.0) -> float:
    """2 x the parameters a token multiplies (one multiply-add each) plus attention over
    `context` tokens; the output head counts `head_share` of a token (prefill computes the
    logits of a prompt's last token only)."""
    cfg = model.config
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name and p is not head)
    return 2 * (body + head_share * head.numel()) + 4 * cfg.num_hidden_layers * cfg.hidden_size * context


async def _gather(engine, prompts, params):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts))


async def _decode_seconds(engine, prompts, params) -> float:
    """Seconds from the moment every row has its first token (the prefill is over) to the last
    token: the decode steps alone, timed from the engine's stream, not as a difference of runs."""
    t_first: list[float] = []
    t_last: list[float] = []

    async def row(prompt):
        seen = False
        async for _ in engine.stream(prompt, params):
            if not seen:
                t_first.append(time.perf_counter())
                seen = True
        t_last.append(time.perf_counter())

    await asyncio.gather(*(row(p) for p in prompts))
    return max(t_last) - max(t_first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--top-p", type=float, default=0.95, help="decode samples at temperature 0.7 with this top_p, as rollouts do")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    peak = matmul_flops()
    model, tok = load_model(args.model)
    vocab = model.config.vocab_size
    prompts = [[(7 + 13 * i + 31 * j) % (vocab - 10) + 5 for j in range(args.prompt)] for i in range(args.batch)]
    sample = SamplingParams(max_tokens=args.tokens + 1, temperature=0.7, top_p=args.top_p, seed=1, ignore_eos=True)
    results = {}
    # the reference path (Hugging Face's cache and attention, a full sort for top-p), then the engine's default
    for name, fast in (("reference", False), ("fast_decode", True)):
        with TorchEngine(copy.deepcopy(model), tok, model_name=args.model, settings=EngineSettings(max_batch_size=args.batch, fast_decode=fast, engine_bf16=False)) as engine:
            asyncio.run(_gather(engine, prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))  # warm-up
            prefill, decode = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                asyncio.run(_gather(engine, prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
                prefill.append(time.perf_counter() - t0)
                decode.append(asyncio.run(_decode_seconds(engine, prompts, sample)))
        prefill_tps = args.batch * args.prompt / statistics.median(prefill)
        decode_tps = args.batch * args.tokens / statistics.median(decode)
        results[name] = {
            "prefill_tokens_s": prefill_tps, "decode_tokens_s": decode_tps,
            "prefill_share": prefill_tps * flops_per_token(model, args.prompt // 2, head_share=1 / args.prompt) / peak,
            "decode_share": decode_tps * flops_per_token(model, args.prompt + args.tokens // 2) / peak,
            "decode_spread": [args.batch * args.tokens / d for d in sorted(decode, reverse=True)]}
    print(f"matmul fp32: {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads); medians of {args.repeats}")
    for name, r in results.items():
        print(f"{name:>11}: prefill {r['prefill_tokens_s']:.0f} tokens/s ({args.batch} x {args.prompt} tokens) = "
              f"{r['prefill_share']:.0%} of the matmul limit; decode {r['decode_tokens_s']:.1f} tokens/s ({args.batch} rows x "
              f"{args.tokens} tokens, top_p {args.top_p}; {min(r['decode_spread']):.1f}-{max(r['decode_spread']):.1f}) = "
              f"{r['decode_share']:.0%}")
    ratio = results["fast_decode"]["decode_tokens_s"] / results["reference"]["decode_tokens_s"]
    print(f"decode tokens/s, fast_decode / reference: {ratio:.2f}")
    print(json.dumps({"model": args.model, "matmul_gflops": peak / 1e9, **results["fast_decode"],
                      "reference": results["reference"], "decode_speedup": ratio}))


if __name__ == "__main__":
    main()
