"""`mas-trainer data`: datasets from recorded served runs (`serve --record` folders, or traces
imported into the same format).

From one or more record folders it builds
- `tasks.jsonl`: the train-side graph inputs (`Trajectory.task`), once each, for `fit --data`;
- `val.jsonl`: the held-out graph inputs, for `fit --val-data` / `eval --data`;
- `sft.jsonl`: one line per LLM call of a well-scored train-side run (rejection sampling), for a
  supervised warm start: `{policy, role, node, run_id, score, messages, completion, tools?,
  prompt_ids?, response_ids?}`;
- `report.json`: what was read, kept and dropped, and why.

Rules (docs/serving.md says the same):
- A call's score is the mean of its run's run-level feedback scores (feedback without `turn`);
  feedback on the call itself (`turn`) overrides it. Labels likewise: the call's own labels, else
  its run's.
- A call is kept when its score >= `min_score` and, with `label`, it carries that label. With
  only `label`, scores are not looked at; with neither, `min_score` is 1.0. Unscored calls are
  never kept; nor are calls of runs whose status is not "ok", nor truncated calls
  (finish_reason "length").
- Split: runs are grouped by task (canonical JSON); a task is held out when a hash of (seed,
  task) falls under `val_fraction`, so all its runs fall on one side, a task keeps its side
  when more records are added, and only train-side runs give SFT lines. Runs without a task
  cannot be held out: they are train side (their calls may be SFT data; they add no task).
- Deduplication: a task once; an SFT example (policy, messages, completion) once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

from pydantic import BaseModel, Field

from mas_trainer.errors import UserError, nested_too_deep
from mas_trainer.production.record import read_runs, run_files, write_synced
from mas_trainer.trace.schema import LLMCall, Trajectory

__all__ = ["SFTLine", "Report", "Datasets", "DEFAULT_MIN_SCORE", "MAX_TASK_BYTES", "MAX_DEPTH", "task_key", "is_val",
           "split_by_task", "run_score", "call_score", "call_labels", "check_folders", "build_datasets", "check_output",
           "write_datasets", "make_datasets"]

DEFAULT_MIN_SCORE = 1.0
MAX_TASK_BYTES = 1 << 20  # as the server's graph records: 1 MiB
MAX_DEPTH = 64  # JSON nesting, as the server's request bodies
FILES = ("tasks.jsonl", "val.jsonl", "sft.jsonl", "report.json")  # report.json last: it marks a complete set


class SFTLine(BaseModel):
    """One supervised example: a kept call's prompt and answer, as sent and received."""

    policy: str
    role: str
    node: str | None
    run_id: str
    score: float | None
    messages: list[dict[str, Any]]
    completion: dict[str, Any]
    tools: list[dict[str, Any]] | None = None  # omitted when the call had none
    prompt_ids: list[int] | None = None  # both omitted unless the call has both (imported traces have none)
    response_ids: list[int] | None = None

    def to_json(self) -> str:
        return _dumps(self.model_dump(exclude={k for k in ("tools", "prompt_ids", "response_ids") if getattr(self, k) is None}))


class Report(BaseModel):
    """report.json: every run and every LLM call read is accounted for."""

    folders: list[str]
    options: dict[str, Any]
    runs_read: int = 0
    runs_duplicate_id: int = 0  # the same run id in two folders: the first is kept
    runs_without_task: int = 0
    runs_task_unusable: dict[str, int] = Field(default_factory=dict)  # too_large / too_deep / not_json: no task, no SFT
    feedback_ignored: int = 0  # not a finite score or a label, or a turn the run does not have
    tasks_train: int = 0
    tasks_val: int = 0
    tasks_duplicate: int = 0  # runs whose task an earlier run already gave
    runs_train: int = 0
    runs_val: int = 0
    calls_read: int = 0
    sft_lines: int = 0
    sft_runs: int = 0  # runs that gave at least one line
    sft_by_role: dict[str, int] = Field(default_factory=dict)
    sft_by_policy: dict[str, int] = Field(default_factory=dict)
    calls_dropped: dict[str, int] = Field(default_factory=dict)  # reason -> calls; calls_read = sft_lines + their sum


class Datasets(BaseModel):
    tasks: list[dict[str, Any]]
    val: list[dict[str, Any]]
    sft: list[SFTLine]
    report: Report


def _dumps(value: Any, *, sort: bool = False) -> str:
    return json.dumps(value, sort_keys=sort, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _count(counts: dict[str, int], key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


def task_key(task: dict[str, Any]) -> str:
    """The task's canonical JSON (sorted keys, compact): equal tasks have equal keys. ValueError
    for a task too deep, too large or not plain JSON (NaN, non-string keys...)."""
    if nested_too_deep(task, MAX_DEPTH):
        raise ValueError("too_deep")
    try:
        key = _dumps(task, sort=True)
    except (ValueError, TypeError, RecursionError):
        raise ValueError("not_json") from None
    if len(key.encode()) > MAX_TASK_BYTES:
        raise ValueError("too_large")
    return key


def is_val(key: str, val_fraction: float, seed: int) -> bool:
    """A task is held out when the hash of (seed, its key) falls under val_fraction: the same
    answer in any run order and for any other tasks read with it."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def split_by_task(tasks: Iterable[dict[str, Any]], val_fraction: float, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, val) tasks, each once, in first-seen order; unusable tasks are left out."""
    seen: set[str] = set()
    train: list[dict[str, Any]] = []
    val: list[dict[str, Any]] = []
    for task in tasks:
        try:
            key = task_key(task)
        except ValueError:
            continue
        if key not in seen:
            seen.add(key)
            (val if is_val(key, val_fraction, seed) else train).append(task)
    return train, val


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _turn(fb: dict[str, Any]) -> str | None:
    turn = fb.get("turn")
    return turn.removeprefix("chatcmpl-") if isinstance(turn, str) else None


def run_score(feedback: Sequence[dict[str, Any]]) -> float | None:
    """The mean of the run-level (no `turn`) finite scores; None when there are none."""
    scores = [s for fb in feedback if fb.get("turn") is None and (s := _number(fb.get("score"))) is not None]
    return sum(scores) / len(scores) if scores else None


def call_score(feedback: Sequence[dict[str, Any]], call_id: str) -> float | None:
    """The mean of the scores given to this call (`turn`), else the run's score."""
    scores = [s for fb in feedback if _turn(fb) == call_id and (s := _number(fb.get("score"))) is not None]
    return sum(scores) / len(scores) if scores else run_score(feedback)


def call_labels(feedback: Sequence[dict[str, Any]], call_id: str) -> set[str]:
    """The labels given to this call (`turn`), else the run's labels."""
    def labels(match: Any) -> set[str]:
        return {fb["label"] for fb in feedback if match(fb) and isinstance(fb.get("label"), str)}

    return labels(lambda fb: _turn(fb) == call_id) or labels(lambda fb: fb.get("turn") is None)


def _ignored_feedback(feedback: Sequence[dict[str, Any]], calls: set[str]) -> int:
    def useful(fb: dict[str, Any]) -> bool:
        turn = fb.get("turn")
        if turn is not None and _turn(fb) not in calls:
            return False
        return _number(fb.get("score")) is not None or isinstance(fb.get("label"), str)

    return sum(not useful(fb) for fb in feedback)


def _sft_line(call: LLMCall, run_id: str, score: float | None) -> SFTLine:
    ids = bool(call.prompt_ids) and bool(call.response_ids)
    return SFTLine(policy=call.policy, role=call.role, node=call.node, run_id=run_id, score=score,
                   messages=call.messages, completion={"role": "assistant", "content": call.output_text, "tool_calls": call.tool_calls},
                   tools=call.tools or None, prompt_ids=call.prompt_ids if ids else None, response_ids=call.response_ids if ids else None)


def _options(min_score: float | None, label: str | None, val_fraction: float, seed: int,
             roles: Sequence[str] | None) -> dict[str, Any]:
    if min_score is not None and not math.isfinite(min_score):
        raise UserError(f"--min-score {min_score}: give a finite number, e.g. 0.8")
    if not (math.isfinite(val_fraction) and 0 <= val_fraction < 1):
        raise UserError(f"--val-fraction {val_fraction}: give a fraction of the tasks to hold out, at least 0 and below 1")
    if label is not None and not label:
        raise UserError("--label is empty: give the label that marks good runs, e.g. --label good")
    if min_score is None and label is None:
        min_score = DEFAULT_MIN_SCORE
    return {"min_score": min_score, "label": label, "val_fraction": val_fraction, "seed": seed, "roles": sorted(set(roles or ()))}


def check_folders(folders: Sequence[str | Path]) -> list[Path]:
    """The record folders, each once; UserError for one that is missing or holds no runs."""
    if not folders:
        raise UserError("no record folder given: name at least one folder written by `mas-trainer serve --record`")
    out: list[Path] = []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise UserError(f"record folder {folder} {'is not a folder' if folder.exists() else 'not found'}: "
                            "give a folder written by `mas-trainer serve --record DIR`")
        if not run_files(folder):
            raise UserError(f"{folder} holds no runs-NNNN.jsonl files: give a folder written by `mas-trainer serve --record DIR`")
        if folder.resolve() not in {p.resolve() for p in out}:
            out.append(folder)
    return out


def build_datasets(folders: Sequence[str | Path], *, min_score: float | None = None, label: str | None = None,
                   val_fraction: float = 0.1, seed: int = 0, roles: Sequence[str] | None = None) -> Datasets:
    """Read every run of `folders` (oldest first, folder by folder) and choose tasks, held-out
    tasks and SFT lines by the rules in this module's docstring."""
    opts = _options(min_score, label, val_fraction, seed, roles)
    paths = check_folders(folders)
    report = Report(folders=[str(p) for p in paths], options=opts)
    tasks: list[dict[str, Any]] = []
    val: list[dict[str, Any]] = []
    sft: list[SFTLine] = []
    seen_runs: set[str] = set()
    seen_tasks: set[str] = set()
    seen_examples: set[bytes] = set()
    for path in paths:
        for traj, feedback in read_runs(path):
            report.runs_read += 1
            report.calls_read += len(traj.llm_calls)
            if traj.rollout_id in seen_runs:
                report.runs_duplicate_id += 1
                _count(report.calls_dropped, "duplicate_run", len(traj.llm_calls))
                continue
            seen_runs.add(traj.rollout_id)
            report.feedback_ignored += _ignored_feedback(feedback, {c.id for c in traj.llm_calls})
            side = _place(traj, opts, report, tasks, val, seen_tasks)
            if side is None:
                _count(report.calls_dropped, "task_unusable", len(traj.llm_calls))
                continue
            if side == "val":
                report.runs_val += 1
                _count(report.calls_dropped, "val_task", len(traj.llm_calls))
                continue
            report.runs_train += 1
            before = len(sft)
            for call in traj.llm_calls:
                line, reason = _sft_choice(traj, call, feedback, opts, seen_examples)
                if line is None:
                    _count(report.calls_dropped, reason)
                    continue
                sft.append(line)
                _count(report.sft_by_role, call.role)
                _count(report.sft_by_policy, call.policy)
            report.sft_runs += len(sft) > before
    report.tasks_train, report.tasks_val, report.sft_lines = len(tasks), len(val), len(sft)
    return Datasets(tasks=tasks, val=val, sft=sft, report=report)


def _sft_choice(traj: Trajectory, call: LLMCall, feedback: Sequence[dict[str, Any]], opts: dict[str, Any],
                seen_examples: set[bytes]) -> tuple[SFTLine | None, str]:
    """(the call's SFT line, "") or (None, why it is dropped)."""
    reason = _select(traj, call, feedback, opts)
    if reason is not None:
        return None, reason
    line = _sft_line(call, traj.rollout_id, call_score(feedback, call.id))
    try:
        example = _dumps([line.policy, line.messages, line.completion], sort=True)
    except (ValueError, TypeError, RecursionError):
        return None, "unusable"
    if nested_too_deep([line.messages, line.tools], MAX_DEPTH):
        return None, "unusable"
    digest = hashlib.sha256(example.encode()).digest()
    if digest in seen_examples:
        return None, "duplicate"
    seen_examples.add(digest)
    return line, ""


def _place(traj: Trajectory, opts: dict[str, Any], report: Report, tasks: list[dict[str, Any]],
           val: list[dict[str, Any]], seen: set[str]) -> str | None:
    """The run's side ("train" or "val"), adding its task when new; None for an unusable task."""
    task = traj.task
    if not task or task == {"input": None}:  # no graph record, or one without an input
        report.runs_without_task += 1
        return "train"
    try:
        key = task_key(task)
    except ValueError as exc:
        _count(report.runs_task_unusable, str(exc))
        return None
    held_out = is_val(key, opts["val_fraction"], opts["seed"])
    if key in seen:
        report.tasks_duplicate += 1
    else:
        seen.add(key)
        (val if held_out else tasks).append(task)
    return "val" if held_out else "train"


def _select(traj: Trajectory, call: LLMCall, feedback: Sequence[dict[str, Any]], opts: dict[str, Any]) -> str | None:
    """Why a train-side call is not SFT data, or None when it is."""
    if traj.status != "ok":
        return "run_not_ok"
    if opts["roles"] and call.role not in opts["roles"]:
        return "role_not_selected"
    if call.finish_reason == "length":
        return "truncated"
    if opts["min_score"] is not None:
        score = call_score(feedback, call.id)
        if score is None:
            return "no_score"
        if score < opts["min_score"]:
            return "below_min_score"
    if opts["label"] is not None and opts["label"] not in call_labels(feedback, call.id):
        return "no_label"
    return None


def check_output(out: str | Path, folders: Sequence[str | Path], *, force: bool = False) -> Path:
    """UserError when `out` is (or is inside) a record folder, is a file, or holds files and
    `force` is not given."""
    out = Path(out)
    where = out.resolve()
    for folder in map(Path, folders):
        rec = folder.resolve()
        if where == rec or rec in where.parents:
            raise UserError(f"--out {out} is inside record folder {folder}: choose a folder outside it, e.g. datasets/")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: give a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out} is not empty: choose a new folder, or add --force to replace its datasets")
    return out


def write_datasets(data: Datasets, out: str | Path) -> Path:
    """Write the four files under `out`. A new or empty `out` appears whole (built in a hidden
    sibling folder, then renamed); an existing one gets each file by rename, report.json last
    and removed first, so a report always describes complete files."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    texts = {"tasks.jsonl": "".join(_dumps(t) + "\n" for t in data.tasks),
             "val.jsonl": "".join(_dumps(t) + "\n" for t in data.val),
             "sft.jsonl": "".join(line.to_json() + "\n" for line in data.sft),
             "report.json": data.report.model_dump_json(indent=1) + "\n"}
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for name in FILES:
            write_synced(tmp / name, texts[name], "w")
        if not out.exists() or not any(out.iterdir()):
            os.replace(tmp, out)  # rename(2) replaces an empty folder
            return out
        (out / "report.json").unlink(missing_ok=True)
        for name in FILES:
            os.replace(tmp / name, out / name)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_datasets(folders: Sequence[str | Path], out: str | Path, *, force: bool = False, **options: Any) -> Datasets:
    """`mas-trainer data`: check the folders and `out`, build the datasets, write them."""
    check_output(out, check_folders(folders), force=force)
    data = build_datasets(folders, **options)
    write_datasets(data, out)
    return data
