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
- Reading: a folder is read twice, line by line, holding per run only its counts, its task's
  hash and its feedback's sums (not its calls): memory goes with what is written, not with what
  is read. Only regular `runs-NNNN.jsonl` (and `feedback.jsonl`) files directly in the folder
  are read, opened without following links, each up to its size at the first read. A line over
  `MAX_LINE_BYTES`, nested deeper than `MAX_LINE_DEPTH`, not UTF-8 JSON, holding a lone
  surrogate (it cannot be written back as UTF-8), or JSON but not a record is skipped and
  counted (`lines_skipped`); a record's fields this build does not know are ignored and the
  record used (`records_unknown_fields`); a skipped file is counted (`files_skipped`).
- Scores are averaged exactly (as fractions): any finite scores give a finite mean.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Protocol, Sequence

from pydantic import BaseModel, Field

from mas_trainer.errors import UserError, nested_too_deep
from mas_trainer.production.record import FEEDBACK_FILE, RUN_ID, GraphRun, RecordedFeedback, write_synced
from mas_trainer.trace.schema import LLMCall

__all__ = ["SFTLine", "Report", "Datasets", "Written", "DEFAULT_MIN_SCORE", "MAX_TASK_BYTES", "MAX_DEPTH", "MAX_LINE_BYTES",
           "MAX_LINE_DEPTH", "task_key", "is_val", "split_by_task", "run_score", "call_score", "call_labels", "check_folders",
           "build_datasets", "check_output", "write_datasets", "make_datasets"]

DEFAULT_MIN_SCORE = 1.0
MAX_TASK_BYTES = 1 << 20  # as the server's graph records: 1 MiB
MAX_DEPTH = 64  # JSON nesting, as the server's request bodies
MAX_LINE_BYTES = 32 << 20  # one record line: a long multimodal prompt fits, a runaway line is not held whole
MAX_LINE_DEPTH = 256  # one record line's nesting: a record wraps a task or messages in a few levels more than MAX_DEPTH
FILES = ("tasks.jsonl", "val.jsonl", "sft.jsonl", "report.json")  # report.json last: it marks a complete set
_RUNS_FILE = re.compile(r"runs-(\d{4,})\.jsonl")
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # a surrogate escape: lone ones cannot be written as UTF-8


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
    """report.json: every run and every LLM call read is accounted for, and every line and file not read."""

    folders: list[str]
    options: dict[str, Any]
    files_skipped: dict[str, int] = Field(default_factory=dict)  # symlink / not_regular / unreadable: never opened
    lines_skipped: dict[str, int] = Field(default_factory=dict)  # too_large / too_deep / unreadable / lone_surrogate / not_a_record
    records_unknown_fields: int = 0  # records used with fields a newer writer added, those fields ignored
    runs_read: int = 0
    runs_duplicate_id: int = 0  # the same run id in two folders: the first is kept
    runs_without_task: int = 0
    runs_task_unusable: dict[str, int] = Field(default_factory=dict)  # too_large / too_deep / not_json: no task, no SFT
    feedback_ignored: int = 0  # not a finite score or a label, or a turn the run does not have
    runs_scored: int = 0  # runs with a score or a label to go by (on the run, or on one of its calls)
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


class Written(BaseModel):
    """What `make_datasets` wrote: the folder and its report (the datasets stay on disk, not in memory)."""

    out: str
    report: Report


def _dumps(value: Any, *, sort: bool = False) -> str:
    return json.dumps(value, sort_keys=sort, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _count(counts: dict[str, int], key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


def task_key(task: dict[str, Any]) -> str:
    """The task's canonical JSON (sorted keys, compact): equal tasks have equal keys. ValueError
    for a task too deep, too large or not plain JSON (NaN, non-string keys, lone surrogates...)."""
    if nested_too_deep(task, MAX_DEPTH):
        raise ValueError("too_deep")
    try:
        key = _dumps(task, sort=True)
        size = len(key.encode())
    except (ValueError, TypeError, RecursionError):  # UnicodeEncodeError is a ValueError
        raise ValueError("not_json") from None
    if size > MAX_TASK_BYTES:
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
    """A finite score as a float, else None (an integer too large for a float included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _mean(scores: Sequence[float]) -> float | None:
    """The exact mean, rounded once: finite scores never sum past the float range on the way."""
    return float(sum(map(Fraction, scores), Fraction(0)) / len(scores)) if scores else None


def _turn(fb: dict[str, Any]) -> str | None:
    turn = fb.get("turn")
    return turn.removeprefix("chatcmpl-") if isinstance(turn, str) else None


def run_score(feedback: Sequence[dict[str, Any]]) -> float | None:
    """The mean of the run-level (no `turn`) finite scores; None when there are none."""
    return _mean([s for fb in feedback if fb.get("turn") is None and (s := _number(fb.get("score"))) is not None])


def call_score(feedback: Sequence[dict[str, Any]], call_id: str) -> float | None:
    """The mean of the scores given to this call (`turn`), else the run's score."""
    own = _mean([s for fb in feedback if _turn(fb) == call_id and (s := _number(fb.get("score"))) is not None])
    return own if own is not None else run_score(feedback)


def call_labels(feedback: Sequence[dict[str, Any]], call_id: str) -> set[str]:
    """The labels given to this call (`turn`), else the run's labels."""
    def labels(match: Any) -> set[str]:
        return {fb["label"] for fb in feedback if match(fb) and isinstance(fb.get("label"), str)}

    return labels(lambda fb: _turn(fb) == call_id) or labels(lambda fb: fb.get("turn") is None)


def _options(min_score: float | None = None, label: str | None = None, val_fraction: float = 0.1, seed: int = 0,
             roles: Sequence[str] | None = None) -> dict[str, Any]:
    if min_score is not None and not math.isfinite(min_score):
        raise UserError(f"--min-score {min_score}: give a finite number, e.g. 0.8")
    if not (math.isfinite(val_fraction) and 0 <= val_fraction < 1):
        raise UserError(f"--val-fraction {val_fraction}: give a fraction of the tasks to hold out, at least 0 and below 1")
    if label is not None and not label:
        raise UserError("--label is empty: give the label that marks good runs, e.g. --label good")
    if min_score is None and label is None:
        min_score = DEFAULT_MIN_SCORE
    return {"min_score": min_score, "label": label, "val_fraction": val_fraction, "seed": seed, "roles": sorted(set(roles or ()))}


# --- reading a record folder: inside it, regular files only, any line survived ---------------------------------------


def _open_in(dfd: int, name: str) -> tuple[IO[bytes] | None, str]:
    """(`name` in the folder open as `dfd`, opened for reading, "") or (None, why not): a link
    is never followed (the file could be anywhere), and only a regular file is read."""
    try:  # O_NONBLOCK: a FIFO planted under the name does not hang the open
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as exc:
        return None, "symlink" if exc.errno == errno.ELOOP else "gone" if exc.errno == errno.ENOENT else "unreadable"
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None, "not_regular"
    return os.fdopen(fd, "rb"), ""


def _open_folder(folder: Path) -> int:
    try:
        return os.open(folder.resolve(), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise UserError(f"record folder {folder} cannot be read ({exc.strerror}): give a folder you can read") from None


def _run_names(dfd: int) -> list[str]:
    """The names of the folder's runs-NNNN.jsonl entries, oldest first (links and all: opening decides)."""
    found = [(int(m.group(1)), name) for name in os.listdir(dfd) if (m := _RUNS_FILE.fullmatch(name))]
    return [name for _, name in sorted(found)]


def _regular_run_files(folder: Path) -> list[str]:
    """The runs-NNNN.jsonl names `data` will read: regular files directly in `folder`, no links."""
    dfd = _open_folder(folder)
    try:
        return [n for n in _run_names(dfd) if stat.S_ISREG(os.stat(n, dir_fd=dfd, follow_symlinks=False).st_mode)]
    finally:
        os.close(dfd)


def _lines(f: IO[bytes], end: int) -> Iterator[bytes | None]:
    """The lines of `f` up to byte `end`; None for a line over MAX_LINE_BYTES, which is skipped
    without ever being held whole."""
    f.seek(0)
    left = end
    while left > 0:
        raw = f.readline(min(MAX_LINE_BYTES + 1, left))
        if not raw:  # the file shrank under us
            return
        left -= len(raw)
        if len(raw) <= MAX_LINE_BYTES:
            yield raw
            continue
        while not raw.endswith(b"\n") and left > 0:
            raw = f.readline(min(1 << 20, left))
            if not raw:
                break
            left -= len(raw)
        yield None


def _encodable(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def _parse(raw: bytes | None) -> tuple[Any, str]:
    """(the line's JSON, "") or (None, why it is skipped)."""
    if raw is None:
        return None, "too_large"
    try:
        text = raw.decode()  # strict: encoded surrogates and other non-UTF-8 bytes are refused here
        value = json.loads(text)
    except RecursionError:  # nested past what json can parse
        return None, "too_deep"
    except ValueError:  # a torn line (the server killed mid-write), or not JSON
        return None, "unreadable"
    if nested_too_deep(value, MAX_LINE_DEPTH):
        return None, "too_deep"
    if _SURROGATE.search(text) and not _encodable(value):
        return None, "lone_surrogate"
    return value, ""


def _known(model: type[BaseModel], data: Any) -> tuple[dict[str, Any], bool]:
    """`data`'s fields `model` knows, and whether it had others (a newer writer's: ignored, not fatal)."""
    if not isinstance(data, dict):
        raise TypeError("not an object")
    known = {k: v for k, v in data.items() if k in model.model_fields}
    return known, len(known) < len(data)


def _record(value: Any) -> tuple[str, str, Any, bool]:
    """(kind, run id, the call / graph record / feedback, had unknown fields) of a runs-file line;
    TypeError, KeyError or ValueError for JSON that is not a record."""
    run_id = value["run_id"]
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise ValueError("run id")
    if "graph" in value:
        data, extra = _known(GraphRun, value["graph"])
        return "graph", run_id, GraphRun.model_validate({**data, "run_id": run_id}), extra
    if "feedback" in value:
        data, extra = _known(RecordedFeedback, value["feedback"])
        fb = RecordedFeedback.model_validate({**data, "run_id": run_id})
        return "feedback", run_id, {"score": fb.score, "label": fb.label, "turn": fb.turn}, extra
    data, extra = _known(LLMCall, value["call"])
    return "call", run_id, LLMCall.model_validate(data), extra


@dataclass(slots=True)
class _Votes:
    """The feedback on a run (turn None) or on one of its calls, summed: never the list itself."""

    total: Fraction = Fraction(0)
    scores: int = 0
    labelled: bool = False
    wanted: bool = False  # carries the label asked for
    given: int = 0
    useless: int = 0  # neither a finite score nor a label
    matched: bool = False  # a call of the run has this id

    def mean(self) -> float | None:
        return float(self.total / self.scores) if self.scores else None


@dataclass(slots=True)
class _Run:
    """What a run's choices need, gathered by the first read; its calls are read again, not kept."""

    order: int = -1  # its first call's place in the folder
    calls: int = 0
    graph: bool = False  # its (first) graph record read
    status: str = "ok"
    key: bytes | None = None  # the hash of its task's canonical JSON
    unusable: str | None = None  # why its task is not usable
    held_out: bool = False
    side: str = ""  # train / val / unusable / duplicate
    gives_task: bool = False  # the first run of its task: its task is written
    votes: dict[str | None, _Votes] = field(default_factory=dict)
    stray: int = 0  # feedback whose turn is not a string
    graph_again: bool = False  # second read: its graph record met
    index: int = 0  # second read: its calls met


class _Sink(Protocol):
    """Where chosen tasks and SFT lines go, in order."""

    def task(self, held_out: bool, text: str) -> None: ...

    def sft(self, text: str) -> None: ...


class _Lists:
    def __init__(self) -> None:
        self.tasks: list[dict[str, Any]] = []
        self.val: list[dict[str, Any]] = []
        self.sft_lines: list[SFTLine] = []

    def task(self, held_out: bool, text: str) -> None:
        (self.val if held_out else self.tasks).append(json.loads(text))

    def sft(self, text: str) -> None:
        self.sft_lines.append(SFTLine.model_validate_json(text))


class _Files:
    """Streams the three dataset files under `folder`; `close` fsyncs them."""

    def __init__(self, folder: Path) -> None:
        self.files = {name: (folder / name).open("w", encoding="utf-8") for name in FILES[:3]}

    def task(self, held_out: bool, text: str) -> None:
        self.files["val.jsonl" if held_out else "tasks.jsonl"].write(text + "\n")

    def sft(self, text: str) -> None:
        self.files["sft.jsonl"].write(text + "\n")

    def close(self, sync: bool) -> None:
        try:
            for f in self.files.values():
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
        finally:
            for f in self.files.values():
                f.close()


class _Curator:
    """Chooses tasks, held-out tasks and SFT lines folder by folder, each folder read twice."""

    def __init__(self, opts: dict[str, Any], report: Report, sink: _Sink) -> None:
        self.opts, self.report, self.sink = opts, report, sink
        self.seen_runs: set[str] = set()
        self.seen_tasks: set[bytes] = set()
        self.seen_examples: set[bytes] = set()

    def folder(self, folder: Path) -> None:
        dfd = _open_folder(folder)
        files: list[tuple[IO[bytes], int]] = []
        try:  # every file stays open between the two reads: one rotated away meanwhile is read whole
            for name in _run_names(dfd):
                f, why = _open_in(dfd, name)
                if f is None:
                    _count(self.report.files_skipped, why)
                else:
                    files.append((f, os.fstat(f.fileno()).st_size))
            legacy, why = _open_in(dfd, FEEDBACK_FILE)
            if why not in ("", "gone"):
                _count(self.report.files_skipped, why)
            runs: dict[str, _Run] = {}
            if legacy is not None:
                with legacy:
                    self._legacy_feedback(legacy, runs)
            self._first_read(files, runs)
            chosen = self._decide(runs)
            self._second_read(files, runs, chosen)
        finally:
            for f, _ in files:
                f.close()
            os.close(dfd)

    def _lines(self, files: list[tuple[IO[bytes], int]], counted: bool) -> Iterator[tuple[str, str, Any]]:
        for f, end in files:
            for raw in _lines(f, end):
                value, why = _parse(raw)
                try:
                    if why:
                        raise ValueError(why)
                    kind, run_id, item, extra = _record(value)
                except (TypeError, KeyError, ValueError):  # a line that is JSON but not a record (crafted, foreign)
                    if counted:
                        _count(self.report.lines_skipped, why or "not_a_record")
                    continue
                if counted and extra:
                    self.report.records_unknown_fields += 1
                yield kind, run_id, item

    def _legacy_feedback(self, f: IO[bytes], runs: dict[str, _Run]) -> None:
        """feedback.jsonl, where earlier builds kept feedback: plain objects, judged as they are."""
        for raw in _lines(f, os.fstat(f.fileno()).st_size):
            value, why = _parse(raw)
            if not why and not (isinstance(value, dict) and isinstance(value.get("run_id"), str)):
                why = "not_a_record"
            if why:
                _count(self.report.lines_skipped, why)
                continue
            self._vote(runs.setdefault(value["run_id"], _Run()), value)

    def _vote(self, run: _Run, fb: dict[str, Any]) -> None:
        turn = fb.get("turn")
        if turn is not None and not isinstance(turn, str):
            run.stray += 1
            return
        votes = run.votes.setdefault(None if turn is None else turn.removeprefix("chatcmpl-"), _Votes())
        votes.given += 1
        score, label = _number(fb.get("score")), fb.get("label")
        if score is not None:
            votes.total += Fraction(score)
            votes.scores += 1
        if isinstance(label, str):
            votes.labelled = True
            votes.wanted |= label == self.opts["label"]
        votes.useless += score is None and not isinstance(label, str)

    def _first_read(self, files: list[tuple[IO[bytes], int]], runs: dict[str, _Run]) -> None:
        order = 0
        for kind, run_id, item in self._lines(files, counted=True):
            run = runs.get(run_id) or runs.setdefault(run_id, _Run())
            if kind == "call":
                if not run.calls:
                    run.order, order = order, order + 1
                run.calls += 1
            elif kind == "graph":
                if not run.graph:
                    run.graph = True
                    self._task(run, item)
            else:
                self._vote(run, item)

    def _task(self, run: _Run, graph: GraphRun) -> None:
        run.status = graph.status
        task = _task_of(graph)
        if task is None:
            return
        try:
            key = task_key(task)
        except ValueError as exc:
            run.unusable = str(exc)
            return
        run.key = hashlib.sha256(key.encode()).digest()
        run.held_out = is_val(key, self.opts["val_fraction"], self.opts["seed"])

    def _decide(self, runs: dict[str, _Run]) -> list[str]:
        """Each run's side, in run order (by first call); the runs with calls, in that order."""
        r = self.report
        chosen = sorted((run_id for run_id, run in runs.items() if run.calls), key=lambda run_id: runs[run_id].order)
        for run_id in chosen:
            run = runs[run_id]
            r.runs_read += 1
            r.calls_read += run.calls
            if run_id in self.seen_runs:
                run.side = "duplicate"
                r.runs_duplicate_id += 1
                _count(r.calls_dropped, "duplicate_run", run.calls)
                continue
            self.seen_runs.add(run_id)
            if run.unusable is not None:
                run.side = "unusable"
                _count(r.runs_task_unusable, run.unusable)
                _count(r.calls_dropped, "task_unusable", run.calls)
                continue
            if run.key is None:  # no graph record, or one without an input
                r.runs_without_task += 1
            elif run.key in self.seen_tasks:
                r.tasks_duplicate += 1
            else:
                self.seen_tasks.add(run.key)
                run.gives_task = True
                if run.held_out:
                    r.tasks_val += 1
                else:
                    r.tasks_train += 1
            run.side = "val" if run.held_out else "train"
            if run.held_out:
                r.runs_val += 1
                _count(r.calls_dropped, "val_task", run.calls)
            else:
                r.runs_train += 1
        return chosen

    def _second_read(self, files: list[tuple[IO[bytes], int]], runs: dict[str, _Run], chosen: list[str]) -> None:
        """Tasks and SFT lines, put back in run order: only what is written is held."""
        tasks: list[tuple[int, bool, str]] = []
        best: dict[bytes, tuple[tuple[int, int], str, str, str]] = {}  # example -> its first place, line, role, policy
        for kind, run_id, item in self._lines(files, counted=False):
            run = runs[run_id]
            if kind == "graph" and not run.graph_again:
                run.graph_again = True
                if run.gives_task:
                    tasks.append((run.order, run.held_out, _dumps(_task_of(item))))
            elif kind == "call" and run.side != "duplicate":
                if (votes := run.votes.get(item.id)) is not None:
                    votes.matched = True
                place = (run.order, run.index)
                run.index += 1
                if run.side == "train":
                    self._call(run_id, run, item, place, best)
        for _, held_out, text in sorted(tasks, key=lambda t: t[0]):
            self.sink.task(held_out, text)
        r = self.report
        for _, text, role, policy in sorted(best.values(), key=lambda b: b[0]):
            self.sink.sft(text)
            _count(r.sft_by_role, role)
            _count(r.sft_by_policy, policy)
        r.sft_lines += len(best)
        r.sft_runs += len({place[0] for place, *_ in best.values()})
        self.seen_examples.update(best)
        for run_id in chosen:
            run = runs[run_id]
            if run.side != "duplicate":
                r.feedback_ignored += run.stray + sum(v.useless if turn is None or v.matched else v.given
                                                      for turn, v in run.votes.items())
                r.runs_scored += any((v.scores or v.labelled) and (turn is None or v.matched) for turn, v in run.votes.items())

    def _call(self, run_id: str, run: _Run, call: LLMCall, place: tuple[int, int],
              best: dict[bytes, tuple[tuple[int, int], str, str, str]]) -> None:
        """Offer a train-side call: the first place of each example wins; the rest are counted."""
        score, reason = self._select(run, call)
        if reason is not None:
            _count(self.report.calls_dropped, reason)
            return
        line = _sft_line(call, run_id, score)
        try:
            example = _dumps([line.policy, line.messages, line.completion], sort=True)
            text = line.to_json()
        except (ValueError, TypeError, RecursionError):
            example = ""
        if not example or nested_too_deep([line.messages, line.tools], MAX_DEPTH):
            _count(self.report.calls_dropped, "unusable")
            return
        digest = hashlib.sha256(example.encode()).digest()
        if digest in self.seen_examples or (digest in best and best[digest][0] < place):
            _count(self.report.calls_dropped, "duplicate")
            return
        if digest in best:
            _count(self.report.calls_dropped, "duplicate")
        best[digest] = (place, text, call.role, call.policy)

    def _select(self, run: _Run, call: LLMCall) -> tuple[float | None, str | None]:
        """(the call's score, why it is not SFT data or None)."""
        own, whole = run.votes.get(call.id), run.votes.get(None)
        score = own.mean() if own is not None and own.scores else whole.mean() if whole is not None else None
        opts = self.opts
        if run.status != "ok":
            return score, "run_not_ok"
        if opts["roles"] and call.role not in opts["roles"]:
            return score, "role_not_selected"
        if call.finish_reason == "length":
            return score, "truncated"
        if opts["min_score"] is not None:
            if score is None:
                return score, "no_score"
            if score < opts["min_score"]:
                return score, "below_min_score"
        if opts["label"] is not None:
            labels = own if own is not None and own.labelled else whole
            if labels is None or not labels.wanted:
                return score, "no_label"
        return score, None


def _task_of(graph: GraphRun) -> dict[str, Any] | None:
    """A graph record's task, or None for one without an input; an input that is not a dict (a
    bare string, a message list) is kept as the task's "input"."""
    task = graph.input if isinstance(graph.input, dict) else {"input": graph.input}
    return None if not task or task == {"input": None} else task


def _sft_line(call: LLMCall, run_id: str, score: float | None) -> SFTLine:
    ids = bool(call.prompt_ids) and bool(call.response_ids)
    return SFTLine(policy=call.policy, role=call.role, node=call.node, run_id=run_id, score=score,
                   messages=call.messages, completion={"role": "assistant", "content": call.output_text, "tool_calls": call.tool_calls},
                   tools=call.tools or None, prompt_ids=call.prompt_ids if ids else None, response_ids=call.response_ids if ids else None)


def check_folders(folders: Sequence[str | Path]) -> list[Path]:
    """The record folders, each once; UserError for one that is missing or holds no runs."""
    if not folders:
        raise UserError("no record folder given: name at least one folder written by `mas-trainer serve --record`")
    out: list[Path] = []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise UserError(f"record folder {folder} {'is not a folder' if folder.exists() else 'not found'}: "
                            "give a folder written by `mas-trainer serve --record DIR` or `import-traces --out DIR`")
        if not _regular_run_files(folder):
            raise UserError(f"{folder} holds no runs-NNNN.jsonl files (links are not followed): "
                            "give a folder written by `mas-trainer serve --record DIR` or `import-traces --out DIR`")
        if folder.resolve() not in {p.resolve() for p in out}:
            out.append(folder)
    return out


def _curate(paths: Sequence[Path], opts: dict[str, Any], sink: _Sink) -> Report:
    report = Report(folders=[str(p) for p in paths], options=opts)
    curator = _Curator(opts, report, sink)
    for path in paths:
        curator.folder(path)
    return report


def build_datasets(folders: Sequence[str | Path], *, min_score: float | None = None, label: str | None = None,
                   val_fraction: float = 0.1, seed: int = 0, roles: Sequence[str] | None = None) -> Datasets:
    """Read every run of `folders` (oldest first, folder by folder) and choose tasks, held-out
    tasks and SFT lines by the rules in this module's docstring; the datasets are returned, so
    held in memory (`make_datasets` streams them to files instead)."""
    opts = _options(min_score, label, val_fraction, seed, roles)
    sink = _Lists()
    report = _curate(check_folders(folders), opts, sink)
    return Datasets(tasks=sink.tasks, val=sink.val, sft=sink.sft_lines, report=report)


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


def _publish(out: Path, fill: Callable[[Path], None]) -> Path:
    """`fill` writes the four files into a hidden sibling folder; a new or empty `out` then
    appears whole (renamed), an existing one gets each file by rename, report.json removed first
    and put last, so a report always describes complete files."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fill(tmp)
        if not out.exists() or not any(out.iterdir()):
            os.replace(tmp, out)  # rename(2) replaces an empty folder
            return out
        (out / "report.json").unlink(missing_ok=True)
        for name in FILES:
            os.replace(tmp / name, out / name)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_datasets(data: Datasets, out: str | Path) -> Path:
    """Write the four files of `data` under `out` (see `_publish`)."""
    texts = {"tasks.jsonl": "".join(_dumps(t) + "\n" for t in data.tasks),
             "val.jsonl": "".join(_dumps(t) + "\n" for t in data.val),
             "sft.jsonl": "".join(line.to_json() + "\n" for line in data.sft),
             "report.json": data.report.model_dump_json(indent=1) + "\n"}

    def fill(tmp: Path) -> None:
        for name in FILES:
            write_synced(tmp / name, texts[name], "w")

    return _publish(Path(out), fill)


def make_datasets(folders: Sequence[str | Path], out: str | Path, *, force: bool = False, **options: Any) -> Written:
    """`mas-trainer data`: check the options, the folders and `out`, then stream the datasets
    into `out` as they are chosen (never all in memory) and say what was written."""
    opts = _options(**options)
    paths = check_folders(folders)
    check_output(out, paths, force=force)
    reports: list[Report] = []

    def fill(tmp: Path) -> None:
        sink = _Files(tmp)
        try:
            reports.append(_curate(paths, opts, sink))
        finally:
            sink.close(sync=bool(reports))
        write_synced(tmp / "report.json", reports[0].model_dump_json(indent=1) + "\n", "w")

    _publish(Path(out), fill)
    return Written(out=str(out), report=reports[0])
