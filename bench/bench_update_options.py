"""What each cheaper-update option saves: one update of the same turns under the shipped
command's learner (full fine-tuning) and under LoRA, LoRA on the top layers, and each with
shared prompts, in one process.

    python bench/bench_update_options.py [--model default|tiny|PATH] [--layers 8] [--reps 2] [--fp32]
    python bench/bench_update_options.py --trajectories RUN_DIR/trajectories/step_000001.jsonl --role answer

The turns are bench_share_prompts.py's (default: the RAG QA demo's answerer shape, 8 prompts x
4 samples of ~100 + ~12 tokens; ``--trajectories``: the exact turns of one step of a run), the
batching the demo's (``mini_batch_size`` 16, ``micro_batch_size`` 4). Each option trains its
own copy of the model (peft injects adapters in place); a tiny learning rate keeps every
repetition the same work. Rounds interleave the options, so machine load hits them alike.
Prints seconds per update, the ratio full / option (above 1: cheaper) and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_learner import timed  # noqa: E402
from bench_share_prompts import grouped_turns, run_turns  # noqa: E402

from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.learners import LearnerConfig, TorchLearner  # noqa: E402

__all__ = ["main", "options"]


def options(layers: int) -> dict[str, dict]:
    """The learner settings compared, by name; "full" (the shipped command's) is the baseline."""
    lora = dict(lora_rank=16, lora_alpha=32)
    return {
        "full": {},
        "lora": lora,
        f"lora_top{layers}": dict(lora, lora_layers=layers),
        "lora+share": dict(lora, share_prompts=True),
        f"lora_top{layers}+share": dict(lora, lora_layers=layers, share_prompts=True),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default (bundled SmolLM2-135M), tiny, or a path")
    parser.add_argument("--layers", type=int, default=8, help="learner.lora_layers of the top-layers options")
    parser.add_argument("--trajectories", default=None, help="a run's trajectories/step_N.jsonl: its turns instead")
    parser.add_argument("--role", default=None, help="with --trajectories: only the calls of this role (e.g. answer)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast (default: the learner's `auto`)")
    args = parser.parse_args(argv)
    base = dict(lr=1e-7, mini_batch_size=16, micro_batch_size=4, **({"bf16": False} if args.fp32 else {}))
    learners = {}
    for name, extra in options(args.layers).items():
        model, _ = load_model(args.model, seed=0)
        learners[name] = TorchLearner(model, LearnerConfig(**base, **extra))
    vocab = learners["full"].model.get_output_embeddings().weight.shape[0]
    turns = run_turns(args.trajectories, args.role) if args.trajectories else grouped_turns(vocab, 8, 4, 100, 12)
    trainable = {name: sum(p.numel() for p in lr.model.parameters() if p.requires_grad) for name, lr in learners.items()}
    print(f"{len(turns)} turns, {len({tuple(t.prompt_ids) for t in turns})} distinct prompts, mean prompt "
          f"{statistics.fmean(len(t.prompt_ids) for t in turns):.0f} and response "
          f"{statistics.fmean(len(t.response_ids) for t in turns):.0f} tokens", flush=True)
    load_before = os.getloadavg()[0]
    times = timed({name: (lambda lr=lr: lr.update(turns)) for name, lr in learners.items()}, args.reps)
    full = statistics.median(times["full"])
    results: dict = {"model": args.model, "turns": len(turns), "source": args.trajectories or "random",
                     "bf16": learners["full"].bf16, "options": {}}
    for name, runs in times.items():
        seconds = statistics.median(runs)
        results["options"][name] = {"s_per_update": seconds, "ratio_full_over_this": full / seconds,
                                    "trainable_params": trainable[name], "rounds_s": runs}
        print(f"{name:>18}: {seconds:6.2f} s/update  full/this {full / seconds:5.2f}  "
              f"{trainable[name] / 1e6:7.2f} M trainable", flush=True)
    results["loadavg_1min_before_after"] = [load_before, os.getloadavg()[0]]
    print(f"1-min load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
