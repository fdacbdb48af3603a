"""`load_config` checks every name a later stage looks up, and stays light to import."""

import re
import subprocess
import sys

import pytest

from mas_trainer.config import ConfigError, load_config


def test_import_does_not_load_torch_and_common_estimators_do_not_load_verl():
    code = ("import sys, mas_trainer.config as c; assert 'torch' not in sys.modules, 'torch'; "
            "c.load_config(overrides=['advantage.estimator=rloo', 'policies.a.advantage.estimator=gae']); "
            "assert 'verl' not in sys.modules, 'verl'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["advantage.estimator=grpp"], "config key 'advantage.estimator': advantage estimator 'grpp' is not usable here; choose one of .*grpo"),
        (["policies.coder.advantage.estimator=remax"], "policies.coder.advantage: .*'remax' is not usable here; choose one of .*rloo"),
        (["reward.weights.trajectroy=0"], r"unknown config key 'reward.weights.trajectroy'; did you mean 'trajectory'\? valid keys here: trajectory, role, turn"),
        (["reward.options.initial=1"], "allocator 'broadcast' has no option 'initial'; valid: none"),
        (["reward.allocator=turn_delta", "reward.options.per_rol=true"], "'turn_delta' has no option 'per_rol'; valid: initial, per_role"),
        (["reward.on_failure=skip"], "reward.on_failure"),
    ],
)
def test_names_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(overrides=overrides)
    assert "\n" not in str(err.value)


def test_valid_names_load():
    cfg = load_config(overrides=["reward.allocator=turn_delta", "reward.options.initial=0.5", "reward.weights.trajectory=0",
                                 "policies.coder.advantage.estimator=rloo_vectorized"])
    assert cfg.reward.weights.trajectory == 0 and cfg.reward.weights.turn == 1
    assert cfg.advantage_for("coder").estimator == "rloo_vectorized"


def test_an_allocator_the_app_registers_is_checked_once_it_exists():
    from mas_trainer.errors import UserError
    from mas_trainer.rewards import check_allocator

    cfg = load_config(overrides=["reward.allocator=registered_by_the_app"])  # not known before the app is imported
    with pytest.raises(UserError, match="unknown reward allocator 'registered_by_the_app'; known: broadcast"):
        check_allocator(cfg.reward.allocator, cfg.reward.options)


def test_config_models_are_importable_from_their_old_places():
    from mas_trainer.algo.config import AdvantageConfig
    from mas_trainer.algo.config import AdvantageConfig as light_advantage
    from mas_trainer.learners.config import CriticConfig as light_critic
    from mas_trainer.learners.config import CriticConfig

    assert AdvantageConfig is light_advantage and CriticConfig is light_critic


@pytest.mark.parametrize("overrides, message", [
    (["runtime.learner=verl", "learner.fused_adamw=true"], r"learner.fused_adamw applies to the torch learner only"),
    (["runtime.learner=auto", "runtime.device=cuda", "policies.p.learner.fused_adamw=false"],
     r"policies.p.learner.fused_adamw applies to the torch learner only"),
    (["runtime.execution=local", "runtime.worker_cpus=1"], r"runtime.worker_cpus sizes the Ray worker groups"),
    (["runtime.learner=verl", "critic.micro_batch_tokens=512"], r"critic.micro_batch_tokens applies to the torch learner only"),
    (["runtime.learner=verl", "policies.p.critic.micro_batch_tokens=512"],
     r"policies.p.critic.micro_batch_tokens applies to the torch learner only"),
    (["runtime.learner=verl", "runtime.worker_cpus=1"], r"runtime.worker_cpus sizes the torch learner's Ray actors"),
    (["runtime.learner=torch", "runtime.share_gpus=true"], r"runtime.share_gpus pools the verl learner's GPUs; the torch"),
    (["runtime.learner=verl", "runtime.device=cpu", "runtime.share_gpus=true"], r"share_gpus .* this run is on CPU"),
    (["runtime.num_cpus=4", "runtime.ray_address=auto"], r"runtime.num_cpus sizes the local Ray instance"),
    (["runtime.learner=torch", "policies.p.resources.procs_per_node=2"],
     r"policies.p.resources: world size 2, but the torch learner runs one process per policy"),
])
def test_a_key_the_chosen_path_would_not_read_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_the_same_keys_load_where_they_are_read():
    load_config(overrides=["runtime.learner=torch", "learner.fused_adamw=true", "runtime.worker_cpus=1", "runtime.torch_threads=2"])


@pytest.mark.parametrize("key, value", [("batch_wait_ms", 5), ("engine_bf16", "true"), ("prefix_cache_mb", 64),
                                        ("fast_decode", "false")])
def test_an_embedded_engine_key_is_refused_when_every_policy_runs_on_vllm(key, value):
    with pytest.raises(ConfigError, match=rf"^runtime.{key} sets the embedded and torch-replica engines; every policy here "
                       r"runs on vllm \(.*\): drop the key$"):
        load_config(overrides=["runtime.engine=vllm", f"runtime.{key}={value}"])
    with pytest.raises(ConfigError, match=rf"runtime.{key} sets the embedded"):
        load_config(overrides=["runtime.engine=vllm", "policies.p.engine=vllm", f"runtime.{key}={value}"])


def test_embedded_engine_keys_load_where_an_engine_reads_them():
    # defaults (a run's config.yaml spells every key), a policy on another engine, and max_batch_size, which is
    # also rollout.max_in_flight's default on vllm
    load_config(overrides=["runtime.engine=vllm", "runtime.batch_wait_ms=50", "runtime.engine_bf16=auto", "runtime.max_batch_size=32"])
    load_config(overrides=["runtime.engine=vllm", "policies.p.engine=torch-replica", "runtime.batch_wait_ms=5"])
    load_config(overrides=["runtime.engine=torch-replica", "runtime.engine_bf16=false", "runtime.prefix_cache_mb=64"])
    from mas_trainer.config import describe_keys

    for key in ("max_batch_size", "batch_wait_ms", "prefix_cache_mb", "fast_decode", "engine_bf16"):
        (line,) = [line for line in describe_keys() if line.startswith(f"  runtime.{key} = ")]
        assert "embedded and torch-replica engines: " in line, line


def test_an_unknown_key_names_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"unknown config key 'learner.lrr'; did you mean 'lr'\? valid keys here: lr, "):
        load_config(overrides=["learner.lrr=1e-5"])
    with pytest.raises(ConfigError, match=r"policies.front.learner: unknown config key 'cliip_ratio_low'; did you mean 'clip_ratio_low'\?"):
        load_config(overrides=["policies.front.learner.cliip_ratio_low=0.1"])


def test_a_renamed_key_is_refused_with_its_new_name_but_a_run_written_before_still_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"^runtime.backend is now called runtime.execution: write runtime.execution=local$"):
        load_config(overrides=["runtime.backend=local"])
    (tmp_path / "config.yaml").write_text("steps: 3\nruntime:\n  backend: local\n")
    with pytest.raises(ConfigError, match="runtime.backend is now called runtime.execution"):
        load_config(tmp_path / "config.yaml")  # a user's file
    from mas_trainer.run.rundir import run_config

    cfg = run_config(tmp_path)  # a run directory's config.yaml, written before the rename
    assert cfg.runtime.execution == "local" and cfg.steps == 3


def test_a_policy_override_must_name_a_policy_of_the_app():
    from mas_trainer.config import check_policy_names

    cfg = load_config(overrides=["policies.frontt.learner.lr=1e-5"])
    with pytest.raises(ConfigError, match=r"^policies.frontt: the app has no policy 'frontt'; did you mean 'front'\? its policies: back, front$"):
        check_policy_names(cfg, ["front", "back"])
    check_policy_names(load_config(overrides=["policies.front.learner.lr=1e-5"]), ["front", "back"])


def test_a_rollout_correction_threshold_without_rollout_correction_is_refused():
    """Set and ignored would be a silent no-op: refused in one line naming the key to set."""
    with pytest.raises(ConfigError, match=r"learner.rollout_is_threshold .* set learner.old_logprobs=rollout_correction"):
        load_config(overrides=["learner.rollout_is_threshold=3"])
    with pytest.raises(ConfigError, match=r"policies.crew.learner.rollout_is_threshold"):
        load_config(overrides=["runtime.learner=verl", "policies.crew.learner.rollout_is_threshold=3"])
    cfg = load_config(overrides=["runtime.learner=verl", "learner.old_logprobs=rollout_correction", "learner.rollout_is_threshold=3"])
    assert cfg.learner.rollout_is_threshold == 3


# --- the numbers that multiply a run's work are bounded -----------------------------------------
# (key, the bound, what each unit costs as the error says it): a value over the bound is refused in
# one line naming both; the bound itself loads. Per-policy sections are checked the same way.
BOUNDS = [
    ("steps", 1_000_000, "training steps: each runs rollout.tasks_per_step x rollout.n rollouts and an update"),
    ("val_n", 1024, "rollouts per held-out task: each is a full run of the app"),
    ("rollout.tasks_per_step", 4096, "tasks drawn per training step: each is run rollout.n times"),
    ("rollout.n", 1024, "rollouts per task: each is a full run of the app"),
    ("rollout.max_in_flight", 4096, "rollouts running at once: each holds a run of the app"),
    ("rollout.max_tokens", 1_048_576, "tokens one reply may decode: each is a forward pass of the model"),
    ("rollout.recursion_limit", 10_000, "LangGraph supersteps per rollout"),
    ("rollout.max_draws", 100, "draws per training step: each runs up to tasks_per_step x n more rollouts"),
    ("reward.counterfactual.k", 256, "K forks per credited turn: each is a full continuation of the app"),
    ("learner.ppo_epochs", 64, "passes over the turns of one update: each is a forward and backward of every turn"),
    ("critic.ppo_epochs", 64, "passes over the turns of one update"),
    ("learner.lora_rank", 4096, "LoRA rank: the adapter's weights, gradients and AdamW state grow with it"),
    ("warm_start.steps", 100_000, "warm-start optimizer steps per policy"),
    ("warm_start.batch_size", 4096, "turns per warm-start optimizer step"),
    ("runtime.resources.nodes", 4096, "nodes of one policy's pool"),
    ("runtime.resources.procs_per_node", 1024, "training processes per node"),
]


@pytest.mark.parametrize("key, bound, cost", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_a_number_that_multiplies_work_is_bounded_and_the_error_names_the_cost(key, bound, cost):
    with pytest.raises(ConfigError, match=rf"^config key '{key}': {bound + 1} is over the bound of {bound} "
                       rf"\({re.escape(cost)}.*\); use at most {bound}") as err:
        load_config(overrides=[f"{key}={bound + 1}"])
    assert "\n" not in str(err.value)
    from mas_trainer.config import describe_keys

    (line,) = [line for line in describe_keys() if line.startswith(f"  {key} = ")]
    assert f"at most {bound}" in line.lower(), line  # documented where every key is (--help, docs/training.md)
    extra = ["runtime.learner=verl", "learner.mini_batch_size=1024"] if key == "runtime.resources.procs_per_node" else []
    if key != "rollout.n":  # alone at its bound: within the bound of rollouts per step with the default tasks
        load_config(overrides=[f"{key}={bound}", *extra])


@pytest.mark.parametrize("key", ["learner.ppo_epochs", "warm_start.steps", "resources.procs_per_node"])
def test_a_policy_override_is_bounded_too(key):
    with pytest.raises(ConfigError, match=rf"^policies.crew.{key.split('.')[0]}: config key '{key.split('.')[1]}': "
                       r"1000000 is over the bound of \d+ \("):
        load_config(overrides=[f"policies.crew.{key}=1000000"])


def test_rollouts_per_step_are_bounded_as_a_product():
    with pytest.raises(ConfigError, match=r"^config key 'rollout': tasks_per_step x n = 4096 x 32 = 131072 rollouts per "
                       r"step is over the bound of 65536 \(each is a full run of the app, .*\); lower tasks_per_step or n$"):
        load_config(overrides=["rollout.tasks_per_step=4096", "rollout.n=32"])
    load_config(overrides=["rollout.tasks_per_step=1024", "rollout.n=64"])  # a large real batch loads
    load_config(overrides=["rollout.tasks_per_step=64", "rollout.n=1024"])


def test_rollout_replicas_are_bounded():
    with pytest.raises(ConfigError, match=r"^config key 'runtime.replica': replicas=1025 is over the bound of 1024 "
                       r"\(rollout replicas per policy: each is a server process with its own copy of the model\)"):
        load_config(overrides=["runtime.replica.replicas=1025"])
