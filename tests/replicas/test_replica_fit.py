"""Rollout replicas through verl's machinery on CPU: `engine: torch-replica` runs the path of
`engine: vllm` (verl's replica life cycle, load balancer, `LLMServerClient`, and
`CheckpointEngineManager.update_weights` from the verl learner's shards to every replica,
over gloo here, NCCL on GPUs)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from transformers import AutoModelForCausalLM  # noqa: E402

from mas_trainer.config import load_config  # noqa: E402
from mas_trainer.loop.trainer import fit  # noqa: E402

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[2]
WORDS = ROOT / "tests" / "fixtures" / "words_app.py"
WORDS_DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
# fp32 on both sides whatever the CPU: "auto" picks bf16 where the CPU has AVX512-BF16 or AMX
REPLICA = ["runtime.learner=verl", "runtime.engine=torch-replica", "learner.mini_batch_size=4", "learner.micro_batch_size=2",
           "model=tiny", "rollout.tasks_per_step=2", "rollout.n=2", "learner.lr=1e-2",
           "learner.bf16=false", "runtime.engine_bf16=false"]


@pytest.fixture(autouse=True)
def _fresh_ray():
    yield
    ray.shutdown()


def _tasks():
    return [json.loads(line) for line in WORDS_DATA.read_text().splitlines() if line.strip()]


def _digest(folder):
    sd = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    return float(sum(v.double().sum() for v in sd.values()))


def test_replicas_serve_each_steps_new_weights(tmp_path):
    """rollout -> update -> weight sync -> rollout, two replicas a policy: every trained turn was
    sampled from the weights of the update before it (the version each answer carries), and the
    replicas' log-probs are the learner's (fp32 here). bypass and rollout_correction train too."""
    out = tmp_path / "run"
    cfg = load_config(overrides=[*REPLICA, "steps=2", "runtime.replica.replicas=2",
                                 "policies.lead.learner.old_logprobs=bypass",
                                 "policies.crew.learner.old_logprobs=rollout_correction"])
    rows = fit(f"{WORDS}:graph", _tasks()[:2], cfg, out)
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 2
    for r in train:
        for p in ("lead", "crew"):
            assert r[f"policy/{p}/replica/stale_turns"] == 0
            assert r[f"policy/{p}/time/weight_sync_s"] > 0 and r[f"policy/{p}/engine/tokens"] > 0
        assert r["policy/crew/logprob_diff"] < 1e-3, r["policy/crew/logprob_diff"]
        # bypass: the engine's log-probs are the old ones; PPO's first ratio is engine vs learner
        assert "policy/lead/logprob_diff" not in r and abs(r["policy/lead/ppo_kl"]) < 1e-3, r["policy/lead/ppo_kl"]
    # verl's rollout-correction metrics come with the correction, not with bypass
    assert any(k.startswith("policy/crew/") and "rollout_is" in k for k in train[0])
    assert not any(k.startswith("policy/lead/") and "rollout_is" in k for k in train[0])
    for p in ("lead", "crew"):
        assert _digest(out / "checkpoint" / "policies" / p) != _digest_base()


def test_overlapped_rollouts_on_replicas_train_within_the_bound(tmp_path):
    """rollout.max_staleness=1 with replicas: the next step's rollouts run on the replicas while the
    verl learner updates, then take the synced weights; no trained turn is more than one update
    old, and the gap is corrected (verl's rollout-correction metrics in every row)."""
    out = tmp_path / "run"
    cfg = load_config(overrides=[*REPLICA, "steps=3", "save_every=3", "eval_every=3", "rollout.max_staleness=1"])
    rows = fit(f"{WORDS}:single", _tasks()[:4], cfg, out)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["rollout/overlapped"] for r in train] == [0.0, 1.0, 1.0]
    for r in train:
        assert r["policy/solo/turns/stale"] == 0 and r["policy/solo/turns"] > 0
        assert r["policy/solo/replica/stale_turns"] <= r["policy/solo/turns"]  # one update behind: trained, corrected
        assert "policy/solo/rollout_is_mean" in r and r["policy/solo/time/weight_sync_s"] > 0
    assert _digest(out / "checkpoint" / "policies" / "solo") != _digest_base()


def _digest_base():
    from mas_trainer.engines.models import load_model

    return float(sum(v.double().sum() for v in load_model("tiny", seed=0)[0].state_dict().values()))


def _replica_pids(session: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            if cmd.startswith(b"ray::TorchRolloutServer") and os.getsid(int(proc.name)) == session:
                pids.append(int(proc.name))
        except (OSError, ProcessLookupError):
            continue
    return pids


def test_a_dead_replica_stops_the_run_in_one_line_and_resume_finishes_it(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mas_trainer.cli", "fit", f"{WORDS}:graph", "--data", str(WORDS_DATA), "--output", str(out),
           *REPLICA, "steps=3", "save_every=1", "eval_every=10", "rollout.max_tokens=12"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    state = out / "checkpoint" / "state.json"
    deadline = time.time() + 600
    while not state.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    victims = _replica_pids(proc.pid)
    if not victims:  # say why: the run ended before its first checkpoint, or no replica was seen
        proc.kill()
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"no replica process found; fit exit {proc.returncode}, state.json {state.exists()}: {err[-3000:]}")
    for pid in victims:  # every replica of the run, as a lost node would take them
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode != 0
    # the CLI's one error line; Ray's own worker logs (which may say "error:" too) may follow it
    [line] = [line for line in err.splitlines() if line.startswith("mas-trainer fit: error:")]
    assert "policy" in line and "rollout replica failed" in line and "--resume" in line, err[-2000:]
    assert "Traceback" not in err
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
