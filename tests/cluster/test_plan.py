"""The run plan: the config resolved once against the app's policies and the machine (a fake
one here), every rule checked before any worker group or Ray starts; `fit` writes it as
RUN_DIR/plan.json and resumes runs written before it existed."""

import json
import pickle
from pathlib import Path

import pytest

from mas_trainer.config import ConfigError, load_config
from mas_trainer.policy.contract import WorkerPlan
from mas_trainer.cluster.plan import Machine, RunPlan, placement_asks, resolve_plan

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
TASKS = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "words.jsonl").read_text().splitlines()]
TWO = {"lead": ("tiny", "tiny"), "crew": ("tiny", "tiny")}


def _plan(*overrides: str, gpus: int = 0, cpus: int = 8, models=TWO) -> RunPlan:
    return resolve_plan(load_config(overrides=list(overrides)), models, machine=Machine(gpus=gpus, cpus=cpus))


def test_auto_is_decided_against_the_machine():
    cpu = _plan()
    assert (cpu.learner, cpu.device, cpu.execution, cpu.gpus_needed) == ("torch", "cpu", "ray", 0)
    assert {w.torch_threads for w in cpu.workers.values()} == {4}  # 8 cores over 2 policies
    assert cpu.runtime.learner == "torch" and cpu.runtime.device == "cpu"
    gpu = _plan("runtime.resources.procs_per_node=2", "learner.mini_batch_size=4", gpus=4)
    assert (gpu.learner, gpu.device, gpu.gpus_needed) == ("verl", "cuda", 4)
    assert {(w.device, w.torch_threads, w.resources.world_size) for w in gpu.workers.values()} == {("cuda", None, 2)}
    local = _plan("runtime.execution=local", gpus=1)  # worker groups in this process: the torch learner
    assert (local.learner, local.device) == ("torch", "cuda")
    assert {w.torch_threads for w in local.workers.values()} == {4}  # in this process: 8 cores over 2 policies' engines
    verl_cpu = _plan("runtime.learner=verl", "runtime.resources.procs_per_node=2", "learner.mini_batch_size=4")
    assert {w.torch_threads for w in verl_cpu.workers.values()} == {2}  # 8 cores over 4 ranks
    assert "torch learner on cpu on Ray" in cpu.summary() and "lead: embedded engine, 1 rank(s), grpo" in cpu.summary()


def test_a_rule_of_the_learner_auto_chose_is_refused_at_plan_time():
    load_config(overrides=["runtime.resources.procs_per_node=2"])  # auto: not known yet when the config loads
    with pytest.raises(ConfigError, match="the torch learner runs one process per policy"):
        _plan("runtime.resources.procs_per_node=2")  # no GPU: torch
    with pytest.raises(ConfigError, match=r"learner.fused_adamw applies to the torch learner only"):
        _plan("learner.fused_adamw=true", gpus=1)  # a GPU: verl


def test_worker_plans_are_typed_and_picklable():
    plan = _plan("policies.crew.learner.lr=0.5", "policies.crew.advantage.estimator=gae")
    crew = plan.workers["crew"]
    assert crew.learner.lr == 0.5 and crew.advantage.estimator == "gae" and crew.replica.replicas == 1
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert WorkerPlan(policy="p", model="tiny", learner={"lr": 0.1}).learner.lr == 0.1  # dicts validate into the models
    assert RunPlan.model_validate_json(plan.model_dump_json()) == plan


def test_gpus_that_are_not_there_are_refused_before_ray_starts():
    verl = ["runtime.learner=verl", "runtime.resources.procs_per_node=2", "learner.mini_batch_size=4"]
    with pytest.raises(ConfigError, match=r"needs 4 GPU\(s\) here \(lead: 2, crew: 2\), and torch sees 2: .*share_gpus=true"):
        _plan(*verl, gpus=2)
    shared = _plan(*verl, "runtime.share_gpus=true", gpus=2)  # one pool of 2 GPUs, taken in turns
    assert shared.share_gpus and shared.gpus_needed == 2 and all(w.offload_between_phases for w in shared.workers.values())
    with pytest.raises(ConfigError, match="runtime.share_gpus puts every policy on one pool"):
        _plan(*verl, "runtime.share_gpus=true", "policies.crew.resources.procs_per_node=1", gpus=2)
    with pytest.raises(ConfigError, match=r"needs 1 GPU\(s\) here .* and torch sees 0"):
        _plan("runtime.device=cuda", "runtime.learner=torch", models={"lead": ("tiny", "tiny")})
    _plan(*verl, "runtime.ray_address=ray://head:10001", gpus=0, models=TWO)  # a cluster: its GPUs are not this machine's


def test_fit_refuses_a_plan_before_any_worker_or_ray_starts(tmp_path, monkeypatch):
    import mas_trainer.cluster.plan as plan_mod
    import mas_trainer.loop.trainer as trainer_mod
    from mas_trainer.loop.trainer import fit

    monkeypatch.setattr(plan_mod, "probe_machine", lambda: Machine(gpus=1, cpus=2))

    def no_workers(*args, **kwargs):
        raise AssertionError("worker groups started")

    monkeypatch.setattr(trainer_mod, "start_workers", no_workers)
    cfg = load_config(overrides=["runtime.share_gpus=true", "policies.crew.resources.procs_per_node=2",
                                 "learner.mini_batch_size=4"])
    with pytest.raises(ConfigError, match="runtime.share_gpus puts every policy on one pool"):
        fit(f"{APP}:graph", TASKS[:4], cfg, tmp_path / "run")


def test_fit_writes_the_plan_and_resumes_a_run_without_one(tmp_path, capsys):
    from rich.console import Console

    from mas_trainer.loop.trainer import fit

    out = tmp_path / "run"
    base = ["runtime.execution=local", "rollout.tasks_per_step=1", "rollout.n=2", "rollout.max_tokens=4", "eval_every=5"]
    console = Console(width=300)
    fit(f"{APP}:graph", TASKS[:4], load_config(overrides=[*base, "steps=1"]), out, console=console)
    plan = RunPlan.model_validate_json((out / "plan.json").read_text())
    assert (plan.learner, plan.device, plan.execution, sorted(plan.workers)) == ("torch", "cpu", "local", ["crew", "lead"])
    assert "starting the torch learner on cpu in this process; lead: embedded engine" in capsys.readouterr().out
    (out / "plan.json").unlink()  # a run written before plan.json existed
    rows = fit(f"{APP}:graph", TASKS[:4], load_config(overrides=[*base, "steps=2"]), out, resume=True, console=console)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    assert RunPlan.model_validate_json((out / "plan.json").read_text()).workers["lead"].model.endswith("policies/lead")


def test_engine_vllm_without_vllm_is_refused_by_the_plan(monkeypatch):
    """A missing vLLM is the plan's one line, before Ray or any worker group starts."""
    import importlib.util

    from mas_trainer.errors import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(UserError, match=r"engine vllm needs vLLM, which is not installed here: pip install -c mas-trainer/constraints-gpu.txt"):
        _plan("runtime.engine=vllm", "runtime.learner=verl", gpus=2)
    _plan("policies.lead.engine=embedded", gpus=2)  # no vllm policy: nothing asked


def test_engine_settings_reach_every_worker_plan_whole():
    from mas_trainer.engines.config import EngineSettings

    plan = _plan("runtime.fast_decode=false", "runtime.prefix_cache_mb=64", "runtime.batch_wait_ms=5",
                 "runtime.engine_bf16=false", "runtime.max_batch_size=3")
    want = EngineSettings(fast_decode=False, prefix_cache_mb=64, batch_wait_ms=5, engine_bf16=False, max_batch_size=3)
    assert [w.engine_settings for w in plan.workers.values()] == [want] * len(plan.workers)
    # the defaults are the config's, one set of them (a plan made without a config used to differ in engine_bf16)
    assert [w.engine_settings for w in _plan().workers.values()][0] == EngineSettings()


def test_a_torch_replica_gets_the_engine_settings_whole():
    pytest.importorskip("verl")
    from mas_trainer.engines.config import EngineSettings
    from mas_trainer.replicas.config import ReplicaConfig
    from mas_trainer.replicas.fleet import rollout_config

    settings = EngineSettings(fast_decode=False, prefix_cache_mb=8, batch_wait_ms=1, engine_bf16=False, max_batch_size=2)
    rcfg = rollout_config("p", "torch-replica", ReplicaConfig(), device="cpu", settings=settings, torch_threads=1)
    # what TorchRolloutServer reads back
    assert EngineSettings.model_validate(rcfg.custom["mas_torch"]["engine"]) == settings


# every engine setting away from its default: what a new setting would be
SETTINGS = ("runtime.max_batch_size=3", "runtime.batch_wait_ms=1", "runtime.prefix_cache_mb=1", "runtime.fast_decode=false",
            "runtime.engine_bf16=false")


def test_every_engine_setting_reaches_the_engine_on_every_path():
    """A setting is a field of `EngineSettings` and its use in the engine: the plan, a worker
    group in this process, the verbs' backends (serve, eval, trace) and a torch replica's config
    hand the object through whole, so the engines get all of it and nothing is copied by name."""
    pytest.importorskip("torch")
    from mas_trainer.engines.config import EngineSettings
    from mas_trainer.loop.backends import policy_backends
    from mas_trainer.policy.local import LocalPolicy
    from mas_trainer.spec import PolicySpec

    cfg = load_config(overrides=[*SETTINGS, "runtime.execution=local"])
    want = EngineSettings.of(cfg.runtime)
    assert all(getattr(want, k) != f.default for k, f in EngineSettings.model_fields.items())  # none left at its default
    plan = resolve_plan(cfg, {"solo": ("tiny", "tiny")}, machine=Machine(gpus=0, cpus=2))
    group = LocalPolicy(plan.workers["solo"])
    try:
        assert group.engine.settings == want
    finally:
        group.close()
    backends = policy_backends({"solo": PolicySpec("solo", "tiny", trainable=True)}, cfg.runtime)
    try:
        assert backends["solo"].engine.settings == want
    finally:
        backends["solo"].engine.close()


def test_vllm_on_cpu_plans_replicas_for_verl_and_the_policys_own_process_for_torch(monkeypatch):
    """engine vllm on CPU: the verl learner gets vLLM replicas of the project's server (ranks
    counted as for any replica), the torch learner vLLM in each policy's process (no replica,
    no rank), where the old log-probs are recomputed (vLLM's kernels are not the learner's)."""
    from mas_trainer.cluster import plan as plan_module
    from mas_trainer.replicas.fleet import replica_name

    monkeypatch.setattr(plan_module, "require_vllm", lambda: None)
    verl = _plan("runtime.engine=vllm", "runtime.replica.replicas=2")
    assert verl.learner == "verl" and [w.replica_first_rank for w in verl.workers.values()] == [0, 2]
    assert replica_name("vllm", "cpu") == "mas-vllm" and replica_name("vllm", "cuda") == "vllm"
    torch = _plan("runtime.engine=vllm", "runtime.learner=torch")
    assert {(w.engine, w.replica_first_rank, w.learner.old_logprobs) for w in torch.workers.values()} == {("vllm", 0, "recompute")}
    assert {w.learner.old_logprobs for w in _plan().workers.values()} == {"bypass"}  # the embedded engine's are exact
    with pytest.raises(ConfigError, match=r"^runtime.replica.replicas sets verl's rollout replicas; with runtime.learner=torch "
                       "vLLM runs in each policy's own process"):
        _plan("runtime.engine=vllm", "runtime.learner=torch", "runtime.replica.replicas=2")
    with pytest.raises(ConfigError, match=r"placement=colocated is verl's hybrid engine, vLLM on the learner's own GPUs; this "
                       "run is on CPU"):
        _plan("runtime.engine=vllm", "runtime.replica.placement=colocated")
    with pytest.raises(ConfigError, match="engine torch-replica syncs weights from verl worker groups"):
        _plan("runtime.engine=torch-replica", "runtime.learner=torch")


def test_a_shared_base_is_one_process_in_the_plan():
    """learner.shared_base: both policies are adapters of base `tiny`, one process, so one set of
    threads (every core), one GPU share and one placement ask; a policy kept out is its own."""
    shared = ["learner.lora_rank=4", "learner.shared_base=true"]
    plan = _plan(*shared)
    assert {w.shared_base for w in plan.workers.values()} == {"tiny"}
    assert {w.torch_threads for w in plan.workers.values()} == {8}  # 8 cores, one process
    assert "an adapter of shared base tiny" in plan.summary()
    gpu = _plan(*shared, "runtime.learner=torch", "runtime.resources.gpus_per_proc=0.5", gpus=1)
    assert gpu.gpus_needed == 0.5 and len(placement_asks(gpu)) == 1
    apart = _plan(*shared, "policies.crew.learner.shared_base=false")
    assert apart.workers["lead"].shared_base == "tiny" and apart.workers["crew"].shared_base is None
    assert {w.torch_threads for w in apart.workers.values()} == {4}
    with pytest.raises(ConfigError, match=r"policies lead, crew are adapters of one shared base \(tiny\) and run in one "
                                          r"process, but their resources differ"):
        _plan(*shared, "runtime.learner=torch", "policies.crew.resources.gpus_per_proc=0.5", gpus=1)
