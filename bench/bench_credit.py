"""Turn credit where the upstream role gates the outcome: broadcast, turn_delta and counterfactual.

    python bench/bench_credit.py [--arms broadcast turn_delta counterfactual cf_k1 cf_rpp cf_train] \
        [--seeds 0 1 2] [--out runs/credit] [steps=20 ...]
    python bench/bench_credit.py --analyze runs/credit/*-*

Runs `mas-trainer fit` on `bench/credit/app.py` (a planner and a writer, two policies; the
trajectory reward is the product of the two outputs' shares of plain words, so a bad plan
scores 0 whatever the writer does) with each arm's allocator and the same everything else:

- ``broadcast``: the trajectory reward on every turn (the default);
- ``turn_delta``: the rule-based split (each turn gets what the reward gained since the turn before);
- ``counterfactual``: K=4 continuations forked from LangGraph's checkpoints before and after
  each turn, credit = V(after) - V(before);
- ``cf_k1``: the same with one continuation per checkpoint (the cheap end of the budget knob);
- ``cf_rpp``: K=4 with ``advantage.estimator=reinforce_plus_plus`` (the credit whitened over the
  batch, not re-centred per group as ``grpo`` does for every other arm);
- ``cf_train``: K=4 with ``reward.counterfactual.train_forks=true`` (the continuations' turns
  are trained too, the K of one checkpoint as one group).

Arms alternate within each seed, so a drift of the machine hits every arm. For each run it
reads the held-out evaluations (``--val-data``, ``val_n`` rollouts a task): the held-out reward
and each role's own score (the share of plain words in that role's output, read from the
held-out trajectories: what each policy learned, apart from the product), against steps and
against wall time, with the forks' seconds counted (``time/fork_s`` is part of the rollout
time). Prints a line per run and per arm (mean and range over seeds); writes OUT/credit.json
and OUT/credit.png (held-out reward and each role's own score over wall time, every run).
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
HERE = ROOT / "bench" / "credit"
_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=.*")
ARMS = {
    "broadcast": ["reward.allocator=broadcast"],
    "turn_delta": ["reward.allocator=turn_delta"],
    "counterfactual": ["reward.allocator=counterfactual", "reward.counterfactual.k=4"],
    "cf_k1": ["reward.allocator=counterfactual", "reward.counterfactual.k=1"],
    "cf_rpp": ["reward.allocator=counterfactual", "reward.counterfactual.k=4", "advantage.estimator=reinforce_plus_plus"],
    "cf_train": ["reward.allocator=counterfactual", "reward.counterfactual.k=4", "reward.counterfactual.train_forks=true"],
}
ESTIMATOR = "grpo"  # every arm's, unless its overrides name another (the config's default)
COMMON = ["steps=20", "rollout.tasks_per_step=4", "rollout.n=4", "rollout.max_tokens=8", "learner.lr=3e-2",
          "eval_every=4", "val_n=4", "save_every=100", "runtime.execution=local", "logger=[console]"]
TARGET = 0.9  # held-out reward whose first crossing is reported (step and wall time)

sys.path.insert(0, str(HERE))
from app import word_fraction  # noqa: E402  (each role's score is the reward's own measure)


def command(arm: str, out: Path, seed: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "mas_trainer", "fit", f"{HERE / 'app.py'}:graph", "--data", str(HERE / "tasks.jsonl"),
            "--val-data", str(HERE / "val.jsonl"), "--output", str(out), *COMMON, *ARMS[arm], f"seed={seed}", *extra]


def role_scores(path: Path) -> dict[str, float]:
    """Each role's mean share of plain words over a held-out evaluation's LLM calls."""
    by_role: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        for call in json.loads(line)["llm_calls"]:
            by_role.setdefault(call["role"], []).append(word_fraction(call["output_text"]))
    return {role: statistics.fmean(v) for role, v in sorted(by_role.items())}


def analyze(run_dir: Path) -> dict:
    """One finished run: its held-out curve by step and by wall time, per role, and what the forks cost."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    elapsed = {r["step"]: r.get("time/elapsed_s", 0.0) for r in rows}
    curve = []
    for r in (r for r in rows if r["kind"] == "val"):
        roles = role_scores(run_dir / "trajectories" / f"step_{r['step']:06d}_val.jsonl")
        curve.append({"step": r["step"], "wall_s": elapsed.get(r["step"], 0.0), "reward": r["reward/mean"], "roles": roles})
    hit = next((c for c in curve if c["reward"] >= TARGET), None)
    fork_s = sum(r.get("time/fork_s", 0.0) for r in train)
    rollout_s = sum(r.get("time/rollout_s", 0.0) for r in train)
    arm = run_dir.name.rsplit("-", 1)[0]
    estimator = next((o.split("=", 1)[1] for o in ARMS.get(arm, []) if o.startswith("advantage.estimator=")), ESTIMATOR)
    return {"run": str(run_dir), "arm": arm, "estimator": estimator, "curve": curve,
            "before": curve[0]["reward"], "final": curve[-1]["reward"], "final_roles": curve[-1]["roles"],
            "train_s": sum(r.get("time/step_s", 0.0) for r in train), "rollout_s": rollout_s, "fork_s": fork_s,
            "forks": sum(r.get("forks/runs", 0.0) for r in train), "wall_s": train[-1].get("time/elapsed_s", 0.0),
            "target_step": hit["step"] if hit else None, "target_wall_s": hit["wall_s"] if hit else None}


def _estimator(results: list[dict], arm: str) -> str:
    return next((r.get("estimator", ESTIMATOR) for r in results if r["arm"] == arm), ESTIMATOR)


def _reach(r: dict) -> str:
    return "-" if r["target_step"] is None else f"step {r['target_step']}, {r['target_wall_s']:.0f} s"


def summarise(results: list[dict]) -> dict[str, dict]:
    out = {}
    for arm in ARMS:
        rs = [r for r in results if r["arm"] == arm]
        if not rs:
            continue
        final = [r["final"] for r in rs]
        roles = sorted({role for r in rs for role in r["final_roles"]})
        out[arm] = {"runs": len(rs), "final_mean": statistics.fmean(final), "final_min": min(final), "final_max": max(final),
                    "before_mean": statistics.fmean(r["before"] for r in rs),
                    "roles_mean": {role: statistics.fmean(r["final_roles"].get(role, 0.0) for r in rs) for role in roles},
                    "train_s_mean": statistics.fmean(r["train_s"] for r in rs),
                    "reached": sum(r["target_step"] is not None for r in rs),
                    "target_wall_s": [r["target_wall_s"] for r in rs], "target_step": [r["target_step"] for r in rs],
                    "fork_share": statistics.fmean(r["fork_s"] / r["train_s"] if r["train_s"] else 0.0 for r in rs)}
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"broadcast": "tab:grey", "turn_delta": "tab:blue", "counterfactual": "tab:orange", "cf_k1": "tab:green",
               "cf_rpp": "tab:red", "cf_train": "tab:purple"}
    panels = [("held-out reward", lambda c: c["reward"]), ("planner's own score", lambda c: c["roles"].get("planner")),
              ("writer's own score", lambda c: c["roles"].get("writer"))]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=110, sharex=True)
    for ax, (title, value) in zip(axes, panels):
        seen = set()
        for r in results:
            ax.plot([c["wall_s"] for c in r["curve"]], [value(c) for c in r["curve"]], marker="o", ms=3, alpha=0.75,
                    color=colours.get(r["arm"], "black"), label=None if r["arm"] in seen else r["arm"])
            seen.add(r["arm"])
        ax.set_xlabel("wall time since launch (s; forks included)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("Planner -> writer relay: turn credit allocators, held-out, every run")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", default=None, help="folder of the runs and the summary (default runs/credit)")
    ap.add_argument("--analyze", nargs="+", default=None, help="only score these finished run folders (ARM-SEED)")
    ap.add_argument("extra", nargs="*", help="config overrides added to every run (e.g. steps=30)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args([a for a in argv if not _OVERRIDE.fullmatch(a)])
    args.extra = [*args.extra, *(a for a in argv if _OVERRIDE.fullmatch(a))]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out or (Path(args.analyze[0]).parent if args.analyze else "runs/credit"))
    if args.analyze:
        dirs = [Path(d) for d in args.analyze]
    else:
        dirs, t0 = [], time.time()
        for seed in args.seeds:
            for arm in args.arms:
                folder = out / f"{arm}-{seed}"
                if folder.exists():
                    raise SystemExit(f"{folder} exists; pick another --out or remove it")
                folder.parent.mkdir(parents=True, exist_ok=True)
                cmd = command(arm, folder, seed, args.extra)
                print("$", " ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
                print(f"[{(time.time() - t0) / 60:.1f} min] {folder} done", flush=True)
                dirs.append(folder)
    results = [analyze(d) for d in dirs]
    print(f"\n{'run':<22} {'held-out before':>15} {'after':>6} {'planner':>8} {'writer':>7} {'train s':>8} {'forks':>6} {'fork s':>7} {'to 0.9':>12}")
    for r in results:
        roles = r["final_roles"]
        print(f"{Path(r['run']).name:<22} {r['before']:>15.3f} {r['final']:>6.3f} {roles.get('planner', 0):>8.3f} "
              f"{roles.get('writer', 0):>7.3f} {r['train_s']:>8.0f} {r['forks']:>6.0f} {r['fork_s']:>7.0f} {_reach(r):>12}")
    summary = summarise(results)
    for arm, s in summary.items():
        roles = ", ".join(f"{k} {v:.3f}" for k, v in s["roles_mean"].items())
        print(f"{arm} ({_estimator(results, arm)}): held-out {s['before_mean']:.3f} -> {s['final_mean']:.3f} (range {s['final_min']:.3f}-{s['final_max']:.3f}, "
              f"{s['runs']} runs; {roles}), training {s['train_s_mean']:.0f} s, forks {100 * s['fork_share']:.0f}% of it; "
              f"held-out {TARGET} reached in {s['reached']}/{s['runs']} runs")
    out.mkdir(parents=True, exist_ok=True)
    (out / "credit.json").write_text(json.dumps({"runs": results, "summary": summary}, indent=1) + "\n")
    plot(results, out / "credit.png")
    print(f"wrote {out / 'credit.json'} and {out / 'credit.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
