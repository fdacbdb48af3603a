"""Seconds per training step: `fit` / a bare single-process GRPO loop on the same work.

Both sides: the same model, 8 prompts x 4 samples, 16 new tokens, one PPO/GRPO update per
batch with AdamW, bf16 autocast, the same reward (share of plain lowercase words). The bare
loop is what one would write by hand: `model.generate` on the whole batch, a no-grad
forward for old log-probs, group-normalised advantages, a clipped policy-gradient step.
`fit` runs the real thing: a LangGraph app, the gateway, the tracer, the worker group
(engine + verl estimator + verl loss) and the run directory. Goal: ratio <= 1.15.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["Name a fruit.", "Name a color.", "Say hello.", "Name an animal.",
           "Describe the sea.", "Name a tool.", "Say yes.", "Name a city."]
APP = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "words_app.py"


def bare_grpo(model_ref: str, steps: int, samples: int, new_tokens: int, lr: float) -> list[float]:
    import torch

    os.environ.setdefault("OPENAI_API_KEY", "bench")  # the fixture module builds its graph on import
    sys.path.insert(0, str(APP.parent))
    from words_app import word_fraction

    from mas_trainer.engines.models import load_model

    model, tok = load_model(model_ref)
    tok.padding_side = "left"
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in PROMPTS]
    enc = tok([c for c in chats for _ in range(samples)], return_tensors="pt", padding=True, add_special_tokens=False)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.eval()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                                 pad_token_id=tok.pad_token_id)
        seq = out.clone()
        resp = seq[:, enc["input_ids"].shape[1]:]
        texts = tok.batch_decode(resp, skip_special_tokens=True)
        rewards = torch.tensor([word_fraction(t) for t in texts]).view(len(PROMPTS), samples)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        attn = torch.cat([enc["attention_mask"], (resp != tok.pad_token_id).long()], dim=1)
        mask = attn[:, enc["input_ids"].shape[1]:].float()

        def logp(m, seq=seq, attn=attn, resp=resp):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = m(input_ids=seq, attention_mask=attn).logits[:, enc["input_ids"].shape[1] - 1:-1]
            return logits.float().log_softmax(-1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)

        with torch.no_grad():
            old = logp(model)
        model.train()
        new = logp(model)
        ratio = (new - old).exp()
        loss = -(torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def fit_steps(model_ref: str, steps: int, samples: int, new_tokens: int, lr: float) -> list[float]:
    from rich.console import Console

    from mas_trainer.config import load_config
    from mas_trainer.loop.trainer import fit

    cfg = load_config(overrides=[
        "runtime.execution=local", f"steps={steps}", f"rollout.tasks_per_step={len(PROMPTS)}", f"rollout.n={samples}",
        f"rollout.max_tokens={new_tokens}", f"runtime.max_batch_size={len(PROMPTS) * samples}", f"learner.lr={lr}",
        f"learner.mini_batch_size={len(PROMPTS) * samples}", f"learner.micro_batch_size={len(PROMPTS) * samples}", "save_every=1000", "eval_every=1000", f"model={model_ref}",
    ])
    with tempfile.TemporaryDirectory() as out:
        rows = fit(f"{APP}:single", [{"question": p} for p in PROMPTS], cfg, Path(out) / "run",
                   console=Console(quiet=True))
    return [r["time/step_s"] for r in rows if r["kind"] == "train"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    a = ap.parse_args()
    # the fixture app asks for 12 tokens; the bench asks all sides for the same count
    bare = bare_grpo(a.model, a.steps, a.samples, a.new_tokens, a.lr)
    fitted = fit_steps(a.model, a.steps, a.samples, a.new_tokens, a.lr)
    b, f = statistics.median(bare[1:] or bare), statistics.median(fitted[1:] or fitted)
    print(f"model {a.model}: {len(PROMPTS)} prompts x {a.samples} samples x {a.new_tokens} new tokens, {a.steps} steps (first is warm-up)")
    print(f"bare GRPO loop: {b:.2f} s/step  {[round(x, 2) for x in bare]}")
    print(f"mas-trainer fit: {f:.2f} s/step  {[round(x, 2) for x in fitted]}")
    print(f"fit / bare seconds per step: {f / b:.3f} (goal <= 1.15)")


if __name__ == "__main__":
    main()
