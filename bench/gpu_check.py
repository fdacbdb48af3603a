"""The GPU check: a few `fit` steps of each GPU path on the device (bench/gpu_check.sh).

No weights can reach the device machine, so the policy is a randomly initialised model of a
real shape (Qwen2.5-0.5B's, on the bundled tokenizer's vocabulary). Cases (`--cases`; the
default order runs the vLLM ones first):

- `vllm-colocated`: the verl learner (GRPO) with its rollouts on vLLM 0.24
  (`runtime.engine=vllm`, `runtime.replica.placement=colocated`: verl's hybrid engine, vLLM
  sleeping on the learner's GPU during the update);
- `vllm-separate`: the same with the replica on a GPU of its own and the weights over NCCL; it
  needs two GPUs, and with fewer it is reported as skipped, with the reason;
- `verl-grpo`: verl's FSDP2 `TrainingWorker` with GRPO, rollouts on the embedded engine (the
  same fit as `vllm-colocated` but for the engine: their rollout tokens/s are printed side by side);
- `verl-mfu`: the verl learner on a batch that loads the GPU (8 tasks x 64 rollouts x 128
  tokens, one optimiser step over all 512 turns), rollouts on vLLM colocated where it imports,
  else on the embedded engine with 32 tokens a reply; its MFU is the learner's;
- `torch`: the torch learner, its engine on the GPU;
- `verl-gae`: the same with GAE (a value-model `TrainingWorker` as the critic);
- `nccl-sync`: the verl learner sending its weights over NCCL to an embedded rollout replica
  (`engine=torch-replica`) after each update. NCCL refuses two ranks on one GPU, so this case
  needs two GPUs; with fewer it is reported as skipped, with the reason;
- `torch-overlap`, `verl-overlap`: each learner with `rollout.max_staleness=1` (the next step's
  rollouts during the update, corrected with verl's rollout correction).

Before the vLLM cases, the modules verl's vLLM replica loads are imported in a child process
(`vllm_probe`): if one fails, the log names it and the exception (`ModuleNotFoundError: No
module named ...`), the vLLM cases are reported as skipped with that line, and the others run.

Per step it prints rollout tokens/s, the update's seconds, the learner's old-log-prob
forward on its own, and the MFU of the train step: 6 N FLOPs per trained token (forward and
backward) over the `train_mini_batch` seconds, against the GPU's bf16 dense peak (`mfu()`,
`PEAK_BF16`, printed in the first line; the torch learner's row has no train-only timer, so its
MFU is over the whole update: a lower bound). Every case tracks to the console only
(`logger=[console]`: the check packs no TensorBoard). One case's failure is printed with its
traceback and does not stop the others; then a table of rollout tokens/s per engine and of the
best MFU per case; the last line is JSON with every case, and the exit status is 1 if any case
failed. On CPU (`--device cpu --shape tiny`) the torch, verl-grpo and verl-gae cases run
(nccl-sync and the vLLM cases are skipped: NCCL and vLLM need GPUs here), which is how the
script is checked there.

    python bench/gpu_check.py [--cases vllm-colocated,vllm-separate,verl-grpo,verl-mfu,torch,nccl-sync] [--steps 3]
                              [--shape qwen2.5-0.5b|qwen2.5-1.5b|tiny] [--device auto] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
POLICY = "solo"  # the policy of words_app.py:single

SHAPES = {  # (hidden, layers, heads, kv heads, intermediate)
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960),
    "tiny": (64, 2, 4, 2, 128),
}
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
VLLM = ["runtime.engine=vllm", "runtime.replica.gpu_memory_utilization=0.3"]
CASES = {  # name -> the overrides that choose its path; the vLLM cases first
    "vllm-colocated": ["runtime.learner=verl", "advantage.estimator=grpo", *VLLM, "runtime.replica.placement=colocated"],
    "vllm-separate": ["runtime.learner=verl", "advantage.estimator=grpo", *VLLM, "runtime.replica.placement=separate"],
    "verl-grpo": ["runtime.learner=verl", "advantage.estimator=grpo"],
    "verl-mfu": ["runtime.learner=verl", "advantage.estimator=grpo"],  # + MFU_BATCH, and vLLM where it imports
    "torch": ["runtime.learner=torch"],
    "verl-gae": ["runtime.learner=verl", "advantage.estimator=gae"],
    "nccl-sync": ["runtime.learner=verl", "runtime.engine=torch-replica", "runtime.replica.weight_sync=nccl"],
    # rollout.max_staleness=1: the next step's rollouts during the update, corrected (verl's rollout correction)
    "torch-overlap": ["runtime.learner=torch", "rollout.max_staleness=1"],
    "verl-overlap": ["runtime.learner=verl", "advantage.estimator=grpo", "rollout.max_staleness=1"],
}
# what a plain run measures (about 6 min on one H200 with vLLM); the rest ran on 2026-12-04 (docs/results/)
DEFAULT_CASES = ("vllm-colocated", "vllm-separate", "verl-grpo", "verl-mfu", "torch", "nccl-sync")
# verl-mfu's batch: 8 tasks x 64 rollouts, one optimiser step over the 512 turns in micro-batches of 64
MFU_BATCH = ["rollout.n=64", "rollout.max_tokens=128", "learner.mini_batch_size=512", "learner.micro_batch_size=64",
             "runtime.max_batch_size=512"]
MFU_EMBEDDED = ["rollout.max_tokens=32", "runtime.max_batch_size=128"]  # verl-mfu without vLLM: shorter replies
# two GPUs: the learner's and the replica's (or NCCL's second rank)
TWO_GPUS = {"nccl-sync": "NCCL refuses two ranks on one GPU", "vllm-separate": "the replica takes a GPU of its own"}
# what verl's vLLM replica and vLLM's GPU worker import, in order (vllm_probe); the first that fails is named
VLLM_MODULES = ("vllm", "vllm.v1.engine.async_llm", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
                "vllm.model_executor.models.qwen2", "vllm.v1.attention.backends.flash_attn", "vllm.vllm_flash_attn",
                "vllm.v1.sample.sampler", "vllm.entrypoints.openai.api_server",
                "verl.workers.rollout.vllm_rollout.vllm_async_server")
PROBE = """
import importlib, json, sys, traceback
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        print(json.dumps({"failed": name, "error": line}))
        sys.exit(0)
import vllm
print(json.dumps({"failed": None, "version": vllm.__version__}))
"""


def vllm_probe(timeout: float = 300.0) -> dict:
    """Import VLLM_MODULES in a child process: {"failed": None, "version": ...}, or the first
    module that failed and its exception's last line (the driver stays free of vLLM's state)."""
    import subprocess

    try:
        out = subprocess.run([sys.executable, "-c", PROBE, *VLLM_MODULES], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"failed": VLLM_MODULES[0], "error": f"importing vLLM took over {timeout:.0f} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"failed": VLLM_MODULES[0], "error": f"the import process exited {out.returncode}: {tail}"}
    return json.loads(lines[-1])


def mfu(params: int, tokens: int, train_s: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation of a train step: 6 N per token (forward 2N + backward 4N) for
    `tokens` trained tokens in `train_s` seconds, over the device's peak; None without a peak."""
    if not peak_flops or train_s <= 0:
        return None
    return 6 * params * tokens / train_s / peak_flops


def off_path(site: str | None) -> None:
    """Take the vLLM list's site (gpu_check.sh's MAS_TRAINER_GPU_VLLM_SITE) off this process's
    path and PYTHONPATH (which Ray's workers inherit): verl imports vLLM wherever it finds it
    (verl.checkpoint_engine), so a vLLM that fails to import must not be found by the other cases."""
    if not site:
        return
    sys.path[:] = [p for p in sys.path if p != site]
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    print(f"the vLLM list ({site}) is off the path for the other cases", flush=True)


def check_overrides(case: str, device: str, steps: int, tasks: int, n: int, model: str, vllm: bool = True) -> list[str]:
    """The `fit` overrides of one case: console tracking only (the check installs no
    TensorBoard), small batches, the random model; verl-mfu's large batch, on vLLM where `vllm`."""
    out = [*CASES[case], "logger=[console]", f"runtime.device={device}", f"steps={steps}", f"save_every={steps}",
           f"eval_every={steps}", f"rollout.tasks_per_step={tasks}", f"rollout.n={n}", "rollout.max_tokens=64",
           "learner.mini_batch_size=8", "learner.micro_batch_size=8", "runtime.max_batch_size=64", f"model={model}"]
    if case == "verl-mfu":  # later keys win
        out += [*MFU_BATCH, *(VLLM + ["runtime.replica.placement=colocated"] if vllm else MFU_EMBEDDED)]
    return out


def random_model(shape: str, folder: Path) -> int:
    """A random Qwen2 of `shape` on the bundled tokenizer, saved as a HF folder; its parameter count."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from mas_trainer.engines.models import tokenizer_dir

    tok = AutoTokenizer.from_pretrained(os.environ.get("MAS_TRAINER_GPU_TOKENIZER") or tokenizer_dir())
    hidden, layers, heads, kv, inter = SHAPES[shape]
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, tie_word_embeddings=True,
                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def trajectory_tokens(run: Path, step: int) -> int:
    """Prompt and response tokens of the step's trainable calls (what one epoch forwards)."""
    lines = (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
    calls = [c for t in map(json.loads, lines) for c in t["llm_calls"] if c["trainable"]]
    return sum(len(c["prompt_ids"]) + len(c["response_ids"]) for c in calls)


def step_figures(row: dict, traj_tokens: int, params: int, peak: float | None, epochs: int = 1) -> dict:
    """One train row's figures. The MFU's seconds are the train step alone: verl's
    `train_mini_batch` (`time/train_mini_batch_s`), not the old-log-prob forward before it
    (`time/old_logprob_s`, reported apart); the torch learner's row has no train-only timer (it
    takes the engine's old log-probs, no forward of its own), so there the update's seconds
    stand in (`train_timer` says which; a lower bound on its MFU). Trained tokens: the torch
    learner's own count (all epochs, skipped turns left out), else the trajectories' x epochs."""
    pre = f"policy/{POLICY}/"
    timed = f"{pre}time/train_mini_batch_s" in row
    train_s = row[f"{pre}time/train_mini_batch_s"] if timed else row["time/update_s"]
    tokens = int(row[f"{pre}tokens"]) if f"{pre}tokens" in row else traj_tokens * epochs
    out = {"step": row["step"], "rollout_tokens_per_s": row["perf/tokens_per_s"], "rollout_s": row["time/rollout_s"],
           "update_s": row["time/update_s"], "train_s": train_s,
           "train_timer": "train_mini_batch" if timed else "update", "old_logprob_s": row.get(f"{pre}time/old_logprob_s"),
           "trained_tokens": tokens, "mfu": mfu(params, tokens, train_s, peak)}
    for key, name in ((f"{pre}time/weight_sync_s", "weight_sync_s"), (f"{pre}mfu", "verl_mfu"),
                      ("rollout/overlapped", "overlapped"), ("time/rollout_wait_s", "rollout_wait_s"),
                      (f"{pre}rollout_is_mean", "rollout_is_mean")):
        if key in row:  # the NCCL sync's seconds; verl's own MFU estimate, for comparison
            out[name] = row[key]
    return out


def run_case(case: str, args: argparse.Namespace, model: Path, params: int, peak: float | None, gpus: int,
             probe: dict | None = None) -> dict:
    uses_vllm = "runtime.engine=vllm" in CASES[case]
    if case in TWO_GPUS and args.device != "cpu" and gpus < 2:
        return {"case": case, "status": "skipped", "why": f"{TWO_GPUS[case]}; this machine has {gpus} GPU(s)"}
    if case == "nccl-sync" and args.device == "cpu":
        return {"case": case, "status": "skipped", "why": "NCCL needs GPUs (CI runs this path over gloo)"}
    if uses_vllm and args.device == "cpu":
        return {"case": case, "status": "skipped", "why": "vLLM rollouts run on GPUs (CI runs the path with engine=torch-replica)"}
    vllm_ok = probe is not None and probe.get("failed") is None
    if uses_vllm and not vllm_ok:
        why = f"vLLM import failed: {probe['failed']}: {probe['error']}" if probe else "vLLM was not probed"
        return {"case": case, "status": "skipped", "why": why}
    from mas_trainer.config import load_config
    from mas_trainer.loop.trainer import fit

    run = Path(tempfile.mkdtemp(prefix=f"gpu-check-{case}-"))
    tasks = [json.loads(line) for line in DATA.read_text().splitlines()]
    cfg = load_config(overrides=[*check_overrides(case, args.device, args.steps, args.tasks, args.n, str(model),
                                                  vllm=vllm_ok), *getattr(args, "set", [])])
    t0 = time.perf_counter()
    rows = fit(f"{APP}:single", tasks, cfg, run)
    steps = [step_figures(r, trajectory_tokens(run, r["step"]), params, peak, cfg.learner.ppo_epochs)
             for r in rows if r["kind"] == "train"]
    for s in steps:
        old = "-" if s["old_logprob_s"] is None else f"{s['old_logprob_s']:.2f} s"
        m = "-" if s["mfu"] is None else f"{s['mfu']:.3f}"
        sync = f"; weight sync {s['weight_sync_s']:.2f} s" if "weight_sync_s" in s else ""
        if "overlapped" in s:  # rollout.max_staleness: did its rollouts run during the last update, and the wait
            sync += f"; overlapped {s['overlapped']:.0f}, waited {s['rollout_wait_s']:.2f} s, IS weight {s.get('rollout_is_mean', 1):.3f}"
        print(f"  [{case}] step {s['step']}: rollout {s['rollout_tokens_per_s']:.0f} tok/s ({s['rollout_s']:.1f} s); "
              f"update {s['update_s']:.2f} s ({s['train_timer']} {s['train_s']:.2f} s over {s['trained_tokens']} tokens, "
              f"old log-probs {old}{sync}); MFU {m}", flush=True)
    return {"case": case, "status": "ok", "wall_s": time.perf_counter() - t0, "steps": steps,
            "engine": cfg.runtime.engine, "learner": cfg.runtime.learner}


def side_by_side(results: list[dict]) -> list[str]:
    """Lines comparing the cases' rollout tokens/s (mean over the steps after the first, which
    holds the engines' warm-up) and the best MFU of each case."""
    lines = []
    for r in results:
        if r.get("status") != "ok" or not r.get("steps"):
            continue
        later = r["steps"][1:] or r["steps"]
        tps = sum(s["rollout_tokens_per_s"] for s in later) / len(later)
        mfus = [s["mfu"] for s in r["steps"] if s["mfu"] is not None]
        best = f"{max(mfus):.3f}" if mfus else "-"
        tokens = max(s["trained_tokens"] for s in r["steps"])
        lines.append(f"  {r['case']:<15} {r.get('engine', '?'):<9} {r.get('learner', '?'):<6} {tps:>10.0f} {best:>8}"
                     f" {tokens:>9}")
    if lines:
        lines.insert(0, f"  {'case':<15} {'engine':<9} {'learner':<6} {'rollout tok/s':>10} {'best MFU':>8} {'tokens':>9}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, of {', '.join(CASES)} (default {','.join(DEFAULT_CASES)})")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override added to every case (repeatable)")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    import torch

    gpus = torch.cuda.device_count()
    if args.device == "auto":
        args.device = "cuda" if gpus else "cpu"
    gpu = torch.cuda.get_device_name(0) if gpus else "none"
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    model = Path(tempfile.mkdtemp(prefix="gpu-check-model-")) / "model"
    params = random_model(args.shape, model)
    print(f"GPU: {gpu} x{gpus}; model: random {args.shape} ({params / 1e6:.0f}M parameters); torch {torch.__version__}; "
          f"MFU against {'no known peak' if peak is None else f'{peak / 1e12:.0f} TFLOP/s bf16 dense'}; "
          f"cases: {', '.join(cases)}", flush=True)
    probe = None
    if args.device != "cpu" and any("runtime.engine=vllm" in CASES[c] or c == "verl-mfu" for c in cases):
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not packed (gpu_vllm_wheels.py)
        t0 = time.perf_counter()
        probe = vllm_probe()
        if probe.get("failed") is None:
            print(f"vLLM {probe['version']} imports ({time.perf_counter() - t0:.0f} s; VLLM_USE_FLASHINFER_SAMPLER="
                  f"{os.environ['VLLM_USE_FLASHINFER_SAMPLER']})", flush=True)
        else:
            print(f"vLLM import failed: {probe['failed']}: {probe['error']} (the vLLM cases are skipped; verl-mfu runs on "
                  "the embedded engine)", flush=True)
            off_path(os.environ.get("MAS_TRAINER_GPU_VLLM_SITE"))
    results = []
    for case in cases:
        print(f"== {case}", flush=True)
        try:
            result = run_case(case, args, model, params, peak, gpus, probe)
        except Exception as exc:  # one broken path must not hide the others
            traceback.print_exc()
            result = {"case": case, "status": "failed", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        if result["status"] != "ok":
            print(f"  [{case}] {result['status']}: {result.get('why') or result.get('error')}", flush=True)
        results.append(result)
    table = side_by_side(results)
    if table:
        print("== side by side (rollout tok/s: mean of the steps after the first)", *table, sep="\n", flush=True)
    summary = {"gpu": gpu, "gpus": gpus, "shape": args.shape, "params": params, "date": time.strftime("%Y-%m-%d"),
               "torch": torch.__version__, "peak_bf16_flops": peak, "vllm": probe, "cases": results}
    print(json.dumps(summary))
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
