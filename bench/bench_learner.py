"""Throughput of the embedded learner against a raw torch training step, in one thread.

The learner adds verl's policy loss, mini/micro-batching, packing, gradient clipping and
metrics around a forward/backward/AdamW step; this measures what that costs. Both sides
train the same model on the same batch (4 sequences x 256 tokens: 128 prompt + 128
response, random ids) with the same autocast and AdamW settings; the raw step is
forward, log_softmax + gather over response tokens, -(logp * adv).mean(), backward, step.

    python bench/bench_learner.py [--model default|tiny|PATH] [--reps 3] [--fp32]

Prints one line per measurement and a final JSON line; the goal is learner/raw >= 0.9.
Rounds interleave raw and learner steps so load from other processes hits both alike.
Also reported: the learner's first-pass ``ppo_kl`` when old log-probs come from an fp32 forward (as the engine's do):
the bf16/fp32 numerics mismatch PPO sees on its first pass. ``--default-adamw`` adds
the raw step with torch's default (single-tensor) AdamW, for context.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from mas_trainer.engines.models import load_model
from mas_trainer.errors import UserError
from mas_trainer.learners import LearnerConfig, TorchLearner, Turn

__all__ = ["main"]


def make_batch(vocab: int, batch: int, prompt: int, response: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (batch, prompt + response), generator=g)
    adv = torch.randn(batch, response, generator=g)
    return ids, adv


def raw_step(model, optimizer, ids, adv, prompt: int, bf16: bool) -> None:
    """The plainest correct policy-gradient step: what the learner is compared with."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids, use_cache=False).logits
    logp = logits[:, prompt - 1 : -1].float().log_softmax(-1).gather(-1, ids[:, prompt:, None]).squeeze(-1)
    loss = -(logp * adv).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fns: dict, reps: int) -> dict[str, list[float]]:
    """Seconds of each function in each of `reps` rounds, after one warm-up round.

    Rounds interleave the functions, so a change in machine load hits all of them alike.
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default (bundled SmolLM2-135M), tiny, or a path")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--default-adamw", action="store_true", help="also time the raw step with torch's default AdamW")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast (default: bf16, the learner's CPU default)")
    args = parser.parse_args(argv)
    bf16 = not args.fp32

    try:
        model, _ = load_model(args.model)
    except UserError as err:
        if args.model != "default":
            raise
        print(f"model 'default' unavailable ({err}); using 'tiny'")
        args.model = "tiny"
        model, _ = load_model("tiny")
    model.eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    ids, adv = make_batch(vocab, args.batch, args.prompt, args.response)
    tokens = ids.numel()

    with torch.no_grad():  # fp32 old log-probs, as the engine returns them
        logits = model(input_ids=ids, use_cache=False).logits[:, args.prompt - 1 : -1].float()
        old = logits.log_softmax(-1).gather(-1, ids[:, args.prompt :, None]).squeeze(-1)
        del logits
    turns = [
        Turn(str(b), ids[b, : args.prompt].tolist(), ids[b, args.prompt :].tolist(), old[b].tolist(), adv[b].tolist())
        for b in range(args.batch)
    ]
    # A tiny learning rate: the weights barely move, so every repetition does the same work.
    config = LearnerConfig(lr=1e-7, mini_batch_size=args.batch, micro_batch_size=args.batch, shuffle=False, bf16=bf16)
    learner = TorchLearner(model, config)
    fused = bool(learner.optimizer.defaults.get("fused"))
    raw_same = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=fused or None)

    first = learner.update(turns)
    results = {
        "model": args.model,
        "tokens_per_step": tokens,
        "bf16": bf16,
        "fused_adamw": fused,
        "first_pass_ppo_kl_vs_fp32_old_logprobs": first["ppo_kl"],
        "first_pass_pg_clipfrac": first["pg_clipfrac"],
    }
    fns = {
        "raw": lambda: raw_step(model, raw_same, ids, adv, args.prompt, bf16),
        "learner": lambda: learner.update(turns),
    }
    if args.default_adamw:
        raw_plain = torch.optim.AdamW(model.parameters(), lr=1e-7)
        fns["raw_default_adamw"] = lambda: raw_step(model, raw_plain, ids, adv, args.prompt, bf16)
    load_before = os.getloadavg()[0]
    times = timed(fns, args.reps)
    for name, runs in times.items():
        seconds = statistics.median(runs)
        results[f"{name}_s"] = seconds
        results[f"{name}_tokens_per_s"] = tokens / seconds
        print(f"{name:>18}: {seconds:6.2f} s/step  {tokens / seconds:8.1f} tokens/s", flush=True)
    results["ratio_learner_over_raw"] = results["learner_tokens_per_s"] / results["raw_tokens_per_s"]
    # Each round times raw and learner back to back: the median of their ratios is the
    # figure least disturbed by other processes on a small machine.
    per_round = [r / l for r, l in zip(times["raw"], times["learner"])]
    results["ratio_per_round_median"] = statistics.median(per_round)
    results["loadavg_1min_before_after"] = [load_before, os.getloadavg()[0]]
    print(f"learner/raw = {results['ratio_learner_over_raw']:.2f} (median of per-round ratios "
          f"{results['ratio_per_round_median']:.2f}; goal >= 0.9); 1-min load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} (other processes slow both sides)")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
