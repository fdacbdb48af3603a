"""Rollout-shaped engine work with the prefix cache and the fast decode off and on, in one process.

An agentic step as the engine sees it: G tasks x n samples, each a conversation of T turns
with one system prompt; turn t re-sends the system prompt, the question and every earlier turn
(answer + tool result). Each turn's requests of all rollouts go out together, as a graph's
node calls do; every request decodes `--max-tokens` tokens (seeded sampling, end of turn
ignored), so every engine does the same decoding. Four engines, each on its own copy of the
weights: `before` (the engine before issue #30: Hugging Face's cache and attention, a full sort
for top-p, no prefix cache), `cache` (the prefix cache alone), `fast_decode` (alone), `both`.

    .venv/bin/python bench/bench_prefix_cache.py [--model default|tiny|PATH] [--tasks 4] [--n 4] [--turns 4] \
        [--max-tokens 16] [--repeats 2]
    .venv/bin/python bench/bench_prefix_cache.py --fit agentic_search [--steps 2] [--arms before,both] [--out runs/prefix]

`--fit NAME` instead runs `mas-trainer fit` on an example app (``agentic_search``: its README
command; ``rag_qa``: the main command's settings) for `--steps` steps with each of `--arms`
(`runtime.fast_decode` and `runtime.prefix_cache_mb` set as the arm says), one after the other,
and prints each step's rollout seconds (`time/rollout_s`) side by side, as ratios to the first.

Prints seconds per step for each engine (best of `--repeats`, the engines alternating), the
ratios to `before` (goal for `both`: <= 0.6 on agentic-search-shaped work), the hit rate and
prefill tokens saved, and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import subprocess
import time
from pathlib import Path

import torch

from mas_trainer.engines.base import SamplingParams
from mas_trainer.engines.chat import HFChatFormat
from mas_trainer.engines.models import load_model
from mas_trainer.engines.torch_engine import TorchEngine
from mas_trainer.engines.config import EngineSettings

SYSTEM = ("You are a research agent. Answer the user's question about the fictional world in the corpus. "
          "Think step by step. To search the corpus, reply with a line SEARCH: <query>; the tool answers with "
          "the best passages. When you know the answer, reply with ANSWER: <short answer>. Use only facts from "
          "the passages; if they do not say, search again with other words.")
TOOL = ("Passage 1: The town of Elmsworth lies on the river Arden and was founded by the Harrow family. "
        "Passage 2: Its mill, built in 1820, was run by Mara Quill until the flood.")


def conversations(tasks: int, turns: int) -> list[list[list[dict]]]:
    """Per task, the messages of each turn (turn t carries turns 0..t-1 with a tool result)."""
    out = []
    for i in range(tasks):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: who ran the mill of town {i}?"}]
        per_turn = []
        for t in range(turns):
            per_turn.append(list(msgs))
            msgs += [{"role": "assistant", "content": f"SEARCH: mill town {i} step {t}"}, {"role": "user", "content": TOOL}]
        out.append(per_turn)
    return out


async def step(engine: TorchEngine, prompts: list[list[list[int]]], n: int, max_tokens: int) -> float:
    """One step: every turn's requests of all rollouts at once, turn after turn."""
    t0 = time.perf_counter()
    for t in range(len(prompts[0])):
        await asyncio.gather(*(engine.generate(p[t], SamplingParams(n=n, max_tokens=max_tokens, seed=k, ignore_eos=True))
                               for k, p in enumerate(prompts)))
    return time.perf_counter() - t0


ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "langgraph_apps"
FITS = {
    "agentic_search": [f"{EXAMPLES}/agentic_search/app.py:graph", "--data", f"{EXAMPLES}/agentic_search/mixed_train.jsonl",
                       "rollout.tasks_per_step=8", "rollout.n=4", "rollout.timeout_s=900", "learner.lr=2e-5",
                       "learner.mini_batch_size=16", "runtime.max_batch_size=32"],
    "rag_qa": [f"{EXAMPLES}/rag_qa/app.py:graph_answerer", "--data", f"{EXAMPLES}/rag_qa/train.jsonl",
               "rollout.tasks_per_step=8", "rollout.n=4", "rollout.temperature=0.7", "learner.lr=2e-5",
               "learner.mini_batch_size=16", "learner.share_prompts=true", "runtime.max_batch_size=32"],
}


# the engine before this work (Hugging Face's cache and attention, a full sort for top-p, no prefix cache), the
# prefix cache alone, the fast decode alone, both: arm -> (runtime.fast_decode, prefix cache on)
ARMS = {"before": (False, False), "cache": (False, True), "fast_decode": (True, False), "both": (True, True)}


def fit_side_by_side(name: str, steps: int, out: Path, cache_mb: float, arms: list[str]) -> None:
    """Rollout seconds per step of the same fit with each engine arm, one after the other."""
    rows = {}
    for arm in arms:
        run = out / f"{name}-{arm}"
        cmd = [str(ROOT / ".venv" / "bin" / "mas-trainer"), "fit", *FITS[name], "--model", "default", "--output", str(run),
               f"steps={steps}", f"save_every={steps}", "eval_every=1000", "runtime.execution=local", "logger=[console]",
               f"runtime.fast_decode={str(ARMS[arm][0]).lower()}", f"runtime.prefix_cache_mb={cache_mb if ARMS[arm][1] else 0}",
               "seed=0"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows[arm] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    base = arms[0]
    for i, first in enumerate(rows[base]):
        cells = []
        for arm in arms:
            row = rows[arm][i]
            rate = next((v for k, v in row.items() if k.endswith("engine/prefix_hit_rate")), None)
            cells.append(f"{arm} {row['time/rollout_s']:.1f} s ({row['time/rollout_s'] / first['time/rollout_s']:.2f}"
                         + (f", hit rate {rate:.0%})" if rate is not None else ")"))
        print(f"{name} step {first['step']}: rollouts " + ", ".join(cells))
    total = {arm: sum(r["time/rollout_s"] for r in rs) for arm, rs in rows.items()}
    print(json.dumps({"fit": name, "steps": steps, **{f"rollout_s_{arm}": total[arm] for arm in arms},
                      **{f"ratio_{arm}": total[arm] / total[base] for arm in arms[1:]}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", choices=sorted(FITS), default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="runs/prefix")
    ap.add_argument("--model", default="default")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cache-mb", type=float, default=256)
    ap.add_argument("--arms", default="before,both", help=f"--fit: engine arms, the first the baseline ({', '.join(ARMS)})")
    args = ap.parse_args()
    if args.fit:
        return fit_side_by_side(args.fit, args.steps, Path(args.out), args.cache_mb, args.arms.split(","))
    model, tok = load_model(args.model)
    fmt = HFChatFormat(tok)
    prompts = [[fmt.render(m) for m in conv] for conv in conversations(args.tasks, args.turns)]
    # each engine its own copy of the weights: fast_decode routes its model's attention (engines/kv.py)
    engines = {name: TorchEngine(copy.deepcopy(model), tok, model_name=name, settings=EngineSettings(max_batch_size=args.tasks * args.n, prefix_cache_mb=args.cache_mb if cache else 0, fast_decode=fast, engine_bf16=False))
               for name, (fast, cache) in ARMS.items()}
    best = {name: float("inf") for name in engines}
    try:
        for r in range(args.repeats):
            for name, engine in engines.items():
                if engine._prefix is not None:
                    engine._prefix.clear()  # each step starts cold, as after a weight update
                before = dict(engine.stats)
                seconds = asyncio.run(step(engine, prompts, args.n, args.max_tokens))
                best[name] = min(best[name], seconds)
                asked = engine.stats["prompt_tokens"] - before["prompt_tokens"]
                saved = engine.stats["cached_tokens"] - before["cached_tokens"]
                print(f"repeat {r} {name:>7}: {seconds:6.2f} s, prompt tokens {asked}, prefill saved {saved}"
                      f" ({saved / asked:.0%})", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    ratios = {name: best[name] / best["before"] for name in engines}
    on = engines["both"].stats
    print(f"{args.model}: {args.tasks} tasks x {args.n} samples x {args.turns} turns, {args.max_tokens} tokens a turn, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}, seconds a step / the engine before:")
    for name in engines:
        print(f"  {name:>7}: {best[name]:6.2f} s = {ratios[name]:.2f}" + ("  (goal <= 0.6)" if name == "both" else ""))
    print(json.dumps({"model": args.model, "tasks": args.tasks, "n": args.n, "turns": args.turns, "max_tokens": args.max_tokens,
                      **{f"{name}_s": best[name] for name in engines}, "ratio": ratios["both"],
                      "hit_rate": on["cached_tokens"] / max(1, on["prompt_tokens"])}))


if __name__ == "__main__":
    main()
