"""vLLM on CPU against the embedded engine: rollout tokens/s, start-up, memory, time to target.

    .venv/bin/python bench/bench_vllm_cpu.py [--out runs/vllm_cpu] [--rag-runs 2] [--rag-steps 2] \\
        [--mr-runs 1] [--mr-steps 1] [--arms embedded,vllm]   # add vllm-fp32 to --arms for vLLM in float32
    .venv/bin/python bench/bench_vllm_cpu.py --analyze runs/vllm_cpu   # only score the finished runs again

Two workloads, each run as `mas-trainer fit` in its own process, one run at a time, the arms
alternating (embedded, vllm, embedded, vllm, ...) so that a drift of the machine hits every arm:

- `rag`: the RAG QA demo (scripts/demo.sh, bench/bench_time_to_target.py's NEW command) cut to
  --rag-steps steps with an evaluation of the 52 held-out questions every --rag-steps steps (so
  before training and at the end). Its time to the held-out target (exact match >= --target)
  is measured as bench_time_to_target does (the run's wall time, start-up included, at the
  first evaluation reaching it); on 2 cores the demo needs 25-30 steps for it (docs/results/
  rag_qa.md), more than a short run has, so the run's measured start-up, median step and
  evaluation times are also projected to the demo's recorded step (--projected-step, with an
  evaluation every 5 steps): a projection, printed as one.
- `map_reduce`: the README's main command (map_reduce.py, `--model default ... rollout.n=4`), cut
  to --mr-steps steps.

Arms: `embedded` is the default engine at its defaults; `vllm` is `runtime.engine=vllm
runtime.learner=torch` (vLLM's LLMEngine inside each policy's process, weights reloaded in
place after every update) at vLLM's defaults (bf16); `vllm-fp32` adds runtime.replica.dtype=float32.

Per run: rollout tokens/s (the train rows' `perf/tokens_per_s`, response tokens / rollout
seconds, median over steps; for `rag` also the held-out evaluations' response tokens /
`time/eval_s`), start-up (the first metrics row's `time/elapsed_s`, which counts from the CLI's
launch, less that row's own step or evaluation time), seconds per step (`time/step_s`, median),
the update's seconds (`time/update_s`, which with vLLM includes the in-place weight reload), and
the peak memory of the whole process tree (the fit process and every descendant: Ray's raylet
and its policy workers), sampled every 0.5 s from /proc: the sum of RSS (shared pages counted in
every process) and the sum of PSS (shared pages split). Prints one line per run and, per
workload, the medians' ratios vllm / embedded; writes OUT/vllm_cpu.json and OUT/vllm_cpu.png
(tokens/s and peak memory side by side; held-out exact match against wall time, every run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_time_to_target import COMMON as RAG_COMMON, NEW as RAG_NEW, analyze as rag_analyze  # noqa: E402

MR_COMMON = ["examples/langgraph_apps/map_reduce.py:graph", "--data", "examples/langgraph_apps/data/map_reduce.jsonl",
             "--model", "default"]
MR_ARGS = ["rollout.n=4"]  # the README's main command: ... --output runs/mine steps=20 rollout.n=4
ARMS = {"embedded": [], "vllm": ["runtime.engine=vllm", "runtime.learner=torch"],
        "vllm-fp32": ["runtime.engine=vllm", "runtime.learner=torch", "runtime.replica.dtype=float32"]}
COLORS = {"embedded": "tab:grey", "vllm": "tab:blue", "vllm-fp32": "tab:green"}


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def tree_memory(pid: int) -> tuple[int, int, int]:
    """(sum of RSS, sum of PSS, processes) in bytes of `pid` and all its descendants."""
    kids, todo, rss, pss, n = _children(), [pid], 0, 0, 0
    while todo:
        p = todo.pop()
        todo.extend(kids.get(p, []))
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
            n += 1
        except OSError:
            continue
    return rss, pss, n


def fit(out: Path, args: list[str], log: Path) -> dict:
    """Run one `mas-trainer fit`, sampling its process tree's memory every 0.5 s."""
    cmd = [str(ROOT / ".venv" / "bin" / "mas-trainer"), "fit", *args, "--output", str(out)]
    print("$", " ".join(["mas-trainer", *cmd[1:]]), flush=True)
    peak = {"rss": 0, "pss": 0, "procs": 0}
    t0 = time.perf_counter()
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=lf, stderr=subprocess.STDOUT)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                rss, pss, n = tree_memory(proc.pid)
                peak["rss"], peak["pss"], peak["procs"] = max(peak["rss"], rss), max(peak["pss"], pss), max(peak["procs"], n)
                stop.wait(0.5)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        rc = proc.wait()
        stop.set()
        th.join()
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "peak_rss_gb": peak["rss"] / 2**30,
            "peak_pss_gb": peak["pss"] / 2**30, "peak_procs": peak["procs"]}


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def measure(run_dir: Path, workload: str, target: float, projected_step: int) -> dict:
    """The run's figures from its metrics.jsonl (and, for rag, its held-out scores)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    first = rows[0]
    own = first.get("time/eval_s", 0.0) if first["kind"] == "val" else first.get("time/step_s", first["time/rollout_s"] + first["time/update_s"])
    # a val row written after a train row at the same step: its time was spent after that step's row
    m = {"startup_s": first["time/elapsed_s"] - own, "steps": len(train),
         "rollout_tok_s": _med([r["perf/tokens_per_s"] for r in train]),
         "rollout_tok_s_each": [r["perf/tokens_per_s"] for r in train],
         "rollout_s": _med([r["time/rollout_s"] for r in train]), "update_s": _med([r["time/update_s"] for r in train]),
         "step_s": _med([r.get("time/step_s") for r in train]), "step_s_each": [r.get("time/step_s") for r in train],
         "response_tokens_per_step": _med([r["tokens/response"] for r in train]),
         "reward_each": [r.get("reward/mean") for r in train], "elapsed_s": rows[-1]["time/elapsed_s"]}
    if val:
        m["eval_s"] = _med([r["time/eval_s"] for r in val])
        m["eval_tok_s"] = _med([r["tokens/response"] / r["time/eval_s"] for r in val])
    if workload == "rag":
        tt = rag_analyze(run_dir, target)
        m.update({k: tt[k] for k in ("reached", "reached_step", "time_to_target_s", "final_em", "final_f1", "curve")})
        if m["step_s"] is not None and val:
            evals = projected_step // 5 + 1  # the demo's evaluations: before training and every 5 steps
            m["projected_time_to_target_s"] = m["startup_s"] + projected_step * m["step_s"] + evals * m["eval_s"]
    return m


def plot(results: list[dict], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4), dpi=110)
    labels = [f"{r['workload']}\n{r['arm']}-{r['index']}" for r in results]
    colors = [COLORS.get(r["arm"], "tab:orange") for r in results]
    axes[0].bar(range(len(results)), [r.get("rollout_tok_s") or 0 for r in results], color=colors)
    axes[0].set_ylabel("rollout tokens/s (train steps, median)")
    axes[1].bar(range(len(results)), [r.get("peak_rss_gb") or 0 for r in results], color=colors, label="sum of RSS")
    axes[1].bar(range(len(results)), [r.get("peak_pss_gb") or 0 for r in results], color="none", edgecolor="black",
                hatch="//", label="sum of PSS")
    axes[1].set_ylabel("peak memory of the process tree (GiB)")
    axes[1].legend(fontsize=7)
    for ax in axes[:2]:
        ax.set_xticks(range(len(results)), labels, fontsize=6, rotation=60)
        ax.grid(alpha=0.3, axis="y")
    ax = axes[2]
    for r in results:
        if r["workload"] == "rag" and r.get("curve"):
            t, em = [c[0] / 60 for c in r["curve"]], [c[1] for c in r["curve"]]
            ax.plot(t, em, marker="o", ms=3, color=COLORS.get(r["arm"], "tab:orange"), alpha=0.8, label=r["arm"])
    ax.axhline(target, color="tab:red", lw=0.8, ls="--", label=f"target {target}")
    handles, labs = ax.get_legend_handles_labels()
    unique = dict(zip(labs, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="center right")
    ax.set_xlabel("wall time of the run (min)")
    ax.set_ylabel("RAG QA held-out exact match")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    fig.suptitle("vLLM on CPU (in-process, torch learner) vs the embedded engine")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def machine() -> dict:
    info = {"cores": os.cpu_count(), "python": platform.python_version(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                info["model_name"] = line.split(":", 1)[1].strip()
            if line.startswith("Flags:"):
                flags = line.split(":", 1)[1].split()
                info["flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "avx_vnni"))
    except OSError:
        pass
    info["loadavg_start"] = os.getloadavg()
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/vllm_cpu")
    ap.add_argument("--arms", default="embedded,vllm", help=f"comma-separated, of {sorted(ARMS)}")
    ap.add_argument("--rag-runs", type=int, default=2, help="runs of each arm on the RAG demo")
    ap.add_argument("--rag-steps", type=int, default=2, help="steps of each RAG run (the demo has 40)")
    ap.add_argument("--mr-runs", type=int, default=1, help="runs of each arm on the README's map-reduce command")
    ap.add_argument("--mr-steps", type=int, default=1, help="steps of each map-reduce run (the README has 20)")
    ap.add_argument("--target", type=float, default=0.9, help="held-out exact match of the RAG demo")
    ap.add_argument("--projected-step", type=int, default=30, help="the step at which the demo reached the target "
                    "(median of the 4 recorded seeds in docs/results/rag_qa.md), for the projection")
    ap.add_argument("--analyze", action="store_true", help="only measure the finished runs in --out again")
    args = ap.parse_args(argv)
    out = Path(args.out)
    arms = [a for a in args.arms.split(",") if a]
    plan = []
    for workload, runs, steps in (("rag", args.rag_runs, args.rag_steps), ("map_reduce", args.mr_runs, args.mr_steps)):
        for i in range(runs):  # alternate the arms: embedded-0, vllm-0, embedded-1, vllm-1, ...
            for arm in arms:
                if workload == "rag":
                    cmd = [*RAG_COMMON, *[a for a in RAG_NEW if not a.startswith(("steps=", "eval_every=", "save_every="))],
                           f"steps={steps}", f"eval_every={steps}", f"save_every={steps}", f"seed={i}"]
                else:
                    cmd = [*MR_COMMON, f"steps={steps}", *MR_ARGS, f"seed={i}"]
                plan.append({"workload": workload, "arm": arm, "index": i, "dir": str(out / f"{workload}-{arm}-{i}"),
                             "args": cmd + ARMS[arm]})
    info = machine()
    saved = {}
    if args.analyze:
        saved = {r["dir"]: r for r in json.loads((out / "progress.json").read_text())}  # what each finished run recorded
        plan = [p for p in plan if p["dir"] in saved]
    else:
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        for p in plan:
            if Path(p["dir"]).exists():
                raise SystemExit(f"{p['dir']} exists; pick another --out or remove it")
        for p in plan:
            p.update(fit(Path(p["dir"]), p["args"], Path(p["dir"] + ".log")))
            p["loadavg_after"] = os.getloadavg()
            (out / "progress.json").write_text(json.dumps([q for q in plan if "rc" in q], indent=1) + "\n")
            print(f"[{(time.time() - t0) / 60:.1f} min] {p['dir']} rc={p['rc']} peak RSS {p['peak_rss_gb']:.2f} GiB "
                  f"(PSS {p['peak_pss_gb']:.2f}), load average {p['loadavg_after'][0]:.1f}", flush=True)
        info["bench_wall_min"] = (time.time() - t0) / 60
    results = []
    for p in plan:
        p = {**saved.get(p["dir"], {}), **p} if args.analyze else p
        if p.get("rc") == 0 and (Path(p["dir"]) / "metrics.jsonl").exists():
            p.update(measure(Path(p["dir"]), p["workload"], args.target, args.projected_step))
        results.append(p)
    print(f"\n{'run':<34} {'tok/s':>7} {'eval tok/s':>10} {'start-up':>9} {'s/step':>7} {'rollout':>8} {'update':>7} "
          f"{'RSS GiB':>8} {'PSS GiB':>8} {'held-out EM':>11} {'to target':>16}")
    for r in results:
        if "startup_s" not in r:
            print(f"{Path(r['dir']).name:<34} FAILED rc={r.get('rc')} (see {r['dir']}.log)")
            continue

        def f(k: str, fmt: str = "{:.1f}", r: dict = r) -> str:
            return fmt.format(r[k]) if r.get(k) is not None else "-"

        ttt = "-"
        if r["workload"] == "rag":
            ttt = f"{r['time_to_target_s']:.0f} s" if r["reached"] else f"> {r['time_to_target_s']:.0f} s"
        print(f"{Path(r['dir']).name:<34} {f('rollout_tok_s'):>7} {f('eval_tok_s'):>10} {f('startup_s'):>9} {f('step_s'):>7} "
              f"{f('rollout_s'):>8} {f('update_s'):>7} {f('peak_rss_gb', '{:.2f}'):>8} {f('peak_pss_gb', '{:.2f}'):>8} "
              f"{f('final_em', '{:.3f}'):>11} {ttt:>16}")
    keys = ("rollout_tok_s", "eval_tok_s", "startup_s", "step_s", "rollout_s", "update_s", "peak_rss_gb", "peak_pss_gb",
            "projected_time_to_target_s", "time_to_target_s")
    summary: dict = {}
    for workload in ("rag", "map_reduce"):
        for arm in arms:
            rs = [r for r in results if r["workload"] == workload and r["arm"] == arm and "startup_s" in r]
            if not rs:
                continue
            s = {}
            for k in keys:
                xs = [r[k] for r in rs if r.get(k) is not None]
                if xs:
                    s[k] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "each": xs}
            if workload == "rag":
                s["reached"] = f"{sum(r['reached'] for r in rs)}/{len(rs)}"
            summary.setdefault(workload, {})[arm] = s
        base = summary.get(workload, {}).get("embedded")
        for arm in arms:
            other = summary.get(workload, {}).get(arm)
            if arm == "embedded" or not base or not other:
                continue
            ratios = {k: other[k]["median"] / base[k]["median"] for k in keys if k in base and k in other and base[k]["median"]}
            summary[workload][f"{arm}/embedded"] = ratios
            print(f"{workload}: {arm} / embedded (medians): " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    for workload in ("rag",):
        for arm in arms:
            s = summary.get(workload, {}).get(arm, {})
            if "projected_time_to_target_s" in s:
                print(f"rag {arm}: projected time to EM>={args.target} at step {args.projected_step} (evaluations every 5 "
                      f"steps; a projection from this run's start-up, step and evaluation times, not a measurement): "
                      f"{s['projected_time_to_target_s']['median']:.0f} s; measured: reached in {s['reached']} runs of "
                      f"{args.rag_steps} steps")
    info["loadavg_end"] = os.getloadavg()
    print(f"machine: {info}")
    print(f"(cut short for the time this bench may take: RAG demo {args.rag_steps} of 40 steps, map-reduce "
          f"{args.mr_steps} of the README's 20)")
    (out / "vllm_cpu.json").write_text(json.dumps({"machine": info, "args": vars(args), "runs": results,
                                                   "summary": summary}, indent=1) + "\n")
    plot([r for r in results if "startup_s" in r], out / "vllm_cpu.png", args.target)
    print(f"wrote {out / 'vllm_cpu.json'} and {out / 'vllm_cpu.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
