"""Run a candidate function against a task's tests, so that the candidate cannot forge its score.

The candidate is code written by the policy being trained, so it is scored by a channel it
cannot reach. Two child processes take part in every run:

- the **sandbox** runs the candidate: it execs the task's ``prompt`` (signature, docstring,
  helpers), then the candidate code, and from then on only answers calls: "call ``add`` with
  these arguments" -> "it returned this value" / "it raised this". Arguments and return values
  cross as plain data (None, bool, int, float, complex, str, bytes, list, tuple, dict, set),
  encoded as JSON; anything else (an object with a rigged ``__eq__``, a generator, a class
  instance) is refused and the call fails. The sandbox never sees the tests.
- the **judge** runs the tests: it execs the ``prompt`` and ``setup`` (trusted task text) and
  each test snippet, with the candidate's functions bound to stand-ins that forward each call
  to the sandbox and rebuild the answer from plain data. Every comparison, ``assert`` and
  exception handler runs in the judge, and the judge alone writes the verdict, one JSON line
  per test, on a pipe that only this process reads.

So whatever the candidate does to its own process (patch ``__main__``, builtins,
``AssertionError``, ``json``; write result lines to its output or to files; exit early) only
changes what its functions return, which is exactly what the tests judge. Anything malformed
or missing counts as a failure: a reply that is not well-formed JSON of the right shape breaks
the channel, a sandbox that exits or closes its channel fails the tests still to come, and a
test without a verdict line failed.

The sandbox runs under the strongest isolation that works here (probed once, see
``default_isolation``):

``bwrap``    bubblewrap (Debian package ``bubblewrap``): new user, pid, network, IPC, UTS and
             cgroup namespaces, all capabilities dropped, the file system read-only except
             its own scratch folder (``/tmp``: a tmpfs of at most ``SCRATCH_LIMIT`` bytes,
             gone with the namespace) and a ``/dev/shm`` of at most ``FILE_SIZE_LIMIT``
             bytes, a fresh ``/proc``, a fresh read-only ``/dev`` and an empty read-only
             ``/run``, a new session; it dies with the thread that started it. A bubblewrap
             without ``--size`` (before 0.7.0, or setuid) binds a folder of this machine's
             temporary folder at ``/tmp`` instead, bounded only by the time limit, and leaves
             ``/dev/shm`` read-only with the rest of ``/dev``.
``unshare``  util-linux ``unshare``: new user, pid, mount (fresh ``/proc``), network, IPC and
             UTS namespaces, but the file system is as writable as for this user.
``none``     a plain child process in its own session (logged as a warning).

With a pid namespace the candidate cannot see or signal this process or the judge, cannot
read their ``/proc/<pid>/environ``, and killing the namespace's first process makes the
kernel kill everything the candidate started (``setsid`` and double forks included). In every
mode the run is bounded: a wall-clock limit for the whole run, an address-space limit and a
file-size limit (``resource`` limits set in the sandbox before the candidate runs), empty
standard input, and at most ``output_cap`` characters kept of what the candidate printed.

Not contained in any mode: reading the file system (whatever this user can read, the task
files included), CPU use within the time limit, and the number of files in the scratch folder
(within the time limit). ``unshare`` and ``none`` (and a bubblewrap without ``--size``) add
disk use: their scratch folder is a folder of this machine's temporary folder, each file at
most 4 MiB but their total bounded only by the time limit (what exceeded ``SCRATCH_LIMIT`` is
logged as a warning). ``unshare`` adds file-system writes (as root that includes the Python
files the judge imports, so only ``bwrap`` keeps the verdict out of reach across runs);
``none`` adds signals, ``/proc`` of this user's processes, ptrace of the judge, network and
leftover processes. Run untrusted models' code with bubblewrap installed, or in a throw-away VM.

Whatever the candidate leaves in its scratch folder (folders nested thousands deep, folders
and files it locked with ``chmod``, symlinks out of the folder, many files) is removed after
every run by ``_remove_scratch``: without recursion, holding one folder open at a time, never
through a symlink and never into another file system; a problem there is logged, never raised,
so ``run_tests`` still returns the candidate's verdict.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["ISOLATIONS", "SandboxResult", "TestOutcome", "default_isolation", "probe", "read_records", "run_tests"]

log = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 5.0
DEFAULT_MEMORY_LIMIT_MB = 1024
DEFAULT_OUTPUT_CAP = 4000  # characters of captured output / error text kept
FILE_SIZE_LIMIT = 4 * 1024 * 1024  # bytes, for any one file the candidate writes (its output included)
SCRATCH_LIMIT = 64 * 1024 * 1024  # bytes, all the files in the scratch folder together (bwrap; others: logged)
MAX_REPLY = 4 * 1024 * 1024  # bytes of one encoded return value
ISOLATIONS = ("bwrap", "unshare", "none")  # strongest first

# Both children: plain data <-> JSON. decode() builds only built-in containers and scalars,
# so nothing the sandbox sends can run code (or compare equal to everything) in the judge.
_CODEC = r'''
import json as _json
import sys as _sys

if hasattr(_sys, "set_int_max_str_digits"):
    _sys.set_int_max_str_digits(0)  # big integers are plain data too
_MAX_DEPTH = 100
_MAX_ITEMS = 1000000  # a huge value fails at once rather than at the time limit
_PLAIN = "plain data (None, bool, int, float, complex, str, bytes, list, tuple, dict, set)"


def encode(value, depth=0, budget=None):
    budget = budget if budget is not None else [_MAX_ITEMS]
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"the value has more than {_MAX_ITEMS} items")
    if depth > _MAX_DEPTH:
        raise ValueError("the value is nested too deeply")
    kind = type(value)  # exact types: a subclass could override __eq__
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(v, depth + 1, budget) for v in value]
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [encode(v, depth + 1, budget) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1, budget), encode(v, depth + 1, budget)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    raise TypeError(f"a {kind.__name__} is not {_PLAIN}")


def decode(data, depth=0):
    if depth > _MAX_DEPTH:
        raise ValueError("the value is nested too deeply")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is dict and len(data) == 1:
        (tag, body), = data.items()
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(*body)
        if type(body) is list:
            items = [decode(v, depth + 1) for v in body]
            if tag in ("tuple", "set", "frozenset"):
                return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
            if tag == "dict" and all(type(p) is list and len(p) == 2 for p in items):
                return {k: v for k, v in items}
    raise ValueError("malformed value")
'''

# The sandbox. stdin: requests from the judge; stdout: replies to the judge; stderr: the
# output file. Everything it holds is the candidate's to tamper with, and that is fine: all it
# can change is the values its functions return.
_SANDBOX = _CODEC + r'''
import io, os, signal, traceback, types


class Capped(io.TextIOBase):
    """print() output: the first cap + 1 characters go to the output file (the parent keeps
    cap of them and sees there was more), the rest is dropped, so printing never fails."""

    def __init__(self, stream, cap):
        self.stream, self.room = stream, cap + 1

    def write(self, s):
        if self.room > 0:
            self.stream.write(s[: self.room])
            self.room -= len(s[: self.room])
        return len(s)

    def flush(self):
        self.stream.flush()


def error_text(exc, code, cap):
    """The exception's last line plus the line of the candidate it happened on, if any."""
    msg = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:cap]
    if isinstance(exc, SyntaxError):
        return msg
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename == "<code>":
            lines = code.splitlines()
            text = lines[frame.lineno - 1].strip() if frame.lineno and frame.lineno <= len(lines) else ""
            return f"{msg} (line {frame.lineno} of the code: {text})"
    return msg


def set_limits(load):
    """Address space and file size, before any candidate code runs (best effort: not every OS has both)."""
    try:
        import resource
    except ImportError:
        return
    limits = [(resource.RLIMIT_FSIZE, load["fsize_bytes"])]
    if load["memory_bytes"]:
        limits.append((resource.RLIMIT_AS, load["memory_bytes"]))
    for which, value in limits:
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with an error


def main():
    # the channel moves to private fds: the candidate reads an empty stdin and prints to the output file
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)

    def reply(**message):
        replies.write(_json.dumps(message).encode() + b"\n")
        replies.flush()

    load = _json.loads(requests.readline())["load"]
    set_limits(load)
    code, entry, cap = load["code"], load["entry_point"], load["output_cap"]
    _sys.stdout = _sys.stderr = Capped(_sys.stdout, cap)
    ns = {"__name__": "candidate", "__builtins__": __builtins__}
    try:
        exec(compile(load["prompt"], "<prompt>", "exec"), ns)
    except BaseException:
        pass  # a prompt that is only a signature is fine either way; the candidate must define it
    stub = ns.get(entry)
    try:
        exec(compile(code, "<code>", "exec"), ns)
    except BaseException as exc:
        return reply(id=1, load_error=error_text(exc, code, cap))
    fn = ns.get(entry)
    if fn is None or fn is stub or not callable(fn):
        return reply(id=1, load_error=f"the code does not define a function named {entry!r}")
    functions = {name: obj for name, obj in ns.items() if isinstance(obj, types.FunctionType)}
    functions[entry] = fn
    reply(id=1, functions=sorted(functions))
    for line in requests:
        request = _json.loads(line)
        reply(id=request["id"], **answer(functions, request, code, cap))


def answer(functions, request, code, cap):
    """One call of a candidate function: the value it returned as plain data, or what it raised."""
    name = request["fn"]
    try:
        value = functions[name](*decode(request["args"]), **decode(request["kwargs"]))
    except SystemExit:
        return {"raised": "SystemExit", "error": "SystemExit: the code called exit()"}
    except BaseException as exc:
        return {"raised": type(exc).__name__, "error": error_text(exc, code, cap)}
    try:
        return {"value": encode(value)}
    except (TypeError, ValueError, RecursionError) as exc:
        return {"raised": "TypeError", "error": f"TypeError: {name} returned a value the tests cannot check: {exc}"}


main()
'''

# The judge. stdin: the spec (once); stdout: the verdict, one JSON line per record; argv: the
# fds of its pipes to and from the sandbox. It never runs candidate code.
_JUDGE = _CODEC + r'''
import ast, builtins, os, traceback

MAX_REPLY = int(_sys.argv[3])
# these never come back as themselves: a StopIteration would end the test's `map`/`all` early
# (a pass), and the exits must not be caught by a test's `except Exception`
_NOT_REBUILT = {"StopIteration", "StopAsyncIteration"}
_EXITS = {"SystemExit", "KeyboardInterrupt", "GeneratorExit"}


class SandboxGone(BaseException):
    """The sandbox ended, or closed its end of the channel, before answering."""


class BadReply(BaseException):
    """The sandbox answered with something that is not a well-formed reply."""


class CandidateError(Exception):
    """The candidate raised an exception that has no built-in equivalent."""


class CandidateExit(BaseException):
    """The candidate called exit() (or raised another exit): not catchable as an Exception."""


class Channel:
    def __init__(self, to_fd, from_fd):
        self.out = os.fdopen(to_fd, "wb")
        self.into = os.fdopen(from_fd, "rb")
        self.last_id = 0
        self.gone = False
        self.broken = None  # why the channel can no longer be trusted to be in step

    def ask(self, **message):
        if self.gone:
            raise SandboxGone()
        if self.broken:
            raise BadReply(self.broken)
        self.last_id += 1
        message["id"] = self.last_id
        try:
            self.out.write(_json.dumps(message).encode() + b"\n")
            self.out.flush()
            line = self.into.readline(MAX_REPLY + 1)
        except OSError:
            line = b""
        if len(line) > MAX_REPLY:
            self.broken = f"the candidate sent a reply larger than {MAX_REPLY} bytes"
            raise BadReply(self.broken)
        if not line.endswith(b"\n"):
            self.gone = True
            raise SandboxGone()
        try:
            reply = _json.loads(line)
        except (ValueError, RecursionError):
            reply = None
        if type(reply) is not dict or reply.get("id") != self.last_id:
            self.broken = "the candidate's process sent a malformed reply"
            raise BadReply(self.broken)
        return reply

    def call(self, name, args, kwargs):
        try:
            request = {"fn": name, "args": encode(list(args)), "kwargs": encode(dict(kwargs))}
        except (TypeError, ValueError, RecursionError) as exc:
            raise TypeError(f"{name}() was given an argument that cannot be sent to the sandbox: {exc}") from None
        reply = self.ask(**request)
        if "value" in reply:
            try:
                return decode(reply["value"])
            except (TypeError, ValueError, RecursionError):
                pass
        elif "raised" in reply:
            raise rebuilt(reply)
        self.broken = "the candidate's process sent a malformed reply"
        raise BadReply(self.broken)

    def function(self, name):
        def stand_in(*args, **kwargs):
            return self.call(name, args, kwargs)
        stand_in.__name__ = stand_in.__qualname__ = name
        return stand_in


def rebuilt(reply):
    """The candidate's exception as the test should see it: the built-in class of that name
    when there is one (so `except ValueError` in a test works), else CandidateError."""
    name, text = reply.get("raised"), str(reply.get("error"))[:CAP]
    if name in _EXITS:
        exc = CandidateExit(text)
    else:
        exc = None
        cls = getattr(builtins, name, None) if isinstance(name, str) and name not in _NOT_REBUILT else None
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                exc = cls(text)
            except Exception:
                exc = None
        exc = exc if exc is not None else CandidateError(text)
    exc.sandbox_error = text
    return exc


def short_error(exc):
    text = getattr(exc, "sandbox_error", None) or "".join(traceback.format_exception_only(type(exc), exc))
    return text.strip()[:CAP]


def got_value(test, ns):
    """For `assert X == Y`, what X evaluated to (a hint for whoever fixes the code)."""
    try:
        node = ast.parse(test).body[-1]
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1 \
                and isinstance(node.test.ops[0], ast.Eq):
            return repr(eval(compile(ast.Expression(node.test.left), "<test>", "eval"), ns))[:200]
    except BaseException:
        return None
    return None


def bind_functions(ns, names, entry, channel):
    """Stand-ins for the candidate's functions, under names the prompt, setup and builtins do not use."""
    for name in names[:1000] if isinstance(names, list) else []:
        if isinstance(name, str) and name.isidentifier() and not name.startswith("__") \
                and name not in ns and not hasattr(builtins, name):
            ns[name] = channel.function(name)
    ns[entry] = ns["candidate"] = channel.function(entry)


def main():
    global CAP
    spec = _json.load(_sys.stdin)
    CAP = spec["output_cap"]
    records = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # what the tests print must not mix with the verdict
    os.close(null)

    def emit(**record):
        records.write(_json.dumps(record) + "\n")
        records.flush()

    channel = Channel(int(_sys.argv[1]), int(_sys.argv[2]))
    entry = spec["entry_point"]
    load = {k: spec[k] for k in ("code", "prompt", "entry_point", "output_cap", "memory_bytes", "fsize_bytes")}
    try:
        loaded = channel.ask(load=load)
    except SandboxGone:
        return emit(kind="gone")
    except BadReply as exc:
        return emit(kind="load", ok=False, error=str(exc))
    if "load_error" in loaded:
        return emit(kind="load", ok=False, error=str(loaded["load_error"])[:CAP])

    ns = {"__name__": "tests", "__builtins__": builtins}
    try:
        exec(compile(spec["prompt"], "<prompt>", "exec"), ns)
    except BaseException:
        pass
    bind_functions(ns, loaded.get("functions"), entry, channel)
    try:
        exec(compile(spec["setup"], "<setup>", "exec"), ns)
    except BaseException as exc:
        return emit(kind="load", ok=False, error="test setup failed: " + short_error(exc))
    emit(kind="load", ok=True)

    for i, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, f"<test {i}>", "exec"), ns)
            failure = None
        except BaseException as exc:
            failure = exc
        # a test that swallowed the sandbox's death or a malformed reply still fails
        if channel.gone:
            emit(kind="test", index=i, ok=False, error="the candidate's process ended during this test")
            return emit(kind="gone")
        if channel.broken:
            emit(kind="test", index=i, ok=False, error=channel.broken)
        elif failure is None:
            emit(kind="test", index=i, ok=True)
        else:
            got = got_value(test, ns) if isinstance(failure, AssertionError) else None
            emit(kind="test", index=i, ok=False, error=short_error(failure), got=got)
    emit(kind="done")


CAP = 4000
main()
'''


@dataclass
class TestOutcome:
    test: str
    passed: bool
    error: str | None = None
    got: str | None = None  # repr of the left side of a failing `assert X == Y`


@dataclass
class SandboxResult:
    passed: int
    total: int
    error: str | None = None  # the first failure, in words (None when all passed)
    timed_out: bool = False
    output: str = ""  # what the candidate printed (capped)
    duration_s: float = 0.0
    tests: list[TestOutcome] = field(default_factory=list)
    isolation: str = ""  # which of ISOLATIONS ran the candidate

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def feedback(self, max_failures: int = 3) -> str:
        """A short report for the reflector: counts, then the first failures."""
        lines = [f"{self.passed}/{self.total} tests passed."]
        if self.timed_out:
            lines.append(self.error or "Time limit exceeded.")
        elif self.error and not any(not t.passed and t.error for t in self.tests):
            lines.append(self.error)
        shown = 0
        for t in self.tests:
            if t.passed or shown >= max_failures:
                continue
            shown += 1
            detail = f"FAILED: {t.test.strip()}"
            if t.got is not None:
                detail += f"  (got {t.got})"
            if t.error and not t.error.startswith("AssertionError"):
                detail += f"  -> {t.error}"
            lines.append(detail)
        if self.output.strip():
            lines.append("Printed output:\n" + self.output.strip()[:500])
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "total": self.total,
            "fraction": self.fraction,
            "all_passed": self.all_passed,
            "timed_out": self.timed_out,
            "error": self.error,
            "duration_s": round(self.duration_s, 3),
        }


# ---------------------------------------------------------------- isolation

# the children get nothing from this process's environment but these
_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}

# inside a new pid namespace the first processes have the smallest pids
_PROBE = "import os, sys; sys.exit(0 if os.getpid() < 10 else 3)"


def _bwrap(workdir: str, sized: bool) -> list[str]:
    """bubblewrap's command prefix; ``sized``: the writable folders are size-limited tmpfs mounts."""
    if sized:  # memory that goes with the namespace, bounded by the kernel: nothing to fill or clean up
        shm = ["--size", str(FILE_SIZE_LIMIT), "--tmpfs", "/dev/shm"]
        scratch = ["--size", str(SCRATCH_LIMIT), "--tmpfs", "/tmp"]
    else:  # no --size: /dev/shm read-only with the rest of /dev, the scratch folder a folder of this machine
        shm, scratch = [], ["--bind", workdir, "/tmp"]
    return [
        "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
        "--ro-bind", "/", "/", "--dev", "/dev", *shm, "--remount-ro", "/dev", "--proc", "/proc",
        "--tmpfs", "/run", "--remount-ro", "/run",  # hides the sockets of services running here
        *scratch, "--chdir", "/tmp", "--",
    ]


def _launcher(kind: str, workdir: str) -> list[str]:
    """The command prefix that starts the sandbox under ``kind`` isolation."""
    if kind == "bwrap":
        return _bwrap(workdir, _sized_tmpfs())
    if kind == "unshare":
        return [
            "unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount-proc",
            "--net", "--ipc", "--uts", "--",
        ]
    if kind == "none":
        return []
    raise ValueError(f"unknown isolation {kind!r}; expected one of {', '.join(ISOLATIONS)}")


def probe(kind: str) -> str | None:
    """None when ``kind`` isolation can run this interpreter here, else why not (one line)."""
    if kind == "none":
        return None
    tool = _launcher(kind, "/")[0]
    if shutil.which(tool) is None:
        return f"{tool} is not installed"
    return _try_launcher(tool, lambda tmp: _launcher(kind, tmp))


def _try_launcher(tool: str, launcher) -> str | None:
    """None when ``launcher(scratch folder)`` runs this interpreter in a new pid namespace, else why not."""
    with tempfile.TemporaryDirectory(prefix="code_gen_probe_") as tmp:
        try:
            proc = subprocess.run(
                launcher(tmp) + [sys.executable, "-I", "-c", _PROBE],
                cwd=tmp, env=_ENV, stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{tool} failed to start: {exc}"
    if proc.returncode == 0:
        return None
    lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    return f"{tool} failed: " + (lines[-1] if lines else f"exit status {proc.returncode}")


@functools.lru_cache(maxsize=None)
def _sized_tmpfs() -> bool:
    """Whether bubblewrap can mount size-limited tmpfs here (``--size``: 0.7.0 and later, not setuid)."""
    if shutil.which("bwrap") is None:
        return False
    why = _try_launcher("bwrap", lambda tmp: _bwrap(tmp, sized=True))
    if why is not None:
        log.warning(
            "code_gen sandbox: bubblewrap cannot mount a size-limited tmpfs (%s); the scratch folder is a "
            "folder of %s, its size bounded only by the time limit (bubblewrap 0.7.0 or later bounds it)",
            why, tempfile.gettempdir(),
        )
    return why is None


@functools.lru_cache(maxsize=None)
def default_isolation() -> str:
    """The strongest of ``ISOLATIONS`` that works on this machine (probed once per process)."""
    reasons = []
    for kind in ISOLATIONS[:-1]:
        why = probe(kind)
        if why is None:
            log.info("code_gen sandbox: candidate code runs under %s", kind)
            if reasons:
                log.warning(
                    "code_gen sandbox: %s; using unshare namespaces: candidate code cannot signal or "
                    "see this process, but can write wherever this user can (install bubblewrap)",
                    "; ".join(reasons),
                )
            return kind
        reasons.append(why)
    log.warning(
        "code_gen sandbox: %s; candidate code runs as a plain child process of this user: it can "
        "signal this process, write files, use the network and leave processes behind "
        "(install bubblewrap)",
        "; ".join(reasons),
    )
    return "none"


# ---------------------------------------------------------------- processes

def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.kill()
    except OSError:
        pass


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def _stop_sandbox(proc: subprocess.Popen, kind: str) -> None:
    """Kill the sandbox and everything it started; return once they are gone."""
    inits: list[int] = []
    if kind != "none" and proc.poll() is None:
        # The launcher's child is the first process of the new pid namespace. Killing it makes
        # the kernel kill every process in the namespace (setsid and double forks included),
        # and that process finishes exiting only once they all have.
        inits = _children(proc.pid)
        for pid in inits:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
    # no namespace (or no /proc children list): the launcher's process group; with a namespace,
    # killing the launcher also kills the namespace (--die-with-parent / --kill-child)
    _kill_group(proc)
    proc.wait()
    # on a loaded machine the namespace can outlive the 2 s above: wait until its first process
    # has exited (gone or a zombie), which the kernel allows only after everything in it
    deadline = time.monotonic() + 30.0
    while any(_running(pid) for pid in inits) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _exit_status(proc: subprocess.Popen, kind: str) -> str:
    """How the sandbox ended, in words, waiting a moment for it to finish ending."""
    try:
        code = proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return "closed its channel"
    if code < 0:
        return f"was killed by signal {-code}"
    if kind == "bwrap" and code > 128:
        return f"was killed by signal {code - 128}"  # how bwrap reports a child's death by signal
    return f"exited with status {code}"


def _start(kind: str, workdir: str, output, max_reply: int) -> tuple[subprocess.Popen, subprocess.Popen]:
    """The sandbox and the judge, joined by two pipes that this process does not keep."""
    to_sandbox_r, to_sandbox_w = os.pipe()
    from_sandbox_r, from_sandbox_w = os.pipe()
    try:
        sandbox = subprocess.Popen(
            _launcher(kind, workdir) + [sys.executable, "-I", "-u", "-c", _SANDBOX],
            cwd=workdir, stdin=to_sandbox_r, stdout=from_sandbox_w, stderr=output,
            start_new_session=True, env=_ENV,
        )
        try:
            judge = subprocess.Popen(
                [sys.executable, "-I", "-c", _JUDGE, str(to_sandbox_w), str(from_sandbox_r), str(max_reply)],
                cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(to_sandbox_w, from_sandbox_r), start_new_session=True, env=_ENV,
            )
        except BaseException:
            _stop_sandbox(sandbox, kind)
            raise
    finally:
        for fd in (to_sandbox_r, to_sandbox_w, from_sandbox_r, from_sandbox_w):
            os.close(fd)
    return sandbox, judge


def _read_output(output, cap: int) -> tuple[str, str]:
    """What the candidate printed (the first ``cap`` bytes), and its last line (for crash reports)."""
    size = os.fstat(output.fileno()).st_size
    output.seek(0)
    head = output.read(cap).decode("utf-8", "replace")
    output.seek(max(0, size - 2000))
    tail = output.read().decode("utf-8", "replace").strip().splitlines()
    return head + ("\n...[output truncated]" if size > cap else ""), (tail[-1][:cap] if tail else "")


def read_records(raw: bytes) -> list[dict]:
    """The judge's verdict lines; anything that is not a JSON object is skipped."""
    records = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _text(value) -> str | None:
    return None if value is None else str(value)


# ---------------------------------------------------------------- the scratch folder

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LISTINGS = 3  # times one folder is listed while emptying it (more: a process still writing there)


def _make_scratch(parent: str | None = None) -> tuple[str, int]:
    """A new private folder for one run, and a descriptor of it (for the clean-up, wherever it goes)."""
    path = tempfile.mkdtemp(prefix="code_gen_", dir=parent)
    try:
        return path, os.open(path, _DIR_FLAGS)
    except BaseException:
        os.rmdir(path)
        raise


def _remove_scratch(path: str, fd: int) -> None:
    """Remove the scratch folder and everything the candidate left in it; closes ``fd``.

    Never raises and never recurses: a tree the candidate built to break the clean-up (nested
    thousands deep, locked with chmod, symlinks out) must not cost the run its verdict. What
    cannot be removed is logged.
    """
    problem = None
    try:
        removed, used, problem = _empty_folder(fd)
        if os.path.samestat(os.lstat(path), os.fstat(fd)):
            os.rmdir(path)
        else:  # the candidate renamed its folder (unshare, none); its content is gone all the same
            problem = problem or f"{path} is no longer the scratch folder"
        if used > SCRATCH_LIMIT:
            log.warning(
                "code_gen sandbox: the candidate left %d files and folders, %.1f MiB, in its scratch folder "
                "(over the %d MiB bound; removed)", removed, used / 2**20, SCRATCH_LIMIT // 2**20,
            )
    except Exception as exc:  # noqa: BLE001 - logged: the verdict does not depend on it
        problem = problem or f"{type(exc).__name__}: {exc}"
    finally:
        os.close(fd)
    if problem:
        log.warning("code_gen sandbox: could not remove all of the scratch folder %s: %s", path, problem)


class _Level:
    """One folder on the way down from the scratch folder: its name, identity, and names left to remove."""

    __slots__ = ("name", "ident", "names", "listings")

    def __init__(self, name: str, ident: tuple[int, int]):
        self.name, self.ident, self.names, self.listings = name, ident, [], 0


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _empty_folder(top: int) -> tuple[int, int, str | None]:
    """Remove everything inside the folder open at ``top`` (the folder itself stays).

    Depth first, with a list for a stack instead of recursion, and only one folder open at a
    time besides ``top``: the way back up is ``..``, checked to be the folder it came down
    from, so no depth runs out of stack or descriptors. Entries are looked at with lstat and
    folders opened with O_NOFOLLOW, so a symlink is removed, never followed; a folder on
    another file system (a mount point) is left alone; a folder the candidate locked (chmod
    000, 0500) is given back to its owner before it is emptied (files need no unlocking).

    Returns (entries removed, bytes they used, the first problem or None).
    """
    removed = used = 0
    problem = None
    top_st = os.fstat(top)
    _unlock(top, top_st)
    path = [_Level("", _ident(top_st))]  # from the scratch folder down to the folder being emptied
    fd = top
    try:
        while True:
            level = path[-1]
            if not level.names and level.listings < _LISTINGS:
                level.listings += 1
                level.names = os.listdir(fd)
            if not level.names:  # emptied (or still being written to by a leftover process): go up
                if len(path) == 1:
                    return removed, used, problem
                path.pop()
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                if _ident(os.fstat(parent)) != path[-1].ident:
                    os.close(parent)
                    return removed, used, problem or "a folder was moved while it was being removed"
                if fd != top:
                    os.close(fd)
                fd = parent
                try:
                    os.rmdir(level.name, dir_fd=fd)
                    removed += 1
                except OSError as exc:
                    problem = problem or f"{level.name}: {exc.strerror}"
                continue
            name = level.names.pop()
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=fd)
                    removed += 1
                    used += st.st_blocks * 512
                elif st.st_dev != top_st.st_dev:
                    problem = problem or f"{name}: a mount point, left alone"
                else:
                    child = _open_folder(name, fd, st)
                    if fd != top:
                        os.close(fd)
                    fd = child
                    path.append(_Level(name, _ident(st)))
                    used += st.st_blocks * 512
            except FileNotFoundError:
                pass
            except OSError as exc:
                problem = problem or f"{name}: {exc.strerror or exc}"
    finally:
        if fd != top:
            os.close(fd)


def _open_folder(name: str, parent: int, st: os.stat_result) -> int:
    """The folder ``name`` in ``parent`` (just lstat-ed as ``st``), opened and unlocked for emptying."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:  # locked (no read or search permission): give it back to its owner first
        if hasattr(os, "O_PATH"):
            path_fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            try:  # through the descriptor: the folder itself, even if a symlink took its name meanwhile
                os.chmod(f"/proc/self/fd/{path_fd}", 0o700)
            finally:
                os.close(path_fd)
        else:
            os.chmod(name, 0o700, dir_fd=parent, follow_symlinks=False)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        opened = os.fstat(fd)
        if _ident(opened) != _ident(st):
            raise OSError(f"{name} was replaced while it was being emptied")
        _unlock(fd, opened)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlock(fd: int, st: os.stat_result) -> None:
    """Let the owner list the folder and remove what it holds (read, write, search)."""
    if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
        os.fchmod(fd, 0o700)


# ---------------------------------------------------------------- the run

def run_tests(
    code: str,
    tests: list[str],
    *,
    entry_point: str,
    prompt: str = "",
    setup: str = "",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB,
    output_cap: int = DEFAULT_OUTPUT_CAP,
    isolation: str | None = None,
) -> SandboxResult:
    """Run ``code`` in a sandbox and ``tests`` in a judge process; never in this process.

    ``isolation`` is one of ``ISOLATIONS``; by default the strongest that works here.
    """
    tests = list(tests)
    kind = isolation or default_isolation()
    _launcher(kind, "/")  # an unknown kind fails here, before anything starts
    spec = json.dumps({
        "code": code, "tests": tests, "entry_point": entry_point, "prompt": prompt, "setup": setup,
        "output_cap": output_cap, "memory_bytes": (memory_limit_mb or 0) * 1024 * 1024,
        "fsize_bytes": FILE_SIZE_LIMIT,
    }).encode()
    start = time.monotonic()
    workdir, workdir_fd = _make_scratch()
    try:
        with tempfile.TemporaryFile() as output:
            sandbox, judge = _start(kind, workdir, output, MAX_REPLY)
            try:
                records, judge_error, timed_out, ended = _collect_verdict(judge, sandbox, kind, spec, time_limit_s)
            finally:
                _stop_sandbox(sandbox, kind)
                _kill_group(judge)
                judge.wait()
            printed, last_line = _read_output(output, output_cap)
    finally:
        _remove_scratch(workdir, workdir_fd)  # once nothing the candidate started is left to write there
    return _verdict(
        records, tests, timed_out=timed_out, time_limit_s=time_limit_s, ended=ended, last_line=last_line,
        judge_error=judge_error, output=printed, duration=time.monotonic() - start, isolation=kind,
    )


def _collect_verdict(judge: subprocess.Popen, sandbox: subprocess.Popen, kind: str, spec: bytes, time_limit_s: float):
    """Feed the judge its spec and collect its verdict lines, up to the time limit.

    Returns (records, the judge's last stderr line, timed out, how the sandbox ended if it ended early).
    """
    timed_out = False
    try:
        raw, err = judge.communicate(spec, timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(judge)
        raw, err = judge.communicate()  # keeps what the judge wrote before the limit
    records = read_records(raw)
    ended = _exit_status(sandbox, kind) if any(r.get("kind") == "gone" for r in records) else None
    err_lines = err.decode("utf-8", "replace").strip().splitlines()
    return records, (err_lines[-1] if err_lines else None), timed_out, ended


def _verdict(records: list[dict], tests: list[str], *, timed_out: bool, time_limit_s: float, ended: str | None,
             last_line: str, judge_error: str | None, output: str, duration: float, isolation: str) -> SandboxResult:
    """The result from the judge's records. Only a well-formed `ok: true` record passes a test."""
    outcomes = [TestOutcome(t, False) for t in tests]
    error: str | None = None
    finished = False
    reported = 0
    for rec in records:
        kind = rec.get("kind")
        if kind == "load" and rec.get("ok") is not True:
            error = _text(rec.get("error")) or "the code could not be loaded"
        elif kind == "test":
            index = rec.get("index")
            if type(index) is int and 0 <= index < len(outcomes):
                o = outcomes[index]
                o.passed, o.error, o.got = rec.get("ok") is True, _text(rec.get("error")), _text(rec.get("got"))
                reported = max(reported, index + 1)
        elif kind == "done":
            finished = True
    if timed_out:
        error = f"Time limit exceeded ({time_limit_s:g} s) after {reported} of {len(tests)} tests"
        if reported < len(tests):
            outcomes[reported].error = f"timed out (limit {time_limit_s:g} s)"
    elif ended is not None:
        # the candidate's process died (os._exit, a signal, the memory limit) or hung up
        error = f"the test process {ended} before finishing" + (f": {last_line}" if last_line else "")
    elif error is None and not finished:
        error = "the test judge stopped before finishing" + (f": {judge_error}" if judge_error else "")
    if error is None:
        first = next((o for o in outcomes if not o.passed), None)
        if first is not None:
            error = f"test failed: {first.test.strip()}" + (f" (got {first.got})" if first.got else "")
            if first.error and not first.error.startswith("AssertionError"):
                error += f" -> {first.error}"
    return SandboxResult(
        passed=sum(o.passed for o in outcomes),
        total=len(tests),
        error=error,
        timed_out=timed_out,
        output=output,
        duration_s=duration,
        tests=outcomes,
        isolation=isolation,
    )
