"""`fit`: the training loop, readable in one sitting.

Each step: draw tasks, run each n times through the gateway (worker groups generate and
keep the tokens), score the trajectories at three levels and allocate one reward per LLM
call, send each policy's thin records to its worker group, which computes advantages
(verl) and updates (verl losses) side by side with the others; then write trajectories
and a metrics row, evaluate and checkpoint on schedule. Each held-out evaluation is ranked
(`best`, loop/selection.py): a new best keeps its weights, and the run stops early once it has
learned enough (a target reached, or no improvement for `best.patience` evaluations).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import yaml
from rich.console import Console

from mas_trainer.apps import forks_of
from mas_trainer.config import ConfigError, FitConfig, check_policy_names, check_trackers
from mas_trainer.engines.chat import unparsed_tool_calls
from mas_trainer.engines.models import check_model
from mas_trainer.errors import UserError
from mas_trainer.gateway import PolicyBackend
from mas_trainer.rewards import RewardSpec, annotate_groups, assign_rewards, check_allocator, is_dropped, score_groups
from mas_trainer.rewards.allocators import needs_forks, rollout_reward
from mas_trainer.run.rundir import RunDir
from mas_trainer.loop.backends import policy_backends
from mas_trainer.loop.selection import Selection
from mas_trainer.loop.session import Session
from mas_trainer.cluster.plan import RunPlan, resolve_plan
from mas_trainer.run.progress import FitProgress
from mas_trainer.run.tracking import Trackers
from mas_trainer.cluster.ray_init import send_worker_output_to
from mas_trainer.cluster.storage import check_shared_rundir
from mas_trainer.cluster.workers import WorkerEngine, join_cluster, start_workers
from mas_trainer.trace.schema import Trajectory

if TYPE_CHECKING:
    from mas_trainer.policy.contract import WorkerGroupHandle

__all__ = ["RolloutsFailed", "fit", "summarize"]

log = logging.getLogger(__name__)


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=4).digest(), "little")


def _order(n_tasks: int, seed: int, epoch: int) -> list[int]:
    return random.Random(_seed(seed, "epoch", epoch)).sample(range(n_tasks), n_tasks)


def take_tasks(n_tasks: int, position: int, count: int, seed: int) -> list[int]:
    """Task indices `position .. position+count` of the endless sequence of shuffled epochs."""
    out = []
    for p in range(position, position + count):
        epoch, i = divmod(p, n_tasks)
        out.append(_order(n_tasks, seed, epoch)[i])
    return out


def _rollout_ids(tag: str, idx: list[int], n: int) -> list[str]:
    """`tag-tTASK-rK` for each task's n rollouts. A draw that crosses an epoch boundary can hold a
    task twice; its second n rollouts count on from rn, so that every rollout has its own id (and
    seed) while the viewer still shows them under the task."""
    seen: Counter[int] = Counter()
    ids = []
    for i in idx:
        ids += [f"{tag}-t{i:05d}-r{seen[i] * n + k}" for k in range(n)]
        seen[i] += 1
    return ids


def summarize(trajs: list[Trajectory], *, timeouts_apart: bool = False) -> dict[str, Any]:
    """Reward and status figures of a batch of scored trajectories.

    `timeouts_apart` (evaluations): rollouts cut by rollout.timeout_s are counted
    (`rollouts/timeout`) but left out of the reward figures, which are then over the rollouts
    that finished: a timeout says the machine was too slow, not how well the app did.
    Without it (training rows) they count as what they were trained with (reward.on_failure)."""
    row: dict[str, Any] = {"rollouts": len(trajs)}
    status: defaultdict[str, int] = defaultdict(int)
    for t in trajs:
        status[t.status] += 1
    row.update({f"rollouts/{k}": v for k, v in sorted(status.items())})
    row["rollouts/dropped"] = sum(is_dropped(t) for t in trajs)
    row["tokens/response"] = sum(len(c.response_ids) for t in trajs for c in t.llm_calls)
    # calls the app got with arguments that are not JSON (cut by max_tokens), or left as text
    row["tool_calls/unparsed"] = sum(unparsed_tool_calls(c.output_text, c.tool_calls, c.tools) for t in trajs for c in t.llm_calls)
    if timeouts_apart:
        row["rollouts/timeout"] = status["timeout"]
        trajs = [t for t in trajs if t.status != "timeout"]
    found = (rollout_reward(t.rewards.trajectory, t.rewards.turns.values(), is_dropped(t)) for t in trajs)
    rewards = [r for r in found if r is not None]
    row["reward/mean"] = statistics.fmean(rewards) if rewards else None
    row["reward/std"] = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
    by_role: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        for c in t.llm_calls:
            if c.id in t.rewards.turns:
                by_role[c.role].append(t.rewards.turns[c.id])
    for role, vals in sorted(by_role.items()):
        row[f"reward/role/{role}"] = statistics.fmean(vals)
    return row


class RolloutsFailed(UserError):
    """Every rollout of a training step failed (each LLM call refused, the app raising, time
    outs): there is nothing to learn from, so the run stops before that step's checkpoint."""


def rollouts_failed(step: int, trajs: list[Trajectory], where: Path, max_failed: float = 1.0) -> RolloutsFailed | None:
    """The error that stops the run when at least `max_failed` of training step `step`'s rollouts failed, else None."""
    failed = [t for t in trajs if t.status != "ok"]
    if not failed or len(failed) < max_failed * len(trajs):
        return None
    first = failed[0]
    cause = " ".join((first.error or first.status).split())
    cause = cause if len(cause) <= 300 else cause[:300] + "..."
    kinds = ", ".join(f"{n} {status}" for status, n in sorted(Counter(t.status for t in failed).items()))
    share = f"all {len(trajs)}" if len(failed) == len(trajs) else f"{len(failed)} of {len(trajs)} (rollout.max_failed={max_failed:g})"
    return RolloutsFailed(f"step {step}: {share} rollouts failed ({kinds}); the first, {first.rollout_id}, with: "
                          f"{cause}; nothing was trained and no checkpoint written for this step (the rollouts: {where}); "
                          "fix the cause, then run again with --resume")


@dataclass
class _Drawn:
    """One training step's rollouts and records, from `_Fit.collect` to `_Fit.update`."""

    step: int
    position: int  # the task sequence's position after this step's draws
    temperature: float | None
    filtering: bool
    trajs: list[Trajectory] = field(default_factory=list)
    forks: list[Trajectory] = field(default_factory=list)
    records: list = field(default_factory=list)
    fork_records: list = field(default_factory=list)
    groups: int = 0
    kept: int = 0
    rollout_s: float = 0.0
    cost: dict[str, float] = field(default_factory=dict)


class _Fit:
    def __init__(self, app_ref: Any, tasks: list[dict], cfg: FitConfig, rundir: RunDir, val_tasks: list[dict], console: Console,
                 started_at: float | None = None) -> None:
        self.app_ref, self.tasks, self.cfg, self.rundir, self.val_tasks, self.console = app_ref, tasks, cfg, rundir, val_tasks, console
        self._started = time.perf_counter() if started_at is None else started_at
        self.rows: list[dict[str, Any]] = []
        self.trackers: Trackers | None = None
        self.progress: FitProgress | None = None
        self.reward_cost: dict[str, float] = {}  # judge/* metrics of the rollouts since the last row
        self.handles: dict[str, WorkerGroupHandle] = {}
        self.warm_examples: dict[str, list[tuple[list[int], list[int]]]] = {}
        self.warm_started: list[str] = []  # recorded in every checkpoint's state
        self.selection = Selection(cfg.best)  # the best evaluation and patience, restored from the checkpoint on resume

    # --- one step ------------------------------------------------------------------------
    async def rollouts(self, session: Session, tasks: list[dict], n: int, ids: list[str], seed: int,
                       temperature: float | None = None, fork: bool = False) -> tuple[list[Trajectory], list[Trajectory]]:
        """The rollouts, rewarded, and (training rollouts, for an allocator that needs forks) their forked
        continuations, rewarded as recorded (no forks of their own: the allocator's broadcast part)."""
        session.reseed(seed, temperature=temperature)
        r = self.cfg.reward
        forks: list[Trajectory] = []
        if fork and needs_forks(r.allocator):  # training rollouts: forked continuations measure each turn's credit
            from mas_trainer.loop.forking import fork_rollouts

            trajs, forks, fork_cost = await fork_rollouts(session, tasks, n, ids, self.reward_spec, r)
            for key, value in fork_cost.items():  # forks/*, time/fork_s: summed over the step's draws, as judge/*
                self.reward_cost[key] = self.reward_cost.get(key, 0) + value
        else:
            trajs = await session.rollouts(tasks, n=n, ids=ids)
        # rewards that rank a group (an LLM judge) see the whole batch first; their cost goes in the row
        cost = await asyncio.to_thread(score_groups, self.reward_spec, trajs)
        for key, value in cost.items():
            self.reward_cost[key] = self.reward_cost.get(key, 0) + value
        for t in [*trajs, *forks]:
            assign_rewards(t, self.reward_spec, allocator=r.allocator, weights=r.weights, on_failure=r.on_failure, options=r.options)
        annotate_groups(self.reward_spec, trajs)
        return trajs, forks

    def take_reward_cost(self) -> dict[str, float]:
        cost, self.reward_cost = self.reward_cost, {}
        return cost

    async def collect(self, session: Session, step: int, position: int) -> _Drawn:
        """Training step `step`'s rollouts, rewarded, and its thin records (dynamic sampling's
        draws included); raises `RolloutsFailed` when too many failed. With
        `rollout.max_staleness=1` it runs while the previous step's update does."""
        from mas_trainer.algo.advantages import tasks_with_spread, turn_records

        c, n = self.cfg, self.cfg.rollout.n
        t0 = time.perf_counter()
        temperature = c.rollout.temperature_at(step)
        d = _Drawn(step=step, position=position, temperature=temperature,
                   filtering=c.rollout.filter_groups and bool(self.handles))  # with nothing to train, more draws buy nothing
        for draw in range(c.rollout.max_draws if d.filtering else 1):
            # a later draw takes as many tasks as groups are still missing (verl draws whole batches; on a small
            # machine a batch of rollouts mostly thrown away costs as much as the step itself)
            idx = take_tasks(len(self.tasks), d.position, c.rollout.tasks_per_step - d.kept, c.seed)
            tag = f"s{step:06d}" + (f"d{draw}" if draw else "")  # draw 0 keeps the ids and seed of a step without filtering
            ids = _rollout_ids(tag, idx, n)
            batch, drawn = await self.rollouts(session, [self.tasks[i] for i in idx], n, ids,
                                               _seed(c.seed, "step", step, *(("draw", draw) if draw else ())),
                                               temperature=temperature, fork=True)
            # a group is one task's n rollouts in one draw, keyed by the task's position in the sequence of tasks
            keys = [d.position + j for j in range(len(idx)) for _ in range(n)]
            recs = turn_records(batch, task_indices=keys)
            d.position, d.groups = d.position + len(idx), d.groups + len(idx)
            d.trajs.extend(batch)
            d.forks.extend(drawn)
            if drawn and c.reward.counterfactual.train_forks:
                d.fork_records.extend(self.fork_records(batch, keys, drawn, d.filtering))
            if not d.filtering:
                d.records = recs
                break
            spread = tasks_with_spread(recs)
            d.kept += len(spread)
            d.records.extend(r for r in recs if r.task_index in spread)
            for t, key in zip(batch, keys, strict=True):  # why a rollout was not trained on, for the trajectory files and the viewer
                if key not in spread and not is_dropped(t):
                    t.rewards.detail["left_out"] = "no spread"
            if d.kept >= (c.rollout.min_groups or c.rollout.tasks_per_step):
                break
        d.rollout_s = time.perf_counter() - t0
        d.cost = self.take_reward_cost()  # this step's judge/* and forks/*: the next step's rollouts may start before its row
        failure = rollouts_failed(step, d.trajs, self.rundir.traj_dir / f"step_{step:06d}.jsonl", c.rollout.max_failed)
        if failure is not None:  # nothing to learn from: stop before the update and the checkpoint
            self.rundir.write_trajectories(step, (t.to_json() for t in d.trajs))  # what failed, for `view` (resume removes it)
            for handle in self.handles.values():  # a dead rollout replica says it more precisely (replicas/engine.py)
                engine_failure = handle.failure()
                if engine_failure is not None:
                    raise engine_failure
            raise failure
        return d

    async def update(self, d: _Drawn) -> dict[str, Any]:
        """Every policy's update on the step's records, all at once; the step's metrics row
        (without the step's wall-clock keys, which the loop adds) and its trajectory files."""
        c = self.cfg
        t1 = time.perf_counter()
        by_policy: dict[str, list] = defaultdict(list)
        for rec in d.records + d.fork_records:
            by_policy[rec.policy].append(rec)
        trainable = list(self.handles)  # worker groups exist for trainable policies only
        # every worker group is called (an empty list clears its buffer), all at once
        results = await asyncio.gather(*(self.handles[p].train(by_policy.get(p, [])) for p in trainable))
        t2 = time.perf_counter()
        row: dict[str, Any] = {"kind": "train", "step": d.step, **summarize(d.trajs), **d.cost}
        if d.temperature is not None:
            row["rollout/temperature"] = d.temperature
        if c.reward.counterfactual.train_forks and d.forks:
            row["forks/trained_turns"] = len(d.fork_records)
        if d.filtering:
            row.update({"rollout/groups": d.groups, "rollout/groups_kept": d.kept})
        for p, result in zip(trainable, results, strict=True):
            row.update({f"policy/{p}/{k}": v for k, v in result.metrics.items() if k not in ("seconds", "tokens_per_s")})
        row["time/rollout_s"] = d.rollout_s
        row["time/update_s"] = t2 - t1
        row["perf/rollouts_per_s"] = len(d.trajs) / max(d.rollout_s, 1e-9)
        row["perf/tokens_per_s"] = row["tokens/response"] / max(d.rollout_s, 1e-9)
        if row.get("time/fork_s"):  # counterfactual credit: the forks' share of time/rollout_s
            row["perf/fork_rollouts_per_s"] = row["forks/runs"] / row["time/fork_s"]
        # the advantages each trained call was updated with, for the viewer (it need not recompute them); a turn id
        # is its call's id (a choice's own: engines.base.choice_id)
        advantages = {cid: adv for result in results for cid, adv in result.advantages.items()}
        for t in [*d.trajs, *d.forks]:
            for call in t.llm_calls:
                if call.id in advantages:
                    t.rewards.detail.setdefault("calls", {}).setdefault(call.id, {})["advantages"] = advantages[call.id]
        self.rundir.write_trajectories(d.step, (t.to_json() for t in d.trajs))
        if d.forks:  # counterfactual credit's continuations, recorded beside the step's rollouts
            self.rundir.write_trajectories(d.step, (f.to_json() for f in d.forks), name=f"step_{d.step:06d}_forks")
        return row

    @staticmethod
    def fork_records(batch: list[Trajectory], keys: list[int], forks: list[Trajectory], filtering: bool) -> list:
        """`reward.counterfactual.train_forks`: the continuations' turn records, the K of one
        checkpoint one group (same state: their returns are compared with each other), kept by
        dynamic sampling's rule when it is on."""
        from mas_trainer.algo.advantages import tasks_with_spread, turn_records
        from mas_trainer.loop.forking import fork_group

        key_of = {t.rollout_id: key for t, key in zip(batch, keys, strict=True)}
        groups = [fork_group(f.rollout_id) for f in forks]
        recs = turn_records(forks, task_indices=[(key_of[rid], "cf", point) for rid, point in groups])
        if not filtering:
            return recs
        spread = tasks_with_spread(recs)
        return [r for r in recs if r.task_index in spread]

    async def held_out(self, session: Session, step: int) -> dict[str, Any] | None:
        if not self.val_tasks:
            return None
        n = self.cfg.val_n
        ids = [f"v{step:06d}-t{i:05d}-r{k}" for i in range(len(self.val_tasks)) for k in range(n)]
        t0 = time.perf_counter()
        # the same seed at every evaluation: differences come from the weights, not the dice
        trajs, _ = await self.rollouts(session, self.val_tasks, n, ids, _seed(self.cfg.seed, "val"),
                                    temperature=self.cfg.rollout.val_temperature)
        await asyncio.gather(*(h.discard() for h in self.handles.values()))
        self.rundir.write_trajectories(step, (t.to_json() for t in trajs), name=f"step_{step:06d}_val")
        return {"kind": "val", "step": step, **summarize(trajs, timeouts_apart=True), **self.take_reward_cost(),
                "time/eval_s": time.perf_counter() - t0}

    async def save(self, staging: Path) -> None:
        await asyncio.gather(*(
            self.handles[p].save(str(self.rundir.policy_dir(p, staging)), str(self.rundir.learner_dir(p, staging)))
            for p in self.handles
        ))

    async def checkpoint(self, step: int, position: int, best: bool = False) -> None:
        """Commit a checkpoint of step `step`; `best`: its weights are the new best as well (kept
        first, as links to the staged files, so the state that names them never comes before them)."""
        staging = self.rundir.staging()
        await self.save(staging)
        if best:
            self.rundir.best_staging(linked_from=staging)
            self.rundir.commit_best(step)
        self.rundir.commit({"step": step, "position": position, "seed": self.cfg.seed, "policies": sorted(self.handles),
                            "warm_start": self.warm_started, **self.selection.state()})
        kept = self.selection.best
        self.rundir.keep_best(kept["step"] if kept and kept["kept"] else None)  # the bests this state supersedes go

    async def keep_best(self, step: int) -> None:
        """A new best between checkpoints: its weights in best/step_N now (the next checkpoint names them)."""
        await self.save(self.rundir.best_staging())
        self.rundir.commit_best(step)

    async def warm_start(self, examples: dict[str, list[tuple[list[int], list[int]]]]) -> dict[str, Any]:
        """The supervised phase, every policy's at once, through the learner that does RL; its
        weights are the engines' when it returns (production/warm_start.py, docs/training.md)."""
        t0 = time.perf_counter()
        for p, ex in examples.items():
            ws = self.cfg.warm_start_for(p)
            self.say(f"warm start of {p}: {ws.steps} steps on {len(ex)} supervised turn{'s' * (len(ex) != 1)} (lr {ws.lr:g})")
        results = await asyncio.gather(*(self.handles[p].warm_start(ex, self.cfg.warm_start_for(p)) for p, ex in examples.items()))
        row: dict[str, Any] = {"kind": "warm_start", "step": 0}
        for p, m in zip(examples, results, strict=True):
            row.update({f"policy/{p}/{k}": v for k, v in m.items()})
        row["time/warm_start_s"] = time.perf_counter() - t0
        self.warm_started = sorted(examples)
        return row

    def record(self, row: dict[str, Any] | None) -> None:
        if row is None:
            return
        # wall time of the run so far, start-up included, continued across resumes (time-to-target figures)
        row["time/elapsed_s"] = self._elapsed_before + time.perf_counter() - self._started
        self.rundir.append_metrics(row)
        self.rows.append(row)
        if self.trackers is not None:
            self.trackers.log(row)
        if self.progress is not None:
            self.progress.show(row)
        from mas_trainer.plots import plot_rewards

        plot_rewards(self.rows, self.rundir.root / "rewards.png")

    # --- the loop --------------------------------------------------------------------------
    async def loop(self, session: Session, state: dict | None, progress: FitProgress) -> None:
        c = self.cfg
        if state:
            try:
                await asyncio.gather(*(h.load(str(self.rundir.learner_dir(p))) for p, h in self.handles.items()))
            except UserError:
                raise
            except (OSError, EOFError, RuntimeError, ValueError, KeyError) as exc:  # a damaged file the format checks let by
                why = " ".join(str(exc).split())[:300] or type(exc).__name__
                raise UserError(f"{self.rundir.checkpoint / 'learner'}: the learner state of the checkpoint of step "
                                f"{state['step']} cannot be loaded ({type(exc).__name__}: {why}); nothing was deleted: restore "
                                "the run's own checkpoint folder from a backup, or train into a new --output") from exc
        step, position = (state["step"], state["position"]) if state else (0, 0)
        if state is None and self.warm_examples:  # a fresh run only: a checkpoint's weights have it already
            self.record(await self.warm_start(self.warm_examples))
        if state is None:
            base = await self.held_out(session, 0)
            self.record(base)
            if base is not None:
                self.selection.observe(base)  # checks best.metric names a held-out key, before any step
        ahead: asyncio.Future | None = None  # rollout.max_staleness=1: the next step's rollouts, running during the update
        stop: str | None = None  # why the run stops before `steps` (best.target, best.patience)
        try:
            while step < c.steps:
                step += 1
                t0 = time.perf_counter()
                overlapped, drawn = ahead is not None, await (ahead or self.collect(session, step, position))
                ahead, waited, position = None, time.perf_counter() - t0, drawn.position
                evaluates = step % c.eval_every == 0 or step == c.steps
                saves = step % c.save_every == 0 or step == c.steps
                update = asyncio.ensure_future(self.update(drawn))
                # not past a held-out evaluation or a checkpoint: those see the update's weights and nothing in flight,
                # so a resumed run continues exactly where the checkpoint left it
                if c.rollout.max_staleness and not (evaluates or saves):  # the last step evaluates and saves
                    ahead = asyncio.ensure_future(self.collect(session, step + 1, position))
                row = await update
                # the wall time the step added: waiting for its rollouts (none when they ran during the last update), then the update
                row["time/step_s"] = waited + row["time/update_s"]
                if c.rollout.max_staleness:
                    row.update({"time/rollout_wait_s": waited, "rollout/overlapped": float(overlapped)})
                self.record(row)  # metrics.jsonl, the trackers, the step line and the bar
                improved, stop = False, None
                if evaluates:
                    held_out = await self.held_out(session, step)
                    if held_out is not None:
                        improved = self.selection.observe(held_out) and c.best.keep
                        stop = self.selection.stop_reason()
                    self.record(held_out)
                    if improved and not (saves or stop):
                        await self.keep_best(step)
                if saves or stop:  # an early stop commits where it stops
                    await self.checkpoint(step, position, best=improved)
                if stop:
                    break
            if self.selection.best is not None:  # one line: the best, and why the run ended where it did
                ended = f"stopped early at step {step} of {c.steps}: {stop}" if stop else f"finished at step {step}"
                self.console.print(f"{ended}; {self.selection.describe()}", markup=False, highlight=False, soft_wrap=True)
        finally:
            if ahead is not None:  # the run stops: the next step's rollouts are not finished nor recorded
                ahead.cancel()
                await asyncio.gather(ahead, return_exceptions=True)

    def say(self, what: str) -> None:
        """What fit is doing before its first step line, with the time since launch."""
        self.console.print(f"fit [{time.perf_counter() - self._started:.1f}s]: {what}", markup=False, highlight=False,
                           soft_wrap=True)

    @contextlib.contextmanager
    def watch(self, state: dict | None) -> Iterator[FitProgress]:
        """The trackers (`logger`) and the progress display around the loop; the trackers
        forget the steps after the checkpoint (they run again) and are closed however it ends."""
        c, after = self.cfg, (state["step"] if state else -1)
        self.trackers = Trackers([name for name in c.logger if name != "console"], self.rundir.root, after_step=after,
                                 kept=list(self.rows), config=c.model_dump(mode="json"))
        failed = True
        try:
            with FitProgress(self.console, c.steps, start_step=max(after, 0), lines="console" in c.logger,
                             launched=self._started) as progress:
                self.progress = progress
                yield progress
            failed = False
        finally:
            self.progress = None
            self.trackers.close(failed=failed)
            self.trackers = None

    def resumable(self, resume: bool) -> tuple[dict | None, bool]:
        """The checkpoint's state to resume from (None: start at step 0) and whether a run that
        stopped before its first checkpoint starts over; what cannot be resumed is refused here."""
        c, run = self.cfg, self.rundir
        state = run.load_state()  # also without --resume: it tells a run with a checkpoint from one killed before it
        # (a damaged or foreign state.json is refused there, before anything is deleted)
        if not resume and run.holds_run():
            if state is not None:
                raise ConfigError(f"{run.root} already holds a run; pass --resume to continue it (from its checkpoint "
                                  f"at step {state['step']}) or choose another --output")
            raise ConfigError(f"{run.root} holds a run that stopped before its first checkpoint, so there is nothing to "
                              "resume; pass --resume to start it over from step 0 (its metrics rows and trajectory files "
                              "are discarded) or choose another --output")
        start_over = state is None and run.holds_run()  # --resume: start over, as verl's auto resume does
        if start_over:
            run.check_start_over()  # unless its records show a checkpoint was committed (and lost)
        elif state is not None:
            run.check_resume(state)  # the state against the records it would prune, the checkpoint's files
            if state["step"] > c.steps:
                raise ConfigError(f"{run.root}: its checkpoint is at step {state['step']}, past steps={c.steps}, so there is "
                                  f"nothing to train; to train on, pass steps=N with N > {state['step']} (steps counts from the "
                                  "run's start)")
        self.selection = Selection.restored(c.best, state, str(run.checkpoint / "state.json"))
        return state, start_over

    def check_app(self, session: Session, state: dict | None) -> tuple[Any, RunPlan]:
        """Load the app, then check it, its tasks, the plan and the models against the config
        before anything is written; its spec and the run plan."""
        from mas_trainer.engines.chat import HFChatFormat
        from mas_trainer.engines.models import load_tokenizer

        c = self.cfg
        self.say(f"loading the app {self.app_ref if isinstance(self.app_ref, str) else type(self.app_ref).__name__}")
        app = session.load_app(self.app_ref, start_engines=False, recursion_limit=c.rollout.recursion_limit,
                               recursion_limit_from="rollout.recursion_limit")
        self.say(f"rollouts run with recursion limit {app.describe_recursion_limit()}")
        check_allocator(c.reward.allocator, c.reward.options)  # one the app registers exists only now
        spec = app.spec
        check_policy_names(c, spec.policies)  # policies.NAME.* overrides name the app's policies (known only now)
        check_tasks = getattr(app, "check_tasks", None)  # a task the graph cannot start from: one line, not every rollout failing
        if check_tasks is not None:
            check_tasks(self.tasks)
            check_tasks(self.val_tasks)
        trainable = {p: (str(self.rundir.policy_dir(p)) if state else pol.base_model, pol.base_model)
                     for p, pol in spec.policies.items() if pol.trainable}
        plan = resolve_plan(c, trainable)  # every rule checked here, before any worker or Ray starts
        bases = sorted({pol.base_model for pol in spec.policies.values()})
        self.say(f"checking the model{'s' if len(bases) > 1 else ''} {', '.join(bases)}")
        for base in bases:
            check_model(base)  # here, in one line, not as a traceback from a worker; hub ids download once
        self.reward_spec = RewardSpec.of(spec.declared)
        if needs_forks(c.reward.allocator):  # an app or task that cannot be forked: one line, before any rollout
            forks_of(app).check(self.reward_spec, c.reward.counterfactual.roles, self.tasks)
        if state is None:  # read, checked and tokenized here, before any worker group starts
            from mas_trainer.production.warm_start import warm_start_examples

            self.warm_examples = warm_start_examples(
                c, {p: pol.trainable for p, pol in spec.policies.items()},
                lambda p: HFChatFormat(load_tokenizer(spec.policies[p].base_model)))
        else:
            self.warm_started = list(state.get("warm_start", []))
            if c.warm_start.data is not None:
                log.info("warm_start.data: a resumed run does not warm-start again (it ran before step 1: %s)",
                         ", ".join(self.warm_started) or "none")
        saved = list(state["policies"]) if state else []
        missing = sorted(set(plan.workers) - set(saved)) if state else []
        if missing:
            raise ConfigError(f"{self.rundir.checkpoint} holds no weights for policy {missing[0]!r}, which the app trains (it "
                              f"has {', '.join(saved) or 'none'}): resume with the app the run was started with, "
                              "or train into a new --output")
        if c.rollout.filter_groups and not plan.workers:
            log.warning("rollout.filter_groups is ignored: no policy is trainable, so no group is trained on; "
                        "each step makes one draw")
        return spec, plan

    def open_rundir(self, spec: Any, plan: RunPlan, state: dict | None, start_over: bool) -> None:
        """Everything checked: now the run directory (started over, or cut back to the
        checkpoint), its config, app and plan, and the metrics rows it keeps."""
        run = self.rundir
        if start_over:
            rows, files = run.start_over()
            log.warning("%s has no complete checkpoint (the run stopped before its first one): starting over from "
                        "step 0; discarded %d metrics rows and %d trajectory files", run.root, rows, files)
        # the records after the checkpoint go before config.yaml is rewritten, so that config.yaml is always the
        # config of the `fit` that wrote whatever lies past the checkpoint (what `check_resume` bounds them by)
        run.truncate_to(state["step"] if state else -1)
        best = state["best"] if state else None
        run.keep_best(best["step"] if best and best["kept"] else None)  # bests of the steps that run again go with their rows
        run.create(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
        self.rows = run.metrics()
        self._elapsed_before = next((float(r["time/elapsed_s"]) for r in reversed(self.rows)
                                     if isinstance(r.get("time/elapsed_s"), (int, float))), 0.0)
        run.write_app(spec)
        (run.root / "plan.json").write_text(plan.model_dump_json(indent=1))

    def __call__(self, resume: bool) -> list[dict[str, Any]]:
        from mas_trainer.engines.chat import HFChatFormat
        from mas_trainer.engines.models import load_tokenizer

        c, (state, start_over) = self.cfg, self.resumable(resume)
        if state is not None and state["step"] == c.steps:  # finished: say so, touch nothing
            self.console.print(f"{self.rundir.root} has finished its {c.steps} steps (checkpoint at step {state['step']}): "
                               f"nothing to train; to train more, run again with --resume and steps=N, N > {c.steps}",
                               markup=False, highlight=False, soft_wrap=True)
            return [r for r in self.rundir.metrics() if r["step"] <= state["step"]]
        stopped = self.selection.stop_reason() if state is not None else None
        if state is not None and stopped:  # stopped early, and this config stops there again: as finished
            self.console.print(f"{self.rundir.root} stopped early at step {state['step']} of {c.steps} ({stopped}): nothing to "
                               "train; to train on, run again with --resume and a later best.target or a larger best.patience "
                               "(or neither)", markup=False, highlight=False, soft_wrap=True)
            return [r for r in self.rundir.metrics() if r["step"] <= state["step"]]
        if state is not None:  # said, not logged: a user who typed --resume sees where it picks up
            self.say(f"resuming {self.rundir.root} from its checkpoint at step {state['step']} of {c.steps} "
                     f"(data position {state['position']})")
        elif start_over:
            self.say(f"{self.rundir.root} stopped before its first checkpoint: starting it over from step 0")
        # Nothing is written to the run directory until the app, the tasks, the plan and the models have been checked:
        # a refused fit leaves it as it was (no config.yaml of a config that never ran, nothing of a run cleared).
        with Session(model=c.model, max_in_flight=c.rollout.max_in_flight or c.runtime.max_batch_size, timeout_s=c.rollout.timeout_s,
                     default_max_tokens=c.rollout.max_tokens) as session:
            spec, plan = self.check_app(session, state)
            join_cluster(plan)  # a cluster too small: one line, the run directory untouched
            self.open_rundir(spec, plan, state, start_over)
            if plan.execution == "ray":  # the workers' output (their tracebacks too) to the run's file, not the console
                send_worker_output_to(self.rundir.root / "workers.log")
            self.say(f"starting the {plan.summary()} (loading weights, building engines)")  # the plan, in one line
            try:
                self.handles = start_workers(plan.workers, plan.runtime)
            except BaseException:
                send_worker_output_to(None)
                raise
            try:
                if plan.runtime.ray_address is not None and plan.execution == "ray":
                    check_shared_rundir(self.rundir.root)  # ranks on other nodes write checkpoints there
                # worker groups serve the trainable policies; frozen ones get engines configured like theirs (runtime.*)
                served = {p: PolicyBackend(WorkerEngine(h), HFChatFormat(load_tokenizer(spec.policies[p].base_model)))
                          for p, h in self.handles.items()}
                for p, backend in policy_backends(spec.policies, plan.runtime, seed=c.seed, served=served).items():
                    session.attach(p, backend)
                first = (state["step"] if state else 0) + 1
                self.say(("the warm start, then " if state is None and self.warm_examples else "")
                         + ("held-out evaluation at step 0, then " if state is None and self.val_tasks else "")
                         + f"step {first}/{c.steps}: rollouts, then the update")
                with self.watch(state) as progress:
                    session.complete(self.loop(session, state, progress))
            except KeyboardInterrupt:
                # closing a worker group waits for an update it is running (minutes on a CPU): say so
                self.console.print("interrupted: stopping the rollouts; an update in progress ends first "
                                   "(Ctrl-C again to quit at once)", markup=False, highlight=False)
                raise
            finally:
                session.stop_calls()  # calls in flight are answered before their worker groups' engines close
                try:
                    for h in self.handles.values():
                        h.close()
                finally:
                    send_worker_output_to(None)
        return self.rows

def fit(app_ref: Any, tasks: list[dict], cfg: FitConfig, output: str | Path, *, val_tasks: list[dict] | None = None,
        resume: bool = False, console: Console | None = None, started_at: float | None = None) -> list[dict[str, Any]]:
    """Train the app's policies on `tasks`; returns every metrics row of the run (resumed ones included)."""
    if not tasks:
        raise ConfigError("no training tasks")
    try:
        check_trackers(cfg.logger)  # a missing tracker package is one line, before anything starts
    except UserError as exc:
        raise ConfigError(str(exc)) from exc
    if any(cfg.engine_for(p) == "vllm" for p in ["", *cfg.policies]):
        from mas_trainer.replicas.config import require_vllm

        require_vllm()  # a missing vLLM too: before the app loads and the gateway starts
    if val_tasks is None and cfg.val_fraction > 0:
        order = random.Random(_seed(cfg.seed, "split")).sample(range(len(tasks)), len(tasks))
        k = max(1, round(len(tasks) * cfg.val_fraction))
        val_tasks = [tasks[i] for i in sorted(order[:k])]
        tasks = [tasks[i] for i in sorted(order[k:])]
    if not val_tasks and (cfg.best.patience is not None or cfg.best.target is not None):
        raise ConfigError("best.patience and best.target stop on held-out evaluations, and this run has none: give "
                          "--val-data or val_fraction, or drop them")
    run = RunDir(output)
    with run.locked():  # one fit per run directory: a second one must not clear the live run's files
        return _Fit(app_ref, tasks, cfg, run, val_tasks or [], console or Console(), started_at)(resume)
