"""Time to held-out exact match 0.9 on the RAG QA demo: the old command vs the new one.

    .venv/bin/python bench/bench_time_to_target.py [--old 1] [--new 3] [--out runs/ttt]
    .venv/bin/python bench/bench_time_to_target.py --analyze runs/ttt/old-0 runs/ttt/new-0 ...

Runs `mas-trainer fit` with the previous main command (OLD: the arguments scripts/demo.sh and the
README gave until 2026-12-02) and with the main command now (NEW: scripts/demo.sh and the README:
training rollouts sampled at temperature 0.7, dynamic sampling with rollout.min_groups, shared
prompts, turn skipping, finer evaluations), one run after the other on this machine,
alternating old and new so that a drift of the machine hits both. Run i of either command
uses seed i (so `--old 3 --new 3` pairs seeds 0, 1, 2; `--first-seed 1` starts at seed 1),
unless a `seed=` override fixes one seed for all.
Each run's held-out evaluations are scored with the example's SQuAD metrics; its time to
target is the run's wall time (`time/elapsed_s`, start-up included) at the first evaluation
whose exact match reaches --target. Prints one line per run, the median of each command and
the ratio new / old; writes OUT/time_to_target.json and OUT/time_to_target.png (exact match
against wall time, every run). A run that never reaches the target counts as its whole wall
time and is marked "not reached" (so the ratio is then an upper bound for the new command).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAG = ROOT / "examples" / "langgraph_apps" / "rag_qa"
sys.path.insert(0, str(RAG.parent))
from rag_qa.report import report  # noqa: E402

COMMON = ["examples/langgraph_apps/rag_qa/app.py:graph_answerer",
          "--data", "examples/langgraph_apps/rag_qa/train.jsonl", "--val-data", "examples/langgraph_apps/rag_qa/heldout.jsonl",
          "--model", "default"]
# The previous main command (scripts/demo.sh and the README until 2026-12-02): full fine-tuning, every turn in
# every update, training rollouts sampled as the app asks (temperature 1), an evaluation every 10 steps.
OLD = ["steps=55", "rollout.tasks_per_step=8", "rollout.n=4", "rollout.val_temperature=0", "eval_every=10", "save_every=10",
       "learner.lr=2e-5", "learner.mini_batch_size=16", "runtime.execution=local", "runtime.max_batch_size=32"]
# The main command now (scripts/demo.sh and the README; tests/bench/test_time_to_target.py keeps them equal): training
# rollouts at temperature 0.7 (a group's samples stay near the greedy reply, so fewer score zero), dynamic sampling
# (groups with no spread left out, a second draw while fewer than 4 of 8 have spread), each distinct prompt run once
# per micro-batch, no update on zero-advantage turns, an evaluation every 5 steps, a stop once held-out F1 reaches 0.98
# or gains less than 0.01 in 3 evaluations (added after the runs of docs/results/rag_qa.md: it would have stopped two
# of them at step 35, after their first exact match >= 0.9). (LoRA adapters made a step about 1.3x cheaper but did not
# learn faster per step: README.)
NEW = ["steps=40", "rollout.tasks_per_step=8", "rollout.n=4", "rollout.temperature=0.7", "rollout.val_temperature=0",
       "rollout.filter_groups=true", "rollout.min_groups=4", "eval_every=5", "save_every=10", "learner.lr=2e-5",
       "learner.mini_batch_size=16", "learner.share_prompts=true", "learner.skip_zero_advantage=true",
       "runtime.execution=local", "runtime.max_batch_size=32", "best.target=0.98", "best.patience=3", "best.min_delta=0.01"]


def run(out: Path, args: list[str], extra: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        raise SystemExit(f"{out} exists; pick another --out or remove it")
    cmd = [str(ROOT / ".venv" / "bin" / "mas-trainer"), "fit", *COMMON, "--output", str(out), *args, *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def analyze(run_dir: Path, target: float) -> dict:
    """Time to target, final scores and wall time of one finished run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    elapsed = {r["step"]: r["time/elapsed_s"] for r in rows if r["kind"] == "val"}
    scores = report(run_dir)
    curve = [(elapsed[s], scores[s]["exact_match"]["mean"], scores[s]["f1"]["mean"]) for s in sorted(scores) if s in elapsed]
    reached = next(((s, elapsed[s]) for s in sorted(scores) if s in elapsed and scores[s]["exact_match"]["mean"] >= target), None)
    last = max(scores)
    return {
        "run": str(run_dir), "target": target,
        "reached_step": reached[0] if reached else None,
        "time_to_target_s": reached[1] if reached else rows[-1]["time/elapsed_s"],
        "reached": reached is not None,
        "final_step": last, "final_em": scores[last]["exact_match"]["mean"], "final_f1": scores[last]["f1"]["mean"],
        "final_em_sem": scores[last]["exact_match"]["sem"],
        "best_em": max(s["exact_match"]["mean"] for s in scores.values()),
        "wall_s": rows[-1]["time/elapsed_s"], "curve": curve,
    }


def plot(results: list[dict], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for r in results:
        old = Path(r["run"]).name.startswith("old")
        t, em = [c[0] / 60 for c in r["curve"]], [c[1] for c in r["curve"]]
        ax.plot(t, em, marker="o", ms=3, color="tab:grey" if old else "tab:blue", alpha=0.8,
                label=("old command" if old else "new command"))
    ax.axhline(target, color="tab:red", lw=0.8, ls="--", label=f"target {target}")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="lower right", fontsize=8)
    ax.set_xlabel("wall time of the run (min)")
    ax.set_ylabel("held-out exact match")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title("RAG QA demo: time to held-out exact match")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=int, default=1, help="runs of the old command")
    ap.add_argument("--new", type=int, default=3, help="runs of the new command")
    ap.add_argument("--out", default=None, help="folder of the runs and the summary (default runs/ttt; with --analyze: "
                    "the first run's parent)")
    ap.add_argument("--first-seed", type=int, default=0, help="run i of either command uses seed FIRST_SEED+i (to add "
                    "seeds to an earlier measurement: --first-seed 1 --new 2 runs seeds 1 and 2)")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--analyze", nargs="+", default=None, help="only score these finished run folders")
    ap.add_argument("extra", nargs="*", help="config overrides added to both commands (e.g. steps=30; seed=1 for every run)")
    args = ap.parse_args(argv)
    out = Path(args.out or (Path(args.analyze[0]).parent if args.analyze else "runs/ttt"))
    if args.analyze:
        dirs = [Path(d) for d in args.analyze]
    else:
        order = []
        for i in range(max(args.old, args.new)):  # alternate: old-0, new-0, old-1, new-1, ...
            if i < args.old:
                order.append((out / f"old-{args.first_seed + i}", OLD))
            if i < args.new:
                order.append((out / f"new-{args.first_seed + i}", NEW))
        t0 = time.time()
        for folder, cmd in order:
            seed = [] if any(e.startswith("seed=") for e in args.extra) else [f"seed={folder.name.rsplit('-', 1)[1]}"]
            run(folder, cmd, [*seed, *args.extra])
            print(f"[{(time.time() - t0) / 60:.1f} min] {folder} done", flush=True)
        dirs = [folder for folder, _ in order]
    results = [analyze(d, args.target) for d in dirs]
    print(f"\n{'run':<28} {'time to EM>=' + str(args.target):>18} {'step':>5} {'final EM':>9} {'final F1':>9} {'wall':>8}")
    for r in results:
        ttt = f"{r['time_to_target_s']:.0f} s" + ("" if r["reached"] else " (not reached)")
        print(f"{r['run']:<28} {ttt:>18} {str(r['reached_step']):>5} {r['final_em']:>9.3f} {r['final_f1']:>9.3f} {r['wall_s']:>6.0f} s")
    by = {k: [r for r in results if (Path(r["run"]).name.startswith(k))] for k in ("old", "new")}
    summary = {}
    for k, rs in by.items():
        if rs:
            times = [r["time_to_target_s"] for r in rs]
            summary[k] = {"median_time_to_target_s": statistics.median(times), "min": min(times), "max": max(times),
                          "reached": sum(r["reached"] for r in rs), "runs": len(rs),
                          "final_em_mean": statistics.fmean(r["final_em"] for r in rs)}
            print(f"{k}: time to target median {summary[k]['median_time_to_target_s']:.0f} s (range {min(times):.0f}-{max(times):.0f}),"
                  f" reached in {summary[k]['reached']}/{len(rs)}, final EM mean {summary[k]['final_em_mean']:.3f}")
    if "old" in summary and "new" in summary:
        ratio = summary["new"]["median_time_to_target_s"] / summary["old"]["median_time_to_target_s"]
        summary["ratio_new_over_old"] = ratio
        print(f"ratio new / old (medians): {ratio:.2f}  (goal <= 0.5)")
    folder = out
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "time_to_target.json").write_text(json.dumps({"runs": results, "summary": summary}, indent=1) + "\n")
    plot(results, folder / "time_to_target.png", args.target)
    print(f"wrote {folder / 'time_to_target.json'} and {folder / 'time_to_target.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
