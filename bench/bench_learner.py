"""Throughput of the embedded learner against a raw torch training step, in one thread.

The learner adds verl's policy loss, mini/micro-batching, packing, gradient clipping and
metrics around a forward/backward/AdamW step; this measures what that costs. Both sides
train the same model on the same batch (4 sequences x 256 tokens: 128 prompt + 128
response, random ids) with the same autocast and AdamW settings; the raw step is
forward, log_softmax + gather over response tokens, -(logp * adv).mean(), backward, step.

    python bench/bench_learner.py [--model default|tiny|PATH] [--reps 3] [--fp32]

Prints one line per measurement and a final JSON line; the goal is learner/raw >= 0.9.
Also reported: the raw step with torch's default (unfused) AdamW, and the learner's
first-pass ``ppo_kl`` when old log-probs come from an fp32 forward (as the engine's do):
the bf16/fp32 numerics mismatch PPO sees on its first pass.
"""

from __future__ import annotations

import argparse
import json
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


def timed(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default (bundled SmolLM2-135M), tiny, or a path")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
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
    raw_plain = torch.optim.AdamW(model.parameters(), lr=1e-7)

    first = learner.update(turns)
    results = {
        "model": args.model,
        "tokens_per_step": tokens,
        "bf16": bf16,
        "fused_adamw": fused,
        "first_pass_ppo_kl_vs_fp32_old_logprobs": first["ppo_kl"],
    }
    for name, fn in [
        ("raw", lambda: raw_step(model, raw_same, ids, adv, args.prompt, bf16)),
        ("learner", lambda: learner.update(turns)),
        ("raw_default_adamw", lambda: raw_step(model, raw_plain, ids, adv, args.prompt, bf16)),
    ]:
        seconds = timed(fn, args.reps)
        results[f"{name}_s"] = seconds
        results[f"{name}_tokens_per_s"] = tokens / seconds
        print(f"{name:>18}: {seconds:6.2f} s/step  {tokens / seconds:8.1f} tokens/s", flush=True)
    results["ratio_learner_over_raw"] = results["learner_tokens_per_s"] / results["raw_tokens_per_s"]
    results["ratio_learner_over_raw_default_adamw"] = (
        results["learner_tokens_per_s"] / results["raw_default_adamw_tokens_per_s"]
    )
    print(f"learner/raw = {results['ratio_learner_over_raw']:.2f} (goal >= 0.9); "
          f"learner/raw with torch's default AdamW = {results['ratio_learner_over_raw_default_adamw']:.2f}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
