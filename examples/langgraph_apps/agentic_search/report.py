"""Held-out exact match and F1 of agentic search runs, before -> after, and what training saw.

    python examples/langgraph_apps/agentic_search/report.py RUN_DIR [RUN_DIR ...] [--json OUT.json]

For each run (e.g. one with ``reward.allocator=broadcast``, one with ``turn_delta``):

- every held-out evaluation ``fit`` wrote (``trajectories/step_N_val.jsonl``: one rollout
  per task), scored with the RAG QA example's SQuAD metrics: exact match and F1, mean,
  standard deviation over questions and standard error of the mean, overall and by number of
  facts the question needs (``task["hops"]``); failed rollouts count as wrong;
- every training step (``trajectories/step_N.jsonl``): the mean F1 of the rollouts, the share
  whose searches fetched a passage holding the answer and whose notes kept it, and the share
  of (task, role) groups whose calls got different rewards (the groups where GRPO's advantage
  is not zero);
- the wall time, from ``metrics.jsonl`` (training steps plus evaluations).

It prints them and plots both to ``RUN_DIR/agentic_search_report.png``; with several runs a
last table compares them, and runs of one command under different seeds (``seed=N``) are
summarised over runs: held-out exact match and F1 before and after, and the gain, as mean,
standard deviation over runs and range (``replicates.py``), plotted to
``agentic_search_runs.png`` beside the runs (``--runs-plot`` for elsewhere); ``--json`` keeps
that summary under ``"over runs"``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

try:
    from ..rag_qa.metrics import exact_match, f1, recall
    from ..rag_qa.report import spread
    from ..replicates import common_parent, report_over_runs, wall_time
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rag_qa.metrics import exact_match, f1, recall
    from rag_qa.report import spread
    from replicates import common_parent, report_over_runs, wall_time

_VAL = re.compile(r"step_(\d+)_val\.jsonl$")
SMOOTH = 5  # steps in the trailing mean of the training F1
_TRAIN = re.compile(r"step_(\d+)\.jsonl$")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _prediction(row: dict) -> str | None:
    state = row.get("final_state") or {}
    return state.get("prediction") if row.get("status") == "ok" and isinstance(state, dict) else None


def holds_answer(row: dict, where: str) -> bool:
    """Did the rollout's searches fetch (``where="searches"``), or its notes keep (``"notes"``),
    the whole answer?"""
    state = row.get("final_state")
    if row.get("status") != "ok" or not isinstance(state, dict):
        return False
    if where == "searches":
        text = " ".join(p["text"] for s in state.get("searches") or [] for p in s.get("passages") or [])
    else:
        text = " ".join(state.get("notes") or [])
    return recall(text, (row.get("task") or {}).get("answer")) == 1.0


def score_val(path: Path) -> dict[str, object]:
    em, f, by_hops = [], [], defaultdict(list)
    for row in _rows(path):
        prediction, task = _prediction(row), row.get("task") or {}
        em.append(exact_match(prediction, task.get("answer")))
        f.append(f1(prediction, task.get("answer")))
        by_hops[task.get("hops")].append(f[-1])
    if not em:
        raise SystemExit(f"{path} holds no rollouts")
    out: dict[str, object] = {"n": len(em), "exact_match": spread(em), "f1": spread(f)}
    out["f1_by_hops"] = {str(h): spread(by_hops[h]) for h in sorted(by_hops, key=str) if h is not None}
    return out


def score_train(path: Path) -> dict[str, float]:
    rows = _rows(path)
    groups: dict[tuple, list[float]] = defaultdict(list)
    for row in rows:
        turns = (row.get("rewards") or {}).get("turns") or {}
        task = json.dumps(row.get("task"), sort_keys=True)
        for call in row.get("llm_calls") or []:
            if call["id"] in turns:
                groups[task, call["role"]].append(turns[call["id"]])
    return {"rollouts": len(rows),
            "f1": statistics.fmean(f1(_prediction(r), (r.get("task") or {}).get("answer")) for r in rows)
            if rows else 0.0,
            "fetched": statistics.fmean(holds_answer(r, "searches") for r in rows) if rows else 0.0,
            "noted": statistics.fmean(holds_answer(r, "notes") for r in rows) if rows else 0.0,
            "groups_with_signal": statistics.fmean(max(v) - min(v) > 1e-9 for v in groups.values()) if groups else 0.0}


def report(run_dir: str | Path) -> dict[str, object]:
    """Held-out scores by step, training figures by step, and the wall time of one run."""
    folder = Path(run_dir) / "trajectories"
    val = {int(m.group(1)): p for p in folder.glob("step_*_val.jsonl") if (m := _VAL.search(p.name))}
    if not val:
        raise SystemExit(f"no held-out evaluations in {folder} (was the run given --val-data?)")
    train = {int(m.group(1)): p for p in folder.glob("step_*.jsonl") if (m := _TRAIN.search(p.name))}
    return {"val": {s: score_val(val[s]) for s in sorted(val)},
            "train": {s: score_train(train[s]) for s in sorted(train)},
            "wall_s": wall_time(Path(run_dir))}


def plot(scores: dict[str, object], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    val = scores["val"]
    steps = list(val)
    for key, label, colour in (("exact_match", "exact match", "tab:blue"), ("f1", "F1", "tab:orange")):
        left.errorbar(steps, [val[s][key]["mean"] for s in steps], yerr=[val[s][key]["sem"] for s in steps],
                      marker="o", capsize=3, color=colour, label=f"{label} (±1 s.e.)")
    for hops, style in (("1", ":"), ("2", "--")):
        if all(hops in val[s]["f1_by_hops"] for s in steps):
            left.plot(steps, [val[s]["f1_by_hops"][hops]["mean"] for s in steps], style, marker="x", color="tab:orange",
                      label=f"F1, {hops}-fact questions")
    left.set_title("held-out (greedy)")
    train = scores["train"]
    tsteps = list(train)
    for key, label, colour in (("f1", "answer F1", "tab:orange"),
                               ("fetched", "searches fetched the answer", "tab:green"),
                               ("noted", "notes kept the answer", "tab:purple"),
                               ("groups_with_signal", "groups with non-zero advantage", "tab:gray")):
        right.plot(tsteps, [train[s][key] for s in tsteps], marker=".", color=colour, label=label)
    # a step draws a few questions, so its F1 jumps with how hard they are: the trailing mean shows the trend
    f1s = [train[s]["f1"] for s in tsteps]
    right.plot(tsteps, [statistics.fmean(f1s[max(0, i - SMOOTH + 1):i + 1]) for i in range(len(f1s))], lw=2.5,
               color="tab:orange", alpha=0.5, label=f"answer F1, mean of the last {SMOOTH} steps")
    right.set_title("training rollouts (share per step)")
    for ax in (left, right):
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(s: dict[str, float]) -> str:
    return f"{s['mean']:.3f} (sd {s['std']:.3f}, se {s['sem']:.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--json", default=None, help="also write the scores here")
    ap.add_argument("--runs-plot", default=None, help="with several runs: where to plot them together "
                    "(default: agentic_search_runs.png in their common parent folder)")
    args = ap.parse_args(argv)
    results, summary = {}, []
    for run_dir in args.run_dirs:
        scores = results[run_dir] = report(run_dir)
        print(f"== {run_dir}")
        for step, s in scores["val"].items():
            hops = "  ".join(f"{h}-fact F1 {v['mean']:.3f}" for h, v in s["f1_by_hops"].items())
            print(f"held-out step {step:>4}  n={s['n']}  exact match {_fmt(s['exact_match'])}  "
                  f"F1 {_fmt(s['f1'])}  {hops}")
        for step, t in scores["train"].items():
            print(f"train    step {step:>4}  rollouts {t['rollouts']}  F1 {t['f1']:.3f}  fetched the answer "
                  f"{t['fetched']:.3f}  notes kept it {t['noted']:.3f}  groups with non-zero advantage "
                  f"{t['groups_with_signal']:.3f}")
        first, last = scores["val"][min(scores["val"])], scores["val"][max(scores["val"])]
        wall = scores["wall_s"]
        line = (f"exact match {first['exact_match']['mean']:.3f} -> {last['exact_match']['mean']:.3f}, "
                f"F1 {first['f1']['mean']:.3f} -> {last['f1']['mean']:.3f} (step {min(scores['val'])} -> "
                f"{max(scores['val'])}; wall {'?' if wall is None else f'{wall / 60:.1f} min'})")
        print(f"held-out {line}")
        print(f"plot: {plot(scores, Path(run_dir) / 'agentic_search_report.png', f'agentic search: {run_dir}')}")
        summary.append(f"{run_dir}: {line}")
    if len(summary) > 1:
        print("== comparison", *summary, sep="\n")
        scores = {r: {step: {"exact match": v["exact_match"]["mean"], "F1": v["f1"]["mean"]}
                      for step, v in results[r]["val"].items()} for r in args.run_dirs}
        plot_path = Path(args.runs_plot) if args.runs_plot else common_parent(args.run_dirs) / "agentic_search_runs.png"
        results["over runs"] = report_over_runs(scores, {r: results[r]["wall_s"] for r in args.run_dirs}, plot_path,
                                                "agentic search: held-out scores of each run")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
