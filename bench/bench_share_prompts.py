"""An update with ``learner.share_prompts`` against the same update without it, in one process.

A GRPO batch holds several samples of each prompt; without sharing, the learner forwards and
backwards the prompt once per sample, with it once per micro-batch row. Both learners train
the same model on the same turns (``--prompts`` prompts x ``--samples`` samples, random ids,
responses of varied length around ``--response`` tokens) with the README demo's batching
(``mini_batch_size`` 16, ``micro_batch_size`` 4, seeded shuffle, so a group's samples are
spread over the mini-batches as in a run); the defaults are the RAG QA demo's answerer turns
(8 x 4, ~100-token prompts, ~12-token answers).

    python bench/bench_share_prompts.py [--model default|tiny|PATH] [--prompts 8] [--samples 4]
        [--prompt 100] [--response 12] [--reps 3] [--fp32]
    python bench/bench_share_prompts.py --trajectories RUN_DIR/trajectories/step_000001.jsonl [--role answer]

``--trajectories`` takes the turns of one training step of a run instead (the exact prompt
and response ids its trainable calls had; advantages drawn at random, which changes no
cost), so the figure is that of a real batch: in the RAG QA demo the rewriter is sampled, so
only some of a group's answerer prompts are equal.

Prints seconds per update of each, tokens forwarded, the ratio plain / shared (goal: above
1, the more the longer the prompt) and a final JSON line; rounds interleave the two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_learner import timed  # noqa: E402

from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.learners import LearnerConfig, TorchLearner, Turn  # noqa: E402

__all__ = ["main", "grouped_turns"]


def grouped_turns(vocab: int, prompts: int, samples: int, prompt: int, response: int, seed: int = 0) -> list[Turn]:
    """`samples` turns per prompt, response lengths spread over [response/2, 3*response/2]."""
    g = torch.Generator().manual_seed(seed)
    turns = []
    for i in range(prompts):
        ids = torch.randint(10, vocab, (prompt,), generator=g).tolist()
        for j in range(samples):
            n = max(1, response // 2 + (j * response) // max(1, samples - 1))
            turns.append(Turn(f"{i}.{j}", ids, torch.randint(10, vocab, (n,), generator=g).tolist(), [-1.0] * n,
                              float(torch.randn((), generator=g))))
    return turns


def run_turns(path: str, role: str | None) -> list[Turn]:
    """The trainable calls (of `role`, if given) of one trajectories file, as turns."""
    g = torch.Generator().manual_seed(0)
    turns = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        for call in (json.loads(line).get("llm_calls") or []) if line.strip() else []:
            if call.get("trainable") and call.get("response_ids") and (role is None or call.get("role") == role):
                turns.append(Turn(call["id"], call["prompt_ids"], call["response_ids"], call["response_logprobs"],
                                  float(torch.randn((), generator=g))))
    if not turns:
        raise SystemExit(f"{path} holds no trainable calls{f' of role {role!r}' if role else ''} with token ids")
    return turns


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default (bundled SmolLM2-135M), tiny, or a path")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--response", type=int, default=12)
    parser.add_argument("--trajectories", default=None, help="a run's trajectories/step_N.jsonl: its turns instead")
    parser.add_argument("--role", default=None,
                        help="with --trajectories: only the calls of this role (the policy map's role name, e.g. answer)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast (default: the learner's `auto`)")
    args = parser.parse_args(argv)
    model, _ = load_model(args.model)
    vocab = model.get_output_embeddings().weight.shape[0]
    turns = run_turns(args.trajectories, args.role) if args.trajectories else \
        grouped_turns(vocab, args.prompts, args.samples, args.prompt, args.response)
    # a tiny learning rate: the weights barely move, so every repetition does the same work
    base = dict(lr=1e-7, mini_batch_size=16, micro_batch_size=4, **({"bf16": False} if args.fp32 else {}))
    plain = TorchLearner(model, LearnerConfig(**base))
    shared = TorchLearner(model, LearnerConfig(**base, share_prompts=True))
    tokens = {"plain": plain.update(turns)["tokens"], "shared": shared.update(turns)["tokens"]}
    results: dict = {"model": args.model, "turns": len(turns), "distinct_prompts": len({tuple(t.prompt_ids) for t in turns}),
                     "prompt_tokens": sum(len(t.prompt_ids) for t in turns) / len(turns),
                     "response_tokens": sum(len(t.response_ids) for t in turns) / len(turns),
                     "source": args.trajectories or "random", "bf16": plain.bf16}
    print(f"{len(turns)} turns, {results['distinct_prompts']} distinct prompts, mean prompt "
          f"{results['prompt_tokens']:.0f} and response {results['response_tokens']:.0f} tokens", flush=True)
    load_before = os.getloadavg()[0]
    times = timed({"plain": lambda: plain.update(turns), "shared": lambda: shared.update(turns)}, args.reps)
    for name, runs in times.items():
        results[f"{name}_s"] = statistics.median(runs)
        results[f"{name}_tokens"] = tokens[name]
        print(f"{name:>7}: {results[f'{name}_s']:6.2f} s/update, {tokens[name]:.0f} tokens forwarded", flush=True)
    results["ratio_plain_over_shared"] = results["plain_s"] / results["shared_s"]
    results["ratio_per_round_median"] = statistics.median(p / s for p, s in zip(times["plain"], times["shared"]))
    results["loadavg_1min_before_after"] = [load_before, os.getloadavg()[0]]
    print(f"plain / shared = {results['ratio_plain_over_shared']:.2f} (median of per-round ratios "
          f"{results['ratio_per_round_median']:.2f}); tokens {tokens['plain'] / tokens['shared']:.2f}x fewer; "
          f"1-min load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
