"""A policy's step, written once: the turns the controller's records name -> advantages (verl's
estimator, grouped by task x role) -> the learner's update (policy, then critic).

Every host runs its update through `policy_step`: the torch learner in this process or a Ray
actor (`policy/local.py`), each rank of verl's worker group (`policy/verl_rank.py`); what
differs is the `PolicyLearner`, the learner contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

from mas_trainer.policy.contract import StepResult

if TYPE_CHECKING:
    from mas_trainer.algo.advantages import TurnAdvantage, TurnRecord
    from mas_trainer.algo.config import AdvantageConfig
    from mas_trainer.learners.batch import Turn
    from mas_trainer.policy.turns import BufferedTurn

__all__ = ["PolicyLearner", "policy_step"]


class PolicyLearner(Protocol):
    """What a step needs of whatever learns: the critic's `values` of the turns (turn id ->
    one value per response token; None without a critic) and one `update` of the policy and
    its critic from the turns' advantages (`TurnAdvantage`: advantages and GAE returns) and
    those values; its metrics (critic ones as `critic/*`)."""

    def values(self, turns: list[Turn]) -> dict[str, list[float]] | None: ...

    def update(self, turns: list[Turn], advantages: Mapping[str, TurnAdvantage],
               values: dict[str, list[float]] | None) -> dict[str, float]: ...


def policy_step(pairs: Sequence[tuple[TurnRecord, BufferedTurn]], config: AdvantageConfig,
                learner: PolicyLearner) -> StepResult:
    """One update from (thin record, buffered turn) pairs (`TurnStore.take`; at least one: a host
    with none skips the step, and the wait for its engine or GPUs); the advantages of every turn
    trained on come back with the metrics."""
    from mas_trainer.algo.advantages import compute_policy_advantages
    from mas_trainer.learners.batch import Turn

    records = [r for r, _ in pairs]
    turns = [Turn(id=r.turn_id, prompt_ids=t.prompt_ids, response_ids=t.response_ids, old_logprobs=t.logprobs, advantages=0.0)
             for r, t in pairs]
    values = learner.values(turns)
    batch = compute_policy_advantages(records, config, values=values)
    per_turn = batch.per_turn()
    metrics = learner.update(turns, per_turn, values)
    adv = batch.advantages[batch.response_mask.bool()]
    metrics.update(turns=float(len(turns)), adv_mean=float(adv.mean()), adv_abs_mean=float(adv.abs().mean()))
    return StepResult(metrics, {tid: a.advantages.tolist() for tid, a in per_turn.items()})
