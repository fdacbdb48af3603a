"""JSON-schema grammars for constrained decoding (xgrammar), compiled without stalling anyone.

A request may bring any schema, and xgrammar's compile time is not bounded by the schema's
size: on the 2-core reference machine an enum of 8,000 sentences (430 KB) takes ~5 s, an
object of 2,000 optional properties (53 KB) ~43 s, and a 50-byte schema whose `pattern` is
`[a-z0-9]{1,10000}` ~38 s. A compile is C++ code that no thread can interrupt, so:

* Size. `check_schema` refuses schemas over `MAX_SCHEMA_BYTES` of compact JSON or with
  more than `MAX_SCHEMA_VALUES` enum/const values, in one line naming the limit (the
  gateway calls it before the engine sees the request; the engine calls it again).
* Time. Every schema not yet compiled is first compiled in a probe process, which is killed
  when it runs past `timeout_s` (the caller gets a ValueError naming the limit), when every
  caller waiting for it has gone (a client hung up), or when the engine closes. Only a schema
  whose probe finished is compiled in this process, where it takes about as long again (a
  compiled grammar does not travel back: xgrammar's `serialize_json` of 32 tool schemas is
  400 MB and takes 30 s, for a grammar that compiles in 0.15 s).
* Nobody waits behind a compile. Compiles run on this module's own threads (at most
  `workers` at a time), never on the event loop's default executor that chat templating
  uses; the lock guards only the cache's bookkeeping, so requests with a schema compiled
  before, and requests without one, are served while compiles run. Callers of one schema
  share one compile.

An engine that compiles grammars itself (vLLM) takes `text=True`: its callers get the EBNF
text of a schema whose probe finished (`json_schema_grammar`), which its own compiler then
compiles in about the probe's time; nothing is compiled in this process.

Probe processes start on first need (importing xgrammar imports torch: a few seconds) and
are kept for the next schema; one is killed only with the compile it runs.

Every output a grammar admits is JSON that strict `json.loads` accepts (`json_schema_grammar`):
xgrammar (0.2.9 and before, mlc-ai/xgrammar#800) writes a string with minLength/maxLength, which
the gateway gives every free string, as a run of any character but quote, backslash and line
breaks, raw tabs and other control characters included; that rule is rewritten without them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import importlib
import json
import logging
import os
import re
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["MAX_SCHEMA_BYTES", "MAX_SCHEMA_VALUES", "COMPILE_TIMEOUT_S", "SchemaRefused", "check_schema", "schema_key",
           "json_schema_grammar", "tokenizer_info", "SchemaGrammars"]

log = logging.getLogger(__name__)


class SchemaRefused(ValueError):
    """A request's JSON schema is refused (too large, a control character named, past the compile
    deadline, rejected by xgrammar): that request fails (400), never the engine that answers it,
    wherever it was raised (a replica's error carries it: `replicas/engine.py`)."""

# Compact JSON bytes of one schema (after the gateway's maxLength/maxItems bounds). Real
# schemas stay far below: 128 forced-tool schemas of five arguments are 50 KB and compile
# in 0.8 s; an OpenAI tool schema is typically under 2 KB.
MAX_SCHEMA_BYTES = 64 * 1024
# enum values plus const keywords in one schema (OpenAI's structured outputs allow 1,000
# enum values too). 1,000 values of 60 characters compile in ~0.5 s.
MAX_SCHEMA_VALUES = 1000
# Seconds one schema may compile (in the probe). Real schemas take milliseconds to ~1 s.
COMPILE_TIMEOUT_S = 10.0
# Seconds a probe process may take to start (it imports xgrammar, hence torch).
_STARTUP_TIMEOUT_S = 120.0
_HEADER = struct.Struct(">cI")  # message kind, payload length
# xgrammar prints the rule for one character of a length-bounded string as `NAME ::= (([^\"\\\r\n]))`;
# matched as a whole line, which no literal or regex inside another rule can be. Its strict form keeps
# escapes out as before: a repetition of anything but one character class costs ~1 s per token mask
# here (0.01 ms for a class), and a `pattern` doing the same ~45 ms.
_LOOSE_CHARACTER = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_STRICT_CHARACTER = r' ::= (([^\0-\x1f\"\\]))'
# Regex parser of the standard library, to find the control characters a `pattern` names.
_sre: Any = importlib.import_module("re._parser")


def schema_key(schema: dict[str, Any]) -> str:
    """The schema's cache key, which is also the JSON handed to xgrammar. Keys keep their order:
    xgrammar writes properties in the schema's order (a forced call's name before its arguments,
    an app's reasoning before its answer)."""
    return json.dumps(schema)


def json_schema_grammar(key: str) -> str:
    """The EBNF grammar (xgrammar's, no free-form whitespace) of a JSON schema given as JSON text,
    whose every output strict `json.loads` accepts: no raw character U+0000-U+001F in a string."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(key, any_whitespace=False))
    return _LOOSE_CHARACTER.sub(lambda m: m.group(1) + _STRICT_CHARACTER, ebnf)


def tokenizer_info(tokenizer: Any, vocab_size: int | None) -> Any:
    """xgrammar's view of a Hugging Face tokenizer as vLLM's xgrammar backend builds it (`backend_xgrammar.py`;
    `vocab_size`: the model's, vLLM's `ModelConfig.get_vocab_size()`), so that a probe times the compile vLLM does."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size or None)


def _names_control(pattern: str) -> bool:
    """Whether a regex names a character U+0000-U+001F (`\\t`, `\\x01`, `[\\0-\\x1f]`). Inside a
    JSON string xgrammar leaves those out of `.`, `\\s` and negated classes, but writes a named one
    raw, where strict JSON wants it escaped. A pattern Python cannot parse is left to xgrammar."""
    try:
        stack = [_sre.parse(pattern)]
    except (re.error, RecursionError, OverflowError):
        return False
    while stack:
        for op, av in stack.pop():
            if op is _sre.LITERAL and av < 0x20:
                return True
            if op is _sre.IN:
                items = [(o, a) for o, a in av if o is not _sre.NEGATE]
                if len(items) == len(av) and any(o is _sre.LITERAL and a < 0x20 or o is _sre.RANGE and a[0] < 0x20
                                                 for o, a in items):
                    return True
                continue
            for part in av if isinstance(av, (tuple, list)) else (av,):  # groups, repeats, branches
                if isinstance(part, _sre.SubPattern):
                    stack.append(part)
                elif isinstance(part, list):
                    stack.extend(q for q in part if isinstance(q, _sre.SubPattern))
    return False


def check_schema(schema: Any, *, max_bytes: int = MAX_SCHEMA_BYTES, max_values: int = MAX_SCHEMA_VALUES) -> None:
    """Raise ValueError (one line, naming the limit) for a schema too large to compile, or with a
    `pattern` that names a control character (no grammar can write that JSON, see `_names_control`).

    Walks the schema iteratively and stops at the first limit it passes, so a hostile 4 MB
    schema costs no more than a legal one. Sizes are compact-JSON bytes, escapes aside.
    """
    size = values = 0
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            size += 1
            for k, v in item.items():
                size += len(k) + 4  # quotes, colon, comma
                if k == "enum" and isinstance(v, list):
                    values += len(v)
                elif k == "const":
                    values += 1
                elif k == "pattern" and isinstance(v, str) and len(v) <= max_bytes and _names_control(v):
                    raise SchemaRefused(f"json_schema pattern {json.dumps(v)} names a control character (U+0000-U+001F), "
                                     "which a JSON string carries only escaped and the grammar cannot escape; leave it out")
                if values > max_values:
                    raise SchemaRefused(f"json_schema has over the limit of {max_values} enum/const values; "
                                     "use fewer values or a free-form string")
                if size > max_bytes:
                    break
                stack.append(v)
        elif isinstance(item, list):
            size += 1 + len(item)
            stack.extend(item)
        elif isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, int) and not isinstance(item, bool):
            size += item.bit_length() * 3 // 10 + 1
        else:
            size += 5  # floats, true/false/null
        if size > max_bytes:
            raise SchemaRefused(f"json_schema is over the limit of {max_bytes} bytes (compact JSON); send a smaller schema")


@dataclass(eq=False)
class _Job:
    """One schema being compiled for every caller waiting on it."""

    key: str
    future: concurrent.futures.Future
    waiters: int = 1
    probe: "_Probe | None" = None  # the process probing it, while it does
    abandoned: bool = False


class _Gone(Exception):
    """The probe process ended (killed, or crashed)."""


class _Probe:
    """A child process that compiles schemas on request and says how it went.

    Only the thread that reads its replies closes its pipes (`close`); any thread may `kill`
    it, which that reader then sees as the end of the pipe."""

    def __init__(self) -> None:
        # run as `python -m` from the folder that holds this package: the child loads this very
        # module, whatever another mas_trainer on its path or in the server's directory would be
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid())], cwd=root,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)  # no terminal signals: its parent decides when it ends
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        self._poll = select.poll()  # not select(): descriptors past 1023 are common in a busy server
        self._poll.register(self._out, select.POLLIN)

    def start(self, init: bytes) -> None:
        """Send the tokenizer and wait until the child is ready (raises _Gone, TimeoutError)."""
        self._send(b"I", init)
        kind, _ = self._reply(time.monotonic() + _STARTUP_TIMEOUT_S)
        if kind != b"R":
            raise _Gone

    def compile(self, key: str, timeout_s: float) -> tuple[bytes, bytes]:
        """Compile one schema: (b"O", b"") or (b"E", error); raises _Gone, TimeoutError."""
        self._send(b"S", key.encode())
        return self._reply(time.monotonic() + timeout_s)

    def _send(self, kind: bytes, payload: bytes) -> None:
        try:
            _write_all(self._in, _HEADER.pack(kind, len(payload)) + payload)
        except OSError:  # BrokenPipeError: it was killed or crashed
            raise _Gone from None

    def _reply(self, deadline: float) -> tuple[bytes, bytes]:
        kind, n = _HEADER.unpack(self._read(_HEADER.size, deadline))
        return kind, self._read(n, deadline)

    def _read(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(left * 1000):
                raise TimeoutError
            try:
                chunk = os.read(self._out, n - len(buf))
            except OSError:
                chunk = b""
            if not chunk:
                raise _Gone
            buf += chunk
        return bytes(buf)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Kill and reap it (from any thread)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Kill it and close its pipes (its reader only)."""
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()  # type: ignore[union-attr]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _resolve(job: _Job, result: Any = None, exc: BaseException | None = None) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # closed or abandoned meanwhile
        if exc is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(exc)


class SchemaGrammars:
    """Compiled grammars by schema: a bounded cache, probes in child processes, compiles on
    threads of its own (see the module docstring)."""

    def __init__(self, tokenizer_info: Callable[[], Any], *, max_grammars: int = 64, timeout_s: float = COMPILE_TIMEOUT_S,
                 workers: int = 2, compiler_threads: int = 2, text: bool = False) -> None:
        """`tokenizer_info` builds the xgrammar TokenizerInfo (called once, on first need); `text`:
        callers get the grammar's EBNF text, probed, instead of a compiled grammar."""
        self.max_grammars = max_grammars
        self.text = text
        self.timeout_s = timeout_s
        self.workers = workers
        self.compiler_threads = compiler_threads
        self.compiles = 0  # schemas compiled in this process (each after its probe)
        self._make_info = tokenizer_info
        self._lock = threading.Lock()  # bookkeeping only: never held while compiling
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()  # least recently used first
        self._jobs: dict[str, _Job] = {}  # by key: compiling, or waiting for a runner
        self._queue: collections.deque[_Job] = collections.deque()
        self._idle: list[_Probe] = []
        self._probes: set[_Probe] = set()  # every probe alive, idle or busy
        self._runners: set[threading.Thread] = set()
        self._closed = False
        self._setup_lock = threading.Lock()
        self._compiler: Any = None
        self._init: bytes | None = None

    def __len__(self) -> int:
        return len(self._cache)

    def probes(self) -> int:
        """Probe processes alive now."""
        with self._lock:
            return sum(p.alive() for p in self._probes)

    def compiling(self) -> int:
        """Schemas being compiled or waiting to be."""
        with self._lock:
            return len(self._jobs)

    # ------------------------------------------------------------------ callers

    async def compile(self, schema: dict[str, Any]) -> Any:
        """The compiled grammar; cancelling the await drops this caller (the compile is killed
        when nobody else waits for it)."""
        found, job = self._enter(schema)
        if job is None:
            return found
        try:
            # the job's future is running: cancelling this await cannot cancel it for others
            return await asyncio.wrap_future(job.future)
        finally:
            self._leave(job)

    def compile_sync(self, schema: dict[str, Any]) -> Any:
        """Blocking `compile`, for threads without an event loop."""
        found, job = self._enter(schema)
        if job is None:
            return found
        try:
            return job.future.result()
        finally:
            self._leave(job)

    def close(self) -> None:
        """Kill every probe; callers still waiting get RuntimeError. Returns promptly: a compile
        already running in this process (it follows a probe that finished within the deadline,
        so it is as short) ends on its own and its grammar is dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._queue.clear()
            idle, self._idle = self._idle, []
            busy = [p for p in self._probes if p not in idle]
            self._probes.clear()
            runners = list(self._runners)
        for probe in idle:
            probe.close()
        for probe in busy:
            probe.kill()  # its runner reads the end of the pipe, and closes it
        for job in jobs:
            _resolve(job, exc=RuntimeError("the engine is closed"))
        deadline = time.monotonic() + 2
        for t in runners:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))  # a runner reading a killed probe ends at once

    def _enter(self, schema: dict[str, Any]) -> tuple[Any, _Job | None]:
        check_schema(schema)
        key = schema_key(schema)
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found, None
            job = self._jobs.get(key)
            if job is not None:
                job.waiters += 1
                return None, job
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_running_or_notify_cancel()
            job = self._jobs[key] = _Job(key, future)
            self._queue.append(job)
            if len(self._runners) < self.workers:
                runner = threading.Thread(target=self._run, name="grammar-compile", daemon=True)
                self._runners.add(runner)
                runner.start()
        return None, job

    def _leave(self, job: _Job) -> None:
        with self._lock:
            job.waiters -= 1
            if job.waiters or job.future.done():
                return
            job.abandoned = True  # nobody waits for it any more: stop compiling it
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            probe, job.probe = job.probe, None
            if probe is not None:
                self._probes.discard(probe)
        _resolve(job, exc=RuntimeError("abandoned by its callers"))
        if probe is not None:
            log.info("json_schema compile abandoned by its callers: its probe is killed")
            probe.kill()  # its runner reads the end of the pipe, and closes it

    # ------------------------------------------------------------------ runner threads

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                while self._queue and self._queue[0].abandoned:
                    self._queue.popleft()
                if self._closed or not self._queue:
                    self._runners.discard(me)
                    return
                job = self._queue.popleft()
            try:
                self._compile(job)
            except Exception as exc:  # noqa: BLE001 - whatever happened, its callers hear of it
                _resolve(job, exc=exc)
            finally:
                with self._lock:
                    if self._jobs.get(job.key) is job:
                        del self._jobs[job.key]

    def _setup(self) -> bytes:
        """This process's compiler and the probes' start message (once)."""
        with self._setup_lock:
            if self._init is None:
                import xgrammar as xgr

                info = self._make_info()
                if not self.text:
                    # xgrammar's own cache stays off: this class bounds what is kept (that cache had no
                    # bound), and with it on an 8,000-value enum compiled in 19 s instead of 3 s
                    self._compiler = xgr.GrammarCompiler(info, max_threads=self.compiler_threads, cache_enabled=False)
                self._init = f"{self.compiler_threads}\n".encode() + info.serialize_json().encode()
            return self._init

    def _take_probe(self) -> _Probe:
        init = self._setup()
        with self._lock:
            while self._idle:
                probe = self._idle.pop()
                if probe.alive():
                    return probe
                self._probes.discard(probe)
                probe.close()  # it died idle
        probe = _Probe()
        with self._lock:
            closed = self._closed
            if not closed:
                self._probes.add(probe)
        try:
            if closed:
                raise _Gone
            probe.start(init)
        except (_Gone, TimeoutError):
            self._discard(probe)
            if self._closed:
                raise RuntimeError("the engine is closed") from None
            raise RuntimeError("the grammar compiler process did not start") from None
        return probe

    def _discard(self, probe: _Probe) -> None:
        with self._lock:
            self._probes.discard(probe)
        probe.close()

    def _release(self, probe: _Probe) -> None:
        """Keep a probe that finished a compile for the next one."""
        with self._lock:
            if not self._closed and probe in self._probes:
                self._idle.append(probe)
                return
        probe.close()

    def _compile(self, job: _Job) -> None:
        probe = self._take_probe()
        with self._lock:
            go = not job.abandoned and not self._closed
            if go:
                job.probe = probe
        if not go:
            self._release(probe)
            return
        start = time.monotonic()
        try:
            kind, error = probe.compile(job.key, self.timeout_s)
        except TimeoutError:
            self._discard(probe)
            log.warning("json_schema compile ran past %g s: its probe was killed", self.timeout_s)
            raise SchemaRefused(f"json_schema took over the limit of {self.timeout_s:g} s to compile; "
                             "simplify the schema") from None
        except _Gone:
            self._discard(probe)
            if job.abandoned or self._closed:
                return  # killed on purpose; its callers were answered
            raise SchemaRefused(f"json_schema crashed the grammar compiler (exit code {probe.proc.returncode})") from None
        finally:
            with self._lock:
                job.probe = None
        self._release(probe)
        if kind != b"O":
            raise SchemaRefused(f"invalid json_schema: {error.decode(errors='replace').strip()}")
        log.debug("json_schema probed in %.3f s", time.monotonic() - start)
        if job.abandoned or self._closed:
            return  # nobody to compile it for
        # It compiled within the deadline in the probe, so it takes about as long here (or in the engine).
        try:
            grammar = json_schema_grammar(job.key) if self.text else self._compiler.compile_grammar(json_schema_grammar(job.key))
        except Exception as err:  # noqa: BLE001 - as in the probe; not expected once it compiled there
            raise SchemaRefused(f"invalid json_schema: {err}") from None
        with self._lock:
            self.compiles += 1
            if not self._closed:
                self._cache[job.key] = grammar
                while len(self._cache) > self.max_grammars:
                    self._cache.popitem(last=False)  # rows already holding it keep their matcher
        _resolve(job, grammar)


# ---------------------------------------------------------------------- the probe process

def _probe_main(parent: int) -> None:
    """Compile the schemas the parent sends; answer b"O" (compiled) or b"E" + the error."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.dup(1)
    os.dup2(2, 1)  # stray prints from imported libraries must not corrupt the replies

    def orphaned() -> None:  # the parent died (SIGKILL too): go, even mid-compile
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()

    def read(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = os.read(0, n - len(buf))
            if not chunk:
                os._exit(0)  # the parent closed the pipe
            buf += chunk
        return bytes(buf)

    def message() -> tuple[bytes, bytes]:
        kind, n = _HEADER.unpack(read(_HEADER.size))
        return kind, read(n)

    def reply(kind: bytes, payload: bytes = b"") -> None:
        _write_all(out, _HEADER.pack(kind, len(payload)) + payload)

    _, init = message()
    threads, _, info_json = init.partition(b"\n")
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(info_json.decode())
    compiler = xgr.GrammarCompiler(info, max_threads=int(threads), cache_enabled=False)
    reply(b"R")
    while True:
        _, key = message()
        try:
            compiler.compile_grammar(json_schema_grammar(key.decode()))
        except Exception as err:  # noqa: BLE001 - xgrammar raises RuntimeError for bad schemas
            reply(b"E", str(err).encode(errors="replace"))
        else:
            reply(b"O")


if __name__ == "__main__":  # the probe process (_Probe): its parent's pid is the argument
    _probe_main(int(sys.argv[1]))
