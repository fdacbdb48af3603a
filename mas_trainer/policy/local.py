"""A policy hosted by one process: the torch learner beside the embedded engine, in the
controller's process (`runtime.execution=local`) or as one Ray actor.

The learner updates the very module the engine generates with, on the engine's own thread
between batches (`run_exclusive`), so the next request already uses the new weights: the
engine is its own weight sink. With `engine: vllm` the policy's process runs vLLM's engine
instead (`engines/vllm_engine.py`) and the learner its own copy of the model, whose weights
go into vLLM in place (`reload`) at the end of every update, still between batches (a LoRA
policy beside vLLM is hosted by `policy/shared_base.py` instead: vLLM takes its adapter). The
step itself is `policy/step.py`'s.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from mas_trainer.engines.threads import set_torch_threads
from mas_trainer.engines.base import Generation, SamplingParams
from mas_trainer.policy.contract import StepResult, WarmStartExample, WorkerPlan
from mas_trainer.policy.step import policy_step
from mas_trainer.policy.turns import Serving, TurnStore

if TYPE_CHECKING:
    from mas_trainer.algo.advantages import TurnAdvantage, TurnRecord
    from mas_trainer.config import WarmStartConfig
    from mas_trainer.learners.batch import Turn

__all__ = ["LocalPolicy", "LearnerSide"]


class LocalPolicy:
    """Engine + turn store + torch learner (and critic) of one trainable policy; a
    `WorkerGroupHandle` itself and the step's `PolicyLearner`. Frozen policies need none of
    this: the controller serves them directly."""

    def __init__(self, plan: WorkerPlan) -> None:
        from mas_trainer.engines.models import adapter_base, is_adapter, load_model
        from mas_trainer.engines.torch_engine import load_engine
        from mas_trainer.learners.torch_learner import TorchLearner

        if plan.torch_threads:
            set_torch_threads(plan.torch_threads)
        self.policy = plan.policy
        learner = plan.learner
        # resuming a LoRA policy: the base again, and its saved adapter trains on (not merged into a new base)
        adapter = plan.model if learner.lora_rank and is_adapter(plan.model) else None
        weights = (plan.reference or adapter_base(adapter)) if adapter else plan.model
        self.engine: Any
        if plan.engine == "vllm":
            from mas_trainer.engines.models import materialize
            from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

            model, self.tokenizer = load_model(weights, seed=plan.seed)
            model = model.to(plan.device)
            self.engine = VllmEngine(materialize(weights, seed=plan.seed), model_name=plan.policy, tokenizer=self.tokenizer,
                                     settings=VllmSettings.of(plan.replica, device=plan.device, seed=plan.seed))
            self._sync = lambda: self.engine.reload(model.state_dict().items())
        else:
            self.engine = load_engine(weights, name=plan.policy, seed=plan.seed, settings=plan.engine_settings, device=plan.device,
                                      threads=plan.torch_threads)
            model, self.tokenizer = self.engine.model, self.engine.tokenizer
            self._sync = lambda: None  # the engine generates with the very module the learner updates
        self.serving = Serving(self.engine, TurnStore(plan.policy, plan.max_staleness))
        reference = None
        if learner.kl_coef > 0 and not learner.lora_rank and plan.reference is not None:  # resumed: the reference stays the base model
            reference = load_model(plan.reference, seed=plan.seed)[0].to(plan.device)
        self.critic = None
        if plan.advantage.estimator == "gae":  # GAE bootstraps from a learned value model
            from mas_trainer.learners.critic import TorchCritic

            # built before a LoRA adapter is injected: the value model copies the plain body
            self.critic = TorchCritic(model, plan.critic)
        self.learner = TorchLearner(model, learner, reference=reference, adapter=adapter, base_model=plan.reference or plan.model)
        self.side = LearnerSide(self.engine, self.serving, self.learner, self.critic, plan, self.tokenizer, self._sync)

    # --- serving ---------------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None = None) -> list[Generation]:
        return await self.serving.generate(prompt_ids, params, turn_id, self.learner.updates)

    async def discard(self) -> int:
        return self.serving.discard()

    def failure(self) -> BaseException | None:
        # the engine lives in this process: its errors reach each call, and a dead vLLM engine says so
        return getattr(self.engine, "failure", None)

    # --- training and checkpoints: the learner side's ----------------------------------------
    async def train(self, records: Sequence[TurnRecord]) -> StepResult:
        return await self.side.train(records)

    async def warm_start(self, examples: Sequence[WarmStartExample], config: WarmStartConfig) -> dict[str, float]:
        return await self.side.warm_start(examples, config)

    async def save(self, folder: str, learner_dir: str) -> None:
        await self.side.save(folder, learner_dir)

    async def load(self, learner_dir: str) -> int:
        return await self.side.load(learner_dir)

    def close(self) -> None:
        self.engine.close()


class LearnerSide:
    """The learner side of one trainable policy beside an engine in this process (`LocalPolicy`'s,
    and each adapter's of a `SharedBase`): updates, the warm start and checkpoints, all on the
    engine's thread between batches (`run_exclusive`), `sync` called after the weights change
    (the engine's weight sink). It is `policy_step`'s `PolicyLearner`."""

    def __init__(self, engine: Any, serving: Serving, learner: Any, critic: Any, plan: WorkerPlan, tokenizer: Any,
                 sync: Callable[[], None]) -> None:
        self.engine, self.serving, self.learner, self.critic = engine, serving, learner, critic
        self.plan, self.tokenizer, self.sync = plan, tokenizer, sync

    async def train(self, records: Sequence[TurnRecord]) -> StepResult:
        """One update from thin records (`TurnRecord`s of this policy), on the engine's thread."""
        pairs = self.serving.turns.take(records, self.learner.updates)
        stale = self.serving.turns.stale_metrics()
        if not pairs:  # nothing to wait for the engine's batch for
            return StepResult({"turns": 0.0, **stale})

        def step(_engine: Any) -> StepResult:
            result = policy_step(pairs, self.plan.advantage, self)
            self.sync()
            return result

        result = await asyncio.wrap_future(self.engine.run_exclusive(step))
        result.metrics.update({**stale, **self.serving.figures()})
        return result

    def values(self, turns: list[Turn]) -> dict[str, list[float]] | None:
        return self.critic.values(turns) if self.critic is not None else None

    def update(self, turns: list[Turn], advantages: Mapping[str, TurnAdvantage],
               values: dict[str, list[float]] | None) -> dict[str, float]:
        trained = [replace(t, advantages=advantages[t.id].advantages.tolist()) for t in turns]
        metrics = self.learner.update(trained)
        if self.critic is not None and values is not None:  # values: the critic's, before this update
            returns = {tid: a.returns.tolist() for tid, a in advantages.items()}
            metrics.update({f"critic/{k}": v for k, v in self.critic.update(trained, returns, values).items()})
        return metrics

    async def warm_start(self, examples: Sequence[WarmStartExample], config: WarmStartConfig) -> dict[str, float]:
        """The supervised warm start (`TorchLearner.supervised`) on the engine's thread, like an
        update: the next request is served by the warm-started weights."""
        def run(_model: Any) -> dict[str, float]:
            metrics = self.learner.supervised(examples, steps=config.steps, lr=config.lr, batch_size=config.batch_size,
                                              seed=self.plan.seed)
            self.sync()
            return metrics

        return await asyncio.wrap_future(self.engine.run_exclusive(run))

    async def save(self, folder: str, learner_dir: str) -> None:
        """Hugging Face (or adapter) folder of the current weights; optimizer and counters in `learner_dir`."""
        def _save(_model: Any) -> None:
            import torch

            self.learner.save_pretrained(folder, self.tokenizer)
            state = {"learner": self.learner.state_dict()}
            if self.critic is not None:
                state["critic"] = self.critic.state_dict()
            os.makedirs(learner_dir, exist_ok=True)
            torch.save(state, os.path.join(learner_dir, "optimizer.pt"))

        await asyncio.wrap_future(self.engine.run_exclusive(_save))

    async def load(self, learner_dir: str) -> int:
        """Resume the optimizer and counters (the weights came with the plan's model folder)."""
        from mas_trainer.run.untrusted import load_tensors

        state = load_tensors(os.path.join(learner_dir, "optimizer.pt"))

        def load(_model: Any) -> None:
            self.learner.load_state_dict(state["learner"])
            if self.critic is not None and "critic" in state:
                self.critic.load_state_dict(state["critic"])

        await asyncio.wrap_future(self.engine.run_exclusive(load))
        return self.learner.updates
