"""Three policies as adapters of one shared base against three separate LoRA policies (issue 44, point 6).

    .venv/bin/python bench/bench_shared_base.py [--out runs/shared_base] [--seeds 0 1 2] [--steps 4] \\
        [--modes separate shared separate-ray] [--decode-reps 5] [--quick] [--no-decode] [--no-fit] [key=value ...]
    .venv/bin/python bench/bench_shared_base.py --analyze runs/shared_base   # only score the finished runs again

Two parts, each against a baseline measured in the same run of the bench:

- **Training** (`fit`): `bench/apps/three_roles.py`, a planner -> writer -> editor relay whose three
  roles are three trainable policies on the bundled model (`default`, SmolLM2-135M-Instruct),
  trained with the same overrides in each mode but the mode:
  ``separate`` = three LoRA policies, each its own base, engine and learner (``learner.lora_rank=16``,
  ``runtime.execution=local``: all three in the fit's one process); ``shared`` = three adapters
  of one base (``learner.shared_base=true``, also ``runtime.execution=local``); ``separate-ray`` =
  the separate policies as full separation runs by default, each policy its own Ray actor
  process (``runtime.execution=ray``). Each run is a `mas-trainer fit` subprocess, the modes
  alternating within a seed (their order reversed every other seed) so that a drift of the
  machine hits every mode. Per run: the peak memory of the fit's whole process tree (the fit and
  every descendant: Ray's raylet, GCS and policy workers) from /proc, the sum of RSS sampled
  every 0.5 s (statm) and the sum of PSS every 10 s (smaps_rollup costs ~0.1 s of CPU for a
  2 GiB process: read more often, the sampler loads the very cores it measures), and the
  largest single process (the fit's ``ru_maxrss``, its waited-for descendants included); the wall
  time per step (``time/step_s``: the step's rollouts and the three updates) over the steps after
  the first (the first warms up); the held-out reward (the fit's own evaluations of
  ``VAL``, greedy, before training and after the last step).
- **Decode**: the embedded engine on one peft model holding three random rank-16 adapters
  (``init_lora_weights=False``, ``learner.target_modules``' default ``all-linear``, as
  `SharedBase` builds them; the engine applies them per row with every adapter's A and B
  stacked, `engines/adapter_batch.py`) against the plain base in an engine of its own, same engine settings,
  same 12 prompts (3 x 4 rows, one batch), greedy, every row exactly --decode-tokens tokens
  (``ignore_eos``). Four arms, interleaved in every repetition: ``base`` (the plain model: what a
  separate policy's merged LoRA costs), ``peft-base`` (the peft model, every row on the bare base),
  ``one-adapter`` (every row on adapter 0), ``three-adapters`` (4 rows each). The first
  repetition warms up and is dropped; medians and ranges of the others.

Prints one line per run (with the load average over it: the reference machine is shared, and
other work on its two cores slows a run several times over), the means per mode (with the range
over seeds), the ratios shared / separate and shared / separate-ray against the goals (memory
<= 0.45x; seconds per step <= 0.7x, as the means' ratio and per seed, whose runs ran back to
back; the held-out reward difference against the seeds' spread), the decode table and ratios
(goal: three adapters <= 1.3x the base's time), and what the weights, gradients and AdamW
moments take per mode (counted from the model, not measured). Writes OUT/shared_base.json
(again with --analyze, keeping the bench's date and duration).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "bench" / "apps" / "three_roles.py"
_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=.*")
COMMON = ["rollout.tasks_per_step=2", "rollout.n=4", "rollout.max_tokens=16", "rollout.val_temperature=0", "val_n=1",
          "learner.lr=1e-3", "learner.lora_rank=16", "save_every=1000", "logger=[console]"]
MODES = {"separate": ["runtime.execution=local"],
         "shared": ["runtime.execution=local", "learner.shared_base=true"],
         "separate-ray": ["runtime.execution=ray"]}
# `mas-trainer fit`, with huggingface_hub's lazy "is jinja2 installed" answer settled first: three LoRA
# policies in one process save their first checkpoints on three engine threads at once, and that answer
# is written "N/A" before it is looked up, so a thread asking meanwhile is told jinja2 is missing
# (peft's model card raises ImportError and the fit exits 1 at its final checkpoint)
FIT = ["-c", "import sys; from huggingface_hub.utils import is_jinja_available; is_jinja_available(); "
       "from mas_trainer.cli import main; sys.exit(main())", "fit"]
GOALS = {"memory": 0.45, "step": 0.7, "decode": 1.3}
RANK = 16

sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(APP.parent))


# ------------------------------------------------------------------------------ training
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


PAGE = os.sysconf("SC_PAGE_SIZE")


def _tree(pid: int) -> list[int]:
    kids, todo, found = _children(), [pid], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(kids.get(p, []))
    return found


def tree_rss(pid: int) -> tuple[int, int]:
    """(sum of RSS in bytes, processes) of `pid` and all its descendants, from /proc/PID/statm (cheap)."""
    rss = n = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                rss += int(f.read().split()[1]) * PAGE
            n += 1
        except (OSError, IndexError, ValueError):
            continue
    return rss, n


def tree_pss(pid: int) -> int:
    """Sum of PSS in bytes of `pid` and its descendants, from /proc/PID/smaps_rollup: ~0.1 s and the
    process's memory-map lock for a 2 GiB process, so read seldom (PSS_EVERY samples)."""
    pss = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                pss += next((int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")), 0)
        except OSError:
            continue
    return pss


SAMPLE_S, PSS_EVERY = 0.5, 20  # RSS every 0.5 s, PSS every 10 s: the sampler must not load the 2 cores it measures


def write_tasks(out: Path) -> tuple[Path, Path]:
    from three_roles import TASKS, VAL

    out.mkdir(parents=True, exist_ok=True)
    data, val = out / "tasks.jsonl", out / "val.jsonl"
    data.write_text("".join(json.dumps({"question": q}) + "\n" for q in TASKS))
    val.write_text("".join(json.dumps({"question": q}) + "\n" for q in VAL))
    return data, val


def run_fit(mode: str, folder: Path, seed: int, steps: int, data: Path, val: Path, extra: list[str]) -> dict:
    """One `mas-trainer fit` in its own process; its process tree's memory sampled every 0.5 s."""
    cmd = [sys.executable, *FIT, f"{APP}:graph", "--data", str(data), "--val-data", str(val),
           "--output", str(folder), *COMMON, f"steps={steps}", f"eval_every={steps}", f"seed={seed}", *MODES[mode], *extra]
    print("$", " ".join(["mas-trainer", *cmd[len(FIT):]]), flush=True)
    peak = {"rss": 0, "pss": 0, "procs": 0}
    loads: list[float] = []
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(folder.parent / f"{folder.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        stop = threading.Event()

        def sample() -> None:
            i = 0
            while not stop.is_set():
                rss, n = tree_rss(proc.pid)
                loads.append(os.getloadavg()[0])
                peak["rss"], peak["procs"] = max(peak["rss"], rss), max(peak["procs"], n)
                if i % PSS_EVERY == PSS_EVERY - 1:
                    peak["pss"] = max(peak["pss"], tree_pss(proc.pid))
                i += 1
                stop.wait(SAMPLE_S)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        stop.set()
        th.join()
    if proc.returncode != 0:
        raise SystemExit(f"{folder}: fit exited {proc.returncode}; see {folder.parent / (folder.name + '.log')}")
    run = {"mode": mode, "seed": seed, "wall_s": time.perf_counter() - t0, "peak_rss_gb": peak["rss"] / 2**30,
           "peak_pss_gb": peak["pss"] / 2**30, "peak_procs": peak["procs"], "maxrss_gb": usage.ru_maxrss * 1024 / 2**30,
           "load_before": load_before, "load_after": os.getloadavg()[0], "load_mean": _mean(loads), "load_max": max(loads, default=0.0)}
    (folder / "bench_run.json").write_text(json.dumps(run, indent=1) + "\n")
    return run


def measure(folder: Path) -> dict:
    """One finished run: what `run_fit` recorded and its metrics rows' figures."""
    run = json.loads((folder / "bench_run.json").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    vals = [r for r in rows if r["kind"] == "val"]
    steps = [r["time/step_s"] for r in train[1:]] or [r["time/step_s"] for r in train]
    run.update(run=folder.name, steps=len(train), step_s_each=[r["time/step_s"] for r in train],
               step_s=statistics.fmean(steps), step_s_min=min(steps), step_s_max=max(steps),
               rollout_s=statistics.fmean(r["time/rollout_s"] for r in train[1:] or train),
               update_s=statistics.fmean(r["time/update_s"] for r in train[1:] or train),
               train_reward=[r["reward/mean"] for r in train], before=vals[0]["reward/mean"], after=vals[-1]["reward/mean"],
               eval_steps=[r["step"] for r in vals])
    return run


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarise(runs: list[dict]) -> dict[str, dict]:
    out = {}
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        steps = [s for r in rs for s in r["step_s_each"][1:] or r["step_s_each"]]
        out[mode] = {"runs": len(rs), "seeds": [r["seed"] for r in rs],
                     "peak_rss_gb": _mean([r["peak_rss_gb"] for r in rs]), "peak_rss_range": [min(r["peak_rss_gb"] for r in rs), max(r["peak_rss_gb"] for r in rs)],
                     "peak_pss_gb": _mean([r["peak_pss_gb"] for r in rs]), "maxrss_gb": _mean([r["maxrss_gb"] for r in rs]),
                     "procs": max(r["peak_procs"] for r in rs),
                     "step_s": _mean([r["step_s"] for r in rs]), "step_s_range": [min(steps), max(steps)],
                     "step_s_sd": statistics.stdev(steps) if len(steps) > 1 else 0.0,
                     "rollout_s": _mean([r["rollout_s"] for r in rs]), "update_s": _mean([r["update_s"] for r in rs]),
                     "before": _mean([r["before"] for r in rs]), "after": _mean([r["after"] for r in rs]),
                     "after_range": [min(r["after"] for r in rs), max(r["after"] for r in rs)],
                     "after_sd": statistics.stdev([r["after"] for r in rs]) if len(rs) > 1 else 0.0,
                     "wall_s": _mean([r["wall_s"] for r in rs])}
    return out


def ratios(summary: dict[str, dict], base: str, runs: list[dict]) -> dict | None:
    """shared / `base`: memory, seconds per step (the means' ratio, and per seed the two runs'
    ratio: a seed's runs ran back to back, so a spell of load hits a pair more evenly than the
    means), and the held-out reward difference against the spread over seeds."""
    if "shared" not in summary or base not in summary:
        return None
    s, b = summary["shared"], summary[base]
    by = {(r["mode"], r["seed"]): r for r in runs}
    paired = {seed: by[("shared", seed)]["step_s"] / by[(base, seed)]["step_s"]
              for seed in sorted({r["seed"] for r in runs}) if ("shared", seed) in by and (base, seed) in by}
    return {"memory_rss": s["peak_rss_gb"] / b["peak_rss_gb"], "memory_pss": s["peak_pss_gb"] / b["peak_pss_gb"],
            "step": s["step_s"] / b["step_s"], "rollout": s["rollout_s"] / b["rollout_s"], "update": s["update_s"] / b["update_s"],
            "step_by_seed": paired, "step_by_seed_median": statistics.median(paired.values()) if paired else float("nan"),
            "reward_diff": s["after"] - b["after"], "reward_spread": max(s["after_range"][1] - s["after_range"][0],
                                                                       b["after_range"][1] - b["after_range"][0]),
            "reward_sd": max(s["after_sd"], b["after_sd"])}


def print_training(runs: list[dict], summary: dict[str, dict]) -> None:
    print(f"\n{'run':<18} {'peak RSS (PSS) GiB':>19} {'ru_maxrss':>9} {'procs':>5} {'s/step mean (min-max)':>23} "
          f"{'rollout s':>9} {'update s':>8} {'held-out before -> after':>25} {'wall':>6} {'load mean/max':>13}")
    for r in runs:
        print(f"{r['run']:<18} {r['peak_rss_gb']:>11.2f} ({r['peak_pss_gb']:.2f}) {r['maxrss_gb']:>9.2f} {r['peak_procs']:>5} "
              f"{r['step_s']:>9.1f} ({r['step_s_min']:.1f}-{r['step_s_max']:.1f}) {r['rollout_s']:>9.1f} {r['update_s']:>8.1f} "
              f"{r['before']:>14.3f} -> {r['after']:.3f} {r['wall_s']:>5.0f}s {r.get('load_mean', r['load_before']):>8.1f}/{r.get('load_max', r['load_after']):.1f}")
    print()
    for mode, s in summary.items():
        print(f"{mode}: peak RSS {s['peak_rss_gb']:.2f} GiB ({s['peak_rss_range'][0]:.2f}-{s['peak_rss_range'][1]:.2f}), PSS "
              f"{s['peak_pss_gb']:.2f}; s/step {s['step_s']:.1f} (steps {s['step_s_range'][0]:.1f}-{s['step_s_range'][1]:.1f}, "
              f"sd {s['step_s_sd']:.1f}); held-out {s['before']:.3f} -> {s['after']:.3f} "
              f"({s['after_range'][0]:.3f}-{s['after_range'][1]:.3f}, sd {s['after_sd']:.3f}); {s['runs']} runs")
    for base in ("separate", "separate-ray"):
        q = ratios(summary, base, runs)
        if q is None:
            continue
        ok = lambda v, goal: "meets" if v <= goal else "MISSES"  # noqa: E731
        seeds = ", ".join(f"seed {k} {v:.2f}x" for k, v in q["step_by_seed"].items())
        print(f"shared / {base}: memory {q['memory_rss']:.2f}x RSS, {q['memory_pss']:.2f}x PSS (goal <= {GOALS['memory']}: "
              f"{ok(q['memory_pss'], GOALS['memory'])}); s/step {q['step']:.2f}x (goal <= {GOALS['step']}: {ok(q['step'], GOALS['step'])}; "
              f"rollout {q['rollout']:.2f}x, update {q['update']:.2f}x; per seed {seeds}, median {q['step_by_seed_median']:.2f}x); "
              f"held-out reward after {q['reward_diff']:+.3f} (seeds' range up to {q['reward_spread']:.3f}, sd up to {q['reward_sd']:.3f})")


# ------------------------------------------------------------------------------ decode
def decode(reps: int, tokens: int) -> dict:
    """The embedded engine: a plain base against three random adapters of one base, one batch of 12 rows."""
    import asyncio

    import torch
    from peft import LoraConfig, get_peft_model

    from mas_trainer.engines.base import SamplingParams
    from mas_trainer.engines.config import EngineSettings
    from mas_trainer.engines.models import load_model
    from mas_trainer.engines.torch_engine import TorchEngine
    from mas_trainer.learners import lora
    from mas_trainer.learners.config import LearnerConfig

    defaults = LearnerConfig(lora_rank=RANK)
    names = [f"adapter_{i}" for i in range(3)]
    settings = EngineSettings(max_batch_size=12)  # the fit's engine defaults (bf16 where fast, fast decode), one batch of 12
    plain, tok = load_model("default")
    base_engine = TorchEngine(plain, tok, model_name="base", settings=settings)
    model, _ = load_model("default")
    peft_model = None
    for name in names:  # as lora.add_named_adapter, but random (B != 0): a trained adapter's cost
        cfg = LoraConfig(r=RANK, lora_alpha=defaults.lora_alpha, target_modules=defaults.target_modules, lora_dropout=0.0,
                         init_lora_weights=False)
        torch.manual_seed(len(names) + names.index(name))
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, cfg)
    engine = TorchEngine(peft_model, tok, model_name="shared", settings=settings, adapters=names)
    base_params = sum(p.numel() for p in plain.parameters())
    adapter_params = len(lora.adapter_params(peft_model, names[0]))
    adapter_numel = sum(p.numel() for p in lora.adapter_params(peft_model, names[0]))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
               for q in ("Name a fruit.", "Describe the sea.", "Say hello.", "Name a city.", "Plan an answer: Name a tool.",
                         "Describe a tree.", "Name a sport.", "Improve this answer: the rain is wet.", "Name a river.",
                         "Describe the sky.", "Name a bird.", "Say goodbye.")]
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    arms = {"base": (base_engine, [None] * 12), "peft-base": (engine, [None] * 12), "one-adapter": (engine, [names[0]] * 12),
            "three-adapters": (engine, [names[i // 4] for i in range(12)])}

    async def once(eng, adapters) -> tuple[float, int]:
        t0 = time.perf_counter()
        gens = await asyncio.gather(*[eng.generate(p, greedy, adapter=a) for p, a in zip(prompts, adapters)])
        return time.perf_counter() - t0, sum(len(g[0].token_ids) for g in gens)

    times: dict[str, list[float]] = {a: [] for a in arms}
    loads = []
    for rep in range(reps + 1):  # the first repetition warms up every arm (kernels, allocations) and is dropped
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for arm in order:
            seconds, produced = asyncio.run(once(*arms[arm]))
            assert produced == 12 * tokens, (arm, produced)
            if rep:
                times[arm].append(seconds)
        loads.append(os.getloadavg()[0])
        print(f"decode repetition {rep}{' (warm-up)' if not rep else ''}: "
              + ", ".join(f"{a} {times[a][-1] if rep else seconds:.2f} s" for a in arms if rep) + f"  load {loads[-1]:.1f}", flush=True)
    base_engine.close()
    engine.close()
    out = {"reps": reps, "tokens": tokens, "rows": 12, "bf16": engine.bf16, "threads": torch.get_num_threads(), "loads": loads,
           "arms": {}, "ratios": {}, "base_params": base_params, "adapter_params": adapter_numel, "adapter_tensors": adapter_params}
    for arm, ts in times.items():
        out["arms"][arm] = {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "each_s": ts,
                            "tokens_per_s": 12 * tokens / statistics.median(ts)}
    for arm in ("peft-base", "one-adapter", "three-adapters"):  # per repetition (the arms ran back to back), then the median
        each = [t / b for t, b in zip(times[arm], times["base"])]
        out["ratios"][arm] = {"median": statistics.median(each), "min": min(each), "max": max(each)}
    return out


def print_decode(d: dict) -> None:
    print(f"\ndecode: 12 rows (3 x 4) x {d['tokens']} tokens, greedy, one batch; bf16 autocast {d['bf16']}, {d['threads']} torch threads; "
          f"median of {d['reps']} repetitions (range)")
    for arm, a in d["arms"].items():
        r = d["ratios"].get(arm)
        print(f"  {arm:<15} {a['median_s']:6.2f} s ({a['min_s']:.2f}-{a['max_s']:.2f})  {a['tokens_per_s']:6.1f} tokens/s"
              + (f"  time / base {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})" if r else ""))
    three = d["ratios"]["three-adapters"]["median"]
    print(f"three adapters mixed / base: {three:.2f}x the base's time (goal <= {GOALS['decode']}: "
          f"{'meets' if three <= GOALS['decode'] else 'MISSES'})")


def state_bytes(d: dict) -> dict:
    """Weights, gradients and AdamW moments in fp32 per mode, counted from the model (not measured)."""
    base, adapter = d["base_params"] * 4, d["adapter_params"] * 4
    per_adapter = adapter * 4  # the adapter, its gradient and AdamW's two moments
    separate, shared = 3 * (base + per_adapter), base + 3 * per_adapter
    return {"base_mb": base / 2**20, "adapter_mb": adapter / 2**20, "separate_mb": separate / 2**20, "shared_mb": shared / 2**20,
            "ratio": shared / separate}


def print_state(s: dict) -> None:
    print(f"\nweights + gradients + AdamW moments (fp32, counted): base {s['base_mb']:.0f} MiB, a rank-{RANK} adapter "
          f"{s['adapter_mb']:.1f} MiB (x4 with its gradient and moments); separate {s['separate_mb']:.0f} MiB, "
          f"shared {s['shared_mb']:.0f} MiB: {s['ratio']:.2f}x")


# ------------------------------------------------------------------------------ main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/shared_base", help="folder of the runs and shared_base.json")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=4, help="training steps a run (held-out evaluation before and after)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--decode-reps", type=int, default=5, help="decode repetitions after a warm-up one")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="one seed, 2 steps, 3 decode repetitions")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--no-fit", action="store_true")
    ap.add_argument("--analyze", default=None, help="only summarise the finished runs (and decode.json) in this folder")
    ap.add_argument("extra", nargs="*", help="config overrides added to every run")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args([a for a in argv if not _OVERRIDE.fullmatch(a)])
    args.extra = [*args.extra, *(a for a in argv if _OVERRIDE.fullmatch(a))]
    if args.quick:
        args.seeds, args.steps, args.decode_reps = args.seeds[:1], 2, 3
    return args


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.analyze or args.out)
    t0 = time.time()
    result: dict = {"machine": machine(), "argv": sys.argv[1:], "common": COMMON, "modes": MODES}
    print(f"{result['machine']['date']}: {result['machine']['cpus']} CPUs ({result['machine']['cpu']}), load {os.getloadavg()[0]:.1f}", flush=True)
    if args.analyze:
        saved = json.loads((out / "shared_base.json").read_text()) if (out / "shared_base.json").exists() else {}
        dec = saved.get("decode")
        folders = sorted(p.parent for p in out.glob("*/bench_run.json"))
    else:
        if (out / "shared_base.json").exists():
            raise SystemExit(f"{out} holds a finished bench; pick another --out or remove it")
        dec = None
        if not args.no_decode:
            dec = decode(args.decode_reps, args.decode_tokens)
            print(f"[{(time.time() - t0) / 60:.1f} min] decode done", flush=True)
        folders = []
        if not args.no_fit:
            data, val = write_tasks(out)
            for i, seed in enumerate(args.seeds):
                for mode in (args.modes if i % 2 == 0 else list(reversed(args.modes))):
                    folder = out / f"{mode}-{seed}"
                    if folder.exists():
                        raise SystemExit(f"{folder} exists; pick another --out or remove it")
                    run_fit(mode, folder, seed, args.steps, data, val, args.extra)
                    print(f"[{(time.time() - t0) / 60:.1f} min] {folder} done", flush=True)
                    folders.append(folder)
    runs = [measure(f) for f in folders]
    summary = summarise(runs)
    if runs:
        print_training(runs, summary)
    if dec:
        print_decode(dec)
        result["state_bytes"] = state_bytes(dec)
        print_state(result["state_bytes"])
    result.update(decode=dec, runs=runs, summary=summary,
                  ratios={b: ratios(summary, b, runs) for b in ("separate", "separate-ray")}, bench_min=(time.time() - t0) / 60)
    if args.analyze:  # the bench's own date, machine, command and duration stay
        result.update({k: saved[k] for k in ("machine", "argv", "bench_min") if k in saved}, analyzed=result["machine"]["date"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "shared_base.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'shared_base.json'}; the bench took {result['bench_min']:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
