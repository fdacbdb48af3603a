"""The trajectory record (one JSON object per line in ``trajectories.jsonl``).

These field names are a contract: docs/trajectory.md lists them and later stages (rewards,
advantages, replay) read them. Add fields, never rename; bump SCHEMA_VERSION when a
field changes meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["SCHEMA_VERSION", "NodeCall", "LLMCall", "ToolCall", "Rewards", "ForkSegment", "ForkValue", "Forks", "Trajectory",
           "RunResult"]

SCHEMA_VERSION = 1

Status = Literal["ok", "error", "timeout"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeCall(_Record):
    """One execution of one graph node. Each `Send` branch and each retry attempt is its own."""

    id: str
    name: str  # qualified: "outer:inner" for a node inside a subgraph
    step: int | None  # LangGraph superstep
    parent_id: str | None  # the enclosing node call, for nodes inside subgraphs
    status: Literal["ok", "error", "cancelled", "interrupted"]
    attempt: int = 1
    error: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    # What the node call is in its rollout, the same in every run of it (LangGraph: superstep,
    # task path with a `Send`'s index, retry attempt, after the enclosing node call's for
    # subgraphs; the span's `mas.branch`): trajectories order their LLM calls by it. None: unknown.
    branch: str | None = None


class LLMCall(_Record):
    """One chat completion choice, with the exact ids the engine produced."""

    id: str
    node_id: str | None
    node: str | None
    role: str
    policy: str
    trainable: bool = True
    messages: list[dict[str, Any]]
    output_text: str | None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)  # the request's tool definitions, as the prompt rendered them
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str | None
    model: str | None = None
    start_time: float | None = None
    end_time: float | None = None

    @model_validator(mode="after")
    def _aligned(self) -> "LLMCall":
        if len(self.response_ids) != len(self.response_logprobs):
            raise ValueError(
                f"llm call {self.id}: {len(self.response_ids)} response ids but {len(self.response_logprobs)} log-probs"
            )
        return self


class ToolCall(_Record):
    id: str
    node_id: str | None
    name: str
    input: Any = None
    output: Any = None
    status: Literal["ok", "error"] = "ok"
    error: str | None = None


class Rewards(_Record):
    trajectory: float | None = None
    roles: dict[str, float] = Field(default_factory=dict)
    turns: dict[str, float] = Field(default_factory=dict)
    # How each turn's reward was made (allocator, levels mixed); for audit.
    detail: dict[str, Any] = Field(default_factory=dict)


class ForkSegment(_Record):
    """Turns credited together: one role's calls between the checkpoints of supersteps ``before`` and ``after``."""

    role: str
    before: int
    after: int
    calls: list[str]


class ForkValue(_Record):
    """V of one checkpoint: the mean of its continuations' returns (a dropped failure's: None), and those that failed."""

    checkpoint_id: str | None = None
    value: float | None = None
    returns: dict[str, float | None] = Field(default_factory=dict)
    failed: dict[str, str] = Field(default_factory=dict)  # fork rollout id -> status; runs before it was recorded lack it


class Forks(_Record):
    """Counterfactual credit's forked continuations of a rollout (rewards/counterfactual.py): K per
    checkpoint, the credited segments, V by checkpoint step (in JSON a string: "3"), the calls skipped with why."""

    k: int
    segments: list[ForkSegment] = Field(default_factory=list)
    values: dict[int, ForkValue] = Field(default_factory=dict)
    skipped: dict[str, str] = Field(default_factory=dict)


class Trajectory(_Record):
    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    task: dict[str, Any]
    status: Status
    error: str | None = None
    trace_id: str | None = None
    nodes: list[NodeCall] = Field(default_factory=list)
    llm_calls: list[LLMCall] = Field(default_factory=list)
    tool_calls: list[ToolCall] = Field(default_factory=list)
    rewards: Rewards = Field(default_factory=Rewards)
    final_state: Any = None
    duration_s: float | None = None
    forks: Forks | None = None

    def to_json(self) -> str:
        return self.model_dump_json()


@dataclass
class RunResult:
    """What an adapter recorded of one run of the app; the controller adds the LLM calls and rewards."""

    status: str
    error: str | None
    final_state: Any
    nodes: list[NodeCall]
    tool_calls: list[ToolCall]
    trace_id: str | None
    # (call id, node) of each non-streamed LLM call the app got an answer to, where the adapter knows them
    answered: list[tuple[str, str]] = field(default_factory=list)
