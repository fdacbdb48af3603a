"""Wall time per training step with rollout.max_staleness 0 and 1, side by side on this machine.

    .venv/bin/python bench/bench_overlap.py [--setup main|replicas] [--steps 6] [--repeats 1] [--out runs/overlap] [key=value ...]

`main`: the README's main command (RAG QA, the bundled model, embedded engine, torch learner in
this process; the same arguments as bench/bench_time_to_target.py's NEW) cut to --steps steps.
`replicas`: the words fixture app on the tiny model with the verl learner and two torch-replica
rollout replicas (separate processes that generate while the learner updates).
Each repeat runs staleness 0 then 1 (alternating, so a drift of the machine hits both), each a
full `fit` in a subprocess. Per run, over the steps after the first: the median wall time per
step (between metrics rows, so writing and plotting count too), the median `time/step_s`
(waiting for the step's rollouts, then its update) of the steps whose rollouts ran during the
previous update (`rollout/overlapped`) and of the others, the median rollout wait, and the run's
wall time. Prints the ratio staleness 1 / staleness 0 of the median wall time per step and
writes OUT/overlap.json. `--analyze RUN_DIR ...` only summarises finished runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_time_to_target import COMMON, NEW  # noqa: E402  the main command, one definition

WORDS = ["tests/fixtures/words_app.py:single", "--data", "tests/fixtures/words.jsonl", "--model", "tiny"]
REPLICAS = ["runtime.learner=verl", "runtime.engine=torch-replica", "runtime.replica.replicas=2", "rollout.tasks_per_step=4",
            "rollout.n=4", "rollout.max_tokens=48", "learner.mini_batch_size=8", "learner.micro_batch_size=8",
            "learner.bf16=false", "runtime.engine_bf16=false", "eval_every=1000", "save_every=1000"]
SETUPS = {"main": (COMMON, [a for a in NEW if not a.startswith("steps=")]), "replicas": (WORDS, REPLICAS)}


def run(out: Path, setup: str, steps: int, staleness: int, extra: list[str]) -> dict:
    app, args = SETUPS[setup]
    if out.exists():
        raise SystemExit(f"{out} exists; pick another --out or remove it")
    cmd = [str(ROOT / ".venv" / "bin" / "mas-trainer"), "fit", *app, "--output", str(out), *args, f"steps={steps}",
           f"rollout.max_staleness={staleness}", *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return summary(out, staleness)


def summary(out: Path, staleness: int) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    for before, row in zip(rows, rows[1:]):  # the wall time between rows: also what time/step_s leaves out (writing, plots)
        row["wall_s"] = row["time/elapsed_s"] - before["time/elapsed_s"]
    train = [r for r in rows if r["kind"] == "train"][1:]  # the first step warms up
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    over = [r["time/step_s"] for r in train if r.get("rollout/overlapped")]
    plain = [r["time/step_s"] for r in train if not r.get("rollout/overlapped")]
    return {"run": str(out), "staleness": staleness, "steps": len(train) + 1, "step_s": med([r["time/step_s"] for r in train]),
            "step_s_overlapped": med(over), "step_s_plain": med(plain), "update_s": med([r["time/update_s"] for r in train]),
            "rollout_s": med([r["time/rollout_s"] for r in train]),
            "rollout_wait_s": med([r.get("time/rollout_wait_s", r["time/rollout_s"]) for r in train]),
            "wall_per_step_s": med([r["wall_s"] for r in train]),
            "wall_s": rows[-1]["time/elapsed_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", choices=sorted(SETUPS), default="main")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="runs/overlap")
    ap.add_argument("--analyze", nargs="+", default=None, help="only summarise these finished run folders")
    ap.add_argument("extra", nargs="*", help="config overrides added to every run")
    a = ap.parse_args()
    out = Path(a.out)
    if a.analyze:
        def staleness(run: Path) -> int:
            return int(yaml.safe_load((run / "config.yaml").read_text())["rollout"]["max_staleness"])
        results = [summary(Path(d), staleness(Path(d))) for d in a.analyze]
    else:
        results = [run(out / f"{a.setup}-s{s}-{i}", a.setup, a.steps, s, a.extra) for i in range(a.repeats) for s in (0, 1)]
    for r in results:
        print(f"staleness {r['staleness']}: step {r['step_s']:.1f} s (overlapped {r['step_s_overlapped'] or 0:.1f}, "
              f"plain {r['step_s_plain'] or 0:.1f}); rollouts {r['rollout_s']:.1f} s, waited {r['rollout_wait_s']:.1f} s; "
              f"update {r['update_s']:.1f} s; wall per step {r['wall_per_step_s']:.1f} s; run {r['wall_s']:.0f} s")
    by = {s: statistics.median(r["wall_per_step_s"] for r in results if r["staleness"] == s) for s in (0, 1)}
    print(f"median wall seconds a step, staleness 1 / staleness 0: {by[1] / by[0]:.2f} ({by[1]:.1f} / {by[0]:.1f})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "overlap.json").write_text(json.dumps({"setup": a.setup, "results": results, "ratio": by[1] / by[0]}, indent=1))


if __name__ == "__main__":
    main()
