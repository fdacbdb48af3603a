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

`compare` (`eval --compare base`) sets a run's trained policies against their base models on
the same tasks, one side's engines after the other's, each rollout with the same id and so
each call with the same sampling seed on both sides: it pairs each task's
rewards and reports the mean difference with its spread over the tasks (`paired_figures`).
Both sides, like `evaluate`, give every rollout an id of its own (`eval-tTASK-rK`), not a random
one, so the same `seed` samples the same rollouts again.

`score_rollouts` scores a batch as `fit` does (group rewards such as an LLM judge first, then
`assign_rewards` on each rollout, then the judges' verdicts in the audit trail); `eval` and
`mas-trainer trace` use it.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mas_trainer.config import RewardConfig, load_config
from mas_trainer.errors import UserError
from mas_trainer.rewards import (RewardError, RewardSpec, annotate_groups, assign_rewards, check_allocator, is_dropped,
                                 score_groups)
from mas_trainer.rewards.allocators import rollout_reward
from mas_trainer.run.rundir import run_config, trained_policies
from mas_trainer.loop.backends import policy_backends, shared_policies
from mas_trainer.loop.session import Session
from mas_trainer.loop.trainer import summarize
from mas_trainer.trace.schema import Trajectory

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["BASE", "evaluate", "compare", "task_rewards", "paired_figures", "comparison_table", "timeout_warning",
           "score_rollouts", "EveryRolloutFailed", "every_rollout_failed"]

BASE = "base"  # what `compare` sets a run's trained policies against: the base models they were trained from


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
             temperature: float | None = None, timeout_s: float | None = None, checkpoint: str | None = None,
             recursion_limit: int | None = None) -> dict[str, Any]:
    """Mean reward of the app on `tasks`, overall and per role, with the run's trained
    policies (`run_dir`; `checkpoint` "best" or "last", default the best where the run kept one)
    or the base models. `seed` seeds the sampling; `temperature`
    replaces the one every LLM call asks for (0: greedy). Left as None, `model`,
    `max_tokens`, `max_in_flight`, `timeout_s`, `recursion_limit` and `temperature` are the run's (`model`,
    `rollout.*`, `rollout.val_temperature`), or `fit`'s defaults without a run; `max_in_flight`
    defaults to `runtime.max_batch_size`, `recursion_limit` to the app's own. Timed-out rollouts are counted, not scored."""
    trained = trained_policies(run_dir, checkpoint) if run_dir is not None else {}
    return _measure(app_ref, tasks, run_dir, trained, model=model, n=n, seed=seed, max_tokens=max_tokens,
                    max_in_flight=max_in_flight, temperature=temperature, timeout_s=timeout_s,
                    recursion_limit=recursion_limit)[1]


def compare(app_ref: Any, tasks: list[dict], *, run_dir: str | Path | None, against: str = BASE, checkpoint: str | None = None,
            **options: Any) -> dict[str, Any]:
    """The run's trained policies against their base models (`against="base"`, the one target
    so far) on the same tasks: each side as `evaluate` measures it, with the same `options` (as
    `evaluate`'s), rollout ids and sampling seed, so that a call seeing the same prompt on both
    sides is sampled with the same seed. Each side has a session of its own (the gateway takes
    a rollout id once), whose engines are closed before the other side's start.

    Returns each side's `evaluate` figures (``base``, ``trained``); ``paired``: for the overall
    reward and each role's, over the tasks scored on both sides, the mean task reward of either
    side, their difference (trained - base), its standard error and a 95% paired bootstrap
    interval (`paired_figures`); and ``per_task``, each task's rewards they are computed from."""
    if against != BASE:
        raise UserError(f"compare={against!r} is not a comparison target: compare a run's trained policies with "
                        f"{BASE!r} (the base models they were trained from)")
    if run_dir is None:
        raise UserError(f"compare={against!r} needs a run (eval --run RUN_DIR): the trained policies to compare with their "
                        "base models")
    trained = trained_policies(run_dir, checkpoint)
    base_trajs, base = _measure(app_ref, tasks, run_dir, {}, **options)
    trained_trajs, result = _measure(app_ref, tasks, run_dir, trained, **options)
    n = options.get("n", 1)
    per_task = [{"task": i, "rollout_ids": [t.rollout_id for t in trained_trajs[i * n:(i + 1) * n]], "base": b, "trained": t}
                for i, (b, t) in enumerate(zip(task_rewards(base_trajs, n), task_rewards(trained_trajs, n), strict=True))]
    seed = options.get("seed", 0)
    return {"tasks": len(tasks), "n": n, "seed": seed, "base": base, "trained": result,
            "paired": paired_figures(per_task, seed=seed), "per_task": per_task}


def _measure(app_ref: Any, tasks: list[dict], run_dir: str | Path | None, checkpoints: dict[str, Path], *,
             model: str | None = None, n: int = 1, seed: int = 0, max_tokens: int | None = None,
             max_in_flight: int | None = None, temperature: float | None = None,
             timeout_s: float | None = None, recursion_limit: int | None = None) -> tuple[list[Trajectory], dict[str, Any]]:
    """The app on `tasks` with the policies in `checkpoints` (the others on their base models),
    in a session of its own: its trajectories, scored, and their figures (`evaluate`'s)."""
    cfg = run_config(run_dir) if run_dir is not None else load_config()
    ro = cfg.rollout
    # a run's base models are built as fit built them (the seed decides `tiny`'s weights)
    model_seed = cfg.seed if run_dir is not None else seed
    with Session(model=_given(model, cfg.model), max_in_flight=_given(max_in_flight, ro.max_in_flight),
                 timeout_s=_given(timeout_s, ro.timeout_s), default_max_tokens=_given(max_tokens, ro.max_tokens),
                 engine_settings=cfg.runtime, seed=model_seed) as session:
        app = session.load_app(app_ref, start_engines=False, recursion_limit=_given(recursion_limit, ro.recursion_limit),
                               recursion_limit_from="--recursion-limit" if recursion_limit is not None else "rollout.recursion_limit")
        r = cfg.reward
        check_allocator(r.allocator, r.options)  # one the app registers exists only now
        # adapters of a shared base (learner.shared_base) are measured as fit ran them: one base, each its adapter
        for name, backend in policy_backends(app.spec.policies, cfg.runtime, seed=model_seed, checkpoints=checkpoints,
                                             shared=shared_policies(cfg, checkpoints)).items():
            session.attach(name, backend)
        session.reseed(seed, temperature=_given(temperature, ro.val_temperature))
        # ids of their own, not random ones: a call's seed derives from its rollout's id, so the same
        # seed samples the same rollouts again, and both sides of a comparison alike
        trajs = session.run(tasks, n=n, ids=_rollout_ids(len(tasks), n))
        failed = every_rollout_failed(trajs, "no reward to report")
        if failed is not None:
            raise failed
        cost, _ = score_rollouts(RewardSpec.of(app.spec.declared), trajs, r)
        settings = {"max_in_flight": session.max_in_flight, "timeout_s": session.timeout_s,
                    "recursion_limit": app.describe_recursion_limit()}
    used = {p: str(checkpoints.get(p, pol.base_model)) for p, pol in app.spec.policies.items()}
    return trajs, {"policies": used, **settings, **summarize(trajs, timeouts_apart=True), **cost}


def _rollout_ids(n_tasks: int, n: int) -> list[str]:
    return [f"eval-t{i:05d}-r{k}" for i in range(n_tasks) for k in range(n)]


def task_rewards(trajs: list[Trajectory], n: int) -> list[dict[str, float]]:
    """Each task's rewards (its `n` rollouts, task-major, as `Session.rollouts` returns them),
    counted as `summarize` counts a batch's: ``reward/mean``, the mean of its scored rollouts'
    rewards (timed-out and dropped ones left out), and ``reward/role/ROLE``, the mean of that
    role's turn rewards; a task with none has no such key."""
    out = []
    for i in range(0, len(trajs), n):
        finished = [t for t in trajs[i:i + n] if t.status != "timeout"]
        found = (rollout_reward(t.rewards.trajectory, t.rewards.turns.values(), is_dropped(t)) for t in finished)
        rewards = [r for r in found if r is not None]
        by_role: dict[str, list[float]] = defaultdict(list)
        for t in finished:
            for c in t.llm_calls:
                if c.id in t.rewards.turns:
                    by_role[c.role].append(t.rewards.turns[c.id])
        row = {"reward/mean": statistics.fmean(rewards)} if rewards else {}
        row.update({f"reward/role/{role}": statistics.fmean(v) for role, v in sorted(by_role.items())})
        out.append(row)
    return out


def paired_figures(per_task: list[dict[str, Any]], *, seed: int = 0, resamples: int = 10_000) -> dict[str, dict[str, Any]]:
    """For each figure of `task_rewards` (``reward/mean``, ``reward/role/ROLE``), over the
    tasks that have it on both sides: ``base`` and ``trained``, the mean of the tasks' values,
    ``difference`` (trained - base, the mean of the tasks' differences), ``std_error`` (the
    differences' sample standard deviation over the square root of ``tasks``) and ``ci95``,
    the 2.5th and 97.5th percentiles of the mean difference over `resamples` draws of as many
    tasks with replacement (a paired bootstrap, seeded by `seed`). Spread needs 2 tasks: with
    one, ``std_error`` and ``ci95`` are None."""
    import numpy as np

    keys = sorted({k for row in per_task for side in ("base", "trained") for k in row[side]},
                  key=lambda k: (k != "reward/mean", k))
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        pairs = [(row["base"][key], row["trained"][key]) for row in per_task if key in row["base"] and key in row["trained"]]
        if not pairs:
            continue
        base, trained = (np.array(side, dtype=float) for side in zip(*pairs, strict=True))
        diff = trained - base
        figures: dict[str, Any] = {"base": float(base.mean()), "trained": float(trained.mean()),
                                   "difference": float(diff.mean()), "std_error": None, "ci95": None, "tasks": len(pairs)}
        if len(pairs) > 1:
            figures["std_error"] = float(diff.std(ddof=1) / np.sqrt(len(pairs)))
            draws = np.random.default_rng(seed).integers(0, len(pairs), size=(resamples, len(pairs)))
            figures["ci95"] = [float(x) for x in np.percentile(diff[draws].mean(axis=1), [2.5, 97.5])]
        out[key] = figures
    return out


def comparison_table(result: dict[str, Any], run_dir: str | Path) -> Table:
    """`compare`'s figures as `mas-trainer eval --compare` prints them."""
    from rich.table import Table

    table = Table(title=f"reward on {result['tasks']} tasks x {result['n']}: trained ({run_dir}) vs base, the same tasks and "
                        "seeds")
    table.add_column("")
    for column in ("base", "trained", "trained - base", "std. error", "95% interval", "tasks"):
        table.add_column(column, justify="right")
    for key, f in result["paired"].items():
        name = "overall" if key == "reward/mean" else f"role {key.split('/', 2)[2]}"
        spread = ("-", "-") if f["std_error"] is None else (f"{f['std_error']:.4f}", "[{:+.4f}, {:+.4f}]".format(*f["ci95"]))
        table.add_row(name, f"{f['base']:.4f}", f"{f['trained']:.4f}", f"{f['difference']:+.4f}", *spread, str(f["tasks"]))
    return table


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
