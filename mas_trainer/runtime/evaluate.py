"""`eval`: the app's reward on tasks, with a run's trained policies or the base models.

With a run, everything that decides the score comes from the run's own config: the engines
(`runtime`: bf16, batching, device), the base model of untrained policies (`model`), the
allocator (`reward`) and how the app is run (`rollout`: max_tokens, timeout, recursion limit,
and `val_temperature` unless a temperature is given), so `eval --run` on a checkpoint
measures what `fit`'s held-out evaluation did.

A rollout cut by `rollout.timeout_s` is not scored: the reward figures are over the rollouts
that finished, and `rollouts/timeout` says how many did not (a timeout says the machine was
too slow for the rollouts in flight, not how well the app did). By default as many rollouts
run at once as an engine decodes together (`runtime.max_batch_size`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mas_trainer.config import load_config
from mas_trainer.rewards import RewardSpec, assign_rewards, check_allocator
from mas_trainer.runtime.backends import run_config, trained_policies
from mas_trainer.runtime.session import Session
from mas_trainer.runtime.trainer import summarize

__all__ = ["evaluate", "timeout_warning"]


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
                 engine=cfg.runtime, seed=model_seed) as session:
        app = session.load_app(app_ref, recursion_limit=ro.recursion_limit, checkpoints=trained)
        r = cfg.reward
        check_allocator(r.allocator, r.options)  # one the app registers exists only now
        session.reseed(seed, temperature=_given(temperature, ro.val_temperature))
        trajs = session.run(tasks, n=n)
        spec = RewardSpec(app.spec.spec.reward, app.spec.spec.role_rewards, app.spec.spec.turn_rewards)
        for t in trajs:
            assign_rewards(t, spec, allocator=r.allocator, weights=r.weights, on_failure=r.on_failure, options=r.options)
        settings = {"max_in_flight": session.max_in_flight, "timeout_s": session.timeout_s}
    used = {p: str(trained.get(p, pol.base_model)) for p, pol in app.spec.policies.items()}
    return {"policies": used, **settings, **summarize(trajs, timeouts_apart=True)}


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
