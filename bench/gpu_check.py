"""The GPU check: a few `fit` steps of each GPU path on the device (bench/gpu_check.sh).

No weights can reach the device machine, so the policy is a randomly initialised model of a
real shape (Qwen2.5-0.5B's, on the bundled tokenizer's vocabulary). Cases (`--cases`):

- `torch`: the torch learner, its engine on the GPU;
- `verl-grpo`: verl's FSDP2 `TrainingWorker` with GRPO;
- `verl-gae`: the same with GAE (a value-model `TrainingWorker` as the critic);
- `nccl-sync`: the verl learner sending its weights over NCCL to an embedded rollout replica
  (`engine=torch-replica`) after each update. NCCL refuses two ranks on one GPU, so this case
  needs two GPUs; with fewer it is reported as skipped, with the reason;
- `torch-overlap`, `verl-overlap`: each learner with `rollout.max_staleness=1` (the next step's
  rollouts during the update, corrected with verl's rollout correction).

Per step it prints rollout tokens/s, the update's seconds, the learner's old-log-prob
forward on its own, and the MFU of the train step: 6 N FLOPs per trained token (forward and
backward) over the `train_mini_batch` seconds, against the GPU's bf16 dense peak (`mfu()`;
the torch learner's row has no train-only timer, so its MFU is over the whole update: a lower
bound). Every case tracks to the console only (`logger=[console]`: the check packs no
TensorBoard). One case's failure is printed with its traceback and does not stop the others;
the last line is JSON with every case, and the exit status is 1 if any case failed. On CPU
(`--device cpu --shape tiny`) the torch, verl-grpo and verl-gae cases run (nccl-sync is
skipped: NCCL needs GPUs), which is how the script is checked there.

    python bench/gpu_check.py [--cases torch,verl-grpo,verl-gae,nccl-sync,torch-overlap,verl-overlap] [--steps 3]
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
CASES = {  # name -> the overrides that choose its path
    "torch": ["runtime.learner=torch"],
    "verl-grpo": ["runtime.learner=verl", "advantage.estimator=grpo"],
    "verl-gae": ["runtime.learner=verl", "advantage.estimator=gae"],
    "nccl-sync": ["runtime.learner=verl", "runtime.engine=torch-replica", "runtime.replica.weight_sync=nccl"],
    # rollout.max_staleness=1: the next step's rollouts during the update, corrected (verl's rollout correction)
    "torch-overlap": ["runtime.learner=torch", "rollout.max_staleness=1"],
    "verl-overlap": ["runtime.learner=verl", "advantage.estimator=grpo", "rollout.max_staleness=1"],
}


def mfu(params: int, tokens: int, train_s: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation of a train step: 6 N per token (forward 2N + backward 4N) for
    `tokens` trained tokens in `train_s` seconds, over the device's peak; None without a peak."""
    if not peak_flops or train_s <= 0:
        return None
    return 6 * params * tokens / train_s / peak_flops


def check_overrides(case: str, device: str, steps: int, tasks: int, n: int, model: str) -> list[str]:
    """The `fit` overrides of one case: console tracking only (the check installs no
    TensorBoard), small batches, the random model."""
    return [*CASES[case], "logger=[console]", f"runtime.device={device}", f"steps={steps}", f"save_every={steps}",
            f"eval_every={steps}", f"rollout.tasks_per_step={tasks}", f"rollout.n={n}", "rollout.max_tokens=64",
            "learner.mini_batch_size=8", "learner.micro_batch_size=8", "runtime.max_batch_size=64", f"model={model}"]


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


def run_case(case: str, args: argparse.Namespace, model: Path, params: int, peak: float | None, gpus: int) -> dict:
    if case == "nccl-sync" and args.device != "cpu" and gpus < 2:
        return {"case": case, "status": "skipped", "why": f"NCCL refuses two ranks on one GPU; this machine has {gpus}"}
    if case == "nccl-sync" and args.device == "cpu":
        return {"case": case, "status": "skipped", "why": "NCCL needs GPUs (CI runs this path over gloo)"}
    from mas_trainer.config import load_config
    from mas_trainer.loop.trainer import fit

    run = Path(tempfile.mkdtemp(prefix=f"gpu-check-{case}-"))
    tasks = [json.loads(line) for line in DATA.read_text().splitlines()]
    cfg = load_config(overrides=[*check_overrides(case, args.device, args.steps, args.tasks, args.n, str(model)),
                                 *getattr(args, "set", [])])
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
    return {"case": case, "status": "ok", "wall_s": time.perf_counter() - t0, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
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
          f"cases: {', '.join(cases)}", flush=True)
    results = []
    for case in cases:
        print(f"== {case}", flush=True)
        try:
            result = run_case(case, args, model, params, peak, gpus)
        except Exception as exc:  # one broken path must not hide the others
            traceback.print_exc()
            result = {"case": case, "status": "failed", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        if result["status"] != "ok":
            print(f"  [{case}] {result['status']}: {result.get('why') or result.get('error')}", flush=True)
        results.append(result)
    summary = {"gpu": gpu, "gpus": gpus, "shape": args.shape, "params": params, "date": time.strftime("%Y-%m-%d"),
               "torch": torch.__version__, "cases": results}
    print(json.dumps(summary))
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
