"""Held-out all-passed rate and HumanEval pass@1 of a code_gen run, before and after training, and their plot.

    python examples/langgraph_apps/code_gen/report.py RUN_DIR [RUN_DIR ...] [--json OUT.json]

Reads the held-out evaluations `fit` wrote (``RUN_DIR/trajectories/step_N_val.jsonl``, the
held-out file of ``tasks.py heldout``) and splits them by task id:

- **held-out easy tasks** (``easy/...``): the share whose final code passes every test
  (``final_state["all_passed"]``, after up to ``MAX_ROUNDS`` coding rounds);
- **HumanEval** (``HumanEval/...``): pass@1, the share whose *first* attempt passes every
  test (``final_state["attempts"][0]``; the split runs one round, so it is also the final code).

A rollout cut by ``rollout.timeout_s`` is not scored (as in ``mas-trainer eval``): the rates
are over the rollouts that finished, and the timed-out ones are counted beside them. A rollout
that failed otherwise (the app raised) counts as not passed. With several rollouts per task
(``val_n``) a task scores the share of its rollouts that passed. Each line gives the mean over
tasks, the standard deviation over tasks and the standard error of the mean; the plot goes to
``RUN_DIR/heldout_pass.png``.

With several runs, each is reported as above, and runs of one command under different seeds
(``seed=N``) are summarised over runs: both rates before and after, and the gain, as mean,
standard deviation over runs and range (``replicates.py``), with every run's curve in
``code_gen_runs.png`` beside the runs (``--runs-plot`` for elsewhere). ``--json`` then writes
``{RUN_DIR: scores, ..., "over runs": summary}``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

try:
    from ..replicates import common_parent, report_over_runs, wall_time
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from replicates import common_parent, report_over_runs, wall_time

_VAL = re.compile(r"step_(\d+)_val\.jsonl$")
SPLITS = {"easy": ("easy/", "held-out all-passed"), "humaneval": ("HumanEval/", "HumanEval pass@1")}


def spread(values: list[float]) -> dict[str, float] | None:
    """Mean, population standard deviation and standard error of the mean (None: no values)."""
    if not values:
        return None
    std = statistics.pstdev(values)
    return {"mean": statistics.fmean(values), "std": std, "sem": std / math.sqrt(len(values))}


def passed(row: dict, split: str) -> bool:
    state = row.get("final_state") or {}
    if row.get("status") != "ok":
        return False
    if split == "humaneval":
        attempts = state.get("attempts") or []
        return bool(attempts and attempts[0].get("all_passed"))
    return bool(state.get("all_passed"))


def score_rows(rows: list[dict]) -> dict[str, dict[str, object]]:
    """Per split: the spread of per-task pass rates, tasks scored and rollouts timed out."""
    out: dict[str, dict[str, object]] = {}
    for split, (prefix, _) in SPLITS.items():
        by_task: dict[str, list[float]] = defaultdict(list)
        timed_out = 0
        for row in rows:
            task_id = str((row.get("task") or {}).get("task_id", ""))
            if not task_id.startswith(prefix):
                continue
            if row.get("status") == "timeout":
                timed_out += 1
                continue
            by_task[task_id].append(1.0 if passed(row, split) else 0.0)
        rates = [statistics.fmean(v) for _, v in sorted(by_task.items())]
        if rates or timed_out:
            out[split] = {"tasks": len(rates), "timed_out": timed_out, "score": spread(rates)}
    return out


def score_file(path: Path) -> dict[str, dict[str, object]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path} holds no rollouts")
    scores = score_rows(rows)
    if not scores:
        raise SystemExit(f"{path} holds no easy/ or HumanEval/ tasks: was the run given tasks.py heldout as --val-data?")
    return scores


def report(run_dir: str | Path) -> dict[int, dict[str, dict[str, object]]]:
    """Scores of every held-out evaluation of the run, by step."""
    folder = Path(run_dir) / "trajectories"
    files = {int(m.group(1)): p for p in folder.glob("step_*_val.jsonl") if (m := _VAL.search(p.name))}
    if not files:
        raise SystemExit(f"no held-out evaluations in {folder} (was the run given --val-data?)")
    return {step: score_file(files[step]) for step in sorted(files)}


def describe(s: dict[str, object] | None) -> str:
    if s is None:
        return "-"
    score = s["score"]
    text = "no rollout finished" if score is None else (
        f"{score['mean']:.3f} (sd {score['std']:.3f}, se {score['sem']:.3f}, {s['tasks']} tasks)")
    return text + (f", {s['timed_out']} timed out (not scored)" if s["timed_out"] else "")


def plot(scores: dict[int, dict[str, dict[str, object]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for (split, (_, label)), colour in zip(SPLITS.items(), ("tab:blue", "tab:orange")):
        points = [(step, s[split]["score"]) for step, s in scores.items() if s.get(split) and s[split]["score"]]
        if points:
            ax.errorbar([p[0] for p in points], [p[1]["mean"] for p in points], yerr=[p[1]["sem"] for p in points],
                        marker="o", capsize=3, color=colour, label=f"{label} (±1 s.e.)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("share of tasks passed")
    ax.set_title("Code generation: held-out tasks passed")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def report_run(run_dir: str) -> dict[int, dict[str, dict[str, object]]]:
    scores = report(run_dir)
    for step, s in scores.items():
        print(f"step {step:>4}  " + "  ".join(f"{label} {describe(s.get(split))}" for split, (_, label) in SPLITS.items()))
    first, last = scores[min(scores)], scores[max(scores)]
    for split, (_, label) in SPLITS.items():
        before, after = first.get(split), last.get(split)
        if before or after:
            print(f"{label}: before (step {min(scores)}) {describe(before)} -> after (step {max(scores)}) {describe(after)}")
    print(f"plot: {plot(scores, Path(run_dir) / 'heldout_pass.png')}")
    return scores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--json", default=None, help="also write the scores here")
    ap.add_argument("--runs-plot", default=None, help="with several runs: where to plot them together "
                    "(default: code_gen_runs.png in their common parent folder)")
    args = ap.parse_args(argv)
    if len(args.run_dirs) == 1:
        scores = report_run(args.run_dirs[0])
        out: dict = {str(k): v for k, v in scores.items()}
    else:
        out, rates = {}, {}
        for run_dir in args.run_dirs:
            print(f"== {run_dir}")
            scores = report_run(run_dir)
            out[run_dir] = {str(k): v for k, v in scores.items()}
            # a step where no rollout of a split finished has no rate for it
            rates[run_dir] = {step: {label: s[split]["score"]["mean"] for split, (_, label) in SPLITS.items()
                                     if s.get(split) and s[split]["score"]} for step, s in scores.items()}
        plot_path = Path(args.runs_plot) if args.runs_plot else common_parent(args.run_dirs) / "code_gen_runs.png"
        out["over runs"] = report_over_runs(rates, {r: wall_time(r) for r in args.run_dirs}, plot_path,
                                            "code generation: held-out pass rates of each run")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
