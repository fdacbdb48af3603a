"""`serve --record DIR`: each served run kept on disk as trajectory JSON, and feedback on it.

A run is every LLM call that shares one W3C trace id (an `@trainable` graph's invocation sends
one); a call that carries none is a run of its own. Its id (32 hex characters) goes back to
the caller as `x-mas-run-id` and `run_id`. Each call is one JSON line in `runs-NNNN.jsonl`,
written, flushed and fsync'ed before the answer leaves, so a kill -9 loses at most the calls in
flight; a line cut short is ended before the next one is written (at start too), so it costs
only itself. Files rotate at `file_mb`; the oldest go once the runs' lines pass `max_mb`, and
their runs are forgotten (feedback on them is refused). The app sends a run's graph input and
output once (`{"run_id": ..., "graph": {...}}` lines), and feedback comes as `{"run_id": ...,
"feedback": {...}}` lines, in the same files, so a run's feedback goes when the run does.
Feedback is bounded apart (per run, and in all a quarter of `max_mb`) and refused past it,
never making room by deleting runs: whoever holds the key could otherwise flood recorded runs
away. `redact` (str -> str) sees every text before the disk does (messages, tools, answers,
graph records, feedback labels and comments); a call it changed loses its token ids, which
would decode to the text it removed (the warm start renders its redacted messages instead).
When it raises (anything, `sys.exit` too), nothing of that call or record is written.
Feedback written on a folder, not posted (`mas-trainer feedback`: a file of it, or a reward
function's scores), says what gave it (`RecordedFeedback.by`) and is taken whole or not at all
(`Recorder.feedback_all`). `read_runs(DIR)` gives (Trajectory, [feedback]) per run (and reads
`feedback.jsonl`, where earlier builds kept it).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, model_validator

from mas_trainer.errors import UserError
from mas_trainer.trace.schema import LLMCall, NodeCall, Trajectory

__all__ = ["Feedback", "RecordedFeedback", "GraphRun", "Recorder", "read_runs", "run_files", "load_redactor", "write_synced", "RUN_ID"]

log = logging.getLogger(__name__)
RUN_ID = re.compile(r"[0-9a-f]{32}")
_RUNS = re.compile(r"runs-(\d{4,})\.jsonl")
FEEDBACK_FILE = "feedback.jsonl"
FEEDBACK_PER_RUN = 100  # entries kept per run: a score per turn of a long run, and then some
FEEDBACK_RUN_BYTES = 64 * 1024  # their lines' bytes per run
FEEDBACK_SHARE = 4  # all feedback kept: at most max_mb / FEEDBACK_SHARE, on top of the runs
Redactor = Callable[[str], str]


class Feedback(BaseModel):
    """POST /v1/feedback: a score or a label for a recorded run, or for one of its calls (`turn`)."""

    model_config = ConfigDict(extra="forbid")
    run_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    score: StrictFloat | None = Field(default=None, allow_inf_nan=False)  # a number: not "1", not true
    label: str | None = Field(default=None, min_length=1, max_length=200)
    turn: str | None = Field(default=None, max_length=64)
    comment: str | None = Field(default=None, max_length=2000)

    @model_validator(mode="after")
    def _something(self) -> Feedback:
        if self.score is None and self.label is None:
            raise ValueError("give a score or a label")
        return self


class RecordedFeedback(Feedback):
    """Feedback as kept: `by` says what gave it when it was not posted (`mas-trainer feedback`: a
    file's line, a reward function and its level), for whoever audits a score. POST bodies are
    `Feedback`, which refuses `by`: a client cannot pass its feedback off as a reward's."""

    by: str | None = Field(default=None, max_length=300)


class GraphRun(BaseModel):
    """POST /v1/runs: a recorded run's graph input and output, sent by the app once its graph
    invocation ends (`@trainable` apps do it themselves); the input becomes the run's task."""

    model_config = ConfigDict(extra="forbid")
    run_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    input: Any = None
    output: Any = None
    status: Literal["ok", "error"] = "ok"
    error: str | None = Field(default=None, max_length=2000)


def load_redactor(target: str) -> Redactor:
    """`module:function`, a function from str to str."""
    module, _, name = target.partition(":")
    if not module or not name:
        raise UserError(f"--redact {target!r}: give module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"--redact {target!r}: {exc}") from None
    if not callable(fn):
        raise UserError(f"--redact {target!r} is not callable")
    return fn  # type: ignore[no-any-return]


def _scrub(value: Any, redact: Redactor) -> Any:
    """`value` with each string passed through `redact`; keys stay (they name fields)."""
    if isinstance(value, str):
        out = redact(value)
        if not isinstance(out, str):
            raise TypeError(f"the redaction hook returned {type(out).__name__}, not str")
        return out
    if isinstance(value, list):
        return [_scrub(v, redact) for v in value]
    if isinstance(value, dict):
        return {k: _scrub(v, redact) for k, v in value.items()}
    return value


MAX_LINE_BYTES = 32 << 20  # a line longer than this (no writer here makes one) is skipped, never held whole


def _regular(path: Path) -> bool:
    """A regular file itself, not a link to one: a reader of a record folder stays inside it."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def run_files(folder: Path) -> list[Path]:
    """The record files of `folder` (regular files, links not followed), oldest first."""
    found = [(int(m.group(1)), p) for p in folder.glob("runs-*.jsonl") if (m := _RUNS.fullmatch(p.name)) and _regular(p)]
    return [p for _, p in sorted(found)]


def _sized_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """Each line's bytes and record (None for a line that is skipped: torn, the server killed
    mid-write; not JSON; longer than MAX_LINE_BYTES, read past in bounded pieces)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:  # a link put there since it was listed, or gone
        log.warning("%s: not read (%s)", path, exc.strerror)
        return
    with os.fdopen(fd, "rb") as f:
        n = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            n, size = n + 1, len(raw)
            if size > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(1 << 20)
                    size += len(raw)
                log.warning("%s:%d: skipping a line of more than %d bytes", path, n, MAX_LINE_BYTES)
                yield size, None
                continue
            try:
                yield size, json.loads(raw)
            except (ValueError, RecursionError):  # RecursionError: nested past what json can parse
                log.warning("%s:%d: skipping a torn or unreadable line", path, n)
                yield size, None


def _lines(path: Path) -> Iterator[Any]:
    """The records of one file; a torn line is skipped."""
    return (rec for _, rec in _sized_lines(path) if rec is not None)


def _ends_torn(path: Path) -> bool:
    """Whether `path` ends inside a line (a write cut short): the next line must start on a new one."""
    try:
        with path.open("rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False
    except OSError:  # unreadable: a newline too many costs one skipped empty line, one too few a record
        return True


def write_synced(path: Path, text: str, mode: str = "a") -> None:
    """Append (or write) `text` and fsync it: on disk before anyone is told it is."""
    with path.open(mode, encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class Recorder:
    """Appends served calls and feedback under `folder`; knows which runs and turns it holds."""

    def __init__(self, folder: str | Path, *, file_mb: float = 64, max_mb: float = 1024,
                 redact: Redactor | None = None) -> None:
        if file_mb <= 0 or max_mb < file_mb:
            raise UserError("--record-file-mb must be > 0 and at most --record-max-mb")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file_bytes, self.max_bytes = int(file_mb * 2**20), int(max_mb * 2**20)
        self.feedback_bytes = self.max_bytes // FEEDBACK_SHARE
        self.redact = redact
        self._lock = threading.Lock()
        # run id -> its call ids, and which runs each file holds (to forget them when it goes)
        self._runs: dict[str, set[str]] = {}
        self._by_file: dict[Path, set[str]] = {}
        self._graphs: set[str] = set()  # runs whose graph record is kept (one each)
        self._feedback: dict[str, list[int]] = {}  # run id -> [entries, bytes] of its feedback
        # each file's bytes of runs (calls, graph records, unreadable lines) and of feedback:
        # only the runs' count against max_bytes, so feedback never deletes a run
        self._sizes: dict[Path, list[int]] = {}
        files = run_files(self.folder)
        for path in files:  # rebuilt at start: runs survive a restart
            size = self._sizes.setdefault(path, [0, 0])
            for n, rec in _sized_lines(path):
                kept = isinstance(rec, dict) and isinstance(rec.get("run_id"), str)
                if kept and isinstance(rec.get("feedback"), dict):
                    size[1] += n
                    self._count_feedback(rec["run_id"], n)
                    continue
                size[0] += n
                if kept and isinstance(rec.get("call"), dict):
                    self._index(path, rec["run_id"], str(rec["call"].get("id")))
                elif kept and isinstance(rec.get("graph"), dict):
                    self._graphs.add(rec["run_id"])
        self._current = files[-1] if files else self.folder / "runs-0000.jsonl"
        self._torn = _ends_torn(self._current)  # killed mid-write: the next line starts on a fresh one

    @property
    def _total(self) -> int:
        return sum(s[0] for s in self._sizes.values())

    @property
    def _feedback_total(self) -> int:
        return sum(s[1] for s in self._sizes.values())

    def _index(self, path: Path, run_id: str, call_id: str) -> None:
        self._runs.setdefault(run_id, set()).add(call_id)
        self._by_file.setdefault(path, set()).add(run_id)

    def _count_feedback(self, run_id: str, n: int) -> None:
        given = self._feedback.setdefault(run_id, [0, 0])
        given[0] += 1
        given[1] += n

    def record(self, run_id: str, call: LLMCall) -> bool:
        """Persist one call of `run_id`; False (and one log line) when the redaction hook failed.
        A call whose text the hook changed is kept without its token ids: they encode the
        text as it was, and this side has no tokenizer to encode the redacted text again."""
        data = call.model_dump(mode="json")
        texts = ("messages", "output_text", "tool_calls", "tools")
        before = {k: data[k] for k in texts}
        if not self._redacted(data, texts, f"run {run_id}: this call"):
            return False
        record: dict[str, Any] = {"run_id": run_id, "call": data}
        if any(data[k] != before[k] for k in texts) and (data["prompt_ids"] or data["response_ids"]):
            data["prompt_ids"], data["response_ids"], data["response_logprobs"] = [], [], []
            record["ids_dropped"] = "redacted"  # what was dropped and why, for whoever counts it
        with self._lock:
            self._append(record)
            self._index(self._current, run_id, data["id"])
            if self._total > self.max_bytes:
                self._trim()
        return True

    def record_graph(self, run: GraphRun) -> tuple[Literal["unknown", "duplicate", "redaction"], str] | None:
        """Persist a run's graph input and output; why it is refused (unknown run, already
        sent, redaction failed: a kind and a sentence), or None."""
        data = run.model_dump(mode="json", exclude={"run_id"})
        if not self._redacted(data, ("input", "output", "error"), f"run {run.run_id}: its graph record"):
            return "redaction", "the server's redaction hook failed on it; it is not recorded"
        with self._lock:
            if run.run_id not in self._runs:
                return "unknown", f"no recorded run {run.run_id!r} (unknown, or rotated away)"
            if run.run_id in self._graphs:
                return "duplicate", f"run {run.run_id} already has its graph record"
            self._append({"run_id": run.run_id, "graph": data})
            self._graphs.add(run.run_id)
            if self._total > self.max_bytes:
                self._trim()
        return None

    def _redacted(self, data: dict[str, Any], keys: tuple[str, ...], what: str) -> bool:
        if self.redact is None:
            return True
        try:
            for key in keys:
                data[key] = _scrub(data[key], self.redact)
        except BaseException as exc:  # the hook's failure, whatever it raises (sys.exit too): never written unredacted
            if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                raise  # Ctrl-C, which only the main thread receives: the user's, not the hook's
            log.error("%s is not recorded: the redaction hook failed (%s: %s)", what, type(exc).__name__,
                      str(exc).replace("\n", " "))
            return False
        return True

    def _append(self, record: dict[str, Any]) -> int:
        """Write one line in the current file (the lock held), rotating at file_bytes; its bytes."""
        line = json.dumps(record, separators=(",", ":")) + "\n"  # ASCII: json.dumps escapes the rest
        if self._current.exists() and self._current.stat().st_size + len(line) > self.file_bytes:
            number = int(_RUNS.fullmatch(self._current.name).group(1)) + 1  # type: ignore[union-attr]
            self._current, self._torn = self.folder / f"runs-{number:04d}.jsonl", False
        if self._torn:
            line = "\n" + line  # ends the torn line, which alone is lost
        try:
            write_synced(self._current, line)
        except BaseException:
            self._torn = _ends_torn(self._current)  # cut short (a full disk): the next line must not join it
            raise
        self._torn = False
        self._sizes.setdefault(self._current, [0, 0])[1 if "feedback" in record else 0] += len(line)
        return len(line)

    def _trim(self) -> None:
        """Delete the oldest files (not the one being written) until the runs' lines fit max_bytes."""
        files = run_files(self.folder)
        for gone in set(self._sizes) - set(files):  # deleted by hand: its runs are gone too
            self._forget(gone)
        for old in files[:-1]:
            if self._total <= self.max_bytes:
                break
            old.unlink(missing_ok=True)
            self._forget(old)

    def _forget(self, path: Path) -> None:
        self._sizes.pop(path, None)
        gone = self._by_file.pop(path, set())
        still = set().union(*self._by_file.values()) if self._by_file else set()
        for run_id in gone - still:  # a run split across files lives while any part does
            self._runs.pop(run_id, None)
            self._graphs.discard(run_id)
            self._feedback.pop(run_id, None)

    def check(self, run_id: str, turn: str | None) -> str | None:
        """Why feedback on (run_id, turn) is refused, or None."""
        with self._lock:
            return self._unknown(run_id, turn)

    def _unknown(self, run_id: str, turn: str | None) -> str | None:
        calls = self._runs.get(run_id) if RUN_ID.fullmatch(run_id) else None
        if calls is None:
            return f"no recorded run {run_id!r} (unknown, or rotated away)"
        # a turn is the completion's id; its "chatcmpl-" prefix is optional
        if turn is not None and turn.removeprefix("chatcmpl-") not in calls:
            return f"run {run_id} has no turn {turn!r}"
        return None

    def feedback(self, fb: Feedback) -> tuple[Literal["unknown", "run_limit", "full", "redaction"], str] | None:
        """Persist feedback on a held run; why it is refused (a kind and a sentence), or None.
        Bounded per run and in all, and refused past that: it never deletes a run to fit."""
        refused = self.feedback_all([fb])
        return None if refused is None else refused[1:]

    def feedback_all(self, entries: list[Feedback]) -> tuple[int, Literal["unknown", "run_limit", "full", "redaction"],
                                                               str] | None:
        """Persist every entry, or none: (the index of the first refused, its kind, why) when one
        is refused, each judged as `feedback` judges one, with the entries before it counted."""
        records: list[dict[str, Any]] = []
        for i, fb in enumerate(entries):
            data = fb.model_dump(mode="json", exclude_none=True, exclude={"run_id"})
            if not self._redacted(data, tuple(k for k in ("label", "comment") if k in data), f"run {fb.run_id}: feedback"):
                return i, "redaction", "the server's redaction hook failed on it; it is not recorded"
            records.append({"run_id": fb.run_id, "feedback": data})
        with self._lock:
            added: dict[str, list[int]] = {}  # run id -> [entries, bytes] of this batch
            total = self._feedback_total
            for i, record in enumerate(records):
                size = len(json.dumps(record, separators=(",", ":"))) + 2  # its line, and a newline ending a torn one
                refused = self._refused(entries[i], size, added.get(entries[i].run_id, [0, 0]), total)
                if refused is not None:
                    return (i, *refused)
                given = added.setdefault(entries[i].run_id, [0, 0])
                given[0], given[1], total = given[0] + 1, given[1] + size, total + size
            for fb, record in zip(entries, records):
                self._count_feedback(fb.run_id, self._append(record))
        return None

    def _refused(self, fb: Feedback, size: int, batch: list[int],
                 total: int) -> tuple[Literal["unknown", "run_limit", "full"], str] | None:
        """Why one entry of `size` bytes is refused (the lock held), `batch` [entries, bytes] of
        its run already taken in this batch, `total` all feedback kept with them."""
        why = self._unknown(fb.run_id, fb.turn)
        if why is not None:
            return "unknown", why
        entries, used = self._feedback.get(fb.run_id, (0, 0))
        entries, used = entries + batch[0], used + batch[1]
        if entries >= FEEDBACK_PER_RUN or used + size > FEEDBACK_RUN_BYTES:
            bound = f"at most {FEEDBACK_PER_RUN} feedback entries and {FEEDBACK_RUN_BYTES // 1024} KiB of them are kept per run"
            return "run_limit", f"run {fb.run_id} has {entries} feedback entries ({used} bytes): {bound}; this one is not recorded"
        if total + size > self.feedback_bytes:
            return "full", (f"the server keeps at most {self.feedback_bytes / 2**20:.3g} MiB of feedback in all "
                            f"(1/{FEEDBACK_SHARE} of --record-max-mb) and is there: more is refused until older "
                            "runs rotate away (a larger --record-max-mb keeps more)")
        return None


def _known(model: type[BaseModel], data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TypeError("not an object")
    return {k: v for k, v in data.items() if k in model.model_fields}


def read_runs(folder: str | Path) -> Iterator[tuple[Trajectory, list[dict[str, Any]]]]:
    """Each recorded run as a Trajectory (calls in order, nodes from the calls' node ids) with
    the feedback given on it, oldest run first."""
    folder = Path(folder)
    calls: dict[str, list[LLMCall]] = {}
    graphs: dict[str, GraphRun] = {}
    feedback: dict[str, list[dict[str, Any]]] = {}
    if _regular(folder / FEEDBACK_FILE):  # where earlier builds kept feedback
        for fb in _lines(folder / FEEDBACK_FILE):
            if isinstance(fb, dict) and isinstance(fb.get("run_id"), str):
                feedback.setdefault(fb["run_id"], []).append(fb)
    for path in run_files(folder):
        for rec in _lines(path):
            try:  # a line that is JSON but not a record (a crafted or foreign file) is skipped, like a torn one
                run_id = rec["run_id"]
                if not RUN_ID.fullmatch(run_id):
                    raise ValueError(f"run id {run_id!r}")
                # fields a newer writer added are ignored, not fatal to the record
                if "graph" in rec:
                    graphs.setdefault(run_id, GraphRun.model_validate({**_known(GraphRun, rec["graph"]), "run_id": run_id}))
                    continue
                if "feedback" in rec:
                    given = RecordedFeedback.model_validate({**_known(RecordedFeedback, rec["feedback"]), "run_id": run_id})
                    feedback.setdefault(run_id, []).append(given.model_dump(mode="json", exclude_none=True))
                    continue
                call = LLMCall.model_validate(_known(LLMCall, rec["call"]))
            except (TypeError, KeyError, ValueError) as exc:
                log.warning("%s: skipping a record that is not a served call (%s)", path, type(exc).__name__)
                continue
            calls.setdefault(run_id, []).append(call)
    for run_id, run in calls.items():
        nodes: dict[str, NodeCall] = {}
        for c in run:
            if c.node_id and c.node_id not in nodes:
                nodes[c.node_id] = NodeCall(id=c.node_id, name=c.node or "", step=None, parent_id=None, status="ok",
                                            start_time=c.start_time, end_time=c.end_time)
        start, end = run[0].start_time, run[-1].end_time
        graph = graphs.get(run_id)
        # a graph input that is not a dict (a bare string, a message list) is kept as the task's "input"
        task = {} if graph is None else graph.input if isinstance(graph.input, dict) else {"input": graph.input}
        traj = Trajectory(rollout_id=run_id, trace_id=run_id, task=task, status=graph.status if graph else "ok",
                          error=graph.error if graph else None, final_state=graph.output if graph else None,
                          nodes=list(nodes.values()), llm_calls=run,
                          duration_s=(end - start) if start is not None and end is not None else None)
        yield traj, feedback.get(run_id, [])
