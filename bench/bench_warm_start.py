"""Does a supervised warm start make the tools example learnable? `fit` with and without it.

The bundled model never calls the calculator on its own (bench_tool_calls.py), so on arithmetic
it cannot do in its head the tools example (`examples/langgraph_apps/tools_agent.py`) scores 0
in every rollout and GRPO has nothing to learn from. Here a scripted teacher writes good
tool-calling turns in the format `mas-trainer data` writes (sft.jsonl): for each training
question the call `calculator(expression)` and, after the tool's result, the final answer,
with the app's own system prompt and tool definition. Then, per seed, two runs of `fit`
on the same tasks and options: `--warm-start sft.jsonl` and none. The held-out reward at step
0 is measured after the warm start (before any RL), and again after the RL steps.

    .venv/bin/python bench/bench_warm_start.py [--seeds 0 1 2] [--steps 4] [--out runs/warm_start] [key=value ...]

Writes OUT/data/{train,heldout,sft}.jsonl, one run directory per arm and seed, and
OUT/warm_start.json; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "langgraph_apps" / "tools_agent.py"
OPTIONS = ["rollout.tasks_per_step=4", "rollout.n=4", "rollout.temperature=0.7",
           "rollout.max_tokens=64", "rollout.val_temperature=0", "learner.lr=2e-5", "runtime.execution=local",
           "runtime.max_batch_size=32", "save_every=1000", "logger=[console]"]


def questions(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """(expression, question) pairs a 135M model cannot do in its head: three-digit products and mixes."""
    out = []
    for _ in range(n):
        a, b, c = rng.randint(101, 999), rng.randint(11, 99), rng.randint(101, 999)
        expression = rng.choice([f"{a} * {b}", f"({a} + {c}) * {b}", f"{a} * {b} - {c}"])
        out.append((expression, rng.choice(["What is {}?", "Compute {}.", "Calculate {}."]).format(expression)))
    return out


def write_data(folder: Path, train: int, heldout: int) -> None:
    """Tasks (the app's input plus `answer`) and the teacher's turns, from fixed seeds."""
    sys.path.insert(0, str(APP.parent))
    os.environ.setdefault("OPENAI_API_KEY", "unused")  # the app builds its client at import; nothing is called here
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from tools_agent import SYSTEM_PROMPT, calculator  # type: ignore[import-not-found]

    folder.mkdir(parents=True, exist_ok=True)
    tool = convert_to_openai_tool(calculator)  # as ChatOpenAI.bind_tools sends it
    rng = random.Random(1234)
    split = {"train": questions(rng, train), "heldout": questions(rng, heldout)}
    for name, rows in split.items():
        tasks = [{"messages": [{"role": "user", "content": q}], "answer": calculator.invoke({"expression": e})} for e, q in rows]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    lines = []
    for i, (expression, question) in enumerate(split["train"]):
        result = calculator.invoke({"expression": expression})
        call = {"id": f"call_{i:024x}", "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
        asked = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        base = {"policy": "agent", "role": "agent", "node": "agent", "run_id": f"{i:032x}", "score": 1.0, "tools": [tool]}
        lines.append({**base, "messages": asked,
                      "completion": {"role": "assistant", "content": None, "tool_calls": [call]}})
        lines.append({**base, "messages": [*asked, {"role": "assistant", "content": None, "tool_calls": [call]},
                                           {"role": "tool", "tool_call_id": call["id"], "content": result}],
                      "completion": {"role": "assistant", "content": f"The answer is {result}.", "tool_calls": []}})
    (folder / "sft.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def held_out(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["reward/mean"] for r in rows if r["kind"] == "val"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--train", type=int, default=48)
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--out", default="runs/warm_start")
    ap.add_argument("--model", default="default", help="default: the bundled SmolLM2-135M; tiny: a wiring check")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    data = out / "data"
    write_data(data, args.train, args.heldout)
    results = []
    for seed in args.seeds:
        for arm in ("warm_start", "none"):  # alternating: a drift of the machine hits both
            run = out / f"{arm}-{seed}"
            extra = ["--warm-start", str(data / "sft.jsonl")] if arm == "warm_start" else []
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "mas_trainer.cli", "fit", f"{APP}:graph", "--data", str(data / "train.jsonl"),
                            "--val-data", str(data / "heldout.jsonl"), "--output", str(run), *extra, "--model", args.model, *OPTIONS,
                            f"steps={args.steps}", f"eval_every={args.steps}", f"seed={seed}", *args.overrides], check=True)
            scores = held_out(run)
            results.append({"arm": arm, "seed": seed, "heldout": scores, "wall_s": time.perf_counter() - t0})
            print(f"{arm:>10} seed {seed}: held-out reward " + ", ".join(f"step {s} {v:.3f}" for s, v in sorted(scores.items())),
                  flush=True)
    (out / "warm_start.json").write_text(json.dumps(results, indent=1))
    print("| arm | seed | held-out reward, step 0 | after the last step | wall time |\n|---|---|---|---|---|")
    for r in results:
        steps = sorted(r["heldout"])
        print(f"| {r['arm']} | {r['seed']} | {r['heldout'][steps[0]]:.3f} | {r['heldout'][steps[-1]]:.3f} | {r['wall_s'] / 60:.1f} min |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
