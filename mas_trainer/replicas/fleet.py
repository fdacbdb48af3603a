"""A policy's rollout replicas, built from verl's parts: replicas from
`RolloutReplicaRegistry` (`vllm`, or `mas-torch` for the embedded engine), verl's load
balancer (`get_router_handle`: sticky sessions, least in-flight) and `LLMServerClient` for
requests, `CheckpointEngineManager.update_weights` for the weights after each update.

What `LLMServerManager` does for verl's trainer, composed here directly because that
manager reads verl's whole trainer config and places replicas only in verl's own ways;
the replicas, balancer, client and weight sync are verl's, unchanged.

Placement (`runtime.replica.placement`): `separate` starts each replica on GPUs of its own
(`init_standalone`) and sends weights over NCCL, one collective group per policy;
`colocated` is verl's hybrid engine (`init_hybrid` on the learner's worker group): every
`tensor_parallel_size` learner ranks drive one vLLM replica on their own GPUs, which sleeps
(vLLM sleep mode frees weights and KV cache) while the learner updates, and takes the new
weights in-process (`naive`: CUDA IPC from the learner rank to vLLM on the same GPU). On CPU,
replicas are the project's own servers in CPU pools of their own, `mas-torch` (the embedded
engine) or `mas-vllm` (vLLM's CPU build in the server's process, `engines/vllm_engine.py`),
and weights travel over gloo (`mas-gloo`). Replica ranks are unique across the run's policies (`first_rank`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
import types
from typing import Any, Callable, Coroutine, Literal

from mas_trainer.engines.config import EngineSettings
from mas_trainer.engines.grammar import SchemaGrammars, tokenizer_info
from mas_trainer.errors import UserError
from mas_trainer.replicas.config import ReplicaConfig, replica_count, require_vllm
from mas_trainer.replicas.engine import ReplicaEngine

__all__ = ["RolloutFleet", "rollout_config", "replica_name", "weight_sync_method",
           "sync_group_name", "learner_checkpoint_engine"]

log = logging.getLogger(__name__)

def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to completion from sync code, whether or not a loop runs in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def sync_group_name(policy: str) -> str:
    """The collective group of a policy's weight sync. verl's NCCL checkpoint engine defaults
    to `"default"`, and Ray's collective group keeps a detached named store under that name:
    a second policy syncing at the same time would join the first one's group."""
    return f"mas_weights_{policy}"


def weight_sync_method(cfg: ReplicaConfig, device: str) -> str:
    """verl checkpoint engine that moves a policy's weights to its replicas. Colocated replicas
    live in the learner's own processes (verl's hybrid engine) and take the weights in-process
    (`naive`): NCCL refuses a group whose two ranks share one GPU."""
    if cfg.weight_sync != "auto":
        return cfg.weight_sync
    if device != "cuda":
        return "mas-gloo"
    return "naive" if cfg.placement == "colocated" else "nccl"


def rollout_config(policy: str, kind: str, cfg: ReplicaConfig, *, device: str, settings: EngineSettings | None = None,
                   torch_threads: int | None = None, gpus_per_node: int = 8) -> Any:
    """verl's `RolloutConfig` of a policy's replicas; the learner's side of the weight sync
    reads its checkpoint-engine section too, so both ends agree on backend and group. A torch
    replica reads its engine settings, whole, from `custom["mas_torch"]`."""
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    method = weight_sync_method(cfg, device)
    engine_kwargs = {"nccl": {"group_name": sync_group_name(policy)}} if method == "nccl" else {}
    name = replica_name(kind, device)
    vllm = None
    if name == "mas-vllm":
        from mas_trainer.engines.vllm_engine import VllmSettings

        vllm = dataclasses.asdict(VllmSettings.of(cfg, device=device))
    return RolloutConfig(
        name=name, mode="async",
        tensor_model_parallel_size=cfg.tensor_parallel_size, data_parallel_size=1, pipeline_model_parallel_size=1,
        n_gpus_per_node=min(gpus_per_node, cfg.tensor_parallel_size), nnodes=1,
        gpu_memory_utilization=cfg.gpu_memory_utilization, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        prompt_length=cfg.max_model_len // 2, response_length=cfg.max_model_len // 2, dtype=cfg.dtype,
        enforce_eager=cfg.enforce_eager,
        # token in, token out, with the sampled tokens' log-probs under the raw distribution
        # (temperature 1, no top-p), as the embedded engine reports them
        calculate_log_probs=True, logprobs_mode="raw_logprobs", skip_tokenizer_init=False,
        # the replicas start from the policy's weights on disk; later weights come from the learner
        load_format="auto",
        free_cache_engine=cfg.placement == "colocated", enable_sleep_mode=cfg.placement == "colocated",
        checkpoint_engine=CheckpointEngineConfig(
            backend=method, update_weights_bucket_megabytes=cfg.bucket_mb, engine_kwargs=engine_kwargs,
            # verl imports this in every process that builds a checkpoint engine (registers mas-gloo)
            custom_backend_module="mas_trainer.replicas.gloo_sync" if method == "mas-gloo" else None),
        custom={"mas_torch": {"engine": (settings or EngineSettings()).model_dump(), "device": device,
                              "torch_threads": torch_threads, "vllm": vllm}},
    )


def replica_name(kind: str, device: str) -> str:
    """verl's replica registry name for an engine kind: verl's vLLM server on GPUs, else the
    project's own server (`mas-vllm`: vLLM in the server's process on CPU, where verl's server
    would ask for a GPU id and its in-place update meets the CPU backend's packed weights)."""
    if kind == "vllm":
        return "vllm" if device == "cuda" else "mas-vllm"
    return "mas-torch"


def model_vocab_size(model_dir: str) -> int | None:
    """The model's vocabulary as vLLM reads it (`ModelConfig.get_vocab_size`: its text config's `vocab_size`)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir).get_text_config(), "vocab_size", None)


def learner_checkpoint_engine(rcfg: Any, rank: int) -> Any:
    """A learner rank's end of the weight sync, built from the replicas' `RolloutConfig` as
    verl's own worker builds it (`engine_workers.py`, "build checkpoint engine")."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    ce = rcfg.checkpoint_engine
    import_external_libs(ce.custom_backend_module or None)
    return CheckpointEngineRegistry.new(ce.backend, is_master=rank == 0, bucket_size=ce.update_weights_bucket_megabytes << 20,
                                        **ce.engine_kwargs.get(ce.backend, {}))


class RolloutFleet:
    """The replicas serving one policy (see the module docstring).

    `first_rank` is the policy's first replica rank: verl names a replica's server actor, pool
    and weight-transfer socket by replica rank alone (its ServerAdapter finds the server by that
    name, without any suffix), so the policies of one run take disjoint ranges, as verl's
    `LLMServerManager(start_rank=...)` does for its own replicas."""

    def __init__(self, policy: str, model_dir: str, kind: str, cfg: ReplicaConfig, *, device: str,
                 settings: EngineSettings | None = None, torch_threads: int | None = None, gpus_per_node: int = 8,
                 first_rank: int = 0, place: Callable[..., None] | None = None) -> None:
        self.policy, self.model_dir, self.kind, self.cfg, self.device = policy, model_dir, kind, cfg, device
        self.weight_sync = weight_sync_method(cfg, device)
        self.settings, self.torch_threads = settings, torch_threads
        self.gpus_per_node = gpus_per_node
        self.first_rank = first_rank
        self.place = place  # places a CPU replica's pool within a bound (cluster/placement.py), else verl waits
        self.replicas: list[Any] = []
        self._pools: list[Any] = []
        self.balancer: Any = None
        self.client: Any = None
        self.version = 0
        self._grammars: list[SchemaGrammars] = []  # the engines' (`engine`): their probes end with the fleet

    @property
    def hybrid(self) -> bool:
        """Colocated on GPUs: the replicas' servers drive vLLM on the learner ranks' own GPUs."""
        return self.device == "cuda" and self.cfg.placement == "colocated"

    def rollout_config(self) -> Any:
        return rollout_config(self.policy, self.kind, self.cfg, device=self.device, settings=self.settings,
                              torch_threads=self.torch_threads, gpus_per_node=self.gpus_per_node)

    def build_replicas(self, replica_cls: Any, learner_world: int) -> list[Any]:
        """The policy's replicas (not started), ranks `first_rank ...`, as verl names them."""
        rcfg = self.rollout_config()
        self.checkpoint_config = rcfg.checkpoint_engine
        from verl.workers.config import HFModelConfig

        model = HFModelConfig(path=self.model_dir)
        n = replica_count(self.cfg, self.device, learner_world)
        self.replicas = [replica_cls(replica_rank=self.first_rank + i, config=rcfg, model_config=model,
                                     gpus_per_node=self.gpus_per_node) for i in range(n)]
        return self.replicas

    # --- life cycle ----------------------------------------------------------------------
    def start(self, learner_group: Any = None) -> "RolloutFleet":
        from verl.workers.rollout.replica import RolloutReplicaRegistry
        from verl.workers.rollout.router import get_router_handle

        if self.kind == "vllm":
            require_vllm()
        if replica_name(self.kind, self.device) != "vllm":
            import mas_trainer.replicas.torch_replica  # noqa: F401  (registers mas-torch and mas-vllm)
        rcfg = self.rollout_config()
        self.build_replicas(RolloutReplicaRegistry.get(rcfg.name), learner_group.world_size if learner_group else 0)
        t0 = time.perf_counter()
        _run(self.init(learner_group))
        self.balancer = get_router_handle(servers={r.server_address: r.server_handle for r in self.replicas})
        self.client = _client(rcfg.name, self.balancer)
        log.info("policy %s: %d %s replica(s) (%s, weights over %s) up in %.0f s", self.policy, len(self.replicas),
                 self.kind, self.cfg.placement if self.device == "cuda" else "cpu", self.weight_sync, time.perf_counter() - t0)
        return self

    async def init(self, learner_group: Any) -> None:
        """Start the built replicas where the placement says."""
        from verl.single_controller.ray.base import RayResourcePool

        if self.device == "cpu":
            for r in self.replicas:
                pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1,
                                       name_prefix=f"mas_rollout_{r.replica_rank}")
                self._pools.append(pool)
                if self.place is not None:
                    self.place(pool, policy=self.policy, what=f"rollout replica {r.replica_rank}")
            await asyncio.gather(*(r.init_colocated(p) for r, p in zip(self.replicas, self._pools)))
        elif self.hybrid:
            if learner_group is None:
                raise UserError("runtime.replica.placement=colocated needs the policy's learner worker group (verl learner)")
            # verl's hybrid engine (LLMServerManager with a worker group): the policy's replica i is
            # served on learner ranks [i*tp, (i+1)*tp), whose processes take its weights in-process.
            # verl's init_hybrid slices the group's workers by replica rank counted from 0; here ranks
            # continue across policies (server names and sockets), so it sees the workers at that offset
            per = self.cfg.tensor_parallel_size
            view = types.SimpleNamespace(workers=[None] * (self.first_rank * per) + list(learner_group.workers))
            await asyncio.gather(*(r.init_hybrid(view) for r in self.replicas))
        else:
            await asyncio.gather(*(r.init_standalone() for r in self.replicas))

    def engine(self, tokenizer: Any, on_output: Any = None, owned: bool = False) -> ReplicaEngine:
        """The gateway's engine for this policy, decoding with the policy's tokenizer."""
        eos = tokenizer.eos_token_id
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        # every schema is probed here, so that one a replica would refuse fails its request, not the engine;
        # verl's vLLM servers are sent its strict grammar, the project's own servers the schema, which they
        # compile themselves (their engine takes a schema, and builds the same grammar from it)
        grammars = SchemaGrammars(lambda: tokenizer_info(tokenizer, model_vocab_size(self.model_dir)), text=True)
        self._grammars.append(grammars)
        send: Literal["grammar", "schema"] = "grammar" if replica_name(self.kind, self.device) == "vllm" else "schema"
        return ReplicaEngine(self.client, model_name=self.policy, eos_ids=eos_ids, grammars=grammars, send=send,
                             decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                             timeout_s=self.cfg.timeout_s, on_output=on_output, on_close=self.close if owned else None,
                             max_model_len=self.cfg.max_model_len)

    def _manager(self, learner_group: Any) -> Any:
        from verl.checkpoint_engine.base import CheckpointEngineManager

        return CheckpointEngineManager(config=self.checkpoint_config, actor_wg=learner_group, replicas=self.replicas)

    # verl's hybrid engine starts vLLM awake: weights and KV cache on the learner's GPUs
    asleep = False

    async def sleep(self, learner_group: Any) -> None:
        """Colocated replicas free the GPUs for the learner (vLLM sleep mode) before it updates,
        saves or loads a checkpoint, as verl's trainer orders them (`ray_trainer.py`: the replicas
        sleep before it loads a checkpoint and after each step's rollouts; the update and the save
        run while they sleep; `update_weights` wakes them). Replicas asleep already are not asked again."""
        if self.hybrid and not self.asleep:
            await asyncio.to_thread(self._manager(learner_group).sleep_replicas)
            self.asleep = True

    async def sync_weights(self, learner_group: Any, version: int) -> dict[str, float]:
        """verl's weight sync from the learner group's shards to every replica; returns its metrics.
        Colocated (`naive`), each learner rank empties its CUDA cache, wakes its replica's weights,
        loads them and then its KV cache, as verl's own worker does (`update_weights(mode="naive")`):
        the only way verl wakes hybrid replicas, whose sleep (level 2) discarded their weights."""
        manager = self._manager(learner_group)
        t0 = time.perf_counter()
        metrics = await asyncio.to_thread(manager.update_weights, global_steps=version) or {}
        self.asleep = False
        await self.set_version(version)
        return {**{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                "time/weight_sync_s": time.perf_counter() - t0}

    async def wake(self, learner_group: Any, version: int) -> None:
        """The replicas serve `version` again after a learner phase that left the weights as they
        hold them (a checkpoint saved, or loaded: they started from it). Asleep ones are woken as
        verl wakes them, by a weight sync; awake ones are only told the version."""
        if self.asleep:
            await self.sync_weights(learner_group, version)
        else:
            await self.set_version(version)

    async def set_version(self, version: int) -> None:
        """Tell every server which learner version it serves (verl's `set_global_steps`): each answer
        carries it back, so a turn sampled from stale weights is seen, not trained on silently."""
        await asyncio.gather(*(s.set_global_steps.remote(version) for r in self.replicas for s in r.servers))
        self.version = version

    def close(self) -> None:
        import ray

        for grammars in self._grammars:
            grammars.close()
        self._grammars = []
        for r in self.replicas:
            # hybrid replicas' workers are the learner's own ranks: the learner closes those
            for actor in set(r.servers) if self.hybrid else {*r.workers, *r.servers}:
                try:
                    ray.kill(actor)
                except Exception:  # already gone (a replica that died is why we may be closing)
                    pass
            pool = r.resource_pool
            if pool is not None and pool not in self._pools and r.rollout_mode is not None and r.rollout_mode.value == "standalone":
                self._pools.append(pool)
        for pool in self._pools:
            for pg in pool.pgs or []:
                ray.util.remove_placement_group(pg)
        if self.balancer is not None:
            ray.kill(self.balancer)
        if self.weight_sync == "nccl":  # Ray's collective group leaves its id store behind, a detached actor
            from ray.util.collective.const import get_store_name

            try:
                ray.kill(ray.get_actor(get_store_name(sync_group_name(self.policy))))
            except ValueError:  # never made (no sync yet), or gone
                pass
        self.replicas, self._pools, self.balancer = [], [], None


def _client(name: str, balancer: Any) -> Any:
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient

    # the two fields of verl's trainer config the client reads
    return LLMServerClient(config=OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": name, "full_determinism": False}}}),
                           load_balancer_handle=balancer)
