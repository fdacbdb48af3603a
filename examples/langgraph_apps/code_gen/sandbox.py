"""Run a candidate function against a task's tests in a child Python process.

NOT a security sandbox. The candidate runs as an ordinary ``python`` child process of the
app, as the same user, with the same file system and network access. What this module does
guarantee is that model-written code never runs inside the app's own process, and that a
run is bounded: a wall-clock time limit (the whole process group is killed when it passes),
an address-space limit and a file-size limit (Linux/macOS ``resource`` limits, set inside
the child), and a cap on the output kept. Run untrusted code in a container or VM.

How one run goes (the harness below, fed to ``python -I -c``):

1. exec the task's ``prompt`` (signature + docstring, plus any imports or helper functions
   the task gives), so the candidate may use them;
2. exec the candidate code; it must (re)define ``entry_point``, which is also bound to the
   name ``candidate`` (HumanEval's tests call ``candidate(...)``);
3. exec the task's ``setup`` (e.g. HumanEval's test module with ``check``), then every test
   snippet in order, each in the same namespace; a test passes when it raises nothing.

The harness appends one JSON line per test to a results file as it goes, so a run that hits
the time limit still reports the tests that passed before it. ``print`` output of the
candidate is captured (capped), standard input is empty.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["SandboxResult", "TestOutcome", "run_tests"]

DEFAULT_TIME_LIMIT_S = 5.0
DEFAULT_MEMORY_LIMIT_MB = 1024
DEFAULT_OUTPUT_CAP = 4000  # characters of captured output / error text kept

# Runs in the child. argv: spec.json results.jsonl; everything else comes from spec.json.
_HARNESS = r'''
import ast, io, json, sys, traceback

spec_path, results_path = sys.argv[1], sys.argv[2]
with open(spec_path) as f:
    spec = json.load(f)
cap = spec["output_cap"]

try:
    import resource
    mem = spec["memory_bytes"]
    if mem:
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 * 1024 * 1024, 4 * 1024 * 1024))
except Exception:
    pass

results = open(results_path, "a", buffering=1)


def emit(**record):
    results.write(json.dumps(record) + "\n")
    results.flush()


class Capped(io.TextIOBase):
    def __init__(self):
        self.parts, self.size = [], 0

    def write(self, s):
        if self.size < cap:
            self.parts.append(s[: cap - self.size])
        self.size += len(s)
        return len(s)

    def text(self):
        out = "".join(self.parts)
        return out + ("\n...[output truncated]" if self.size > cap else "")


def short_error(exc):
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()[:cap]


def error_in_code(exc, filename):
    """The exception's last line plus the line of the candidate it happened on, if any."""
    msg = short_error(exc)
    if isinstance(exc, SyntaxError):
        return msg
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename == filename:
            lines = spec["code"].splitlines()
            text = lines[frame.lineno - 1].strip() if frame.lineno and frame.lineno <= len(lines) else ""
            return f"{msg} (line {frame.lineno} of the code: {text})"
    return msg


def got_value(test, ns):
    """For `assert X == Y`, what X evaluated to (a hint for whoever fixes the code)."""
    try:
        tree = ast.parse(test)
        node = tree.body[-1]
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1 \
                and isinstance(node.test.ops[0], ast.Eq):
            value = eval(compile(ast.Expression(node.test.left), "<test>", "eval"), ns)
            return repr(value)[:200]
    except BaseException:
        return None
    return None


out = Capped()
sys.stdout = sys.stderr = out
ns = {"__name__": "candidate", "__builtins__": __builtins__}
entry = spec["entry_point"]
try:
    exec(compile(spec["prompt"], "<prompt>", "exec"), ns)
except BaseException:
    pass  # a prompt that is only a signature is fine either way; the candidate must define it
stub = ns.get(entry)
try:
    exec(compile(spec["code"], "<code>", "exec"), ns)
except BaseException as exc:
    emit(kind="load", ok=False, error=error_in_code(exc, "<code>"), output=out.text())
    sys.exit(0)
fn = ns.get(entry)
if fn is None or fn is stub or not callable(fn):
    emit(kind="load", ok=False, error=f"the code does not define a function named {entry!r}", output=out.text())
    sys.exit(0)
ns["candidate"] = fn
try:
    exec(compile(spec["setup"], "<setup>", "exec"), ns)
except BaseException as exc:
    emit(kind="load", ok=False, error="test setup failed: " + short_error(exc), output=out.text())
    sys.exit(0)
emit(kind="load", ok=True)
for i, test in enumerate(spec["tests"]):
    try:
        exec(compile(test, f"<test {i}>", "exec"), ns)
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            err = "SystemExit: the code called exit()"
        else:
            err = error_in_code(exc, "<code>")
        got = got_value(test, ns) if isinstance(exc, AssertionError) else None
        emit(kind="test", index=i, ok=False, error=err, got=got)
    else:
        emit(kind="test", index=i, ok=True)
emit(kind="done", output=out.text())
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


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError, OSError):
        proc.kill()


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
) -> SandboxResult:
    """Run ``code`` and then each of ``tests`` in a fresh ``python`` child; never in this process."""
    tests = list(tests)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="code_gen_") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        results_path = os.path.join(tmp, "results.jsonl")
        with open(spec_path, "w") as f:
            json.dump(
                {
                    "code": code,
                    "tests": tests,
                    "entry_point": entry_point,
                    "prompt": prompt,
                    "setup": setup,
                    "output_cap": output_cap,
                    "memory_bytes": (memory_limit_mb or 0) * 1024 * 1024,
                },
                f,
            )
        open(results_path, "w").close()
        with open(os.path.join(tmp, "stderr.txt"), "w+b") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _HARNESS, spec_path, results_path],
                cwd=tmp,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # its own process group: the time limit kills children too
                env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"},
            )
            timed_out = False
            try:
                proc.wait(timeout=time_limit_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc)  # also reaps anything the candidate left running
            proc.wait()
            stderr.seek(0)
            crash = stderr.read(output_cap).decode("utf-8", "replace").strip()
        with open(results_path, encoding="utf-8", errors="replace") as f:
            records = []
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    break  # a line cut short by the kill
    duration = time.monotonic() - start

    outcomes = [TestOutcome(t, False) for t in tests]
    error: str | None = None
    output = ""
    finished = False
    for rec in records:
        if rec.get("kind") == "load" and not rec.get("ok"):
            error = rec.get("error")
            output = rec.get("output") or ""
        elif rec.get("kind") == "test":
            o = outcomes[rec["index"]]
            o.passed, o.error, o.got = bool(rec["ok"]), rec.get("error"), rec.get("got")
        elif rec.get("kind") == "done":
            finished = True
            output = rec.get("output") or ""
    passed = sum(o.passed for o in outcomes)
    if timed_out:
        done = sum(1 for r in records if r.get("kind") == "test")
        error = f"Time limit exceeded ({time_limit_s:g} s) after {done} of {len(tests)} tests"
        if done < len(tests):
            outcomes[done].error = f"timed out (limit {time_limit_s:g} s)"
    elif error is None and not finished:
        # the child died without reporting (os._exit, a signal, the memory or file-size limit)
        code_ = proc.returncode
        why = f"killed by signal {-code_}" if code_ is not None and code_ < 0 else f"exited with status {code_}"
        error = f"the test process {why} before finishing" + (f": {crash.splitlines()[-1]}" if crash else "")
    if error is None:
        first = next((o for o in outcomes if not o.passed), None)
        if first is not None:
            error = f"test failed: {first.test.strip()}" + (f" (got {first.got})" if first.got else "")
            if first.error and not first.error.startswith("AssertionError"):
                error += f" -> {first.error}"
    return SandboxResult(
        passed=passed,
        total=len(tests),
        error=error,
        timed_out=timed_out,
        output=output,
        duration_s=duration,
        tests=outcomes,
    )
