"""`eval`: the app's reward on tasks, with a run's trained policies or the base models.

With a run, everything that decides the score comes from the run's own config: the engines
(`runtime`: bf16, batching, device), the base model of untrained policies (`model`), the
allocator (`reward`) and how the app is run (`rollout`: max_tokens, timeout, recursion limit,
and `val_temperature` unless a temperature is given), so `eval --run` on a checkpoint
measures what `fit`'s held-out evaluation did.

A rollout cut by `rollout.timeout_s` is not scored: the reward figures are over the rollouts
that finished, and `rollouts/timeout` says how many did not (a timeout says the machine was
too slow for the rollouts in flight, not how well the app did). By default as many rollouts
run at once as an engine decodes together (`runtime.max_batch_size`). When every rollout failed
there is no reward to report: `evaluate` raises `EveryRolloutFailed`, one line naming the first
failure's cause (`mas-trainer eval` exits 2).

`score_rollouts` scores a batch as `fit` does (group rewards such as an LLM judge first, then
`assign_rewards` on each rollout, then the judges' verdicts in the audit trail); `eval` and
`mas-trainer trace` use it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from mas_trainer.config import RewardConfig, load_config
from mas_trainer.errors import UserError
from mas_trainer.rewards import RewardError, RewardSpec, annotate_groups, assign_rewards, check_allocator, score_groups
from mas_trainer.run.rundir import run_config, trained_policies
from mas_trainer.loop.backends import policy_backends, shared_policies
from mas_trainer.loop.session import Session
from mas_trainer.loop.trainer import summarize
from mas_trainer.trace.schema import Trajectory

__all__ = ["evaluate", "timeout_warning", "score_rollouts", "EveryRolloutFailed", "every_rollout_failed"]


class EveryRolloutFailed(UserError):
    """No rollout of a batch finished (the app raised, every LLM call refused, timeouts): there
    is nothing to score. One line naming the first failure's cause."""


def every_rollout_failed(trajs: list[Trajectory], after: str = "") -> EveryRolloutFailed | None:
    """The error to raise when there were rollouts and none has status ``ok``, else None.
    ``after`` ends the line (what was kept, what to do)."""
    if not trajs or any(t.status == "ok" for t in trajs):
        return None
    first = trajs[0]
    cause = " ".join((first.error or first.status).split())
    cause = cause if len(cause) <= 300 else cause[:297] + "..."
    kinds = ", ".join(f"{n} {status}" for status, n in sorted(Counter(t.status for t in trajs).items()))
    return EveryRolloutFailed(f"every rollout failed ({len(trajs)} of {len(trajs)}: {kinds}); the first, "
                              f"{first.rollout_id}, with: {cause}" + (f"; {after}" if after else ""))


def score_rollouts(spec: RewardSpec, trajs: list[Trajectory], reward: RewardConfig, *,
                   keep_going: bool = False) -> tuple[dict[str, float], list[RewardError]]:
    """Score a batch of rollouts as `fit` does: rewards that rank a group (an LLM judge) see the
    whole batch first, then every rollout is judged at each level and its calls given their
    rewards (`assign_rewards`, with `reward`'s allocator, weights and on_failure), then the
    judges' verdicts are added to the audit trail. Returns the judges' cost (``judge/...``
    metrics) and, with `keep_going`, the RewardError of each rollout whose reward raised (that
    rollout is left unscored, the others are scored); without it the first one is raised."""
    cost = score_groups(spec, trajs)
    errors: list[RewardError] = []
    for t in trajs:
        try:
            assign_rewards(t, spec, allocator=reward.allocator, weights=reward.weights, on_failure=reward.on_failure,
                           options=reward.options)
        except RewardError as exc:
            if not keep_going:
                raise
            errors.append(exc)
    annotate_groups(spec, trajs)
    return cost, errors


def evaluate(app_ref: Any, tasks: list[dict], *, run_dir: str | Path | None = None, model: str | None = None,
             n: int = 1, seed: int = 0, max_tokens: int | None = None, max_in_flight: int | None = None,
             temperature: float | None = None, timeout_s: float | None = None) -> dict[str, Any]:
    """Mean reward of the app on `tasks`, overall and per role, with the run's trained
    policies (`run_dir`) or the base models. `seed` seeds the sampling; `temperature`
    replaces the one every LLM call asks for (0: greedy). Left as None, `model`,
    `max_tokens`, `max_in_flight`, `timeout_s` and `temperature` are the run's (`model`,
    `rollout.*`, `rollout.val_temperature`), or `fit`'s defaults without a run; `max_in_flight`
    defaults to `runtime.max_batch_size`. Timed-out rollouts are counted, not scored."""
    trained = trained_policies(run_dir) if run_dir is not None else {}
    cfg = run_config(run_dir) if run_dir is not None else load_config()
    ro = cfg.rollout
    # a run's base models are built as fit built them (the seed decides `tiny`'s weights)
    model_seed = cfg.seed if run_dir is not None else seed
    with Session(model=_given(model, cfg.model), max_in_flight=_given(max_in_flight, ro.max_in_flight),
                 timeout_s=_given(timeout_s, ro.timeout_s), default_max_tokens=_given(max_tokens, ro.max_tokens),
                 engine_settings=cfg.runtime, seed=model_seed) as session:
        app = session.load_app(app_ref, start_engines=False, recursion_limit=ro.recursion_limit)
        # adapters of a shared base (learner.shared_base) are measured as fit ran them: one base, each its adapter
        for name, backend in policy_backends(app.spec.policies, cfg.runtime, seed=model_seed, checkpoints=trained,
                                             shared=shared_policies(cfg, trained)).items():
            session.attach(name, backend)
        r = cfg.reward
        check_allocator(r.allocator, r.options)  # one the app registers exists only now
        session.reseed(seed, temperature=_given(temperature, ro.val_temperature))
        trajs = session.run(tasks, n=n)
        failed = every_rollout_failed(trajs, "no reward to report")
        if failed is not None:
            raise failed
        spec = RewardSpec.of(app.spec.declared)
        cost, _ = score_rollouts(spec, trajs, r)
        settings = {"max_in_flight": session.max_in_flight, "timeout_s": session.timeout_s}
    used = {p: str(trained.get(p, pol.base_model)) for p, pol in app.spec.policies.items()}
    return {"policies": used, **settings, **summarize(trajs, timeouts_apart=True), **cost}


def timeout_warning(result: dict[str, Any]) -> str | None:
    """One line when rollouts timed out: they are not scored, and how to avoid them."""
    k = result.get("rollouts/timeout") or 0
    if not k:
        return None
    return (f"warning: {k} of {result['rollouts']} rollouts ran past rollout.timeout_s ({result['timeout_s']:g} s) and are "
            f"not scored (the means are over the {result['rollouts'] - k} that finished); if the machine is too slow for "
            f"{result['max_in_flight']} at once, lower --max-in-flight or raise --timeout")


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value
