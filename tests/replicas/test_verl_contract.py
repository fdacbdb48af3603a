"""The GPU rollout path against verl 0.9.1's own code, on CPU.

vLLM cannot be installed here, so nothing of the vLLM path runs; but most of what it depends
on is verl's Python, which can: its ServerAdapter (how a rollout process finds its vLLM server
and builds the weight-transfer socket), its NCCL checkpoint engine (the collective group),
its CheckpointEngineManager, its replica base class and its package metadata. These tests feed
them what the project builds, so a change on either side that breaks the contract fails here.
verl source files whose package imports vLLM are loaded by path with the vLLM-only names
stubbed; nothing of verl is copied or edited.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
import tomllib
import types
from pathlib import Path
from unittest.mock import patch

import pytest

verl = pytest.importorskip("verl")
pytest.importorskip("zmq")

from verl.workers.rollout.replica import RolloutReplica  # noqa: E402

from mas_trainer.config import ConfigError, load_config  # noqa: E402
from mas_trainer.replicas.config import ReplicaConfig  # noqa: E402
from mas_trainer.replicas.fleet import (  # noqa: E402
    RolloutFleet,
    learner_checkpoint_engine,
    rollout_config,
    weight_sync_method,
)

ROOT = Path(__file__).resolve().parents[2]
VERL = Path(verl.__file__).parent


def _load(rel: str, name: str, stubs: dict[str, types.ModuleType]) -> types.ModuleType:
    """A verl source file, executed as module `name` with `stubs` in sys.modules meanwhile."""
    with patch.dict(sys.modules, stubs):
        spec = importlib.util.spec_from_file_location(name, VERL / rel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vllm_rollout() -> types.ModuleType:
    """verl's `vllm_rollout.py` (ServerAdapter); its package needs vLLM only for the sleep level
    and its own __init__'s version check."""
    third = types.ModuleType("verl.third_party.vllm")
    third.VLLM_SLEEP_LEVEL = 2
    sender = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"
    bucketed = _load("workers/rollout/vllm_rollout/bucketed_weight_transfer.py", sender, {})
    return _load("workers/rollout/vllm_rollout/vllm_rollout.py", "_verl_vllm_rollout",
                 {"verl.third_party.vllm": third, sender: bucketed})


@pytest.fixture(scope="module")
def nccl_engine() -> types.ModuleType:
    """verl's NCCL checkpoint engine; cupy (a CUDA library) is only touched by `prepare`."""
    cupy = types.ModuleType("cupy")
    cupy.ndarray = type("ndarray", (), {})
    return _load("checkpoint_engine/nccl_checkpoint_engine.py", "_verl_nccl_engine", {"cupy": cupy})


def _vllm_server_name(replica: RolloutReplica, node_rank: int = 0) -> str:
    """The name verl's vLLMReplica.launch_servers gives a policy replica's server actor, read
    from verl's source (vllm_async_server.py imports vLLM, so it cannot be imported here)."""
    src = (VERL / "workers/rollout/vllm_rollout/vllm_async_server.py").read_text()
    launch = src[src.index("class vLLMReplica"):]
    expr = re.search(r"prefix = self\._get_server_name_prefix\(\)(?:.|\n)*?else:\s*\n\s*name = (f\"[^\"]+\")", launch)
    assert expr, "verl's vLLMReplica no longer names its server the way this test reads it"
    prefix = re.search(r"def _get_server_name_prefix\(self\) -> str:(?:.|\n)*?return \"([^\"]+)\"", src).group(1)
    return eval(expr.group(1), {}, {"prefix": prefix, "self": replica, "node_rank": node_rank})  # noqa: S307


class _Replica(RolloutReplica):
    """verl's replica base class as the fleet uses it; servers are not started here. Its
    launch_servers asserts what vLLMReplica.launch_servers asserts."""

    launched: list["_Replica"] = []

    async def launch_servers(self) -> None:
        assert len(self.workers) == self.world_size, (
            f"worker number {len(self.workers)} not equal to world size {self.world_size}")
        _Replica.launched.append(self)


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    from mas_trainer.engines.models import materialize

    return str(materialize("tiny", seed=0))


def _fleets(tiny_dir: str, placement: str = "separate", tp: int = 1, replicas: int = 2, world: int = 1):
    """Two vLLM policies as `fit` starts them: the run plan numbers their replicas (ranks continue
    across policies), each fleet starts from its plan's first rank as cluster/workers.py does."""
    from mas_trainer.cluster.plan import Machine, resolve_plan

    count = [] if placement == "colocated" else [f"runtime.replica.replicas={replicas}"]  # colocated: one per TP ranks
    cfg = load_config(overrides=["runtime.learner=verl", "runtime.device=cuda", "runtime.engine=vllm", *count,
                                 f"runtime.replica.placement={placement}", f"runtime.replica.tensor_parallel_size={tp}",
                                 f"runtime.resources.procs_per_node={world}", f"learner.mini_batch_size={4 * world}"])
    with patch("mas_trainer.cluster.plan.require_vllm", lambda: None):  # vLLM cannot be installed here
        plan = resolve_plan(cfg, {"planner": (tiny_dir, tiny_dir), "coder": (tiny_dir, tiny_dir)}, machine=Machine(gpus=64, cpus=8))
    fleets = []
    for policy, w in plan.workers.items():
        fleet = RolloutFleet(policy, tiny_dir, "vllm", w.replica, device="cuda", first_rank=w.replica_first_rank)
        fleet.build_replicas(_Replica, world)
        fleets.append(fleet)
    return fleets


def _adapter(module: types.ModuleType, monkeypatch, *, rank: int, local_world: int, **kwargs):
    """verl's ServerAdapter in a rollout (or hybrid learner) process of the given rank; records
    the actor name it looks its server up by."""
    looked_up: list[str] = []
    fake_ray = types.SimpleNamespace(
        get_runtime_context=lambda: types.SimpleNamespace(get_job_id=lambda: "03000000"),
        get_actor=lambda name: looked_up.append(name) or object())
    monkeypatch.setattr(module, "ray", fake_ray)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", str(local_world))
    adapter = module.ServerAdapter(device_mesh=None, **kwargs)
    adapter.looked_up = looked_up
    return adapter


def test_each_replica_process_finds_its_own_server_by_verls_name(vllm_rollout, tiny_dir, monkeypatch):
    """Issue 24, point 1: the weight sync of a standalone replica goes through verl's
    CheckpointEngineWorker, whose ServerAdapter (built with the kwargs the replica gives its
    workers) looks the server up by `vllm_server_{replica_rank}_{node_rank}`, no suffix."""
    names = set()
    for fleet in _fleets(tiny_dir):
        for replica in fleet.replicas:
            init = replica.get_ray_class_with_init_args().kwargs  # what verl's CheckpointEngineWorker gets
            adapter = _adapter(vllm_rollout, monkeypatch, rank=0, local_world=1, config=init["rollout_config"],
                               model_config=init["model_config"], replica_rank=init["replica_rank"])
            assert adapter._ensure_server_handle()
            assert adapter.looked_up == [_vllm_server_name(replica)]
            names.add(adapter.looked_up[0])
    assert len(names) == 4  # two policies x two replicas: no two servers share a name


def test_no_two_replicas_share_a_weight_transfer_socket(vllm_rollout, tiny_dir, monkeypatch):
    """Point 2: verl builds the CUDA-IPC socket path from job id + replica rank + local rank and
    unlinks and re-binds it; policies update in parallel, so the paths must differ across them."""
    paths = []
    for fleet in _fleets(tiny_dir):
        for replica in fleet.replicas:
            init = replica.get_ray_class_with_init_args().kwargs
            adapter = _adapter(vllm_rollout, monkeypatch, rank=0, local_world=1, config=init["rollout_config"],
                               model_config=init["model_config"], replica_rank=init["replica_rank"])
            paths.append(adapter.zmq_handle)
    assert len(set(paths)) == len(paths) == 4, paths


def test_each_policy_syncs_over_a_collective_group_of_its_own(nccl_engine, tiny_dir):
    """Point 3: verl's NCCL checkpoint engine defaults to group "default", a named store in Ray's
    collective group. The replicas' engines (built as verl's CheckpointEngineWorker builds them)
    and the learner's (built as verl's own trainer worker does) agree per policy, differ across."""
    groups = {}
    for fleet in _fleets(tiny_dir):
        rcfg = fleet.rollout_config()
        ce = rcfg.checkpoint_engine
        assert ce.backend == "nccl"
        rollout_side = nccl_engine.NCCLCheckpointEngine(
            bucket_size=ce.update_weights_bucket_megabytes << 20, **ce.engine_kwargs.get(ce.backend, {}))
        with patch.dict(sys.modules, {"verl.checkpoint_engine.nccl_checkpoint_engine": nccl_engine}):
            from verl.checkpoint_engine import CheckpointEngineRegistry

            with patch.dict(CheckpointEngineRegistry._registry, {"nccl": nccl_engine.NCCLCheckpointEngine}):
                learner_side = learner_checkpoint_engine(rcfg, rank=1)  # rank 0 would open a zmq server
        assert learner_side.group_name == rollout_side.group_name != "default"
        groups[fleet.policy] = rollout_side.group_name
    assert len(set(groups.values())) == 2, groups


def _resolve(requirement: str, seen: set[str]) -> set[str]:
    """Distributions a requirement on verl brings, through verl's own metadata (extras followed)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if req.name != "verl":
        return {req.name.lower()}
    found: set[str] = set()
    for extra in req.extras - seen:
        seen.add(extra)
        for line in requires("verl") or []:
            dep = Requirement(line)
            if dep.marker is not None and dep.marker.evaluate({"extra": extra}):
                found |= _resolve(str(dep).split(";")[0], seen)
    return found


def test_the_vllm_extra_installs_what_the_nccl_sync_imports():
    """Point 4: verl's NCCL checkpoint engine imports cupy when it loads, and verl's own `vllm`
    extra does not bring it (its `fsdp` and `megatron` extras do)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    brought = set().union(*(_resolve(r, set()) for r in extras["vllm"]))
    assert "vllm" in brought
    assert any(name.startswith("cupy") for name in brought), sorted(brought)
    src = (VERL / "checkpoint_engine/nccl_checkpoint_engine.py").read_text()
    assert "import cupy" in src  # the reason; if verl drops it, this extra can drop cupy too


def test_the_gpu_constraints_pin_what_the_gpu_extras_bring():
    """Points 4 and 7: cupy and flash-attention come from verl's own extras, at verl's pins, and
    constraints-gpu.txt holds the same pins (a drift on either side fails here)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "flash-attn" in set().union(*(_resolve(r, set()) for r in extras["flash-attn"]))
    pins = {Requirement(line).name.lower(): str(Requirement(line).specifier)
            for line in (ROOT / "constraints-gpu.txt").read_text().splitlines() if line and not line.startswith("#")}
    for line in requires("verl") or []:
        dep = Requirement(line)
        if dep.name.lower() in ("flash-attn", "cupy-cuda13x", "vllm", "torch", "transformers") and dep.marker and any(
                dep.marker.evaluate({"extra": e}) for e in ("vllm", "cupy-cu130", "flash-attn-cu130torch211")):
            assert pins.get(dep.name.lower()) == str(dep.specifier), (dep.name, pins.get(dep.name.lower()))


def test_colocated_replicas_run_on_the_learner_ranks_as_verls_hybrid_engine(vllm_rollout, tiny_dir, monkeypatch):
    """Point 5: colocated, verl gives each `tensor_parallel_size` learner ranks one replica
    (`LLMServerManager`), whose vLLMReplica asserts workers == TP x DP; each learner rank's own
    ServerAdapter (mas_trainer's hybrid worker) finds its replica's server by verl's name."""
    from mas_trainer.policy import verl_rank

    _Replica.launched.clear()
    world, tp = 4, 2
    learner = types.SimpleNamespace(workers=[f"rank{i}" for i in range(world)], world_size=world)
    fleets = _fleets(tiny_dir, placement="colocated", tp=tp, world=world)
    for fleet in fleets:
        assert fleet.weight_sync == "naive"
        asyncio.run(fleet.init(learner))
    assert len(_Replica.launched) == 4 and all(len(r.workers) == tp for r in _Replica.launched)
    monkeypatch.setattr("verl.workers.rollout.base.get_rollout_class", lambda name, mode: vllm_rollout.ServerAdapter)
    for fleet in fleets:
        servers = {r.replica_rank: _vllm_server_name(r) for r in fleet.replicas}
        owners = []
        for rank in range(world):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", str(world))
            adapter = _adapter(vllm_rollout, monkeypatch, rank=rank, local_world=world, config=fleet.rollout_config(),
                               model_config=fleet.replicas[0].model_config,
                               replica_rank=fleet.first_rank + rank // tp)
            via_worker = verl_rank._server_adapter(fleet.rollout_config(), tiny_dir, fleet.first_rank + rank // tp)
            assert via_worker.replica_rank == adapter.replica_rank
            if adapter._ensure_server_handle():
                owners.append(adapter.looked_up[0])
        assert owners == list(servers.values())  # one server-side rank per replica, each its own


def test_colocated_weights_go_in_process_not_over_nccl(monkeypatch, tiny_dir):
    """Point 6: NCCL refuses a group whose two ranks share a GPU; verl syncs colocated rollouts
    in-process (`naive`): its CheckpointEngineManager then only asks the learner group to
    `update_weights(mode="naive")`. An explicit nccl with colocated is refused at load."""
    from verl.checkpoint_engine import base

    assert weight_sync_method(ReplicaConfig(placement="colocated"), "cuda") == "naive"
    assert weight_sync_method(ReplicaConfig(), "cuda") == "nccl"
    assert weight_sync_method(ReplicaConfig(placement="colocated"), "cpu") == "mas-gloo"
    [fleet, _] = _fleets(tiny_dir, placement="colocated", world=1)
    calls = []
    learner = types.SimpleNamespace(world_size=1, update_weights=lambda **kw: calls.append(kw) or [{}])
    monkeypatch.setattr(base, "ray", types.SimpleNamespace(get=lambda refs: refs))
    manager = fleet._manager(learner)
    assert manager.update_weights(global_steps=3) == {}
    assert calls == [{"global_steps": 3, "mode": "naive"}]
    with pytest.raises(ConfigError, match="NCCL refuses"):
        load_config(overrides=["runtime.learner=verl", "runtime.engine=vllm", "runtime.replica.placement=colocated",
                               "runtime.replica.weight_sync=nccl"])


def test_rollout_config_is_one_verl_accepts_for_both_kinds(tiny_dir):
    """The replicas' config is verl's own dataclass (its validation ran) for vllm and torch-replica."""
    for kind, name in (("vllm", "vllm"), ("torch-replica", "mas-torch")):
        rcfg = rollout_config("p", kind, ReplicaConfig(), device="cuda")
        assert rcfg.name == name and rcfg.checkpoint_engine.engine_kwargs["nccl"]["group_name"] == "mas_weights_p"
    cpu = rollout_config("p", "torch-replica", ReplicaConfig(), device="cpu")
    assert cpu.checkpoint_engine.backend == "mas-gloo" and cpu.checkpoint_engine.custom_backend_module


@pytest.mark.parametrize("overrides, match", [
    (["runtime.learner=verl", "runtime.resources.gpus_per_proc=0.5"], "one rank per GPU"),
    (["runtime.learner=verl", "runtime.engine=torch-replica", "runtime.replica.placement=colocated"], "hybrid engine"),
    (["runtime.learner=verl", "runtime.engine=vllm", "runtime.replica.placement=colocated", "runtime.share_gpus=true"],
     "use one of them"),
    (["runtime.learner=verl", "runtime.engine=vllm", "runtime.replica.placement=colocated",
      "runtime.replica.tensor_parallel_size=2", "runtime.resources.procs_per_node=3", "learner.mini_batch_size=6"],
     "multiple of"),
    (["runtime.learner=verl", "runtime.engine=vllm", "runtime.replica.weight_sync=naive"], "only colocated"),
])
def test_placements_verl_cannot_run_are_refused_when_the_config_loads(overrides, match):
    """Points 5, 6 and 12: one line saying why and what works instead, before anything starts."""
    with pytest.raises(ConfigError, match=match) as err:
        load_config(overrides=overrides)
    assert "\n" not in str(err.value)


@pytest.mark.verl
def test_closing_a_fleet_ends_the_id_store_rays_nccl_group_leaves_behind():
    """Ray's collective group keeps the NCCL unique id of `mas_weights_POLICY` in a detached
    actor that outlives the job; closing the fleet ends it, so a run leaves nothing on a shared
    cluster (the GPU path, its cleanup checked here against a store made the way Ray makes it)."""
    import time

    import ray
    from ray.util.collective.const import get_store_name
    from ray.util.collective.util import NCCLUniqueIDStore

    from mas_trainer.replicas.fleet import RolloutFleet, sync_group_name

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        name = get_store_name(sync_group_name("lead"))
        store = NCCLUniqueIDStore.options(name=name, lifetime="detached", num_cpus=0).remote(name)
        ray.get(store.set_id.remote(b"id"))
        fleet = RolloutFleet("lead", "unused", "torch-replica", ReplicaConfig(), device="cuda")
        assert fleet.weight_sync == "nccl"
        fleet.close()
        with pytest.raises(ValueError):
            for _ in range(100):  # ray.kill is asynchronous: the name goes once the actor is dead
                ray.get_actor(name)
                time.sleep(0.1)
        fleet.close()  # twice, or with no store: nothing to end
    finally:
        ray.shutdown()
