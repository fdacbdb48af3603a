"""The contracts of a policy's worker group: what it is told to be, and what it presents.

`WorkerPlan` is what the controller tells a worker group to be (picklable: it crosses into a
Ray actor's constructor), decided once in the run plan (`cluster/plan.py`).

`WorkerGroupHandle` is what every host of a policy presents (this process, one Ray actor,
verl's worker group of ranks, or rollout replicas in front of one): the trainer and the
gateway never ask which one runs. `StepResult` is what one update gives back: its metrics
and the advantages each trained turn was updated with, which the trainer writes into the
step's trajectories (the viewer shows them; nothing recomputes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field

from mas_trainer.algo.config import AdvantageConfig
from mas_trainer.config import Resources
from mas_trainer.engines.config import EngineSettings
from mas_trainer.learners.config import CriticConfig, LearnerConfig
from mas_trainer.replicas.config import ReplicaConfig

if TYPE_CHECKING:  # the core imports no torch at module import
    from mas_trainer.algo.advantages import TurnRecord
    from mas_trainer.config import WarmStartConfig
    from mas_trainer.engines.base import Generation, SamplingParams

__all__ = ["StepResult", "WarmStartExample", "WorkerGroupHandle", "WorkerPlan"]

WarmStartExample = tuple[Sequence[int], Sequence[int]]
"""(prompt ids, completion ids) of one supervised warm-start example."""


@dataclass
class StepResult:
    """One update of one policy: `metrics` (with the engine keys of
    `engines.base.ENGINE_METRICS`) and `advantages` (turn id -> the per-response-token
    advantages the update used; empty when nothing was trained)."""

    metrics: dict[str, float] = field(default_factory=dict)
    advantages: dict[str, list[float]] = field(default_factory=dict)


class WorkerGroupHandle(Protocol):
    """What the trainer and the gateway need of a policy's worker group, whichever learner
    and wherever it runs: `generate` (with a `turn_id` the choices' tokens stay in the group),
    `discard` (forget them; how many), `train` (one update from the controller's thin
    `TurnRecord`s), `warm_start` (the supervised phase before RL; its `sft_*` metrics;
    afterwards the engines serve the new weights), `save` (Hugging Face folder, learner
    state), `load` (learner state; the updates it had made), `failure` (why the engine
    serving the policy is dead, if it is: a lost rollout replica)."""

    policy: str

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       turn_id: str | None = None) -> list[Generation]: ...

    async def discard(self) -> int: ...

    async def train(self, records: Sequence[TurnRecord]) -> StepResult: ...

    async def warm_start(self, examples: Sequence[WarmStartExample], config: WarmStartConfig) -> dict[str, float]: ...

    async def save(self, folder: str, learner_dir: str) -> None: ...

    async def load(self, learner_dir: str) -> int | None: ...

    def failure(self) -> BaseException | None: ...

    def close(self) -> None: ...


class WorkerPlan(BaseModel):
    """Everything one worker group needs to start (picklable, validated once)."""

    model_config = ConfigDict(extra="forbid")

    policy: str
    model: str = Field(description="model the weights start from: tiny | default | a folder | a hub id")
    reference: str | None = Field(None, description="model of the frozen KL reference (default: `model`)")
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    resources: Resources = Field(default_factory=Resources)
    engine_settings: EngineSettings = Field(default_factory=EngineSettings, description="runtime.*'s engine keys, whole")
    torch_threads: int | None = None
    engine: Literal["embedded", "vllm", "torch-replica"] = Field(
        "embedded", description="embedded: rank 0 hosts the engine; otherwise rollout replicas serve and receive the weights")
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig, description="replica engines only")
    replica_first_rank: int = Field(0, ge=0, description="the policy's first rollout replica rank (ranks are unique in a run)")
    max_staleness: int = Field(0, ge=0, description="rollout.max_staleness: how many updates old a trained turn may be")
    shared_base: str | None = Field(
        None, description="the shared base this policy is an adapter of (learner.shared_base): policies with the same "
        "name are one process, one base model and one engine (`policy/shared_base.py`); None: a policy of its own")
    offload_between_phases: bool = Field(
        False, description="GPUs shared with other worker groups: the learner's shards and optimizer leave the GPU after each update")
