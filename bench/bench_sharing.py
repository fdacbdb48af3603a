"""RAG QA's sharing modes on one budget: answerer only, full sharing, full separation.

    .venv/bin/python bench/bench_sharing.py [--modes answerer shared separate] [--seeds 0] \
        [--out runs/sharing] [steps=30 ...]
    .venv/bin/python bench/bench_sharing.py --analyze runs/sharing/shared-0 ...

Runs `mas-trainer fit` on the three objects of `examples/langgraph_apps/rag_qa/app.py`, which
differ only in their policy map (the same graph, rewards, data and overrides):

- ``answerer`` (`graph_answerer`): the answerer learns, the rewriter is frozen (the demo's graph);
- ``shared`` (`graph_shared`): one policy serves and learns both roles;
- ``separate`` (`graph`): the rewriter and the answerer are two policies, two learners.

The overrides are the previous main command's (bench_time_to_target.OLD, with which the
README's sharing figures were measured; its 55 steps unless an override changes them), so a row's budget is the same number of questions, samples and steps; with two
trained roles a step updates twice as many turns, which the wall time shows. Runs go mode
after mode for each seed, so a drift of the machine hits every mode. Each run's held-out
evaluations are scored with the example's SQuAD metrics; prints one line per run and per mode
(mean and range over seeds), writes OUT/sharing.json and OUT/sharing.png (held-out exact
match per step, every run).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = "examples/langgraph_apps/rag_qa/app.py"
_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=.*")
MODES = {"answerer": "graph_answerer", "shared": "graph_shared", "separate": "graph"}

sys.path.insert(0, str(ROOT / "bench"))
import bench_time_to_target as ttt  # noqa: E402  (the previous main command, and how a run is scored)


def command(mode: str, out: Path, seed: int, extra: list[str]) -> list[str]:
    """The fit command of one run: the previous main command's arguments on this mode's graph object."""
    common = [f"{APP}:{MODES[mode]}", *ttt.COMMON[1:]]
    return [str(ROOT / ".venv" / "bin" / "mas-trainer"), "fit", *common, "--output", str(out),
            *ttt.OLD, f"seed={seed}", *extra]


def summarise(results: list[dict]) -> dict[str, dict]:
    """Per mode: mean and range over seeds of the final scores and of the wall time."""
    out = {}
    for mode in MODES:
        rs = [r for r in results if Path(r["run"]).name.rsplit("-", 1)[0] == mode]
        if not rs:
            continue
        em, f1, wall = [r["final_em"] for r in rs], [r["final_f1"] for r in rs], [r["wall_s"] for r in rs]
        out[mode] = {"runs": len(rs), "final_em_mean": statistics.fmean(em), "final_em_min": min(em),
                     "final_em_max": max(em), "final_f1_mean": statistics.fmean(f1),
                     "before_em_mean": statistics.fmean(r["before_em"] for r in rs),
                     "before_f1_mean": statistics.fmean(r["before_f1"] for r in rs),
                     "wall_s_mean": statistics.fmean(wall)}
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"answerer": "tab:grey", "shared": "tab:blue", "separate": "tab:orange"}
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    seen = set()
    for r in results:
        mode = Path(r["run"]).name.rsplit("-", 1)[0]
        steps, em = [c[0] for c in r["steps_curve"]], [c[1] for c in r["steps_curve"]]
        ax.plot(steps, em, marker="o", ms=3, color=colours.get(mode, "black"), alpha=0.8,
                label=None if mode in seen else f"{mode} ({MODES.get(mode, '?')})")
        seen.add(mode)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out exact match")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("RAG QA: sharing modes on one budget")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def analyze(run_dir: Path) -> dict:
    """One finished run: the time-to-target analysis plus its first evaluation and its curve by step."""
    result = ttt.analyze(run_dir, 0.9)
    scores = ttt.report(run_dir)
    first = scores[min(scores)]
    result.update(before_em=first["exact_match"]["mean"], before_f1=first["f1"]["mean"],
                  final_f1_sem=scores[max(scores)]["f1"]["sem"],
                  steps_curve=[(s, scores[s]["exact_match"]["mean"], scores[s]["f1"]["mean"]) for s in sorted(scores)])
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--out", default=None, help="folder of the runs and the summary (default runs/sharing)")
    ap.add_argument("--analyze", nargs="+", default=None, help="only score these finished run folders (MODE-SEED)")
    ap.add_argument("extra", nargs="*", help="config overrides added to every run (e.g. steps=30)")
    # key=value words are overrides wherever they stand (after --modes or --seeds too)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args([a for a in argv if not _OVERRIDE.fullmatch(a)])
    args.extra = [*args.extra, *(a for a in argv if _OVERRIDE.fullmatch(a))]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out or (Path(args.analyze[0]).parent if args.analyze else "runs/sharing"))
    if args.analyze:
        dirs = [Path(d) for d in args.analyze]
    else:
        dirs, t0 = [], time.time()
        for seed in args.seeds:
            for mode in args.modes:
                folder = out / f"{mode}-{seed}"
                if folder.exists():
                    raise SystemExit(f"{folder} exists; pick another --out or remove it")
                folder.parent.mkdir(parents=True, exist_ok=True)
                cmd = command(mode, folder, seed, args.extra)
                print("$", " ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, cwd=ROOT, check=True)
                print(f"[{(time.time() - t0) / 60:.1f} min] {folder} done", flush=True)
                dirs.append(folder)
    results = [analyze(d) for d in dirs]
    print(f"\n{'run':<28} {'before EM / F1':>15} {'after EM / F1':>15} {'(se)':>7} {'best EM':>8} {'wall':>8}")
    for r in results:
        print(f"{r['run']:<28} {r['before_em']:>6.3f} / {r['before_f1']:.3f} {r['final_em']:>6.3f} / {r['final_f1']:.3f}"
              f" {r['final_em_sem']:>7.3f} {r['best_em']:>8.3f} {r['wall_s']:>6.0f} s")
    summary = summarise(results)
    for mode, s in summary.items():
        print(f"{mode} ({MODES[mode]}): after EM mean {s['final_em_mean']:.3f} (range {s['final_em_min']:.3f}-"
              f"{s['final_em_max']:.3f}, {s['runs']} runs), F1 {s['final_f1_mean']:.3f}, wall {s['wall_s_mean'] / 60:.1f} min")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharing.json").write_text(json.dumps({"runs": results, "summary": summary}, indent=1) + "\n")
    plot(results, out / "sharing.png")
    print(f"wrote {out / 'sharing.json'} and {out / 'sharing.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
