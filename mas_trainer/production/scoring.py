"""`mas-trainer feedback`: scores and labels for the runs of a record folder that no server is
writing (an `import-traces` folder, or a stopped `serve --record`'s), so `data` can choose among
them: imported runs come with no feedback of their own.

Three sources, written by the `Recorder` as POST /v1/feedback is (the same lines, per-run bounds
and run/turn checks), each taken whole or not at all, so a command that failed can be run again
as it was:
- one entry (`add_feedback`): a run id with a score and/or a label, optionally a turn and comment;
- a JSON-lines file of POST /v1/feedback bodies (`feedback_from_file`): a regular file of at most
  `MAX_FILE_BYTES`, each line at most `MAX_LINE_BYTES` (the server's bound on a feedback body);
  a line that is not such a body, or names a run or turn the folder does not hold, is one error
  naming FILE:LINE;
- a reward function (`score_with_reward`): `fn(task, final_state, trajectory) -> float | None`, or
  a `@trainable` app whose `reward=` it is, called on each run of the folder rebuilt as a
  Trajectory (`read_runs`: task from the graph record, final state its output), as `fit` calls
  it on a rollout. A run that failed is not scored, nor one a reward already scored (a folder that
  `import-traces --listen` keeps filling is scored again for its new runs only); None scores
  nothing. A reward that raises is one error naming the function, where it raised, the level and
  the run (`RewardError`).
Each entry says what gave it (`by`: the file and line, or the reward and its level), for audit.
Nothing read from the folder executes (JSON records only); the reward is code the user names.
"""

from __future__ import annotations

import inspect
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from mas_trainer.errors import UserError, shown_path
from mas_trainer.production.curate import check_folders
from mas_trainer.production.record import Feedback, RecordedFeedback, Recorder, read_runs
from mas_trainer.rewards.levels import RewardError, RewardSpec, check_arity, evaluate_levels

__all__ = ["MAX_FILE_BYTES", "MAX_LINE_BYTES", "Scored", "add_feedback", "feedback_from_file", "load_reward",
           "score_with_reward"]

MAX_FILE_BYTES = 64 << 20  # a feedback file
MAX_LINE_BYTES = 8 << 10  # one line: POST /v1/feedback's bound on a body
REWARD_BY = "reward "  # how a reward's entries begin their `by`


@dataclass
class Scored:
    """What one `mas-trainer feedback` wrote, and (a reward run) what it left unscored and why."""

    folder: str
    entries: int = 0
    runs: int = 0  # runs given an entry
    runs_read: int = 0  # a reward run: the runs it looked at
    not_applicable: int = 0  # the reward returned None
    not_ok: int = 0  # runs whose status is not ok
    already: int = 0  # runs a reward scored before
    scores: list[float] = field(default_factory=list)


def _invalid(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(map(str, err["loc"]))
    return f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}"


def _write(folder: Path, entries: list[RecordedFeedback], where: Callable[[int], str], scored: Scored) -> Scored:
    """Every entry into `folder`, or none (UserError naming the first refused)."""
    if entries:
        refused = Recorder(folder, max_mb=2**30).feedback_all(list(entries))  # 2**30: never trims, as an import
        if refused is not None:
            i, _, why = refused
            raise UserError(f"{where(i)}{why}; nothing was written to {folder}")
    scored.entries, scored.runs = len(entries), len({e.run_id for e in entries})
    return scored


def add_feedback(folder: str | Path, run_id: str, *, score: float | None = None, label: str | None = None,
                 turn: str | None = None, comment: str | None = None, by: str = "mas-trainer feedback") -> Scored:
    """One score and/or label for run `run_id` of `folder` (or for its call `turn`)."""
    (path,) = check_folders([folder])
    try:
        entry = RecordedFeedback(run_id=run_id, score=score, label=label, turn=turn, comment=comment, by=by)
    except ValidationError as exc:
        raise UserError(f"feedback on run {run_id!r}: {_invalid(exc)}") from None
    return _write(path, [entry], lambda _: "", Scored(str(path)))


def _open_regular(path: Path) -> Any:
    """`path` open for reading when it is a regular file of at most MAX_FILE_BYTES, else UserError
    (O_NONBLOCK: a FIFO under that name does not hang the open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UserError(f"--from {path}: cannot read it ({exc.strerror}); give a JSON-lines file of feedback") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
        os.close(fd)
        why = ("not a regular file; give a JSON-lines file of feedback" if not stat.S_ISREG(info.st_mode)
               else f"over {MAX_FILE_BYTES >> 20} MB; split it")
        raise UserError(f"--from {path}: {why}")
    return os.fdopen(fd, "rb")


def _parse_line(raw: bytes) -> Feedback:
    """One line as a POST /v1/feedback body; ValueError saying why not."""
    if len(raw) > MAX_LINE_BYTES:
        raise ValueError(f"a line over {MAX_LINE_BYTES >> 10} KiB (a feedback body is at most that)")
    try:
        return Feedback.model_validate_json(raw.decode())  # strict UTF-8 and JSON, then the POST body's own checks
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    except ValidationError as exc:
        raise ValueError(_invalid(exc)) from None


def feedback_from_file(folder: str | Path, source: str | Path) -> Scored:
    """Each line of `source` (a POST /v1/feedback body: {"run_id", "score" and/or "label", "turn"?,
    "comment"?}) as feedback on `folder`'s runs, all of them or none; blank lines are skipped."""
    (path,) = check_folders([folder])
    source = Path(source)
    entries: list[RecordedFeedback] = []
    lines: list[int] = []
    with _open_regular(source) as f:
        n = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            n += 1
            if not raw.strip():
                continue
            try:
                fb = _parse_line(raw.rstrip(b"\r\n"))
            except ValueError as exc:
                raise UserError(f"{source}:{n}: {exc}; nothing was written to {path} (fix or remove the line)") from None
            entries.append(RecordedFeedback(**fb.model_dump(), by=f"file {source.name[:200]}:{n}"))
            lines.append(n)
    if not entries:
        raise UserError(f"--from {source} holds no feedback lines; write one JSON object a line, e.g. "
                        '{"run_id": "<32 hex>", "score": 0.8}')
    return _write(path, entries, lambda i: f"{source}:{lines[i]}: ", Scored(str(path)))


def _takes_three(obj: Any) -> bool:
    """Whether `obj` can be called as a reward, fn(task, final_state, trajectory)."""
    if not callable(obj):
        return False
    try:
        inspect.signature(obj).bind(None, None, None)
    except (TypeError, ValueError):
        return False
    return True


def load_reward(ref: str) -> Callable[..., Any]:
    """The trajectory reward `ref` names: a function (task, final_state, trajectory), or an app
    (a LangGraph graph, or a function building one) whose `@trainable(reward=...)` it is."""
    from mas_trainer.apps import app_runner, load_object

    obj = load_object(ref)
    if _takes_three(obj):
        return obj  # type: ignore[no-any-return]
    try:
        reward = app_runner(obj).spec.declared.reward
    except UserError as exc:
        raise UserError(f"--reward {ref}: {str(exc).splitlines()[0]}; give a function (task, final_state, trajectory) "
                        "-> float | None, or a @trainable app with reward=") from None
    if reward is None:
        raise UserError(f"--reward {ref}: the app declares no trajectory reward; give it @trainable(reward=...), or name a "
                        "function (task, final_state, trajectory) -> float | None")
    return reward  # type: ignore[no-any-return]


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _audit(fn: Callable[..., Any], ref: str | None) -> str:
    """What a reward's entries say gave them: as the user named it, the function, where it is defined, the level."""
    name = _name(fn)
    ref = ref or f"{getattr(fn, '__module__', None) or '?'}.{name}"
    code = getattr(fn, "__code__", None)
    where = f" defined at {shown_path(code.co_filename)}:{code.co_firstlineno}" if code is not None else ""
    own = "" if ref.endswith((f":{name}", f".{name}")) else f" ({name})"
    return f"{REWARD_BY}{ref}{own}{where}, trajectory level"[:300]


def score_with_reward(folder: str | Path, reward: str | Callable[..., Any]) -> Scored:
    """Score each run of `folder` with `reward` (a reference as `load_reward` takes, or the
    function itself) at the trajectory level, as `fit` scores a rollout; all or nothing."""
    (path,) = check_folders([folder])
    fn = load_reward(reward) if isinstance(reward, str) else reward
    check_arity("reward", fn)
    by = _audit(fn, reward if isinstance(reward, str) else None)
    spec = RewardSpec(trajectory=fn)
    scored = Scored(str(path))
    entries: list[RecordedFeedback] = []
    for traj, feedback in read_runs(path):
        scored.runs_read += 1
        if traj.status != "ok":  # its calls are never SFT data; fit gives a failed rollout reward.on_failure, not the reward
            scored.not_ok += 1
            continue
        if any(str(fb.get("by") or "").startswith(REWARD_BY) for fb in feedback):
            scored.already += 1
            continue
        try:
            value = evaluate_levels(spec, traj).trajectory
        except RewardError as exc:
            raise RewardError(f"{exc}; nothing was written to {path}") from exc
        if value is None:
            scored.not_applicable += 1
            continue
        entries.append(RecordedFeedback(run_id=traj.rollout_id, score=value, by=by))
        scored.scores.append(value)
    return _write(path, entries, lambda i: f"run {entries[i].run_id}: ", scored)

