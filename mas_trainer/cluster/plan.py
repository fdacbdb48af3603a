"""What `fit` will do, decided once before anything starts: the run plan (`RunPlan`: learner,
device, where the workers run, pools, engines, trackers, allocator) and in it one worker plan per trainable
policy (`policy.contract.WorkerPlan`: what the controller tells a worker group to be).

The plan crosses a process boundary (a Ray actor's constructor), so it carries plain data and
pydantic models (picklable): the already-validated sections of the `fit` config.
"""

from __future__ import annotations

from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field

from mas_trainer.engines.config import EngineSettings
from mas_trainer.engines.threads import available_cores, share, threads_from_env
from mas_trainer.policy.contract import WorkerPlan
from mas_trainer.config import ConfigError, FitConfig, RuntimeConfig, check_runtime, old_logprobs_mode, resolve_learner
from mas_trainer.replicas.config import first_replica_ranks, replica_count, require_vllm

__all__ = ["placement_asks", "check_cluster_fits", "check_joined_cluster", "RunPlan", "Machine", "probe_machine", "decide_device", "resolve_plan"]


class Machine(BaseModel):
    """What `auto` is decided against: this machine as torch sees it (`probe_machine`; tests pass their own)."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(0, ge=0, description="GPUs torch sees here")
    cpus: int = Field(1, ge=1, description="CPU cores this process may use here (affinity, cgroup quota)")


def probe_machine() -> Machine:
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover - the core runs without torch
        gpus = 0
    return Machine(gpus=gpus, cpus=available_cores())


def decide_device(device: str, machine: Machine | None = None) -> Literal["cpu", "cuda"]:
    """`runtime.device` decided: `auto` is `cuda` where torch sees a GPU (on `machine`, default
    this one), else `cpu`. `fit`'s plan and the verbs' engines (`serve`, `eval`, `trace`) ask here."""
    if device in ("cpu", "cuda"):
        return device  # type: ignore[return-value]
    return "cuda" if (machine or probe_machine()).gpus else "cpu"


class RunPlan(BaseModel):
    """The `fit` config resolved once against the app and the machine, before any worker group
    or Ray starts: everything after it reads the plan instead of deciding again. Written as
    RUN_DIR/plan.json."""

    model_config = ConfigDict(extra="forbid")

    learner: Literal["torch", "verl"]
    device: Literal["cpu", "cuda"]
    execution: Literal["ray", "local"]
    machine: Machine
    share_gpus: bool = Field(False, description="verl on GPUs: every worker group on one pool, offloaded between phases")
    gpus_needed: float = Field(0.0, description="GPUs the worker groups and rollout replicas take (0 on CPU)")
    trackers: list[str] = Field(default_factory=list)
    allocator: str = "broadcast"
    workers: dict[str, WorkerPlan] = Field(default_factory=dict, description="one per trainable policy")
    runtime: RuntimeConfig = Field(description="runtime.*, with learner and device decided")

    def summary(self) -> str:
        where = "in this process" if self.execution == "local" else "on Ray"
        pools = " (one shared GPU pool)" if self.share_gpus else ""
        each = "; ".join(f"{p}: {w.engine} engine, {w.resources.world_size} rank(s), {w.advantage.estimator}"
                         + (f", an adapter of shared base {w.shared_base}" if w.shared_base else "")
                         for p, w in self.workers.items()) or "no trainable policy"
        return f"{self.learner} learner on {self.device} {where}{pools}; {each}"


def resolve_plan(cfg: FitConfig, models: Mapping[str, tuple[str, str]], *, machine: Machine | None = None) -> RunPlan:
    """The run plan of `cfg` for the app's trainable policies (`models`: policy -> (weights to start
    from, base model)), on `machine` (default: this one, probed). Every rule the learner choice
    brings is checked here (`check_runtime`), so nothing is refused after Ray starts."""
    machine = machine or probe_machine()
    rt = cfg.runtime
    device = decide_device(rt.device, machine)
    learner = resolve_learner(cfg, device)
    assert learner is not None  # the device is known
    check_runtime(cfg, learner, device)
    stale = cfg.rollout.max_staleness
    workers = {p: WorkerPlan(policy=p, model=model, reference=base, advantage=cfg.advantage_for(p), max_staleness=stale,
                             learner=cfg.learner_for(p).model_copy(  # `auto` decided here, once, for every learner
                                 update={"old_logprobs": old_logprobs_mode(cfg.learner_for(p), learner, stale, cfg.engine_for(p))}),
                             critic=cfg.critic_for(p), seed=cfg.seed, device=device, resources=cfg.resources_for(p),
                             engine_settings=EngineSettings.of(rt), engine=cfg.engine_for(p), replica=rt.replica)
               for p, (model, base) in models.items()}
    # a LoRA policy beside vLLM is a shared base of its own: vLLM takes its adapter in place (multi-LoRA), where a
    # weight reload would need the adapter merged into a full copy of the model after every update
    groups = {p: base if cfg.learner_for(p).shared_base else f"{base}/{p}" for p, (_model, base) in models.items()
              if cfg.learner_for(p).shared_base or (cfg.learner_for(p).lora_rank and workers[p].engine == "vllm")}
    workers = _shared_bases(workers, groups)
    if any(w.engine == "vllm" for w in workers.values()):  # before minutes of start-up, not after
        require_vllm()
    shared = rt.share_gpus and learner == "verl" and device == "cuda"
    if shared and len({(w.resources.nodes, w.resources.procs_per_node) for w in workers.values()}) > 1:
        raise ConfigError("runtime.share_gpus puts every policy on one pool, so every policy needs the same resources: "
                          "set runtime.resources only, not policies.NAME.resources")
    ranks = sum(w.resources.world_size for w in workers.values())
    processes = len({w.shared_base or p for p, w in workers.items()})  # a shared base's policies are one process
    first = first_replica_ranks({p: 0 if w.engine == "embedded" or learner == "torch" else replica_count(w.replica, device, w.resources.world_size)
                                 for p, w in workers.items()})
    for name, w in workers.items():  # torch threads per process: configured, else the cores shared out
        threads = rt.torch_threads
        if threads is None and rt.execution == "local":  # every policy process in this one: each engine a share
            threads = threads_from_env() or share(machine.cpus, processes)
        elif threads is None and (learner == "torch" or device == "cpu"):
            threads = share(machine.cpus, ranks if learner == "verl" else processes)
        workers[name] = w.model_copy(update={"torch_threads": threads,
                                             "offload_between_phases": shared,
                                             "replica_first_rank": first[name]})
    needed = _gpus_needed(workers, learner, shared, rt.execution) if device == "cuda" else 0.0
    if device == "cuda" and rt.ray_address is None and needed > machine.gpus:
        fix = ("lower runtime.resources.gpus_per_proc (0.5: two policies a GPU)" if learner == "torch" else
               "lower runtime.resources.procs_per_node or the replicas" + ("" if shared else ", set runtime.share_gpus=true"))
        raise ConfigError(f"the {learner} learner needs {needed:g} GPU(s) here ({_gpu_use(workers, learner)}), and torch sees "
                          f"{machine.gpus}: {fix}, or join a cluster with runtime.ray_address")
    return RunPlan(learner=learner, device=device, execution=rt.execution, machine=machine, share_gpus=shared, gpus_needed=needed,
                   trackers=list(cfg.logger), allocator=cfg.reward.allocator, workers=workers,
                   runtime=rt.model_copy(update={"learner": learner, "device": device}))


def _processes(workers: Mapping[str, WorkerPlan]) -> dict[str, WorkerPlan]:
    """One plan per torch-learner process: a shared base's first policy stands for all of them."""
    seen: dict[str, WorkerPlan] = {}
    for p, w in workers.items():
        seen.setdefault(w.shared_base or p, w)
    return {w.policy: w for w in seen.values()}


def _shared_bases(workers: dict[str, WorkerPlan], bases: Mapping[str, str]) -> dict[str, WorkerPlan]:
    """Policies with learner.shared_base on one base model become adapters of one shared base
    (`bases`: policy -> `WorkerPlan.shared_base`, the base's reference), which must run alike: one
    engine, one device share."""
    groups: dict[str, list[str]] = {}
    for p, base in bases.items():
        groups.setdefault(base, []).append(p)
    for base, names in groups.items():
        for key in ("engine", "resources"):
            seen = {p: getattr(workers[p], key) for p in names}
            if len({repr(v) for v in seen.values()}) > 1:
                raise ConfigError(f"policies {', '.join(names)} are adapters of one shared base ({base}) and run in one process, "
                                  f"but their {key} differ ({'; '.join(f'{p}: {v}' for p, v in seen.items())}): give them one "
                                  f"(set it outside policies.NAME), or set policies.NAME.learner.shared_base=false for some")
        for p in names:
            workers[p] = workers[p].model_copy(update={"shared_base": base})
    return workers


# the GPUs of one node a replica's pool may take (RolloutFleet's `gpus_per_node`, as verl's default)
REPLICA_GPUS_PER_NODE = 8


def _replica_gpus(w: WorkerPlan) -> int:
    """GPUs of a policy's rollout replicas beside its learner: a vLLM replica's
    `tensor_parallel_size`, a torch replica's one (both in GPU pools of their own, verl's
    standalone mode); colocated ones use the learner's."""
    if w.engine == "embedded" or w.replica.placement == "colocated":
        return 0
    return w.replica.replicas * w.replica.tensor_parallel_size


def _replica_asks(w: WorkerPlan) -> list[dict[str, float]]:
    """One replica's placement groups where it runs beside the learner: on CPU one bundle of a
    CPU (the fleet's pool); on GPUs verl's standalone pool (`RolloutReplica.init_standalone`:
    `max_colocate_count=2`, so two CPUs a GPU) of `tensor_parallel_size` GPUs over
    `tensor_parallel_size / gpus_per_replica_node` nodes."""
    if w.engine == "embedded" or (w.device == "cuda" and w.replica.placement == "colocated"):
        return []
    if w.device != "cuda":
        return [{"CPU": 1.0}]
    tp = w.replica.tensor_parallel_size
    per_node = min(REPLICA_GPUS_PER_NODE, tp)
    return [{"CPU": 2.0 * per_node, "GPU": float(per_node)}] * (tp // per_node)


def _gpus_needed(workers: Mapping[str, WorkerPlan], learner: str, shared: bool, where: str) -> float:
    if learner == "torch":  # in this process every policy takes the one GPU; on Ray each its share
        return float(bool(workers)) if where == "local" else sum(w.resources.gpus_per_proc for w in _processes(workers).values())
    ranks = [w.resources.world_size for w in workers.values()]
    return float((max(ranks, default=0) if shared else sum(ranks)) + sum(map(_replica_gpus, workers.values())))


def _gpu_use(workers: Mapping[str, WorkerPlan], learner: str) -> str:
    each = (w.resources.gpus_per_proc if learner == "torch" else w.resources.world_size + _replica_gpus(w)
            for w in workers.values())
    return ", ".join(f"{p}: {n:g}" for p, n in zip(workers, each))


def placement_asks(plan: RunPlan) -> list[tuple[str, dict[str, float]]]:
    """What Ray must place for the worker groups, as (policy, what one node gives it): verl's
    resource pools ask one strict-pack placement group per node of `procs_per_node` bundles
    (a CPU each, and a GPU each on GPUs; `share_gpus`: one pool for all, asked once); rollout
    replicas beside the learner their own pools (`_replica_asks`); a torch-learner actor its
    `worker_cpus` and GPU share."""
    asks: list[tuple[str, dict[str, float]]] = []
    processes = _processes(plan.workers)
    for i, (p, w) in enumerate(plan.workers.items()):
        r, gpu = w.resources, w.device == "cuda"
        if plan.learner == "verl" and not (plan.share_gpus and i):
            cpus = r.procs_per_node * (len(plan.workers) if plan.share_gpus else 1)
            asks += [(p, {"CPU": float(cpus), **({"GPU": float(r.procs_per_node)} if gpu else {})})] * r.nodes
        elif plan.learner == "torch" and p in processes:
            ask = {"CPU": plan.runtime.worker_cpus, "GPU": r.gpus_per_proc if gpu else 0.0}
            asks += [(p, {k: v for k, v in ask.items() if v})] if any(ask.values()) else []
        if plan.learner == "verl":
            asks += [(p, ask) for ask in _replica_asks(w)] * w.replica.replicas
    return asks


def check_cluster_fits(asks: list[tuple[str, dict[str, float]]], nodes: list[dict[str, float]], address: str) -> None:
    """Refuse, in one line, worker groups the joined cluster's nodes (their total resources)
    cannot hold, before Ray is asked to place any: Ray would wait for them for ever. First fit,
    largest asks first, one node per placement group, as Ray's strict packing places them."""
    free = [dict(n) for n in nodes]
    for policy, ask in sorted(asks, key=lambda a: -sum(a[1].values())):
        node = next((n for n in free if all(n.get(k, 0.0) >= v - 1e-9 for k, v in ask.items())), None)
        if node is None:
            wanted = sum(1 for p, _ in asks if p == policy)
            have = "; ".join(", ".join(f"{k} {v:g}" for k, v in sorted(n.items()) if k in ("CPU", "GPU")) or "no CPU or GPU"
                             for n in nodes) or "no node"
            shown = "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(ask.items())) + "}"
            raise ConfigError(f"policy {policy} asks {wanted} placement(s) of {shown} each on one node, and the Ray cluster at "
                              f"{address} cannot hold the run's worker groups (its {len(nodes)} node(s): {have}): add nodes, or "
                              "lower runtime.resources (nodes, procs_per_node) or the replicas")
        for k, v in ask.items():
            node[k] = node.get(k, 0.0) - v


def check_joined_cluster(plan: RunPlan) -> None:
    """`check_cluster_fits` against the cluster this driver joined (`runtime.ray_address`; a
    local instance is sized for the run when it starts)."""
    import ray

    if plan.runtime.ray_address is None:
        return
    nodes = [{k: float(v) for k, v in n["Resources"].items()} for n in ray.nodes() if n.get("Alive")]
    check_cluster_fits(placement_asks(plan), nodes, plan.runtime.ray_address)
