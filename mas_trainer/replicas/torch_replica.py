"""The project's own rollout server as a verl rollout replica: the embedded torch engine
(`mas-torch` in verl's `RolloutReplicaRegistry`), or vLLM's engine in the server's process
(`mas-vllm`: `engine: vllm` on CPU, `engines/vllm_engine.py`; on GPUs verl's own vLLM
server runs instead).

A `TorchRolloutServer` answers what verl's vLLM server answers (`generate(prompt_ids,
sampling_params, request_id) -> TokenOutput`, the sampling dict in vLLM's field names, plus
sleep / wake-up / abort / kv-cache calls) and receives weights the way verl's
`CheckpointEngineWorker` does (`execute_checkpoint_engine`, `update_weights`). So a policy
with `engine: torch-replica` runs through the same `LLMServerClient`, load balancer and
`CheckpointEngineManager.update_weights` as one with `engine: vllm`, on CPU: that is how CI
tests the vLLM path's order (rollout, update, weight sync, rollout) and its failures.
One process per replica (tensor parallel size 1); CPU or one GPU.

With vLLM the weights verl's sync streams in (gloo on CPU) go to vLLM's `reload_weights` as
real tensors in this process: the CPU backend's packed weights refuse `load_weights`, which
verl's own in-place update calls, and a separate engine-core process would get lists.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

from mas_trainer.engines.threads import set_torch_threads
from mas_trainer.engines.base import SamplingParams

__all__ = ["TorchRolloutServer", "TorchReplica", "sampling_from_vllm"]

log = logging.getLogger(__name__)

# the vLLM SamplingParams fields this server honours; any other is refused, not ignored
_FIELDS = {"temperature", "top_p", "max_tokens", "stop", "seed", "ignore_eos", "logprobs", "structured_outputs",
           "include_stop_str_in_output", "repetition_penalty"}


def sampling_from_vllm(fields: dict[str, Any]) -> SamplingParams:
    """The embedded engine's `SamplingParams` from vLLM `SamplingParams` keyword arguments."""
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise ValueError(f"sampling field(s) {', '.join(unknown)} not supported by the torch replica")
    if fields.get("repetition_penalty", 1.0) != 1.0:
        raise ValueError("repetition_penalty is not supported by the torch replica")
    structured = fields.get("structured_outputs")
    schema = None
    if structured is not None:  # vLLM's StructuredOutputsParams(json=...) or its dict form
        schema = structured.get("json") if isinstance(structured, dict) else getattr(structured, "json", None)
    return SamplingParams(
        temperature=float(fields.get("temperature", 1.0)),
        top_p=float(fields.get("top_p", 1.0)),
        max_tokens=int(fields.get("max_tokens", 256)),
        stop=tuple(fields.get("stop") or ()),
        seed=fields.get("seed"),
        json_schema=schema,
        ignore_eos=bool(fields.get("ignore_eos", False)),
    )


class TorchRolloutServer(Worker):
    """One replica process: the embedded engine, served the way verl serves vLLM."""

    def __init__(self, rollout_config: Any, model_config: Any, replica_rank: int = 0, **_: Any) -> None:
        super().__init__()
        from verl.checkpoint_engine import CheckpointEngineRegistry

        import mas_trainer.replicas.gloo_sync  # noqa: F401  (registers mas-gloo)
        from mas_trainer.engines.config import EngineSettings
        from mas_trainer.engines.torch_engine import load_engine

        opts = dict((rollout_config.custom or {}).get("mas_torch", {}))
        if opts.get("torch_threads"):
            set_torch_threads(int(opts["torch_threads"]))
        device = torch.device("cuda", torch.cuda.current_device()) if opts.get("device") == "cuda" else torch.device("cpu")
        self.engine: Any
        if opts.get("vllm") is not None:
            from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

            self.engine = VllmEngine(model_config.local_path, model_name=f"replica-{replica_rank}",
                                     settings=VllmSettings(**opts["vllm"]))
        else:
            self.engine = load_engine(model_config.local_path, name=f"replica-{replica_rank}", device=device,
                                      settings=EngineSettings.model_validate(opts.get("engine", {})),
                                      threads=int(opts["torch_threads"]) if opts.get("torch_threads") else None)
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        ce = rollout_config.checkpoint_engine
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ce.backend, bucket_size=ce.update_weights_bucket_megabytes << 20, **dict(ce.engine_kwargs or {}).get(ce.backend, {}))

    # --- serving: verl's vLLM server interface ----------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **_: Any) -> TokenOutput:
        params = sampling_from_vllm(dict(sampling_params))
        version = self.global_steps  # read first: a row is never counted fresher than the weights that ran it
        gen = (await self.engine.generate(list(prompt_ids), params))[0]
        return TokenOutput(token_ids=gen.token_ids, log_probs=gen.logprobs, stop_reason="completed",
                           extra_fields={"global_steps": version})

    async def wake_up(self, tags: list[str] | None = None) -> None:  # weights stay in memory; no KV cache between batches
        return None

    async def sleep(self) -> None:
        return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        # nothing to abort: a row in flight finishes on the weights it started with (new weights load
        # between rows, run_exclusive), so with overlapped rollouts (rollout.max_staleness) it is kept
        return {}

    async def resume_generation(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def set_global_steps(self, global_steps: int) -> None:
        """The learner version now served; answers carry it in `extra_fields["global_steps"]`."""
        self.global_steps = global_steps

    # --- weights: verl's CheckpointEngineWorker interface -------------------------------
    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None) -> None:
        from mas_trainer.learners.verl_parts import load_streamed_weights

        received = [(name, t.clone()) async for name, t in self.checkpoint_engine.receive_weights(global_steps=global_steps)]
        if hasattr(self.engine, "load_weights"):  # vLLM: its own loader, between its batches
            await asyncio.wrap_future(self.engine.load_weights(received))
            return
        # the learner's stream, verl's names (MoE experts unpacked): the same copy as the learner's own engine
        await asyncio.wrap_future(self.engine.run_exclusive(lambda model: load_streamed_weights(model, received)))

    async def shutdown(self) -> None:
        self.engine.close()


class TorchReplica(RolloutReplica):
    """verl's replica life cycle around `TorchRolloutServer` (one process a replica)."""

    def get_ray_class_with_init_args(self) -> Any:
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs

        return RayClassWithInitArgs(cls=ray.remote(TorchRolloutServer), rollout_config=self.config,
                                    model_config=self.model_config, replica_rank=self.replica_rank)

    def rollout_worker_use_gpu(self) -> bool:
        return (self.config.custom or {}).get("mas_torch", {}).get("device") == "cuda"

    async def launch_servers(self) -> None:
        assert len(self.workers) == 1, "a replica of the project's server is one process (tensor_model_parallel_size=1)"
        self.servers = list(self.workers)
        self._server_handle = self.workers[0]
        self._server_address = f"{self.config.name}{self.name_suffix}-{self.replica_rank}"


# one class for both: the server reads which engine to build from the rollout config
RolloutReplicaRegistry.register("mas-torch", lambda: TorchReplica)
RolloutReplicaRegistry.register("mas-vllm", lambda: TorchReplica)
