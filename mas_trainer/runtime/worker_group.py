"""The model-local side of the star: one worker group per policy.

It owns the policy's engine, the buffer of the turns that engine generated (their exact
token ids and log-probs), the advantage computation and the updates. The controller only
sends thin records (turn id, reward, group) and receives metrics; the model state never
leaves. The learner updates the very module the engine generates with, on the engine's
own thread between batches, so the next request already uses the new weights.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from typing import Any, Sequence

from mas_trainer.engines.base import EngineMeter, Generation, SamplingParams
from mas_trainer.runtime.plan import WorkerPlan
from mas_trainer.runtime.turns import TurnStore

__all__ = ["WorkerGroup"]


class WorkerGroup:
    """Engine + turn store + learner of one trainable policy (a Ray actor, or an object
    in-process); a `WorkerGroupHandle` itself. Frozen policies need none of this: the
    controller serves them directly."""

    def __init__(self, plan: WorkerPlan) -> None:
        import torch

        from mas_trainer.engines.models import adapter_base, is_adapter, load_model
        from mas_trainer.engines.torch_engine import load_engine
        from mas_trainer.learners.torch_learner import TorchLearner

        if plan.torch_threads:
            torch.set_num_threads(plan.torch_threads)
        self.policy, self.seed = plan.policy, plan.seed
        learner = plan.learner
        # resuming a LoRA policy: the base again, and its saved adapter trains on (not merged into a new base)
        adapter = plan.model if learner.lora_rank and is_adapter(plan.model) else None
        weights = (plan.reference or adapter_base(adapter)) if adapter else plan.model
        self.engine = load_engine(weights, name=plan.policy, seed=plan.seed,
                                  max_batch_size=plan.max_batch_size, batch_wait_ms=plan.batch_wait_ms,
                                  bf16=plan.engine_bf16, device=plan.device, prefix_cache_mb=plan.prefix_cache_mb,
                                  fast_decode=plan.fast_decode)
        model, self.tokenizer = self.engine.model, self.engine.tokenizer
        self.turns = TurnStore(plan.policy, plan.max_staleness)
        self.meter = EngineMeter(self.engine)
        reference = None
        if learner.kl_coef > 0 and not learner.lora_rank and plan.reference is not None:  # resumed: the reference stays the base model
            reference = load_model(plan.reference, seed=plan.seed)[0].to(plan.device)
        self.advantage_config = plan.advantage
        self.critic = None
        if self.advantage_config.estimator == "gae":  # GAE bootstraps from a learned value model
            from mas_trainer.learners.critic import TorchCritic

            # built before a LoRA adapter is injected: the value model copies the plain body
            self.critic = TorchCritic(model, plan.critic)
        self.learner = TorchLearner(model, learner, reference=reference, adapter=adapter, base_model=plan.reference or plan.model)

    # --- serving ---------------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None = None) -> list[Generation]:
        version = self.learner.updates  # the engine runs no row across an update (run_exclusive waits for them)
        gens = await self.engine.generate(prompt_ids, params)
        self.turns.record(turn_id, prompt_ids, gens, version)
        return gens

    async def discard(self) -> int:
        """Forget stored turns (held-out rollouts, or turns nobody trained on); the engine
        figures of the next update count from here, so a resumed run reports the same ones."""
        self.meter.read()
        return self.turns.clear()

    # --- training --------------------------------------------------------------------------
    async def train(self, records: Sequence[Any]) -> dict[str, float]:
        """One update from thin records (`TurnRecord`s of this policy); empties the turn store."""
        from mas_trainer.algo.advantages import compute_policy_advantages
        from mas_trainer.learners.batch import Turn

        pairs = self.turns.take(records, self.learner.updates)
        stale = self.turns.stale_metrics()
        if not pairs:
            return {"turns": 0.0, **stale}
        records = [r for r, _ in pairs]
        turns = [Turn(id=r.turn_id, prompt_ids=t.prompt_ids, response_ids=t.response_ids, old_logprobs=t.logprobs,
                      advantages=0.0) for r, t in pairs]
        learner, critic = self.learner, self.critic

        def update(_model: Any) -> dict[str, float]:
            values = critic.values(turns) if critic is not None else None
            batch = compute_policy_advantages(records, self.advantage_config, values=values)
            per_turn = batch.per_turn()
            trained = [replace(t, advantages=per_turn[t.id].advantages.tolist()) for t in turns]
            metrics = learner.update(trained)
            if critic is not None and values is not None:  # values: the critic's, above
                returns = {tid: a.returns.tolist() for tid, a in per_turn.items()}
                metrics.update({f"critic/{k}": v for k, v in critic.update(trained, returns, values).items()})
            adv = batch.advantages[batch.response_mask.bool()]
            return {**metrics, "turns": float(len(turns)), "adv_mean": float(adv.mean()), "adv_abs_mean": float(adv.abs().mean())}

        metrics = await asyncio.wrap_future(self.engine.run_exclusive(update))
        return {**metrics, **stale, **self.meter.read()}

    async def warm_start(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]], config: Any) -> dict[str, float]:
        """The supervised warm start (`TorchLearner.supervised`, a `WarmStartConfig`) on the
        engine's thread, like an update: the next request is served by the warm-started weights."""
        learner, seed = self.learner, self.seed

        def run(_model: Any) -> dict[str, float]:
            return learner.supervised(examples, steps=config.steps, lr=config.lr, batch_size=config.batch_size, seed=seed)

        return await asyncio.wrap_future(self.engine.run_exclusive(run))

    # --- checkpoints -----------------------------------------------------------------------
    async def save(self, folder: str, learner_dir: str) -> None:
        """Hugging Face folder of the current weights; optimizer and counters in `learner_dir`."""
        def _save(model: Any) -> None:
            import torch

            self.learner.save_pretrained(folder, self.tokenizer)
            state = {"learner": self.learner.state_dict()}
            if self.critic is not None:
                state["critic"] = self.critic.state_dict()
            os.makedirs(learner_dir, exist_ok=True)
            torch.save(state, os.path.join(learner_dir, "optimizer.pt"))

        await asyncio.wrap_future(self.engine.run_exclusive(_save))

    async def load(self, learner_dir: str) -> None:
        """Resume the optimizer and counters (the weights came with the plan's model folder)."""
        import pickle

        import torch

        from mas_trainer.errors import UserError

        path = os.path.join(learner_dir, "optimizer.pt")
        try:  # tensors, numbers and containers only: a run directory must not be able to run code here
            state = torch.load(path, weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(f"{path} holds more than tensors and numbers (a pickle that could run code); refused: "
                            "resume only run directories this project wrote") from None

        def load(_model: Any) -> None:
            self.learner.load_state_dict(state["learner"])
            if self.critic is not None and "critic" in state:
                self.critic.load_state_dict(state["critic"])

        await asyncio.wrap_future(self.engine.run_exclusive(load))

    def close(self) -> None:
        self.engine.close()
