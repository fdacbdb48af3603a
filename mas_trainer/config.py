"""The `fit` configuration: typed models, loaded from YAML, with dotted `key=value` overrides.

An unknown key is an error naming the valid keys at that level; `mas-trainer fit --help`
lists every key with its default (`describe_keys`). Every name a later stage looks up
(allocator and its options, reward weights, advantage estimator, per policy too) is checked
here, before anything starts. Importing this module does not import torch.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mas_trainer.algo.config import AdvantageConfig
from mas_trainer.engines.config import EngineSettings
from mas_trainer.errors import UserError, did_you_mean
from mas_trainer.learners.config import CriticConfig, LearnerConfig, at_most
from mas_trainer.rewards.allocators import LevelWeights, allocator_names, check_allocator
from mas_trainer.rewards.config import CounterfactualConfig
from mas_trainer.replicas.config import ENGINES, ReplicaConfig

__all__ = [
    "FitConfig", "BestConfig", "PolicyConfig", "WarmStartConfig", "RuntimeConfig", "Resources", "load_config", "describe_keys", "check_torch_only", "check_policy_names",
    "check_trackers", "check_runtime", "resolve_learner", "old_logprobs_mode", "TRACKERS", "ConfigError", "RENAMED",
]

TRACKERS = ("console", "tensorboard", "mlflow", "wandb")

# Upper bounds of the numbers that multiply a run's work (`at_most`): each refuses a typo or a hostile
# config in one line naming the cost, and is far above what a real run uses (the largest published
# GRPO/DAPO batches are 512-1024 tasks x 16-64 rollouts).
MAX_STEPS = 1_000_000
MAX_TASKS_PER_STEP = 4096
MAX_N = 1024  # rollout.n and val_n
MAX_ROLLOUTS_PER_STEP = 65_536  # rollout.tasks_per_step x rollout.n
MAX_IN_FLIGHT = 4096
MAX_TOKENS = 1_048_576  # the longest context of any model; the gateway caps a reply at the model's own too
MAX_RECURSION = 10_000
MAX_DRAWS = 100
MAX_WARM_START_STEPS = 100_000
MAX_WARM_START_BATCH = 4096
MAX_REPLICAS = 1024
MAX_NODES = 4096
MAX_PROCS_PER_NODE = 1024

# what each tracker imports, and what to install when it is missing
# the package is not on PyPI: its extras install from a checkout (README, Install)
_TRACKERS_EXTRA = "or the trackers extra from a checkout: pip install -c mas-trainer/constraints.txt './mas-trainer[trackers]'"
_TRACKER_NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard",), "pip install tensorboard"),
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), f"pip install mlflow ({_TRACKERS_EXTRA})"),
    "wandb": (("wandb",), f"pip install wandb ({_TRACKERS_EXTRA})"),
}


def check_trackers(names: Iterable[str]) -> None:
    """One line naming what to install for each tracker whose package is missing; called
    when the config loads and again before `fit` starts anything."""
    for name in names:
        if name not in TRACKERS:
            raise UserError(f"logger: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        modules, how = _TRACKER_NEEDS.get(name, ((), ""))
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if name == "mlflow" and "mlflow" not in missing and os.environ.get("MLFLOW_TRACKING_URI", "sqlite").split(":")[0] != "sqlite":
            missing = []  # a server or another store: the client alone is enough
        if missing:
            raise UserError(f"logger: {name} needs the {', '.join(missing)} package{'s' if len(missing) > 1 else ''}, "
                            f"not installed: {how}")


class Resources(BaseModel):
    """Where one policy's worker group runs (config: `runtime.resources`, per policy
    `policies.NAME.resources`)."""

    model_config = ConfigDict(extra="forbid")

    nodes: Annotated[int, at_most(MAX_NODES, "nodes of one policy's pool: each starts procs_per_node training processes")] = Field(
        1, ge=1, description=f"nodes of the policy's resource pool (verl learner; at most {MAX_NODES})")
    procs_per_node: Annotated[int, at_most(MAX_PROCS_PER_NODE, "training processes per node: each holds a shard of the model "
                                           "and its optimizer state")] = Field(
        1, ge=1, description="training processes (ranks) per node; world size = nodes x procs_per_node "
        f"(verl learner; the torch learner runs one process per policy; at most {MAX_PROCS_PER_NODE})")
    gpus_per_proc: float = Field(1.0, gt=0, le=1, description="GPU share of each rank where there are GPUs (1: a GPU each; "
                                 "below 1 only on the torch learner, whose policies then share GPUs)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class ConfigError(UserError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutConfig(_Strict):
    tasks_per_step: Annotated[int, at_most(MAX_TASKS_PER_STEP, "tasks drawn per training step: each is run rollout.n times")] = Field(
        8, ge=1, description=f"tasks drawn per training step (at most {MAX_TASKS_PER_STEP}, and tasks_per_step x n at most "
        f"{MAX_ROLLOUTS_PER_STEP}: every rollout of a step is kept until its update)")
    n: Annotated[int, at_most(MAX_N, "rollouts per task: each is a full run of the app")] = Field(
        4, ge=1, description=f"rollouts per task (the group the advantages compare within; at most {MAX_N})")
    max_in_flight: Annotated[int | None, at_most(MAX_IN_FLIGHT, "rollouts running at once: each holds a run of the app, its "
                                                 "open requests and an engine row")] = Field(
        None, ge=1, description="rollouts running at once (default: runtime.max_batch_size, the rows an engine decodes together: "
        f"more only wait for a row, and run into timeout_s; at most {MAX_IN_FLIGHT})")
    timeout_s: float = Field(300.0, gt=0, description="a rollout running longer is stopped (status timeout)")
    max_tokens: Annotated[int, at_most(MAX_TOKENS, "tokens one reply may decode: each is a forward pass of the model, for "
                                       "every call of every rollout")] = Field(
        64, ge=1, description=f"max_tokens of requests that set none (at most {MAX_TOKENS}; a reply also stops at the model's context)")
    recursion_limit: Annotated[int | None, at_most(MAX_RECURSION, "LangGraph supersteps per rollout: each can run its nodes' "
                                                   "LLM calls again")] = Field(
        None, ge=1, description="LangGraph recursion limit per rollout, replacing the app's own (default: the app's, bound "
        f"with graph.with_config(recursion_limit=N) as create_agent and deepagents do, else LangGraph's; at most {MAX_RECURSION})")
    temperature: float | None = Field(
        None, ge=0, le=2, description="temperature of every LLM call in training rollouts (default: the app's own; the learner trains the raw, temperature-1 policy)")
    temperature_schedule: dict[int, float] = Field(
        default_factory=dict, description="{step: temperature}: from that training step on, training rollouts sample at that "
        "temperature instead of `temperature` (e.g. {21: 1.0}: explore again once the answers have settled)")
    val_temperature: float | None = Field(
        None, ge=0, le=2, description="temperature of every LLM call in held-out evaluations (0: greedy; default: the app's own)")
    filter_groups: bool = Field(
        False, description="dynamic sampling (DAPO): train only on groups whose turns got different rewards (the others have "
        "zero advantage), drawing as many more tasks as groups are missing, up to max_draws draws a step, until "
        "tasks_per_step such groups are found")
    max_draws: Annotated[int, at_most(MAX_DRAWS, "draws per training step: each runs up to tasks_per_step x n more "
                                      "rollouts")] = Field(
        3, ge=1, description="with filter_groups: most draws in one step (the first of tasks_per_step tasks, each later one "
        f"of the groups still missing; at most {MAX_DRAWS}); a step that finds fewer groups with spread trains on those it found")
    min_groups: int | None = Field(
        None, ge=1, description="with filter_groups: draw again only while fewer than this many groups have spread "
        "(default tasks_per_step, DAPO's rule; a later draw still takes all the groups missing from tasks_per_step). "
        "E.g. half of tasks_per_step: early steps, where most groups differ, take one draw, late ones, where most agree, more")
    max_staleness: int = Field(
        0, ge=0, le=1, description="1: the next step's rollouts run while the policies update, on the weights they have "
        "(one update behind at most; a turn older than that is never trained), and the gap is corrected with verl's rollout "
        "correction (learner.old_logprobs auto becomes rollout_correction); steps that evaluate or checkpoint wait for their "
        "update first, so resume stays exact. 0: rollouts and updates take turns (docs/training.md#overlap)")
    max_failed: float = Field(
        1.0, gt=0, le=1, description="fit stops (exit 2, no checkpoint of that step) when at least this share of a training "
        "step's rollouts failed (error or timeout); 1.0: only when all did")

    @model_validator(mode="after")
    def _rollouts_per_step(self) -> RolloutConfig:
        total = self.tasks_per_step * self.n
        if total > MAX_ROLLOUTS_PER_STEP:
            raise ValueError(f"tasks_per_step x n = {self.tasks_per_step} x {self.n} = {total} rollouts per step is over the "
                             f"bound of {MAX_ROLLOUTS_PER_STEP} (each is a full run of the app, and the step keeps every one "
                             "until its update); lower tasks_per_step or n")
        return self

    @field_validator("temperature_schedule")
    @classmethod
    def _schedule(cls, v: dict[int, float]) -> dict[int, float]:
        for step, t in v.items():
            if step < 1 or not 0 <= t <= 2:
                raise ValueError(f"entry {step}: {t} must map a training step >= 1 to a temperature in [0, 2], e.g. {{21: 1.0}}")
        return dict(sorted(v.items()))

    def temperature_at(self, step: int) -> float | None:
        """The temperature of training step `step`'s rollouts: the schedule's last entry at or
        before it, else `temperature`."""
        return next((t for s, t in reversed(self.temperature_schedule.items()) if s <= step), self.temperature)


class RewardConfig(_Strict):
    allocator: str = Field("broadcast", description="broadcast | turn_delta | counterfactual (forked continuations, fit only) | a name registered with register_allocator")
    weights: LevelWeights = Field(default_factory=LevelWeights)
    options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the allocator (turn_delta: initial, per_role)")
    on_failure: float | Literal["drop"] = Field(0.0, description="reward of every call of a failed rollout, or drop it from its group")
    counterfactual: CounterfactualConfig = Field(
        default_factory=CounterfactualConfig, description="allocator=counterfactual: which roles' turns are credited by "
        "forked continuations, K, the budget per step, boundaries_only (docs/rewards.md)")


class WarmStartConfig(_Strict):
    """The supervised warm start (config: `warm_start`, per policy `policies.NAME.warm_start`):
    before the first RL step of a fresh run, each trainable policy takes `steps` optimizer steps
    on the mean token NLL of good turns (docs/training.md, "Warm start")."""

    data: str | None = Field(None, description="JSONL of supervised turns (one per line: policy, messages, completion; "
                             "`mas-trainer data` writes it from well-scored runs); None: no warm start")
    steps: Annotated[int, at_most(MAX_WARM_START_STEPS, "warm-start optimizer steps per policy: each is a forward and "
                                  "backward of batch_size turns")] = Field(
        20, ge=0, description=f"optimizer steps per policy (0: no warm start for it; at most {MAX_WARM_START_STEPS})")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate of the warm start (a fresh optimizer; the learner's "
                      "betas, eps, weight decay and max_grad_norm)")
    batch_size: Annotated[int, at_most(MAX_WARM_START_BATCH, "turns per warm-start optimizer step: each is a forward and "
                                       "backward of the model")] = Field(
        8, ge=1, description=f"turns per optimizer step (at most the policy's turns, and at most {MAX_WARM_START_BATCH})")
    min_score: float | None = Field(None, description="only lines whose score is at least this (lines without a score "
                                    "are then left out)")


class BestConfig(_Strict):
    """Which held-out evaluation's weights are the run's best, and when a run has learned enough
    (config: `best`; docs/training.md, "The best checkpoint and early stop"). Keeping the best is
    on (what `serve`, `export` and `eval` should get is the best the run reached, not wherever it
    drifted to); stopping early is off until asked for (only the user knows what "learned" means)."""

    metric: str = Field("val/reward/mean", description="the held-out metric that ranks evaluations after step 0, as "
                        "trackers name it: val/reward/mean, val/reward/role/ROLE, any numeric key of the kind val rows")
    mode: Literal["max", "min"] = Field("max", description="max: higher is better; min: lower is better")
    keep: bool = Field(True, description="keep the weights of the best evaluation in RUN_DIR/best/step_N/policies/ (a save "
                       "of the policies per new best); serve, export and eval take them by default (--checkpoint last: the "
                       "last checkpoint)")
    patience: int | None = Field(None, ge=1, description="stop early after this many held-out evaluations in a row without "
                                 "an improvement of more than min_delta over the best (None: never)")
    min_delta: float = Field(0.0, ge=0, description="with patience: the least change of the metric that counts as an improvement")
    target: float | None = Field(None, description="stop early once an evaluation reaches this (>= with mode max, <= with "
                                 "min; None: never)")

    @field_validator("metric")
    @classmethod
    def _held_out(cls, v: str) -> str:
        if not v.startswith("val/") or v == "val/":
            raise ValueError(f"{v!r} must name a held-out metric as trackers do, val/ then the key of the held-out rows, "
                             "e.g. val/reward/mean")
        return v


class PolicyConfig(_Strict):
    """Per-policy overrides of the shared learner and advantage settings."""

    learner: dict[str, Any] = Field(default_factory=dict, description="LearnerConfig fields for this policy")
    advantage: dict[str, Any] = Field(default_factory=dict, description="AdvantageConfig fields for this policy")
    critic: dict[str, Any] = Field(default_factory=dict, description="CriticConfig fields for this policy (GAE only)")
    resources: dict[str, Any] = Field(default_factory=dict, description="Resources fields for this policy's worker group (verl learner)")
    engine: Literal[ENGINES] | None = Field(None, description="this policy's engine (default: runtime.engine)")  # type: ignore[valid-type]
    warm_start: dict[str, Any] = Field(default_factory=dict, description="WarmStartConfig fields for this policy "
                                       "(steps, lr, batch_size, min_score; the data file is shared)")


class RuntimeConfig(_Strict, EngineSettings):
    """Where and how the policies run; the engine settings (`EngineSettings`) are its own keys too."""

    learner: Literal["auto", "verl", "torch"] = Field(
        "auto", description="verl: verl's FSDP2 training workers, a Ray worker group per policy; torch: the embedded "
        "learner, one process per policy; auto: verl where there are GPUs, torch on CPU only (faster there, see docs)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where engines and learners run (auto: cuda if torch sees a GPU)")
    resources: Resources = Field(default_factory=Resources)
    engine: Literal[ENGINES] = Field(  # type: ignore[valid-type]
        "embedded", description="what generates rollouts: embedded = the torch engine in the policy's worker group; vllm = "
        "vLLM, weights replaced in place after each update: verl's rollout replicas with the verl learner (on CPU vLLM's CPU "
        "build in the replica's process), in the policy's own process with the torch learner; torch-replica = the embedded "
        "engine behind the replica interface (CPU)")
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig, description=f"rollout replicas (at most {MAX_REPLICAS} a policy)")
    share_gpus: bool = Field(False, description="verl learner on GPUs: every policy's worker group on one pool of GPUs (rollout and update take turns) instead of disjoint pools")
    execution: Literal["ray", "local"] = Field("ray", description="where the policies' worker groups run: ray = Ray actors (one per policy, or verl's ranks); local = in this process (torch learner only)")
    ray_address: str | None = Field(None, description="join this Ray cluster instead of starting a local one")
    num_cpus: int | None = Field(None, description="CPUs of the local Ray instance (default: all); not with ray_address")
    placement_timeout_s: float = Field(600.0, gt=0, description="longest wait for Ray to place a worker group's or rollout "
                                       "replica's resources (an autoscaling cluster adding nodes) before the run stops and says "
                                       "what could not be placed")
    worker_cpus: float = Field(0.0, ge=0, description="CPUs each worker group actor reserves (0 fits any number on one machine); "
                               "torch learner on Ray only (verl's ranks take their pool's bundles)")
    torch_threads: int | None = Field(None, ge=1, description="torch threads per Ray worker process (default: on CPU cores / "
                                      "processes: policies, or verl ranks) and per engine in this process (serve, trace, eval, "
                                      "runtime.execution=local; default: the cores it may use / its engines, docs/engine.md)")

    @field_validator("replica")
    @classmethod
    def _replicas_bounded(cls, replica: ReplicaConfig) -> ReplicaConfig:
        if replica.replicas > MAX_REPLICAS:
            raise ValueError(f"replicas={replica.replicas} is over the bound of {MAX_REPLICAS} (rollout replicas per policy: each "
                             f"is a server process with its own copy of the model); use at most {MAX_REPLICAS}")
        return replica


class FitConfig(_Strict):
    seed: int = Field(0, description="seeds data order, sampling and the tiny model")
    steps: Annotated[int, at_most(MAX_STEPS, "training steps: each runs rollout.tasks_per_step x rollout.n rollouts and an "
                                  "update")] = Field(20, ge=1, description=f"training steps (at most {MAX_STEPS})")
    model: str | None = Field(None, description="base model of every policy (tiny | default | PATH | Hugging Face hub id); default: as the app says")
    save_every: int = Field(10, ge=1, description="checkpoint every N steps (and at the end)")
    eval_every: int = Field(10, ge=1, description="evaluate the held-out split every N steps (and before training)")
    val_fraction: float = Field(0.0, ge=0, lt=1, description="fraction of --data held out when --val-data is not given")
    val_n: Annotated[int, at_most(MAX_N, "rollouts per held-out task: each is a full run of the app, at every evaluation")] = Field(
        1, ge=1, description=f"rollouts per held-out task (at most {MAX_N})")
    best: BestConfig = Field(default_factory=BestConfig)
    logger: list[Literal[TRACKERS]] = Field(  # type: ignore[valid-type]
        ["console", "tensorboard"], description="trackers that get every metrics row: console (a line per step), tensorboard "
        "(RUN_DIR/tensorboard), mlflow (RUN_DIR/mlflow.db), wandb (offline, RUN_DIR/wandb); e.g. logger=[console,mlflow]")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    policies: dict[str, PolicyConfig] = Field(default_factory=dict, description="per-policy overrides: policies.NAME.learner.lr=...")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    @field_validator("logger", mode="before")
    @classmethod
    def _logger_list(cls, value: Any) -> Any:
        """`logger=tensorboard` and `logger=console,mlflow` too, not only a YAML list."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return [] if value is None else value

    def learner_for(self, policy: str) -> LearnerConfig:
        over = self.policies.get(policy)
        return LearnerConfig.model_validate({**self.learner.model_dump(), **(over.learner if over else {})})

    def advantage_for(self, policy: str) -> AdvantageConfig:
        over = self.policies.get(policy)
        return AdvantageConfig.model_validate({**self.advantage.model_dump(), **(over.advantage if over else {})})

    def resources_for(self, policy: str) -> Resources:
        over = self.policies.get(policy)
        return Resources.model_validate({**self.runtime.resources.model_dump(), **(over.resources if over else {})})

    def engine_for(self, policy: str) -> str:
        over = self.policies.get(policy)
        return over.engine if over is not None and over.engine is not None else self.runtime.engine

    def critic_for(self, policy: str) -> CriticConfig:
        over = self.policies.get(policy)
        return CriticConfig.model_validate({**self.critic.model_dump(), **(over.critic if over else {})})

    def warm_start_for(self, policy: str) -> WarmStartConfig:
        over = self.policies.get(policy)
        return WarmStartConfig.model_validate({**self.warm_start.model_dump(), **(over.warm_start if over else {})})


RENAMED = {"runtime.backend": "runtime.execution"}
"""Keys renamed since runs were first written -> their name now (in the same section): a user's
config that spells the old one is refused in one line; a run directory's config.yaml is read
with the new name (`load_config(upgrade=True)`), so runs written before still eval, export, serve."""


def _renamed_keys(tree: dict[str, Any], upgrade: bool) -> None:
    for old, new in RENAMED.items():
        *parents, leaf = old.split(".")
        node: Any = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        if not upgrade:
            raise ConfigError(f"{old} is now called {new}: write {new}={node[leaf]}")
        node.setdefault(new.rsplit(".", 1)[1], node.pop(leaf))


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _describe_error(err: ValidationError, root: type[BaseModel] | None = None) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        section = root if root is not None and len(e["loc"]) == 1 else _section_of(tuple(e["loc"][:-1]))
        if section is None:
            return f"unknown config key {loc!r}; see mas-trainer fit --help"
        hint = did_you_mean(str(e["loc"][-1]), section.model_fields)
        return f"unknown config key {loc!r}; {hint}valid keys here: {', '.join(section.model_fields)}"
    return f"config key {loc!r}: {e['msg'].removeprefix('Value error, ')}"


def _section_of(path: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model a config path points into (None where keys are free, e.g. policy names)."""
    model: type[BaseModel] = FitConfig
    parts = [str(p) for p in path]
    while parts:
        part = parts.pop(0)
        if model is FitConfig and part == "policies":
            if not parts:
                return None
            parts.pop(0)
            model = PolicyConfig
            continue
        field = model.model_fields.get(part)
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), base: Mapping[str, Any] | None = None, *,
                upgrade: bool = False) -> FitConfig:
    """YAML file (optional), then `base` (e.g. CLI flags), then `key=value` overrides (values parsed as YAML).
    `upgrade`: the file is a run's config.yaml, whose renamed keys (`RENAMED`) are read under their new names."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the config must be a mapping of keys")
        tree = loaded
    for key, value in (base or {}).items():
        _set_dotted(tree, key, value)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. learner.lr=1e-5)")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw else "")
    _renamed_keys(tree, upgrade)
    try:
        cfg = FitConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe_error(exc)) from exc
    for name in cfg.policies:  # per-policy sections must be valid too
        for part, build, model in (("learner", cfg.learner_for, LearnerConfig), ("advantage", cfg.advantage_for, AdvantageConfig),
                                   ("critic", cfg.critic_for, CriticConfig), ("resources", cfg.resources_for, Resources),
                                   ("warm_start", cfg.warm_start_for, WarmStartConfig)):
            try:
                build(name)
            except ValidationError as exc:
                raise ConfigError(f"policies.{name}.{part}: {_describe_error(exc, model)}") from exc
    _check_reward(cfg)
    rt = cfg.runtime
    device = None if rt.device == "auto" else rt.device  # else decided by the run plan, against the machine
    check_runtime(cfg, resolve_learner(cfg, device), device)
    _check_filter_groups(cfg)
    if cfg.best.min_delta and cfg.best.patience is None:
        raise ConfigError("best.min_delta sets what counts as an improvement for best.patience, which is off: set "
                          "best.patience=N (held-out evaluations without one before the run stops), or drop min_delta")
    for name, over in cfg.policies.items():
        if "data" in over.warm_start:  # one file holds every policy's lines
            raise ConfigError(f"policies.{name}.warm_start.data: the warm-start file is shared (each line names its policy); "
                              "set warm_start.data, and policies.NAME.warm_start.steps=0 to leave a policy out")
    try:
        check_trackers(cfg.logger)  # a missing tracker package: one line, before anything starts
    except UserError as exc:
        raise ConfigError(str(exc)) from exc
    return cfg


def _check_reward(cfg: FitConfig) -> None:
    """The allocator's options, where the allocator is known now. An allocator the app
    registers (`@register_allocator` in the app's module) exists only once the app is
    imported, after the config: `check_allocator` is called again there."""
    r = cfg.reward
    if r.allocator not in allocator_names():
        return
    try:
        check_allocator(r.allocator, r.options)
    except UserError as exc:
        raise ConfigError(str(exc)) from exc


def _check_filter_groups(cfg: FitConfig) -> None:
    """Dynamic sampling keeps groups by the spread of their rewards, which is what a group
    baseline turns into advantages; GAE's come from the critic, so equal rewards still teach."""
    r = cfg.rollout
    if not r.filter_groups:
        if r.min_groups is not None:
            raise ConfigError("rollout.min_groups only applies with rollout.filter_groups=true; set that or drop min_groups")
        return
    if r.min_groups is not None and r.min_groups > r.tasks_per_step:
        raise ConfigError(f"rollout.min_groups={r.min_groups} is more than rollout.tasks_per_step={r.tasks_per_step}, "
                          f"so every step would take max_draws draws; use at most {r.tasks_per_step}")
    for name in ["", *cfg.policies]:
        if (cfg.advantage_for(name) if name else cfg.advantage).estimator == "gae":
            where = f"policies.{name}.advantage.estimator" if name else "advantage.estimator"
            raise ConfigError(f"rollout.filter_groups drops groups whose rewards are all equal, which still carry GAE "
                              f"advantages; use a group estimator in {where} (grpo, rloo, ...) or filter_groups=false")


def _replicated(cfg: FitConfig) -> set[str]:
    """The rollout-replica engines the config gives any policy (an unnamed one gets runtime.engine)."""
    return {cfg.engine_for(name) for name in ["", *cfg.policies]} - {"embedded"}


def _only_vllm(cfg: FitConfig) -> bool:
    """Every policy generates on vLLM: runtime.engine is vllm and no policy names another engine."""
    return cfg.runtime.engine == "vllm" and all(p.engine in (None, "vllm") for p in cfg.policies.values())


def resolve_learner(cfg: FitConfig, device: str | None) -> str | None:
    """`runtime.learner`, `auto` decided: verl on Ray where there are GPUs (device cuda) or rollout
    replicas, else torch; None while that waits on a device not yet decided (`auto`)."""
    rt = cfg.runtime
    if rt.learner != "auto":
        return rt.learner
    if rt.execution == "local":
        return "torch"
    if _replicated(cfg) or device == "cuda":
        return "verl"
    return "torch" if device == "cpu" else None


def check_runtime(cfg: FitConfig, learner: str | None, device: str | None) -> None:
    """What the learner and device choice require, and the keys the chosen path would not read:
    the one place of these rules, run when the config loads (with what is known then: None for a
    choice still `auto`) and again by the run plan with everything decided, before anything starts."""
    _check_learner(cfg, learner)
    _check_ignored(cfg, learner, device)


def _check_overlap(cfg: FitConfig, engines: set[str]) -> None:
    """Where the next step's rollouts cannot run beside the update, max_staleness is refused
    rather than quietly doing nothing."""
    rt, why = cfg.runtime, None
    if "vllm" in engines:
        why = ("verl's weight sync into a vLLM server that is still generating has not been run here; use "
               "engine=torch-replica or embedded")
    elif engines and rt.replica.placement == "colocated":
        why = "colocated replicas sleep while the learner updates on their GPUs; use runtime.replica.placement=separate"
    elif rt.share_gpus:
        why = "runtime.share_gpus gives the GPUs to one phase at a time; drop it"
    if why:
        raise ConfigError(f"rollout.max_staleness={cfg.rollout.max_staleness} overlaps rollouts with the update, but {why}")


def old_logprobs_mode(learner_cfg: LearnerConfig, learner: str | None, max_staleness: int, engine: str = "embedded") -> str:
    """`learner.old_logprobs` with `auto` decided: rollout_correction when rollouts may be a step
    behind (`rollout.max_staleness` > 0), else recompute on the verl learner (verl's default) and
    bypass on the torch learner with the embedded engine (its log-probs are exact for the weights
    it trains; vLLM's kernels are not the learner's, so beside vLLM it recomputes too)."""
    if learner_cfg.old_logprobs != "auto":
        return learner_cfg.old_logprobs
    if max_staleness:
        return "rollout_correction"
    return "bypass" if learner == "torch" and engine == "embedded" else "recompute"


def _check_learner(cfg: FitConfig, learner: str | None) -> None:
    """What the learner choice requires."""
    rt = cfg.runtime
    engines = _replicated(cfg)
    if engines:
        which = ", ".join(sorted(engines))
        if learner == "torch" and engines != {"vllm"}:
            raise ConfigError(f"engine {which} syncs weights from verl worker groups on Ray: use runtime.learner=verl "
                              "(or auto on GPUs) and runtime.execution=ray, or runtime.engine=embedded")
        if learner == "torch":  # vLLM in the policy's own process, beside the learner
            _check_vllm_beside_torch(rt.replica)
            engines = set()
        if "torch-replica" in engines and rt.replica.tensor_parallel_size != 1:
            raise ConfigError("engine torch-replica is one process a replica: set runtime.replica.tensor_parallel_size=1")
        _check_placement(cfg, engines)
    if learner == "verl" or engines:
        check_torch_only(cfg, "runtime.learner=torch and runtime.engine=embedded")
    if cfg.rollout.max_staleness:
        _check_overlap(cfg, engines)
    for name in ["", *cfg.policies]:
        old = old_logprobs_mode(cfg.learner_for(name) if name else cfg.learner, learner, cfg.rollout.max_staleness,
                                cfg.engine_for(name))
        if cfg.rollout.max_staleness and old not in ("rollout_correction", "bypass"):
            where = f"policies.{name}.learner.old_logprobs" if name else "learner.old_logprobs"
            raise ConfigError(f"rollout.max_staleness={cfg.rollout.max_staleness} trains on turns one update old, and {where}={old} "
                              "would recompute the old log-probs without correcting for that: set it to auto or rollout_correction")
        # a threshold other than the default, and nothing reads it (compared with the default, not "was it set":
        # a run's config.yaml sets every key, and old run directories must keep loading)
        threshold = (cfg.learner_for(name) if name else cfg.learner).rollout_is_threshold
        if threshold != LearnerConfig.model_fields["rollout_is_threshold"].default and old != "rollout_correction":
            where = f"policies.{name}.learner" if name else "learner"
            raise ConfigError(f"{where}.rollout_is_threshold truncates the importance weights of rollout correction, which "
                              f"is off ({where}.old_logprobs={old}): set learner.old_logprobs=rollout_correction, or drop it")
    if learner == "verl" and rt.execution == "local":
        raise ConfigError("runtime.learner=verl runs worker groups on Ray; drop runtime.execution=local (or use runtime.learner=torch)")
    if learner == "verl":
        for name in ["", *cfg.policies]:
            res = cfg.resources_for(name) if name else rt.resources
            if res.gpus_per_proc < 1:
                where = f"policies.{name}.resources.gpus_per_proc" if name else "runtime.resources.gpus_per_proc"
                raise ConfigError(f"{where}={res.gpus_per_proc}: the verl learner places one rank per GPU (NCCL refuses two "
                                  "ranks of one group on one GPU), so a share below 1 would only leave GPUs idle; to let "
                                  "policies share GPUs set runtime.share_gpus=true (or use runtime.learner=torch)")
            sizes = [("learner", cfg.learner_for(name).mini_batch_size if name else cfg.learner.mini_batch_size)]
            if (cfg.advantage_for(name) if name else cfg.advantage).estimator == "gae":  # the critic's worker too
                sizes.append(("critic", cfg.critic_for(name).mini_batch_size if name else cfg.critic.mini_batch_size))
            for part, mini in sizes:
                if mini % res.world_size:
                    where = f"policies.{name}.{part}.mini_batch_size" if name else f"{part}.mini_batch_size"
                    raise ConfigError(f"{where}={mini} must be a multiple of the worker group's world size {res.world_size} "
                                      "(resources.nodes x resources.procs_per_node): each rank takes an equal share")


def check_policy_names(cfg: FitConfig, app_policies: Iterable[str]) -> None:
    """`policies.NAME.*` must name one of the app's policies (known once the app is imported)."""
    known = sorted(app_policies)
    for name in cfg.policies:
        if name not in known:
            hint = did_you_mean(name, known)
            raise ConfigError(f"policies.{name}: the app has no policy {name!r}; {hint}its policies: {', '.join(known) or 'none'}")


def _check_ignored(cfg: FitConfig, learner: str | None, device: str | None) -> None:
    """A key the chosen path would not read is refused, not silently dropped: checked on values
    other than the default (a run's config.yaml spells out every key, so "given" is not enough)."""
    rt = cfg.runtime
    if learner == "verl":
        for section, key, why in (("learner", "fused_adamw", "verl's FSDP optimizer picks its own AdamW kernel"),
                                  ("critic", "micro_batch_tokens", "verl's value model cuts micro-batches by "
                                   "critic.micro_batch_size alone")):
            default = type(getattr(cfg, section)).model_fields[key].default
            given = [(f"{section}.{key}", getattr(getattr(cfg, section), key))]
            given += [(f"policies.{n}.{section}.{key}", getattr(p, section).get(key, default)) for n, p in cfg.policies.items()]
            for where, value in given:
                if value != default:
                    raise ConfigError(f"{where} applies to the torch learner only ({why}): drop the key, or use "
                                      "runtime.learner=torch")
        if rt.worker_cpus != RuntimeConfig.model_fields["worker_cpus"].default:
            raise ConfigError("runtime.worker_cpus sizes the torch learner's Ray actors; verl places one rank per CPU or "
                              "GPU bundle of its pool: drop the key, or use runtime.learner=torch")
    if learner == "torch":
        for name in ["", *cfg.policies]:
            res = cfg.resources_for(name) if name else rt.resources
            if res.world_size > 1:
                where = f"policies.{name}.resources" if name else "runtime.resources"
                raise ConfigError(f"{where}: world size {res.world_size}, but the torch learner runs one process per policy; "
                                  "set nodes=1 and procs_per_node=1, or use runtime.learner=verl")
    if device == "cpu" and rt.replica.placement == "colocated" and _replicated(cfg) and learner == "verl":
        raise ConfigError("runtime.replica.placement=colocated is verl's hybrid engine, vLLM on the learner's own GPUs; this "
                          "run is on CPU, where replicas run in processes of their own: use placement=separate")
    if rt.num_cpus is not None and rt.ray_address is not None:
        raise ConfigError("runtime.num_cpus sizes the local Ray instance; a cluster joined at runtime.ray_address offers "
                          "the CPUs its nodes started with: drop one of the two keys")
    if rt.share_gpus and (learner == "torch" or device == "cpu"):
        raise ConfigError("runtime.share_gpus pools the verl learner's GPUs" + (
            "; the torch learner's policies share GPUs with runtime.resources.gpus_per_proc below 1" if learner == "torch"
            else ", and this run is on CPU") + ": drop the key")
    if _only_vllm(cfg):
        for key, why in (("batch_wait_ms", "vLLM schedules its own batches"), ("engine_bf16", "vLLM's weights are in "
                         "runtime.replica.dtype"), ("prefix_cache_mb", "vLLM caches prefixes itself"),
                         ("fast_decode", "vLLM pages its own K/V cache")):
            if getattr(rt, key) != RuntimeConfig.model_fields[key].default:
                raise ConfigError(f"runtime.{key} sets the embedded and torch-replica engines; every policy here runs on "
                                  f"vllm ({why}): drop the key")
    if rt.execution == "local":
        for key in ("worker_cpus",):
            if getattr(rt, key) != RuntimeConfig.model_fields[key].default:
                raise ConfigError(f"runtime.{key} sizes the Ray worker groups; with runtime.execution=local they run in this "
                                  "process: drop the key, or use runtime.execution=ray")


def _check_placement(cfg: FitConfig, engines: set[str]) -> None:
    """Rollout replicas' placement and weight sync, as verl can run them (docs/vllm.md)."""
    rep = cfg.runtime.replica
    if rep.placement == "separate":
        if rep.weight_sync == "naive":
            raise ConfigError("runtime.replica.weight_sync=naive hands weights over inside the learner's processes, which "
                              "only colocated replicas share; use placement=colocated, or weight_sync=auto (nccl on GPUs)")
        return
    if "torch-replica" in engines:
        raise ConfigError("runtime.replica.placement=colocated is verl's hybrid engine (vLLM driven from the learner's own "
                          "GPU processes); engine torch-replica runs in processes of its own: use placement=separate")
    if rep.weight_sync not in ("auto", "naive"):
        raise ConfigError(f"runtime.replica.weight_sync={rep.weight_sync} cannot reach colocated replicas: they share the "
                          "learner's GPUs, where NCCL refuses a group of two ranks on one GPU; colocated replicas take "
                          "the weights in-process (naive): drop the key, or use placement=separate")
    if cfg.runtime.share_gpus:
        raise ConfigError("runtime.share_gpus puts every policy's learner on the same GPUs, and placement=colocated every "
                          "policy's vLLM too; use one of them")
    tp = rep.tensor_parallel_size
    for name in ["", *cfg.policies]:
        if cfg.engine_for(name) == "embedded":
            continue
        world = cfg.resources_for(name).world_size if name else cfg.runtime.resources.world_size
        where = f"policies.{name}.resources" if name else "runtime.resources"
        if world % tp:
            raise ConfigError(f"placement=colocated: the world size {world} of {where} must be a multiple of "
                              f"runtime.replica.tensor_parallel_size={tp} (every {tp} learner ranks drive one replica)")
        if "replicas" in rep.model_fields_set and rep.replicas != world // tp:
            raise ConfigError(f"placement=colocated: runtime.replica.replicas={rep.replicas}, but verl runs one replica per "
                              f"{tp} learner rank(s): {world // tp} for {where}; drop runtime.replica.replicas")


def _check_vllm_beside_torch(rep: ReplicaConfig) -> None:
    """The torch learner with `engine: vllm` runs one vLLM engine in each policy's process and
    loads the weights into it after every update: no replicas to count or place."""
    for key in ("replicas", "placement", "tensor_parallel_size", "weight_sync", "bucket_mb"):
        if getattr(rep, key) != ReplicaConfig.model_fields[key].default:
            raise ConfigError(f"runtime.replica.{key} sets verl's rollout replicas; with runtime.learner=torch vLLM runs in "
                              "each policy's own process and takes the weights there after every update: drop the key, or "
                              "use runtime.learner=verl")


def check_torch_only(cfg: FitConfig, fix: str) -> None:
    """LoRA, skip_zero_advantage and share_prompts exist on the torch learner only in this version."""
    for name in ["", *cfg.policies]:
        learner = cfg.learner_for(name) if name else cfg.learner
        for key, on in (("shared_base", learner.shared_base), ("lora_rank", learner.lora_rank), ("skip_zero_advantage", learner.skip_zero_advantage),
                        ("share_prompts", learner.share_prompts)):
            if on:
                where = f"policies.{name}.learner.{key}" if name else f"learner.{key}"
                raise ConfigError(f"{where} runs on the torch learner with the embedded engine only in this version: "
                                  f"set {fix}, or turn {key} off")


def describe_keys(model: type[BaseModel] = FitConfig, prefix: str = "") -> list[str]:
    """Every key with its default and description, one per line, for --help and the docs."""
    lines = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        key = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.extend(describe_keys(ann, key + "."))
            continue
        default = field.get_default(call_default_factory=True)
        lines.append(f"  {key} = {default!r}  {field.description or ''}".rstrip())
    return lines
