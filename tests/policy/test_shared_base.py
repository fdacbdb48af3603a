"""Policies as LoRA adapters of one shared base (learner.shared_base): one base in memory, one
engine mixing every adapter's rows, one learner per adapter; the base never moves."""

import asyncio
import copy
import json
from pathlib import Path

import pytest
import torch

from mas_trainer.algo.advantages import TurnRecord
from mas_trainer.engines.base import SamplingParams, choice_id
from mas_trainer.engines.config import EngineSettings
from mas_trainer.learners.config import LearnerConfig
from mas_trainer.policy.contract import WorkerPlan

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
TASKS = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "words.jsonl").read_text().splitlines()]
PROMPT = [1, 17, 42, 99, 7, 300, 12]


def _plans(names=("a", "b"), **learner):
    cfg = LearnerConfig(lora_rank=4, lora_alpha=8, lr=5e-2, shared_base=True, **learner)
    settings = EngineSettings(batch_wait_ms=0, engine_bf16=False, prefix_cache_mb=8)
    return {n: WorkerPlan(policy=n, model="tiny", learner=cfg, engine_settings=settings, seed=3, shared_base="tiny")
            for n in names}


def _train_once(host, policy, rewards):
    """Generate a group of len(rewards) choices for `policy` and update it with those rewards."""
    async def run():
        gens = await host.generate(policy, PROMPT, SamplingParams(n=len(rewards), max_tokens=6, temperature=1.0, seed=1), "c")
        records = [TurnRecord(choice_id("c", i), f"r{i}", 0, "role", policy, len(g.token_ids), r)
                   for i, (g, r) in enumerate(zip(gens, rewards))]
        return await host.train(policy, records)
    return asyncio.run(run())


def test_each_policys_update_moves_its_own_adapter_only_and_the_base_stays_bit_identical():
    from mas_trainer.engines.models import load_model
    from mas_trainer.learners.lora import adapter_params
    from mas_trainer.policy.shared_base import SharedBase

    host = SharedBase(_plans())
    try:
        base = {k: v.clone() for k, v in load_model("tiny", seed=3)[0].state_dict().items()}
        before = {n: [p.detach().clone() for p in adapter_params(host.peft, host.keys[n])] for n in ("a", "b")}
        result = _train_once(host, "a", [1.0, 0.0, 0.5, 0.0])
        assert result.metrics["turns"] == 4 and result.metrics["optimizer_steps"] >= 1
        after = {n: [p.detach() for p in adapter_params(host.peft, host.keys[n])] for n in ("a", "b")}
        assert any(not torch.equal(x, y) for x, y in zip(before["a"], after["a"]))  # a moved
        assert all(torch.equal(x, y) for x, y in zip(before["b"], after["b"]))  # b did not
        _train_once(host, "b", [0.0, 1.0, 0.0, 0.2])
        assert any(not torch.equal(x, y) for x, y in zip(before["b"], adapter_params(host.peft, host.keys["b"])))
        # the base under the adapters: every weight of the bundled model, bit for bit
        plain = {k.replace("base_layer.", ""): v for k, v in host.peft.get_base_model().state_dict().items() if "lora_" not in k}
        assert plain.keys() == base.keys() and all(torch.equal(plain[k], base[k]) for k in base)
    finally:
        host.close()


def test_a_mixed_batch_answers_each_adapter_as_its_own_merged_model_would_and_the_base_as_the_base():
    """Rows of adapters a and b and of the bare base in one batch (twice: the second through the
    prefix cache) give token for token what each policy's own merged model gives alone."""
    from mas_trainer.engines.models import load_model
    from mas_trainer.engines.torch_engine import TorchEngine
    from mas_trainer.policy.shared_base import SharedBase

    host = SharedBase(_plans())
    try:
        for policy, rewards in (("a", [1.0, 0.0, 0.0, 0.0]), ("b", [0.0, 0.0, 1.0, 0.0])):
            _train_once(host, policy, rewards)
        merged = {}
        for name in ("a", "b"):
            m = copy.deepcopy(host.peft)
            m.set_adapter(host.keys[name])
            merged[name] = m.merge_and_unload()
        merged[None] = load_model("tiny", seed=3)[0]
        prompts = [PROMPT * 4, [5, 9, 11]]
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        asks = [(p, a) for p in prompts for a in ("a", "b", None)]

        async def mixed():
            return await asyncio.gather(*[host.engine.generate(p, greedy, adapter=host.keys.get(a)) for p, a in asks])

        first, again = asyncio.run(mixed()), asyncio.run(mixed())
        assert host.engine.stats["cached_tokens"] > 0  # the second round reused the prefixes, per adapter
        answers = {}
        for (p, a), one, two in zip(asks, first, again):
            with TorchEngine(merged[a], host.tokenizer, model_name="solo", settings=EngineSettings(engine_bf16=False)) as solo:
                ref = solo.generate_sync(p, greedy)[0]
            assert one[0].token_ids == ref.token_ids == two[0].token_ids, a
            torch.testing.assert_close(torch.tensor(one[0].logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
            answers[(tuple(p), a)] = ref.token_ids
        assert len({tuple(answers[(tuple(prompts[0]), a)]) for a in ("a", "b", None)}) > 1  # three policies, not one
        with pytest.raises(ValueError, match="has no adapter 'c'; its adapters: adapter_0, adapter_1"):
            asyncio.run(host.engine.generate(PROMPT, greedy, adapter="c"))
    finally:
        host.close()


def _cfg(*overrides):
    from mas_trainer.config import load_config

    return load_config(overrides=["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "learner.lr=5e-2",
                                  "rollout.max_tokens=12", "seed=3", "learner.lora_rank=4", "learner.lora_alpha=8",
                                  "learner.shared_base=true", *overrides])


def test_fit_trains_two_adapters_of_one_base_checkpoints_each_and_resumes(tmp_path):
    """The words app's planner and writer on policies a and b, adapters of one base, the critic
    frozen: each checkpoint is a plain adapter folder of base tiny; --resume trains both on."""
    from safetensors.torch import load_file

    from mas_trainer.engines.models import adapter_base, is_adapter
    from mas_trainer.loop.trainer import fit

    out = tmp_path / "run"
    rows = fit(f"{APP}:two_adapters", TASKS[:4], _cfg("steps=1", "save_every=1"), out)
    [train] = [r for r in rows if r["kind"] == "train"]
    assert train["policy/a/turns"] == 4 and train["policy/b/turns"] == 4
    plan = json.loads((out / "plan.json").read_text())
    assert {w["shared_base"] for w in plan["workers"].values()} == {"tiny"}
    folders = {p: out / "checkpoint" / "policies" / p for p in ("a", "b")}
    assert all(is_adapter(f) and adapter_base(f) == "tiny" for f in folders.values())
    at_one = {p: load_file(f / "adapter_model.safetensors") for p, f in folders.items()}
    assert at_one["a"].keys() == at_one["b"].keys() and all(".a." not in k and ".b." not in k for k in at_one["a"])
    assert any(not torch.equal(at_one["a"][k], at_one["b"][k]) for k in at_one["a"])  # two adapters, not one
    rows = fit(f"{APP}:two_adapters", TASKS[:4], _cfg("steps=2", "save_every=1"), out, resume=True)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    for p, f in folders.items():
        at_two = load_file(f / "adapter_model.safetensors")
        assert any(not torch.equal(at_one[p][k], at_two[k]) for k in at_two), p


def test_shared_base_is_refused_without_lora_and_on_the_verl_learner():
    from mas_trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="shared_base holds each policy as a LoRA adapter of one base; set lora_rank"):
        load_config(overrides=["learner.shared_base=true"])
    with pytest.raises(ConfigError, match=r"learner.shared_base runs on the torch learner"):
        load_config(overrides=["learner.shared_base=true", "learner.lora_rank=4", "runtime.learner=verl"])


def _fit_cmd(out, *extra):
    import sys

    return [sys.executable, "-m", "mas_trainer", "fit", f"{APP}:two_adapters", "--data", str(ROOT / "tests" / "fixtures" / "words.jsonl"),
            "--output", str(out), "runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_in_flight=1",
            "rollout.max_tokens=10", "steps=4", "save_every=2", "eval_every=10", "val_fraction=0.25", "learner.lr=5e-2", "seed=5",
            "learner.lora_rank=4", "learner.lora_alpha=8", "learner.shared_base=true",
            # bit-exact across processes: fp32 everywhere and MKL's reproducible mode
            "learner.bf16=false", "runtime.engine_bf16=false", *extra]


def _rows_and_turns(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not {"time", "perf"} & set(k.split("/")[:3])} for r in rows]
    turns = {p.name: [(t["rollout_id"], [(c["policy"], c["response_ids"]) for c in t["llm_calls"]])
                      for t in map(json.loads, p.read_text().splitlines())] for p in sorted((out / "trajectories").iterdir())}
    return rows, turns


def test_kill_9_after_a_checkpoint_then_resume_gives_the_uninterrupted_runs_rows_and_turns(tmp_path):
    import os
    import signal
    import subprocess
    import time

    env = {**os.environ, "MKL_CBWR": "COMPATIBLE"}
    whole = tmp_path / "whole"
    done = subprocess.run(_fit_cmd(whole), env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen(_fit_cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state, deadline = out / "checkpoint" / "state.json", time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if state.exists() and json.loads(state.read_text())["step"] == 2:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed after its step-2 checkpoint"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    resumed = subprocess.run(_fit_cmd(out, "--resume"), env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _rows_and_turns(out) == _rows_and_turns(whole)
    for p in ("a", "b"):
        assert (out / "checkpoint" / "policies" / p / "adapter_model.safetensors").read_bytes() == \
            (whole / "checkpoint" / "policies" / p / "adapter_model.safetensors").read_bytes()


def test_on_ray_the_shared_base_is_one_actor_serving_both_policies(tmp_path):
    """runtime.execution=ray: the two adapters' policies are one Ray actor (one process, one
    base), and both train."""
    from mas_trainer.loop.trainer import fit

    ray = pytest.importorskip("ray")
    out = tmp_path / "run"
    try:
        rows = fit(f"{APP}:two_adapters", TASKS[:2], _cfg("steps=1", "runtime.execution=ray"), out)
    finally:
        ray.shutdown()  # fit leaves Ray up for its caller; the next test's Ray is sized for that test
    [train] = [r for r in rows if r["kind"] == "train"]
    assert train["policy/a/turns"] == 4 and train["policy/b/turns"] == 4
    assert train["policy/a/optimizer_steps"] >= 1 and train["policy/b/optimizer_steps"] >= 1
    plan = json.loads((out / "plan.json").read_text())
    assert plan["workers"]["a"]["torch_threads"] == plan["machine"]["cpus"]  # one process: it gets every core


@pytest.mark.model
def test_on_the_bundled_model_each_adapter_moves_and_the_base_stays_the_bundled_models_bit_for_bit():
    from mas_trainer.engines.models import load_model
    from mas_trainer.learners.lora import adapter_params
    from mas_trainer.policy.shared_base import SharedBase

    plans = {n: p.model_copy(update={"model": "default", "shared_base": "default"}) for n, p in _plans().items()}
    host = SharedBase(plans)
    try:
        before = {n: [p.detach().clone() for p in adapter_params(host.peft, host.keys[n])] for n in plans}
        for n in plans:
            _train_once(host, n, [1.0, 0.0, 0.5, 0.0])
        for n in plans:
            assert any(not torch.equal(x, y) for x, y in zip(before[n], adapter_params(host.peft, host.keys[n]))), n
        bundled = load_model("default")[0].state_dict()
        plain = {k.replace("base_layer.", ""): v for k, v in host.peft.get_base_model().state_dict().items() if "lora_" not in k}
        assert plain.keys() == bundled.keys() and all(torch.equal(plain[k], bundled[k]) for k in bundled)
    finally:
        host.close()
