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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mas_trainer.engines.base import Generation, SamplingParams

__all__ = ["WorkerGroup", "BufferedTurn"]


@dataclass
class BufferedTurn:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]


class WorkerGroup:
    """Engine + turn buffer + learner of one policy (a Ray actor, or an object in-process)."""

    def __init__(
        self,
        policy: str,
        model_spec: str,
        *,
        learner: dict[str, Any] | None,
        advantage: dict[str, Any] | None,
        seed: int = 0,
        max_batch_size: int = 8,
        torch_threads: int | None = None,
    ) -> None:
        import torch

        from mas_trainer.engines.models import load_model
        from mas_trainer.engines.torch_engine import TorchEngine

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.policy = policy
        model, self.tokenizer = load_model(model_spec, seed=seed)
        self.engine = TorchEngine(model, self.tokenizer, model_name=policy, max_batch_size=max_batch_size)
        self.buffer: dict[str, BufferedTurn] = {}
        self.learner = None
        self.advantage_config = None
        if learner is not None:  # frozen policies generate only
            from mas_trainer.algo.advantages import AdvantageConfig
            from mas_trainer.learners.config import LearnerConfig
            from mas_trainer.learners.torch_learner import TorchLearner

            self.learner = TorchLearner(model, LearnerConfig.model_validate(learner))
            self.advantage_config = AdvantageConfig.model_validate(advantage or {})

    # --- serving ---------------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None = None) -> list[Generation]:
        gens = await self.engine.generate(prompt_ids, params)
        if turn_id is not None and self.learner is not None:
            for i, g in enumerate(gens):
                self.buffer[turn_id if i == 0 else f"{turn_id}-{i}"] = BufferedTurn(list(prompt_ids), g.token_ids, g.logprobs)
        return gens

    def discard(self) -> int:
        """Forget buffered turns (held-out rollouts, or turns nobody trained on)."""
        n = len(self.buffer)
        self.buffer.clear()
        return n

    # --- training --------------------------------------------------------------------------
    async def train(self, records: Sequence[Any]) -> dict[str, float]:
        """One update from thin records (`TurnRecord`s of this policy); clears the buffer."""
        from mas_trainer.algo.advantages import compute_policy_advantages
        from mas_trainer.learners.batch import Turn

        if self.learner is None:
            raise RuntimeError(f"policy {self.policy} is frozen")
        records = [r for r in records if r.turn_id in self.buffer]
        if not records:
            self.buffer.clear()
            return {"turns": 0.0}
        batch = compute_policy_advantages(records, self.advantage_config)
        per_turn = batch.per_turn()
        turns = []
        for rec in records:
            buf = self.buffer[rec.turn_id]
            turns.append(Turn(id=rec.turn_id, prompt_ids=buf.prompt_ids, response_ids=buf.response_ids,
                              old_logprobs=buf.logprobs, advantages=per_turn[rec.turn_id].advantages.tolist()))
        self.buffer.clear()
        learner = self.learner
        metrics = await asyncio.wrap_future(self.engine.run_exclusive(lambda _model: learner.update(turns)))
        adv = batch.advantages[batch.response_mask.bool()]
        return {**metrics, "turns": float(len(turns)), "adv_mean": float(adv.mean()), "adv_abs_mean": float(adv.abs().mean())}

    # --- checkpoints -----------------------------------------------------------------------
    async def save(self, folder: str, optimizer_path: str | None = None) -> None:
        """Hugging Face folder of the current weights (+ optimizer state for resume)."""
        def _save(model: Any) -> None:
            import torch

            if self.learner is not None:
                self.learner.save_pretrained(folder, self.tokenizer)
                if optimizer_path:
                    torch.save(self.learner.state_dict(), optimizer_path)
            else:
                Path(folder).mkdir(parents=True, exist_ok=True)
                model.save_pretrained(folder)
                self.tokenizer.save_pretrained(folder)

        await asyncio.wrap_future(self.engine.run_exclusive(_save))

    async def load_optimizer(self, path: str) -> None:
        import torch

        if self.learner is not None and os.path.exists(path):
            state = torch.load(path, weights_only=False)
            await asyncio.wrap_future(self.engine.run_exclusive(lambda _m: self.learner.load_state_dict(state)))

    def close(self) -> None:
        self.engine.close()
