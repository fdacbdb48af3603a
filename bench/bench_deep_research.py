"""Held-out reward before -> after training on the deep research example, three seeds.

    .venv/bin/python bench/bench_deep_research.py [--seeds 0 1 2] [--model default] [--no-warm-start]
                                                  [--out runs/deep_research] [-- KEY=VALUE ...]

First (unless --no-warm-start) the demonstrations: `demos.py` next to the app runs it on
`train.jsonl` with a scripted teacher that delegates well, into OUT/sft.jsonl (one warm-start
line per model call of the three agents). Then for each seed S: `mas-trainer fit
examples/langgraph_apps/deep_research/app.py:graph --warm-start OUT/sft.jsonl` on `train.jsonl`
(held-out evaluations on `heldout.jsonl`, seed=S; the one at step 0 comes after the warm start,
before any RL) into OUT/seed-S, then
`mas-trainer eval ... --run OUT/seed-S --compare base --seed S --temperature 0` on
`heldout.jsonl`: the trained policies (lead, research, critic) and their base models on the same
held-out tasks with the same sampling seed. Nothing forces delegation during fit or eval
(that is the tests' middleware): the lead earns the answer only by handing the question to the
researcher itself. The bundled SmolLM2-135M (`--model default`) never does (0 reward on base,
docs/agents.md), so without the warm start GRPO gets no signal from it.
Prints per seed the held-out reward of base and trained, the paired difference and its standard
error, each agent's role reward, and the held-out reward after the warm start alone; writes
OUT/deep_research.json (every eval's JSON and the held-out curve).
KEY=VALUE after `--` are passed to fit as config overrides (they replace the defaults below).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP_DIR = "examples/langgraph_apps/deep_research"
APP = f"{APP_DIR}/app.py:graph"
FIT = ["steps=40", "rollout.tasks_per_step=8", "rollout.n=4", "rollout.max_tokens=96", "learner.lr=1e-5", "eval_every=10",
       "rollout.val_temperature=0"]
WARM = ["warm_start.steps=30", "warm_start.batch_size=8", "warm_start.lr=5e-5"]
ROLES = ("lead", "researcher", "critic")


def run_seed(seed: int, model: str, out: Path, overrides: list[str], demos: Path | None) -> dict:
    run = out / f"seed-{seed}"
    cli = [sys.executable, "-m", "mas_trainer.cli"]
    warm = ["--warm-start", str(demos), *WARM] if demos is not None else []
    subprocess.run([*cli, "fit", APP, "--data", f"{APP_DIR}/train.jsonl", "--val-data", f"{APP_DIR}/heldout.jsonl",
                    "--model", model, "--output", str(run), f"seed={seed}", *warm, *(overrides or FIT)], cwd=ROOT, check=True)
    done = subprocess.run([*cli, "eval", APP, "--data", f"{APP_DIR}/heldout.jsonl", "--run", str(run), "--compare", "base",
                           "--seed", str(seed), "--temperature", "0", "--output", str(run / "heldout_compare.json")],
                          cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True)
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines() if r.strip()]
    return {**json.loads(done.stdout), "heldout_curve": {r["step"]: r["reward/mean"] for r in rows if r.get("kind") == "val"}}


def line(seed: int, result: dict) -> str:
    overall = result["paired"]["reward/mean"]
    se = f" ± {overall['std_error']:.3f}" if overall["std_error"] is not None else ""
    roles = "  ".join(f"{r} {p['base']:.2f} -> {p['trained']:.2f}" for r in ROLES
                      if (p := result["paired"].get(f"reward/role/{r}")) is not None)
    curve = result.get("heldout_curve") or {}
    warm = f"  (fit's held-out at step 0, after the warm start: {curve[0]:.3f})" if 0 in curve else ""
    return (f"seed {seed}: held-out reward {overall['base']:.3f} -> {overall['trained']:.3f} "
            f"(difference {overall['difference']:+.3f}{se}, {overall['tasks']} tasks)  {roles}{warm}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--model", default="default", help="tiny | default (the bundled SmolLM2-135M) | PATH")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "deep_research")
    parser.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                        help="no demonstrations: RL from the base model alone")
    parser.add_argument("overrides", nargs="*", help="fit config overrides (after --), replacing the defaults")
    args = parser.parse_args(argv)
    demos = None
    if args.warm_start:
        demos = args.out / "sft.jsonl"
        subprocess.run([sys.executable, f"{APP_DIR}/demos.py", "--data", f"{APP_DIR}/train.jsonl", "--out", str(demos)],
                       cwd=ROOT, check=True)
    results = {}
    for seed in args.seeds:
        results[seed] = run_seed(seed, args.model, args.out, args.overrides, demos)
        print(line(seed, results[seed]), flush=True)
    (args.out / "deep_research.json").write_text(json.dumps({str(s): r for s, r in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
