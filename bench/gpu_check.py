"""A few `fit` steps with the engine and the verl learner on the GPU (bench/gpu_check.sh).

No weights can reach the device machine, so the policy is a randomly initialised model of a
real shape (Qwen2.5-0.5B's, on the bundled tokenizer's vocabulary). Prints, per step, rollout
tokens/s (the engine), the update's seconds and tokens/s (verl's FSDP2 worker: old log-probs,
train_mini_batch, weight gather) and the update's MFU against the GPU's bf16 dense peak, then a
JSON line. Runs on CPU too (`--device cpu --shape tiny`), which is how it is checked here.

    python bench/gpu_check.py [--steps 4] [--shape qwen2.5-0.5b|qwen2.5-1.5b|tiny] [--device auto]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"

SHAPES = {  # (hidden, layers, heads, kv heads, intermediate)
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960),
    "tiny": (64, 2, 4, 2, 128),
}
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    args = parser.parse_args(argv)
    import torch

    from mas_trainer.config import load_config
    from mas_trainer.runtime.trainer import fit

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    params = random_model(args.shape, tmp / "model")
    print(f"GPU: {gpu}; model: random {args.shape} ({params / 1e6:.0f}M parameters); torch {torch.__version__}", flush=True)
    tasks = [json.loads(line) for line in DATA.read_text().splitlines()]
    cfg = load_config(overrides=[
        "runtime.learner=verl", f"runtime.device={args.device}", f"steps={args.steps}", f"save_every={args.steps}",
        f"eval_every={args.steps}", f"rollout.tasks_per_step={args.tasks}", f"rollout.n={args.n}", "rollout.max_tokens=64",
        "learner.mini_batch_size=8", "learner.micro_batch_size=8", "runtime.max_batch_size=64", f"model={tmp / 'model'}"])
    t0 = time.perf_counter()
    rows = fit(f"{APP}:single", tasks, cfg, tmp / "run")
    wall = time.perf_counter() - t0
    result: dict = {"gpu": gpu, "shape": args.shape, "params": params, "date": time.strftime("%Y-%m-%d"), "wall_s": wall, "steps": []}
    for row in (r for r in rows if r["kind"] == "train"):
        step = row["step"]
        calls = [json.loads(line) for line in (tmp / "run" / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        tokens = sum(len(c["prompt_ids"]) + len(c["response_ids"]) for t in calls for c in t["llm_calls"] if c["trainable"])
        train_s = row.get("policy/solo/time/train_mini_batch_s") or row["time/update_s"]
        # forward+backward of the update (6 N per token) plus the old-log-prob forward (2 N)
        mfu = 8 * params * tokens / train_s / peak if peak else None
        s = {"step": step, "rollout_tokens_per_s": row["perf/tokens_per_s"], "rollout_s": row["time/rollout_s"],
             "update_s": row["time/update_s"], "train_mini_batch_s": train_s, "update_tokens_per_s": tokens / row["time/update_s"],
             "mfu": mfu}
        result["steps"].append(s)
        print(f"step {step}: rollout {s['rollout_tokens_per_s']:.0f} tok/s ({s['rollout_s']:.1f} s); update {s['update_s']:.1f} s, "
              f"{s['update_tokens_per_s']:.0f} tok/s; MFU {mfu if mfu is None else f'{mfu:.3f}'}", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
