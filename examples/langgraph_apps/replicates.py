"""Runs of one command under different seeds: which runs are replicates, and their spread.

One RL run is one draw: on these apps the step at which a small model's answers change shape
moves by several steps between seeds, so a before -> after figure needs the spread over
runs, not only the spread over questions of one run. The example reports
(``agentic_search/report.py``, ``code_gen/report.py``) take several run directories; runs
whose resolved ``config.yaml`` and ``app.json`` agree except for the seed and the step count
are replicates of one command, and this module summarises a score over them: number of runs,
mean, sample standard deviation, range, and a plot with one line per run.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import yaml

__all__ = ["command_key", "common_parent", "common_steps", "describe", "group_replicates", "over_runs", "plot_runs",
           "print_summary", "report_over_runs", "seed_of", "summarise", "wall_time"]

# a replicate may differ in these: the seed (and the learner's and critic's, resolved from it),
# and the step count (a run continued with --resume steps=N trains its first steps as the shorter one)
_FREE = (("seed",), ("steps",), ("save_every",), ("learner", "seed"), ("critic", "seed"))


def _config(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise SystemExit(f"{run_dir} has no config.yaml (is it a `mas-trainer fit` run directory?)")
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def seed_of(run_dir: str | Path) -> int | None:
    return _config(run_dir).get("seed")


def _resolved(run_dir: str | Path) -> dict:
    """The run's config with today's defaults filled in, so a run written before a key existed
    compares equal to one that has it at its default (as written, if it no longer loads)."""
    raw = _config(run_dir)
    try:
        from mas_trainer.config import load_config

        return load_config(Path(run_dir) / "config.yaml").model_dump(mode="json")
    except Exception:  # noqa: BLE001 - a key since removed, or mas_trainer not importable: compare as written
        return raw


def command_key(run_dir: str | Path) -> str:
    """The run's resolved config and policy map, less what replicates may differ in."""
    config = _resolved(run_dir)
    for path in _FREE:
        node = config
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    app = Path(run_dir) / "app.json"
    record = json.loads(app.read_text(encoding="utf-8")) if app.exists() else None
    return json.dumps({"config": config, "app": record}, sort_keys=True)


def wall_time(run_dir: str | Path) -> float | None:
    """Seconds of training steps plus held-out evaluations, from ``metrics.jsonl`` (None: no file)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sum(r.get("time/step_s") or 0.0 for r in rows if r.get("kind") == "train") + \
        sum(r.get("time/eval_s") or 0.0 for r in rows if r.get("kind") == "val")


def group_replicates(run_dirs: list[str]) -> list[list[str]]:
    """The run directories grouped by command, groups and runs in the order given."""
    groups: dict[str, list[str]] = {}
    for run_dir in run_dirs:
        groups.setdefault(command_key(run_dir), []).append(run_dir)
    return list(groups.values())


def common_steps(steps_per_run: list[list[int]]) -> list[int]:
    """The steps at which every run was evaluated, in order."""
    return sorted(set.intersection(*(set(s) for s in steps_per_run))) if steps_per_run else []


def common_parent(run_dirs: list[str]) -> Path:
    return Path(os.path.commonpath([str(Path(r).resolve()) for r in run_dirs])) if len(run_dirs) > 1 \
        else Path(run_dirs[0]).resolve().parent


def over_runs(values: list[float]) -> dict[str, float]:
    """n, mean, sample standard deviation (0 for one run), min and max of one score over runs."""
    if not values:
        raise ValueError("over_runs needs at least one run's score")
    return {"n": len(values), "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def describe(s: dict[str, float]) -> str:
    return f"{s['mean']:.3f} (sd {s['sd']:.3f} over {s['n']} runs, range {s['min']:.3f}-{s['max']:.3f})"


def summarise(scores: dict[str, dict[int, dict[str, float]]], walls: dict[str, float | None]) -> list[dict]:
    """Per group of replicates among ``scores[run][step][name]`` (a run's mean score at a held-out
    step): each score before (the first step all runs evaluated) and after (the last), and the
    gain, over runs; and the wall time in minutes where every run has one."""
    out = []
    for runs in group_replicates(list(scores)):
        steps = common_steps([list(scores[r]) for r in runs])
        if not steps:
            raise SystemExit(f"runs {', '.join(runs)} share no held-out step; evaluate them at the same steps")
        first, last = steps[0], steps[-1]
        names = [n for n in scores[runs[0]][first] if all(n in scores[r][first] and n in scores[r][last] for r in runs)]
        group = {"runs": runs, "seeds": [seed_of(r) for r in runs], "steps": [first, last], "scores": {
            n: {"before": over_runs([scores[r][first][n] for r in runs]),
                "after": over_runs([scores[r][last][n] for r in runs]),
                "gain": over_runs([scores[r][last][n] - scores[r][first][n] for r in runs])} for n in names}}
        if all(walls.get(r) is not None for r in runs):
            group["wall_min"] = over_runs([walls[r] / 60 for r in runs])
        out.append(group)
    return out


def print_summary(groups: list[dict]) -> None:
    for g in groups:
        if len(g["runs"]) == 1:  # its scores are in the per-run lines already; one run has no spread
            print(f"== over runs: {g['runs'][0]} is the only run of its command: no spread (rerun it with other seeds)")
            continue
        print(f"== over runs: {', '.join(g['runs'])} (seeds {', '.join(map(str, g['seeds']))}; "
              f"held-out step {g['steps'][0]} -> {g['steps'][1]})")
        for name, s in g["scores"].items():
            print(f"{name}: {describe(s['before'])} -> {describe(s['after'])}; gain {s['gain']['mean']:+.3f} "
                  f"(sd {s['gain']['sd']:.3f}, range {s['gain']['min']:+.3f} to {s['gain']['max']:+.3f})")
        if "wall_min" in g:
            w = g["wall_min"]
            print(f"wall time {w['mean']:.1f} min (range {w['min']:.1f}-{w['max']:.1f})")


def report_over_runs(scores: dict[str, dict[int, dict[str, float]]], walls: dict[str, float | None],
                     plot_path: Path, title: str) -> list[dict]:
    """Print the spread over replicates and plot every run's held-out curves; groups of one run
    are printed too (sd 0), so a comparison of commands reads the same way."""
    groups = summarise(scores, walls)
    print_summary(groups)
    label = {r: g["runs"][0] if len(g["runs"]) == 1 else f"{g['runs'][0]} +{len(g['runs']) - 1}"
             for g in groups for r in g["runs"]}
    names = list(groups[0]["scores"])
    panels = {n: {} for n in names}
    for run, steps in scores.items():
        for n in names:
            panels[n].setdefault(label[run], {})[run] = {k: v[n] for k, v in steps.items() if n in v}
    print(f"plot: {plot_runs(panels, plot_path, title)}")
    return groups


def plot_runs(panels: dict[str, dict[str, dict[str, dict[int, float]]]], path: Path, title: str) -> Path:
    """``panels[score][group][run][step]``: a panel per score, a thin line per run, each group's mean thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), dpi=120, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (score, groups) in zip(axes[0], panels.items()):
        for i, (group, runs) in enumerate(groups.items()):
            colour = colours[i % len(colours)]
            for steps in runs.values():
                ax.plot(list(steps), list(steps.values()), marker=".", lw=0.8, alpha=0.45, color=colour)
            steps = common_steps([list(s) for s in runs.values()])
            ax.plot(steps, [statistics.fmean(s[k] for s in runs.values()) for k in steps], marker="o", lw=2.2,
                    color=colour, label=f"{group}: mean of {len(runs)} runs (thin: each run)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("step")
        ax.set_title(f"held-out {score}")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
