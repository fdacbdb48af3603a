"""The verl learner on CPU: verl's FSDP2 TrainingWorker in a Ray worker group, gloo, world size 2.

This is the path a GPU cluster runs (NCCL instead of gloo); CI runs it on the tiny model.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from transformers import AutoModelForCausalLM  # noqa: E402

from mas_trainer.config import ConfigError, load_config  # noqa: E402
from mas_trainer.loop.trainer import fit  # noqa: E402

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[2]
WORDS = ROOT / "tests" / "fixtures" / "words_app.py"
WORDS_DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
MAP_REDUCE = ROOT / "examples" / "langgraph_apps" / "map_reduce.py"
MAP_REDUCE_DATA = ROOT / "examples" / "langgraph_apps" / "data" / "map_reduce.jsonl"
VERL = ["runtime.learner=verl", "runtime.resources.procs_per_node=2", "learner.mini_batch_size=4", "learner.micro_batch_size=2"]


@pytest.fixture(autouse=True)
def _fresh_ray():
    yield
    ray.shutdown()


def _params(folder):
    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def _map_reduce():
    """The map_reduce example's graph (planner -> one policy, worker + reducer -> another),
    with a reward a random model's summaries vary on (its keyword reward is 0 for all)."""
    from mas_trainer import trainable
    from mas_trainer.apps import load_object

    app = load_object(f"{MAP_REDUCE}:builder")
    roles = load_object(f"{MAP_REDUCE}:ROLES")
    return trainable(app, roles=roles, policies={"planner": "tiny", "worker": "tiny"},
                     reward=lambda task, state, traj=None: len(set(str(state.get("summary", "")))) / 40)


def test_example_app_partial_sharing_trains_both_policies(tmp_path):
    """Each policy a 2-rank verl worker group; both move, apart from each other."""
    out = tmp_path / "run"
    cfg = load_config(overrides=[*VERL, "model=tiny", "steps=1", "rollout.tasks_per_step=1", "rollout.n=2",
                                 "learner.lr=1e-2", "seed=1", "policies.worker.learner.kl_coef=0.1"])
    rows = fit(_map_reduce, [{"topic": "tides", "num_subtopics": 1}], cfg, out)
    [train] = [r for r in rows if r["kind"] == "train"]
    app = json.loads((out / "app.json").read_text())
    policies = sorted(p for p, v in app["policies"].items() if v["trainable"])
    assert policies == ["planner", "worker"]
    assert train["policy/planner/turns"] == 2 and train["policy/worker/turns"] == 4  # worker + reducer share
    for p in policies:
        assert abs(train[f"policy/{p}/logprob_diff"]) < 0.5  # engine vs learner log-probs of the same tokens
    # the KL loss to a frozen reference TrainingWorker, for the one policy that asked for it
    assert "policy/worker/kl_loss" in train and "policy/planner/kl_loss" not in train
    from mas_trainer.engines.models import load_model

    base = load_model("tiny", seed=1)[0].state_dict()
    weights = {p: _params(out / "checkpoint" / "policies" / p) for p in policies}
    for p in policies:
        assert any(not torch.equal(weights[p][k], base[k]) for k in base), f"{p} did not move"
        assert (out / "checkpoint" / "learner" / p / "model_world_size_2_rank_1.pt").exists()
    a, b = (weights[p] for p in policies)
    assert any(not torch.equal(a[k], b[k]) for k in a), "the two policies share weights"


def test_verl_and_torch_learners_agree_on_one_update(tmp_path):
    """Same turns, same advantages, fp32: verl's FSDP2 update over 2 ranks and the embedded
    torch learner give the same loss and the same parameters (within 1e-5 of the loss and
    2e-2 x lr per parameter: AdamW's first step is about +-lr per element, so a gradient
    that rounds differently near zero moves an element by a fraction of lr)."""
    from verl.plugin.platform.platform_manager import set_platform
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from mas_trainer.algo.advantages import TurnRecord, compute_policy_advantages
    from mas_trainer.algo.config import AdvantageConfig
    from mas_trainer.engines.base import SamplingParams
    from mas_trainer.engines.models import load_model
    from mas_trainer.learners.batch import Turn
    from mas_trainer.learners.config import LearnerConfig
    from mas_trainer.learners.torch_learner import TorchLearner
    from mas_trainer.learners.verl_cpu import PlatformCPU, worker_env
    from mas_trainer.policy.contract import WorkerPlan
    from mas_trainer.policy.verl_rank import PolicyWorker

    lr = 1e-3
    learner = {"lr": lr, "mini_batch_size": 8, "micro_batch_size": 2, "bf16": False, "shuffle": False}
    set_platform(PlatformCPU())
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": worker_env()})
    plan = WorkerPlan(policy="p", model="tiny", learner=learner, advantage={}, critic={}, seed=4)
    group = RayWorkerGroup(resource_pool=RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1),
                           ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(PolicyWorker), plan=plan),
                           device_name="cpu", worker_env=worker_env())

    async def sample():
        rank0 = group.workers[0]
        return [await rank0.generate.remote([1, 17, 300 + i, 42][: 2 + i % 3], SamplingParams(max_tokens=6 + i, seed=i), f"t{i}")
                for i in range(8)]

    gens = asyncio.run(sample())
    prompts = [[1, 17, 300 + i, 42][: 2 + i % 3] for i in range(8)]
    records = [TurnRecord(f"t{i}", f"r{i}", i // 4, "a", "p", len(g[0].token_ids), float(i % 3)) for i, g in enumerate(gens)]
    [verl_result, _] = ray.get(group.train(records))
    verl_metrics = verl_result.metrics
    ray.get(group.save(str(tmp_path / "hf"), str(tmp_path / "learner")))
    ray.get(group.close())

    model, _ = load_model("tiny", seed=4)
    torch_learner = TorchLearner(model, LearnerConfig.model_validate(learner))
    adv = compute_policy_advantages(records, AdvantageConfig()).per_turn()
    old = torch_learner.log_probs([Turn(f"t{i}", prompts[i], g[0].token_ids, g[0].logprobs, 0.0) for i, g in enumerate(gens)])
    turns = [Turn(f"t{i}", prompts[i], g[0].token_ids, old[i].tolist(), adv[f"t{i}"].advantages.tolist()) for i, g in enumerate(gens)]
    torch_metrics = torch_learner.update(turns)

    # the advantages the update used come back with it, as the one policy step computed them
    assert verl_result.advantages == {tid: a.advantages.tolist() for tid, a in adv.items()}
    assert verl_metrics["pg_loss"] == pytest.approx(torch_metrics["pg_loss"], abs=1e-5)
    assert verl_metrics["grad_norm"] == pytest.approx(torch_metrics["grad_norm"], rel=1e-4)
    after = _params(tmp_path / "hf")
    base = load_model("tiny", seed=4)[0].state_dict()
    mine = model.state_dict()
    moved = max((mine[k] - base[k]).abs().max().item() for k in base)
    assert moved > lr / 2  # the update did something
    worst = max((after[k] - mine[k]).abs().max().item() for k in mine if k in after)
    assert worst < 2e-2 * lr, worst


def _fit_cli(out, *extra):
    return [sys.executable, "-m", "mas_trainer.cli", "fit", f"{WORDS}:graph", "--data", str(WORDS_DATA), "--output", str(out),
            *VERL, "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_in_flight=1", "rollout.max_tokens=12",
            "steps=4", "save_every=2", "eval_every=2", "val_fraction=0.25", "learner.lr=1e-2", "seed=5",
            "learner.bf16=false", "runtime.engine_bf16=false", *extra]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/")) and "/perf/" not in k and "/time/" not in k and not k.endswith("/seconds")}
            for r in rows]


def test_kill_9_then_resume_loses_and_duplicates_nothing(tmp_path):
    env = {**os.environ, "MKL_CBWR": "COMPATIBLE"}
    whole = tmp_path / "whole"
    done = subprocess.run(_fit_cli(whole), capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]

    broken = tmp_path / "broken"
    proc = subprocess.Popen(_fit_cli(broken), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline:  # kill after the step-2 checkpoint, while step 3 or 4 runs
        rows = _rows(broken) if (broken / "metrics.jsonl").exists() else []
        if any(r["kind"] == "train" and r["step"] >= 3 for r in rows):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the controller and its Ray workers, as a crash would
    proc.wait()
    subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], capture_output=True)  # its daemons too
    resumed = subprocess.run(_fit_cli(broken, "--resume"), capture_output=True, text=True, timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = _rows(broken), _rows(whole)
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    assert sorted(p.name for p in (broken / "trajectories").iterdir()) == sorted(p.name for p in (whole / "trajectories").iterdir())
    for name in ("step_000003.jsonl", "step_000004.jsonl"):
        assert (broken / "trajectories" / name).read_text().count("\n") == 4
    assert _comparable(got) == _comparable(want)


def test_verl_learner_config_is_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="multiple of the worker group's world size 2"):
        load_config(overrides=["runtime.learner=verl", "runtime.resources.procs_per_node=2", "learner.mini_batch_size=3"])
    with pytest.raises(ConfigError, match=r"policies.crew.critic.mini_batch_size=3 must be a multiple"):
        load_config(overrides=[*VERL, "policies.crew.advantage.estimator=gae", "critic.mini_batch_size=3"])
    load_config(overrides=[*VERL, "critic.mini_batch_size=3"])  # no GAE: no critic worker to split for
    with pytest.raises(ConfigError, match="drop runtime.execution=local"):
        load_config(overrides=["runtime.learner=verl", "runtime.execution=local"])
    cfg = load_config(overrides=["runtime.learner=verl", "policies.crew.resources.procs_per_node=2"])
    assert cfg.resources_for("crew").world_size == 2 and cfg.resources_for("lead").world_size == 1


def test_gae_critic_is_a_value_model_training_worker(tmp_path):
    """GAE for one policy (a value-model TrainingWorker beside the actor), GRPO for the other;
    one rank of `lead` holds only padding rows (2 turns over 2 ranks x mini-batch 4)."""
    tasks = [json.loads(line) for line in WORDS_DATA.read_text().splitlines()]
    cfg = load_config(overrides=[*VERL, "steps=1", "rollout.tasks_per_step=1", "rollout.n=2", "rollout.max_tokens=12",
                                 "policies.crew.advantage.estimator=gae", "critic.lr=1e-3", "critic.mini_batch_size=2",
                                 "critic.micro_batch_size=1", "seed=2"])
    rows = fit(f"{WORDS}:graph", tasks[:1], cfg, tmp_path / "run")
    [train] = [r for r in rows if r["kind"] == "train"]
    assert train["policy/lead/turns"] == 2 and train["policy/crew/turns"] == 4
    assert "policy/crew/critic/vf_loss" in train and "policy/lead/critic/vf_loss" not in train
    assert (tmp_path / "run" / "checkpoint" / "learner" / "crew" / "critic" / "model_world_size_2_rank_1.pt").exists()


def test_overlapped_rollouts_on_rank_0s_engine_train_within_the_bound(tmp_path):
    """rollout.max_staleness=1 on the verl learner with its embedded engine (rank 0 of 2): the
    next step's turns stay in rank 0's buffer through the update, none is trained past the bound,
    and rollout correction (the `auto` choice there) weights every update."""
    tasks = [json.loads(line) for line in WORDS_DATA.read_text().splitlines()]
    cfg = load_config(overrides=[*VERL, "steps=3", "save_every=3", "eval_every=3", "rollout.tasks_per_step=2", "rollout.n=2",
                                 "rollout.max_tokens=8", "rollout.max_staleness=1", "seed=2"])
    rows = fit(f"{WORDS}:single", tasks[:4], cfg, tmp_path / "run")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["rollout/overlapped"] for r in train] == [0.0, 1.0, 1.0]
    assert all(r["policy/solo/turns"] == 4 and r["policy/solo/turns/stale"] == 0 for r in train)
    assert all("policy/solo/rollout_is_mean" in r for r in train)


def test_a_master_port_taken_before_rank_0_binds_it_restarts_the_group(monkeypatch):
    """verl picks a group's master port by binding port 0 and letting it go; on a busy node another
    process can take it before rank 0's store binds it (CI saw EADDRINUSE). A group whose rank 0
    lost its port is started again on a new one."""
    import socket

    import verl.single_controller.ray.base as verl_ray

    from mas_trainer.cluster.plan import Machine, resolve_plan
    from mas_trainer.cluster.groups import start_verl_groups

    held = socket.socket()
    held.bind(("", 0))
    held.listen()
    port = held.getsockname()[1]
    picks = []
    real = verl_ray.get_master_addr_port

    class FirstPickTaken:  # the first group's first pick is a port another process now holds
        def options(self, **kw):
            picked = real.options(**kw)

            class Pick:
                def remote(self, **args):
                    picks.append(args)
                    if len(picks) == 1:
                        return ray.put((ray.util.get_node_ip_address(), str(port)))
                    return picked.remote(**args)

            return Pick()

    monkeypatch.setattr(verl_ray, "get_master_addr_port", FirstPickTaken())
    cfg = load_config(overrides=[*VERL, "model=tiny", "runtime.torch_threads=1"])
    plan = resolve_plan(cfg, {"a": ("tiny", "tiny")}, machine=Machine(gpus=0, cpus=4))
    groups = start_verl_groups(plan.workers, plan.runtime)
    try:
        assert sorted(groups) == ["a"] and len(picks) == 2  # the taken port, then a free one
        for g in groups.values():
            assert asyncio.run(g.discard()) == 0  # every rank up: rank 0 answers
            assert g.group.workers and all(ray.get([w.__ray_ready__.remote() for w in g.group.workers]))
    finally:
        held.close()
        for g in groups.values():
            g.close()


def test_verl_warm_start_moves_the_weights_and_matches_the_torch_learner(tmp_path):
    """The supervised warm start on verl's TrainingWorker (2 ranks, verl's sft_loss): the same
    batches and losses as the torch learner's, the weights move, and rank 0's engine (which
    writes the Hugging Face folder) holds them."""
    from verl.plugin.platform.platform_manager import set_platform
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from mas_trainer.config import WarmStartConfig
    from mas_trainer.engines.models import load_model
    from mas_trainer.learners.config import LearnerConfig
    from mas_trainer.learners.torch_learner import TorchLearner
    from mas_trainer.learners.verl_cpu import PlatformCPU, worker_env
    from mas_trainer.policy.contract import WorkerPlan
    from mas_trainer.policy.verl_rank import PolicyWorker

    learner = {"lr": 1e-3, "mini_batch_size": 4, "micro_batch_size": 2, "bf16": False}
    ws = WarmStartConfig(steps=3, lr=1e-3, batch_size=3)  # 3 turns a step: one rank gets a row of no loss tokens
    examples = [([1, 17, 300 + i, 42][: 2 + i % 3], [50 + i, 60, 70, 2][: 2 + i % 2]) for i in range(5)]
    set_platform(PlatformCPU())
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": worker_env()})
    plan = WorkerPlan(policy="p", model="tiny", learner=learner, advantage={}, critic={}, seed=4)
    group = RayWorkerGroup(resource_pool=RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1),
                           ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(PolicyWorker), plan=plan),
                           device_name="cpu", worker_env=worker_env())
    [verl_metrics, _] = ray.get(group.warm_start(examples, ws))
    ray.get(group.save(str(tmp_path / "hf"), str(tmp_path / "learner")))
    # RL goes on with verl's ppo_loss again
    from mas_trainer.algo.advantages import TurnRecord
    from mas_trainer.engines.base import SamplingParams

    gens = [ray.get(group.workers[0].generate.remote([1, 17, 42], SamplingParams(max_tokens=4, seed=i), f"t{i}")) for i in range(4)]
    records = [TurnRecord(f"t{i}", f"r{i}", 0, "a", "p", len(g[0].token_ids), float(i)) for i, g in enumerate(gens)]
    [ppo, _] = ray.get(group.train(records))
    assert "pg_loss" in ppo.metrics and ppo.metrics["turns"] == 4 and len(ppo.advantages) == 4
    ray.get(group.close())

    model, _ = load_model("tiny", seed=4)
    torch_metrics = TorchLearner(model, LearnerConfig.model_validate(learner)).supervised(
        examples, steps=ws.steps, lr=ws.lr, batch_size=ws.batch_size, seed=4)
    assert verl_metrics["sft_loss_first"] == pytest.approx(torch_metrics["sft_loss_first"], abs=1e-4)
    assert verl_metrics["sft_loss"] == pytest.approx(torch_metrics["sft_loss"], abs=1e-3)
    assert verl_metrics["sft_loss"] < verl_metrics["sft_loss_first"]
    assert verl_metrics["sft_tokens"] == torch_metrics["sft_tokens"] and verl_metrics["sft_examples"] == 5
    base = load_model("tiny", seed=4)[0].state_dict()
    after = _params(tmp_path / "hf")
    assert max((after[k] - base[k]).abs().max().item() for k in base if k in after) > ws.lr / 2
