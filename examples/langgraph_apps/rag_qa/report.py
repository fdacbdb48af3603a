"""Held-out exact match and F1 of a RAG QA run, before and after training, and their plot.

    python examples/langgraph_apps/rag_qa/report.py RUN_DIR [--json OUT.json]

Reads the held-out evaluations `fit` wrote (``RUN_DIR/trajectories/step_N_val.jsonl``: one
rollout per task, the answer in ``final_state["prediction"]``, the reference in
``task["answer"]``), scores each with this example's SQuAD metrics, prints one line per
evaluation (mean, standard deviation over questions, standard error of the mean) and writes
``RUN_DIR/heldout_em_f1.png``. Rollouts that failed count as wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

try:
    from .metrics import exact_match, f1
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rag_qa.metrics import exact_match, f1

_VAL = re.compile(r"step_(\d+)_val\.jsonl$")


def spread(values: list[float]) -> dict[str, float]:
    """Mean, population standard deviation and standard error of the mean."""
    std = statistics.pstdev(values)
    return {"mean": statistics.fmean(values), "std": std, "sem": std / math.sqrt(len(values))}


def score_file(path: Path) -> dict[str, object]:
    em, f = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        state = row.get("final_state") or {}
        prediction = state.get("prediction") if row.get("status") == "ok" else None
        reference = (row.get("task") or {}).get("answer")
        em.append(exact_match(prediction, reference))
        f.append(f1(prediction, reference))
    if not em:
        raise SystemExit(f"{path} holds no rollouts")
    return {"n": len(em), "exact_match": spread(em), "f1": spread(f)}


def report(run_dir: str | Path) -> dict[int, dict[str, object]]:
    """Score of every held-out evaluation of the run, by step."""
    folder = Path(run_dir) / "trajectories"
    files = {int(m.group(1)): p for p in folder.glob("step_*_val.jsonl") if (m := _VAL.search(p.name))}
    if not files:
        raise SystemExit(f"no held-out evaluations in {folder} (was the run given --val-data or val_fraction?)")
    return {step: score_file(files[step]) for step in sorted(files)}


def plot(scores: dict[int, dict[str, object]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(scores)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for key, label, colour in (("exact_match", "exact match", "tab:blue"), ("f1", "F1", "tab:orange")):
        mean = [scores[s][key]["mean"] for s in steps]
        sem = [scores[s][key]["sem"] for s in steps]
        ax.errorbar(steps, mean, yerr=sem, marker="o", capsize=3, color=colour, label=f"held-out {label} (±1 s.e.)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.set_title("RAG QA: held-out exact match and F1")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--json", default=None, help="also write the scores here")
    args = ap.parse_args(argv)
    scores = report(args.run_dir)
    for step, s in scores.items():
        em, f = s["exact_match"], s["f1"]
        print(f"step {step:>4}  n={s['n']}  exact match {em['mean']:.3f} (sd {em['std']:.3f}, se {em['sem']:.3f})"
              f"  F1 {f['mean']:.3f} (sd {f['std']:.3f}, se {f['sem']:.3f})")
    first, last = scores[min(scores)], scores[max(scores)]
    print(f"held-out exact match {first['exact_match']['mean']:.3f} -> {last['exact_match']['mean']:.3f}, "
          f"F1 {first['f1']['mean']:.3f} -> {last['f1']['mean']:.3f}")
    png = plot(scores, Path(args.run_dir) / "heldout_em_f1.png")
    print(f"plot: {png}")
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in scores.items()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
