"""The code_gen sandbox against candidates that try to forge their score or reach the trainer.

Each attack is scored as a failure (or, for attacks on the trainer, leaves it unharmed and
nothing running). The forging attacks run under every isolation that works here, "none"
included, since the verdict channel does not depend on namespaces; the attacks on the
trainer need a pid namespace and run in a stand-in trainer process, so that a defence that
failed would kill the stand-in, not pytest.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples.langgraph_apps.code_gen import sandbox  # noqa: E402

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(4, 4) == 8"]
LIMIT_S = 3.0  # every attack here ends well before this; a hang would show as a time-out
AVAILABLE = [kind for kind in sandbox.ISOLATIONS if sandbox.probe(kind) is None]
NAMESPACED = [kind for kind in AVAILABLE if kind != "none"]


def run(code, tests=ADD_TESTS, kind=None, **kwargs):
    return sandbox.run_tests(code, tests, entry_point="add", isolation=kind,
                             time_limit_s=kwargs.pop("time_limit_s", LIMIT_S), **kwargs)


def needs_namespaces(kind):
    if kind not in NAMESPACED:
        pytest.skip(f"{kind} isolation is not available here")


# ---------------------------------------------------------------- forging the verdict

FAKE_RECORDS = "".join(json.dumps(r) + "\n" for r in (
    [{"kind": "load", "ok": True}] + [{"kind": "test", "index": i, "ok": True} for i in range(3)] + [{"kind": "done"}]
))
WRONG_ADD = "def add(a, b):\n    return 7\n"  # right for none of ADD_TESTS

FORGERIES = {
    # the old harness's reporting function, reached through __main__ / sys.modules / builtins
    "patch_harness_functions": """
import builtins, sys, __main__
def always_ok(*args, **kwargs):
    return None
for module in (__main__, sys.modules["__main__"]):
    for name in list(vars(module)):
        if not name.startswith("__") and callable(getattr(module, name)):
            setattr(module, name, always_ok)
builtins.emit = builtins.report = always_ok
""" + WRONG_ADD,
    "call_harness_reporter_then_exit": """
import os, __main__
for name in ("emit", "report", "record", "reply"):
    reporter = getattr(__main__, name, None)
    if callable(reporter):
        for i in range(3):
            reporter(kind="test", index=i, ok=True)
        reporter(kind="done", output="")
        os._exit(0)
""" + WRONG_ADD,
    "append_to_files_named_in_argv": f"""
import os, sys
for arg in sys.argv[1:]:
    try:
        with open(arg, "a") as f:
            f.write({FAKE_RECORDS!r})
    except OSError:
        pass
os._exit(0)
""",
    "patch_json_in_sys_modules": """
import sys
sys.modules["json"].dumps = lambda *a, **k: '{"kind": "done"}'
sys.modules["json"].loads = lambda *a, **k: {"kind": "test", "ok": True}
""" + WRONG_ADD,
    "write_results_files": f"""
import glob, os
fake = {FAKE_RECORDS!r}
# only its own folder: under unshare or none it could reach other runs' files in the real /tmp
for path in glob.glob("*.jsonl") + ["results.jsonl", "results.json"]:
    with open(path, "w") as f:
        f.write(fake)
""" + WRONG_ADD,
    "print_fake_records": f"""
import sys
print({FAKE_RECORDS!r})
sys.stderr.write({FAKE_RECORDS!r})
def add(a, b):
    print({FAKE_RECORDS!r})
    return 7
""",
    "write_fake_records_to_every_fd": f"""
import os
for fd in range(256):
    try:
        os.write(fd, {FAKE_RECORDS!r}.encode() + b'{{"id": 2, "value": 5}}\\nnot json\\n')
    except OSError:
        pass
""" + WRONG_ADD,
    "close_every_fd": "import os\nos.closerange(0, 1024)\n" + WRONG_ADD,
    "sys_exit_at_load": "import sys\nsys.exit(0)\n" + WRONG_ADD,
    "os_exit_at_load": "import os\nos._exit(0)\n" + WRONG_ADD,
    "os_exit_in_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "system_exit_in_call": "def add(a, b):\n    raise SystemExit(0)\n",
    "keyboard_interrupt_in_call": "def add(a, b):\n    raise KeyboardInterrupt\n",
    "patch_assertion_error_and_unittest": """
import builtins, unittest
class Never(Exception):
    pass
builtins.AssertionError = Never
unittest.TestCase.assertEqual = lambda *a, **k: None
""" + WRONG_ADD,
    "rigged_eq": "class Yes:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes()\n",
    "int_subclass_eq": "class Five(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Five(0)\n",
    "huge_return_value": "def add(a, b):\n    return 'x' * (5 * 1024 * 1024)\n",
    # a well-formed reply line whose value is not (a set of lists), ahead of the real reply, on whatever fd it is
    "malformed_value": """
import os
def add(a, b):
    for fd in range(3, 20):
        try:
            os.write(fd, b'{"id": 2, "value": {"set": [[1]]}}\\n')
        except OSError:
            pass
    return 5
""",
    "many_items_return_value": "def add(a, b):\n    return [0] * 3000000\n",
}


@pytest.mark.parametrize("kind", AVAILABLE)
@pytest.mark.parametrize("attack", sorted(FORGERIES))
def test_forgery_is_scored_as_a_failure(attack, kind):
    r = run(FORGERIES[attack], kind=kind)
    assert r.passed == 0 and not r.all_passed and r.error, (attack, r)
    assert not r.timed_out, f"{attack} should fail fast: {r.error}"
    assert r.isolation == kind


@pytest.mark.parametrize("kind", AVAILABLE)
def test_a_test_that_swallows_exceptions_still_fails_when_the_candidate_exits(kind):
    tests = ["try:\n    add(1, 1)\nexcept Exception:\n    pass"]
    for code in ("def add(a, b):\n    raise SystemExit(0)\n", "import os\ndef add(a, b):\n    os._exit(0)\n"):
        r = run(code, tests, kind=kind)
        assert r.passed == 0, (code, r)
    assert run("def add(a, b):\n    raise ValueError('no')\n", tests, kind=kind).all_passed  # a real exception is caught


def test_stop_iteration_cannot_end_a_tests_loop_early():
    # in the test, map() would take a StopIteration from the candidate as the end of its input: all([]) is True
    tests = ["assert all(map(add, [1, 2], [3, 4]))"]
    r = run("def add(a, b):\n    raise StopIteration\n", tests)
    assert r.passed == 0 and "StopIteration" in r.error


def test_huge_output_is_capped_and_the_caller_is_fine():
    code = "print('x' * (10 * 1024 * 1024))\ndef add(a, b):\n    print('y' * 10**6)\n    return a + b\n"
    r = run(code, output_cap=1000)
    assert len(r.output) < 1100 and r.output.endswith("[output truncated]") and r.all_passed
    # straight to the file, past print(): the file-size limit stops it
    code = "import os\nwhile True:\n    os.write(1, b'x' * 2 ** 20)\ndef add(a, b):\n    return a + b\n"
    r = run(code, output_cap=1000)
    assert len(r.output) < 1100 and r.passed == 0 and "File too large" in r.error


def test_memory_and_file_size_limits_still_hold():
    r = run("def add(a, b):\n    return len(bytearray(2 * 1024 ** 3))\n", memory_limit_mb=512)
    assert r.passed == 0 and "MemoryError" in r.error
    r = run("def add(a, b):\n    open('big', 'wb').write(b'0' * (8 * 1024 * 1024))\n    return a + b\n")
    assert r.passed == 0 and "File too large" in r.error


def test_the_channel_carries_plain_data_faithfully():
    values = ["None", "True", "-0.0", "10 ** 5000", "'é\\n\"'", "b'\\x00\\xff'", "1 + 2j", "float('inf')",
              "(1, [2.5, 'a'])", "{1: {'k': (None,)}, 'x': frozenset({1})}", "{3, 4}", "[[]] * 3"]
    tests = [f"v = {v}\nassert add(v, 0) == v and type(add(v, 0)) is type(v)" for v in values]
    tests += ["import math\nassert math.isnan(add(float('nan'), 0))",
              "try:\n    add(1, 1)\nexcept ZeroDivisionError as e:\n    assert 'line 4' in str(e)\nelse:\n    assert False"]
    code = "def add(a, b):\n    if b == 0:\n        return a\n    return a / (b - b)\n"
    r = run(code, tests)
    assert r.all_passed, r.feedback()
    r = run("def add(a, b):\n    return a\n", ["assert add(lambda: 1, 0)"])
    assert r.passed == 0 and "cannot be sent to the sandbox" in r.tests[0].error


# ---------------------------------------------------------------- malformed or missing records

def verdict(raw: bytes, tests=ADD_TESTS, **kwargs):
    args = dict(timed_out=False, time_limit_s=1.0, ended=None, last_line="", judge_error=None, output="",
                duration=0.0, isolation="none")
    return sandbox._verdict(sandbox.read_records(raw), tests, **{**args, **kwargs})


def test_malformed_records_count_as_failures():
    raw = b"\n".join([
        b"garbage", b'{"kind": "test", "index": 0, "ok": "yes"}', b'{"kind": "test", "index": "1", "ok": true}',
        b'{"kind": "test", "index": true, "ok": true}', b'{"kind": "test", "index": 7, "ok": true}',
        b'{"kind": "test", "index": -1, "ok": true}', b"[1, 2]", b"\xff\xfe", b'{"kind": "test"}', b'"text"',
        b'{"kind": "done"}', b'{"kind": "test", "index": 2, "ok": tr',
    ])
    r = verdict(raw)
    assert (r.passed, r.all_passed) == (0, False) and r.error.startswith("test failed")


def test_missing_records_count_as_failures():
    r = verdict(b"")
    assert r.passed == 0 and r.error == "the test judge stopped before finishing"
    r = verdict(b'{"kind": "load", "ok": true}\n{"kind": "test", "index": 0, "ok": true}\n', judge_error="Boom")
    assert r.passed == 1 and not r.all_passed and r.error == "the test judge stopped before finishing: Boom"
    r = verdict(b'{"kind": "load", "ok": false}\n{"kind": "done"}\n')
    assert r.passed == 0 and r.error == "the code could not be loaded"


# ---------------------------------------------------------------- reaching the trainer

STAND_IN = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from examples.langgraph_apps.code_gen.sandbox import run_tests
r = run_tests(sys.stdin.read(), ["assert add(2, 3) == 5"], entry_point="add", isolation=sys.argv[1],
              time_limit_s=3.0, output_cap=100000)
print(json.dumps({"passed": r.passed, "error": r.error, "output": r.output}))
"""


def in_stand_in(code, kind, env=None):
    """run_tests in a stand-in trainer (own session, so a failed defence cannot reach pytest)."""
    proc = subprocess.run([sys.executable, "-c", STAND_IN, kind, str(ROOT)], input=code, text=True,
                          capture_output=True, timeout=60, env={**os.environ, **(env or {})},
                          start_new_session=True)
    assert proc.returncode == 0, f"the stand-in trainer died ({proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.splitlines()[-1])


KILLS = {
    "kill_parent": "os.kill(os.getppid(), signal.SIGKILL)",
    "killpg_parent": "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
    "kill_every_visible_pid": (
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit() and int(p) != os.getpid():\n"
        "        try:\n            os.kill(int(p), signal.SIGKILL)\n        except OSError:\n            pass"
    ),
    # kill(-1) signals every process the caller may signal: only run where a pid namespace is proven
    "kill_minus_one": "if os.getpid() < 10:\n    os.kill(-1, signal.SIGKILL)",
}


@pytest.mark.parametrize("kind", NAMESPACED or ["bwrap"])
@pytest.mark.parametrize("attack", sorted(KILLS))
def test_candidate_cannot_kill_the_trainer(attack, kind):
    needs_namespaces(kind)
    code = "import os, signal\ntry:\n" + "".join(f"    {line}\n" for line in KILLS[attack].splitlines())
    code += "except OSError:\n    pass\n" + WRONG_ADD
    result = in_stand_in(code, kind)
    assert result["passed"] == 0


@pytest.mark.parametrize("kind", NAMESPACED or ["bwrap"])
def test_candidate_cannot_read_the_trainers_environment(kind):
    needs_namespaces(kind)
    secret = uuid.uuid4().hex
    code = """
import glob, os, subprocess
found = []
def grab():
    for path in ["/proc/%d/environ" % os.getppid(), *glob.glob("/proc/[0-9]*/environ")]:
        try:
            found.append(open(path, "rb").read().decode("latin-1"))
        except OSError:
            pass
grab()
subprocess.run(["umount", "-l", "/proc"], capture_output=True)  # under unshare: uncover the host's /proc
grab()
found.append(repr(dict(os.environ)))
print("ATTACK RAN", [text for text in found if "MAS_SANDBOX_TEST_SECRET" in text])
""" + WRONG_ADD
    result = in_stand_in(code, kind, env={"MAS_SANDBOX_TEST_SECRET": secret})
    assert "ATTACK RAN" in result["output"] and secret not in result["output"]


def processes_with(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("kind", NAMESPACED or ["bwrap"])
def test_nothing_the_candidate_starts_outlives_the_verdict(kind):
    needs_namespaces(kind)
    marker = f"code-gen-leftover-{uuid.uuid4().hex}"
    sleeper = f"[sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}]"
    code = f"""
import os, subprocess, sys, time
subprocess.Popen({sleeper}, start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:  # setsid + double fork: a daemon
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, {sleeper})
    os._exit(0)
for _ in range(30):  # a bounded stand-in for a fork bomb: many sleeping children in their own sessions
    if os.fork() == 0:
        os.setsid()
        time.sleep(60)
        os._exit(0)
time.sleep(0.3)
def add(a, b):
    return a + b
"""
    try:
        r = run(code, kind=kind)
        assert r.all_passed, r.error  # the attack ran to the end
        assert processes_with(marker) == []
    finally:
        for pid in processes_with(marker):  # only if the containment failed
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("kind", NAMESPACED or ["bwrap"])
def test_candidate_has_no_network(kind):
    needs_namespaces(kind)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"hello")
    print("CONNECTED")
except OSError as exc:
    print("NO NETWORK", exc)
def add(a, b):
    return a + b
"""
        r = run(code, kind=kind)
        assert "NO NETWORK" in r.output and r.all_passed
        with pytest.raises(BlockingIOError):
            server.accept()


def test_bwrap_keeps_the_file_system_read_only():
    if "bwrap" not in AVAILABLE:
        pytest.skip("bubblewrap is not available here")
    outside = Path(tempfile.mkdtemp(prefix="code_gen_fs_", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    targets = [outside / "pwned", Path(f"/code_gen_pwned_{uuid.uuid4().hex}")]
    code = f"""
for path in {[str(t) for t in targets]!r}:
    try:
        open(path, "w").write("x")
        print("WROTE", path)
    except OSError as exc:
        print("REFUSED", exc)
open("scratch.txt", "w").write("the scratch folder is writable")
def add(a, b):
    return a + b
"""
    try:
        r = run(code, kind="bwrap")
        assert r.all_passed and "WROTE" not in r.output and r.output.count("REFUSED") == 2, r.output
        assert not any(t.exists() for t in targets)
    finally:
        for t in targets:  # only if the containment failed
            t.unlink(missing_ok=True)
        outside.rmdir()


# ---------------------------------------------------------------- what the candidate leaves behind

def called_deep(fn, frames=200):
    """fn() from ``frames`` calls down, as the verifier is called from deep inside LangGraph."""
    return fn() if frames == 0 else called_deep(fn, frames - 1)


@pytest.fixture
def scratch_root(tmp_path, monkeypatch):
    """The folder the sandbox makes its scratch folders in (tempfile's), empty and private to the test."""
    root = tmp_path / "scratch_root"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def nested(depth, body=""):
    """A candidate that makes ``depth`` nested folders (deeper than PATH_MAX allows by name: by chdir)."""
    return f"""
import os
for _ in range({depth}):
    os.mkdir("d")
    os.chdir("d")
{body}
def add(a, b):
    return a + b
"""


@pytest.mark.parametrize("kind", AVAILABLE)
@pytest.mark.parametrize("depth", [900, 3000])
def test_deeply_nested_folders_are_removed(kind, depth, scratch_root):
    r = called_deep(lambda: run(nested(depth, 'open("f", "w").write("x")'), kind=kind, time_limit_s=20.0))
    assert r.all_passed and not r.timed_out, r.error  # the candidate's own verdict, not a crash
    assert list(scratch_root.iterdir()) == []


@pytest.mark.parametrize("kind", AVAILABLE)
def test_locked_folders_many_files_and_symlinks_out_are_removed(kind, scratch_root, tmp_path):
    outside = tmp_path / "outside"  # what the symlinks point at: it must survive the clean-up
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    body = f"""
for i in range(300):
    open("f%d" % i, "w").close()
for target, name in (({str(outside)!r}, "out"), ({str(outside / "keep.txt")!r}, "out_file"), ("/", "root"),
                     ("..", "up"), (".", "self")):
    os.symlink(target, name)
for i in range(1000):  # climb back up, locking a file and then the folder on each level
    open("locked", "w").close()
    os.chmod("locked", 0)
    os.chdir("..")
    os.chmod("d", (0, 0o500, 0o100, 0o300)[i % 4])
os.symlink({str(outside)!r}, "out")
os.chmod(".", 0o500)
"""
    r = called_deep(lambda: run(nested(1000, body), kind=kind, time_limit_s=20.0))
    assert r.all_passed and not r.timed_out, r.error
    assert list(scratch_root.iterdir()) == []
    assert (outside / "keep.txt").read_text() == "keep" and os.listdir(outside) == ["keep.txt"]


def test_the_clean_up_removes_any_tree_without_following_symlinks(tmp_path):
    """The clean-up on its own, as this user (so locked folders lock it out unless it unlocks them)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    os.chmod(outside, 0o500)
    scratch, fd = sandbox._make_scratch(str(tmp_path))
    level = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(1100):  # by descriptor, as a candidate would (the tests above go past PATH_MAX)
        os.mkdir("d", dir_fd=level)
        os.symlink(str(outside), "out", dir_fd=level)
        if i % 500 == 0:
            os.mkfifo("fifo", dir_fd=level)
            for j in range(100):
                os.close(os.open(f"f{j}", os.O_CREAT | os.O_WRONLY, 0, dir_fd=level))
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=level)
        os.close(level)
        level = child
    os.symlink("..", "up", dir_fd=level)
    os.close(level)
    # lock every level, deepest last (locking a folder first would shut the way down)
    level = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(1100):
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=level)
        os.fchmod(level, (0, 0o500, 0o100, 0o300)[i % 4])
        os.close(level)
        level = child
    os.fchmod(level, 0)
    os.close(level)
    called_deep(lambda: sandbox._remove_scratch(scratch, fd))
    os.chmod(outside, 0o700)
    assert not os.path.lexists(scratch) and os.listdir(tmp_path) == ["outside"]
    assert os.listdir(outside) == ["keep.txt"] and (outside / "keep.txt").read_text() == "keep"


@pytest.mark.parametrize("kind", AVAILABLE)
def test_what_the_candidate_writes_is_bounded_or_reported(kind, scratch_root, monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "SCRATCH_LIMIT", 1024 * 1024)
    sized = kind == "bwrap" and sandbox._sized_tmpfs()
    # /run and /dev only where they are the sandbox's own: under unshare and none they are this machine's
    code = f"""
import os
def fill(folder, count):
    for i in range(count):
        try:
            with open(os.path.join(folder, "code_gen_fill%d" % i), "wb") as f:
                f.write(b"x" * 512 * 1024)
        except OSError as exc:
            print("STOPPED", folder, i, exc.strerror)
            return
    print("WROTE", folder, count)
fill(".", 8)
for folder in {["/run", "/dev", "/dev/shm"] if sized else []}:
    fill(folder, 12)
def add(a, b):
    return a + b
"""
    with caplog.at_level("WARNING", logger=sandbox.log.name):
        r = run(code, kind=kind)
    assert r.all_passed, r.error
    assert list(scratch_root.iterdir()) == []
    if sized:
        # the scratch folder holds at most SCRATCH_LIMIT bytes; /run and /dev are read-only, /dev/shm small
        assert "WROTE . 8" not in r.output and "No space left on device" in r.output, r.output
        assert "STOPPED /run 0 Read-only file system" in r.output and "STOPPED /dev 0 " in r.output, r.output
        assert "WROTE /dev/shm" not in r.output, r.output
    else:
        # no bound here (writes are not contained): what the candidate left is reported, then removed
        assert "WROTE . 8" in r.output, r.output
        assert any("left" in m and "scratch folder" in m for m in caplog.messages), caplog.messages
