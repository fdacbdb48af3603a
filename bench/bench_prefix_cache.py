"""Rollout-shaped engine work with the prefix cache off and on, in one process.

An agentic step as the engine sees it: G tasks x n samples, each a conversation of T turns
with one system prompt; turn t re-sends the system prompt, the question and every earlier turn
(answer + tool result). Each turn's requests of all rollouts go out together, as a graph's
node calls do; every request decodes `--max-tokens` tokens (seeded sampling, end of turn
ignored), so both engines do the same decoding and differ only in what they prefill.

    .venv/bin/python bench/bench_prefix_cache.py [--model default|tiny|PATH] [--tasks 4] [--n 4] [--turns 4] \
        [--max-tokens 16] [--repeats 2]
    .venv/bin/python bench/bench_prefix_cache.py --fit agentic_search [--steps 2] [--out runs/prefix]

`--fit NAME` instead runs `mas-trainer fit` on an example app (``agentic_search``: its README
command; ``rag_qa``: the main command's settings) for `--steps` steps, once with the cache off
and once on, and prints each step's rollout seconds (`time/rollout_s`) side by side.

Prints seconds per step for each engine (best of `--repeats`, the two alternating), the
on/off ratio (goal: <= 0.6 on agentic-search-shaped work), the hit rate and prefill tokens
saved, and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from pathlib import Path

import torch

from mas_trainer.engines.base import SamplingParams
from mas_trainer.engines.chat import HFChatFormat
from mas_trainer.engines.models import load_model
from mas_trainer.engines.torch_engine import TorchEngine

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


def fit_side_by_side(name: str, steps: int, out: Path, cache_mb: float) -> None:
    """Rollout seconds per step of the same fit with the prefix cache off, then on."""
    rows = {}
    for arm, mb in (("off", 0), ("on", cache_mb)):
        run = out / f"{name}-{arm}"
        cmd = [str(ROOT / ".venv" / "bin" / "mas-trainer"), "fit", *FITS[name], "--model", "default", "--output", str(run),
               f"steps={steps}", f"save_every={steps}", "eval_every=1000", "runtime.execution=local", "logger=[console]",
               f"runtime.prefix_cache_mb={mb}", "seed=0"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows[arm] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    for off, on in zip(rows["off"], rows["on"]):
        rate = next((v for k, v in on.items() if k.endswith("engine/prefix_hit_rate")), 0.0)
        print(f"{name} step {off['step']}: rollouts off {off['time/rollout_s']:.1f} s, on {on['time/rollout_s']:.1f} s "
              f"= {on['time/rollout_s'] / off['time/rollout_s']:.2f}; hit rate {rate:.0%}")
    total = {arm: sum(r["time/rollout_s"] for r in rs) for arm, rs in rows.items()}
    print(json.dumps({"fit": name, "steps": steps, "rollout_s_off": total["off"], "rollout_s_on": total["on"],
                      "ratio": total["on"] / total["off"]}))


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
    args = ap.parse_args()
    if args.fit:
        return fit_side_by_side(args.fit, args.steps, Path(args.out), args.cache_mb)
    model, tok = load_model(args.model)
    fmt = HFChatFormat(tok)
    prompts = [[fmt.render(m) for m in conv] for conv in conversations(args.tasks, args.turns)]
    engines = {"off": TorchEngine(model, tok, model_name="off", max_batch_size=args.tasks * args.n),
               "on": TorchEngine(model, tok, model_name="on", max_batch_size=args.tasks * args.n, prefix_cache_mb=args.cache_mb)}
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
                print(f"repeat {r} cache {name:>3}: {seconds:6.2f} s, prompt tokens {asked}, prefill saved {saved}"
                      f" ({saved / asked:.0%})", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    ratio = best["on"] / best["off"]
    on = engines["on"].stats
    print(f"{args.model}: {args.tasks} tasks x {args.n} samples x {args.turns} turns, {args.max_tokens} tokens a turn, "
          f"{torch.get_num_threads()} threads: cache on {best['on']:.2f} s / off {best['off']:.2f} s = {ratio:.2f} (goal <= 0.6)")
    print(json.dumps({"model": args.model, "tasks": args.tasks, "n": args.n, "turns": args.turns, "max_tokens": args.max_tokens,
                      "off_s": best["off"], "on_s": best["on"], "ratio": ratio,
                      "hit_rate": on["cached_tokens"] / max(1, on["prompt_tokens"])}))


if __name__ == "__main__":
    main()
