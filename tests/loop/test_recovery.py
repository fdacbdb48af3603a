"""Recovery of `fit`: kill -9 anywhere, power loss, Ray driver death.

- kill -9 at chosen and random moments (during rollouts and before the first checkpoint,
  during checkpoint staging, between the commit's two renames, mid-write of a metrics row or
  a trajectory file, with a best evaluation's weights staged, at a random time), each followed
  by `--resume`: the finished run has the same metrics rows, trajectories, state (the best and
  the patience too) and best weights as an uninterrupted one, none lost, none twice;
- a checkpoint is committed only after what it covers is fsynced;
- one `fit` per run directory, the lock dies with its holder;
- killing the driver of a Ray run leaves no Ray process of that run behind.

The `fit` processes under test are forked from one process that has done the imports once
(this file run as a script, `_zygote`), which saves about 10 s a run; each is a process of its
own, killed by a real SIGKILL, by the test or by itself at an exact moment (`_crash_at`).
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
# 6 train tasks, 2 held out; checkpoints after steps 2, 4, 6; evaluations at 0, 3, 6
FIT = ["fit", f"{APP}:single", "--data", str(DATA),
       "runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_in_flight=1", "rollout.max_tokens=12",
       "steps=6", "save_every=2", "eval_every=3", "val_fraction=0.25", "learner.lr=1e-2", "seed=5",
       # bit-exact: fp32 updates, and MKL's conditional numerical reproducibility, without which
       # a fresh process may round the first resumed update differently in the last bit
       "learner.bf16=false", "runtime.engine_bf16=false"]
ENV = {**os.environ, "MKL_CBWR": "COMPATIBLE"}
POINTS = ("generate", "trajectories", "metrics", "saving", "staged", "renamed", "best")


def _crash_at(point: str, count: int) -> None:
    """In the `fit` process: SIGKILL itself at the `count`-th occurrence of `point`:
    generate      an LLM call reaches the policy's worker group (rollouts, evaluations)
    trajectories  a training step's trajectory file is half written
    metrics       half of a training step's metrics row is on disk
    saving        the staged checkpoint has its HF folder but not yet the optimizer state
    staged        the staged checkpoint is complete, not yet committed
    renamed       the old checkpoint is moved aside, the staged one not yet in its place
    best          a new best evaluation's weights are staged, not yet renamed to best/step_N
    """
    import torch

    from mas_trainer.policy import local
    from mas_trainer.run import rundir

    assert point in POINTS, point
    seen: Counter = Counter()

    def at(name: str) -> None:
        seen[name] += 1
        if name == point and seen[name] == count:
            os.kill(os.getpid(), signal.SIGKILL)

    generate = local.LocalPolicy.generate

    async def _generate(self, *args, **kwargs):
        at("generate")
        return await generate(self, *args, **kwargs)

    write_trajectories = rundir.RunDir.write_trajectories

    def _write_trajectories(self, step, lines, name=None):
        def cut(lines):
            for i, line in enumerate(lines):
                if i == 1:
                    at("trajectories")
                yield line
        return write_trajectories(self, step, cut(lines) if name is None else lines, name)

    append_metrics = rundir.RunDir.append_metrics

    def _append_metrics(self, row):
        if row.get("kind") == "train" and point == "metrics" and seen["metrics"] + 1 == count:
            text = json.dumps(row) + "\n"
            with self.metrics_path.open("a") as f:
                f.write(text[: len(text) // 2])
        if row.get("kind") == "train":
            at("metrics")
        return append_metrics(self, row)

    save = torch.save

    def _save(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            at("saving")
        return save(obj, f, *args, **kwargs)

    commit = rundir.RunDir.commit

    def _commit(self, state):
        at("staged")
        return commit(self, state)

    replace = os.replace

    def _replace(src, dst, *args, **kwargs):
        if Path(src).name == ".checkpoint-staging":
            at("renamed")
        if Path(src).name == ".staging" and Path(src).parent.name == "best":
            at("best")
        return replace(src, dst, *args, **kwargs)

    local.LocalPolicy.generate = _generate
    rundir.RunDir.write_trajectories = _write_trajectories
    rundir.RunDir.append_metrics = _append_metrics
    rundir.RunDir.commit = _commit
    torch.save = _save
    os.replace = _replace


def _zygote() -> None:
    """Import what `fit` imports, run nothing (no torch op: no thread pool to break by forking),
    then fork one `fit` per request line {"args", "log", "crash"}; answer its pid, then its exit status."""
    import langchain_openai  # noqa: F401
    import langgraph.graph  # noqa: F401
    import torch  # noqa: F401
    import transformers.generation.utils  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import mas_trainer.adapters.langgraph  # noqa: F401
    import mas_trainer.engines.models  # noqa: F401
    import mas_trainer.plots  # noqa: F401
    import mas_trainer.loop.trainer  # noqa: F401
    import mas_trainer.policy.local  # noqa: F401
    from mas_trainer.cli import main

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                # Ctrl-C as in a terminal: a job a non-interactive shell starts in the background
                # (CI's, often) inherits SIGINT ignored, and Python then leaves it ignored
                signal.signal(signal.SIGINT, signal.default_int_handler)
                if req["crash"]:
                    _crash_at(*req["crash"])
                rc = main(req["args"])
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc or 0)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


class Forks:
    """The test's side of `_zygote`."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.n = 0
        self.proc = subprocess.Popen([sys.executable, __file__, "--zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=ENV, cwd=ROOT)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def start(self, out, *extra, crash=None) -> tuple[int, Path]:
        self.n += 1
        log = self.logs / f"fit_{self.n}.log"
        log.touch()
        req = {"args": [*FIT, "--output", str(out), *extra], "log": str(log), "crash": crash}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        self.pid = json.loads(self.proc.stdout.readline())["pid"]
        return self.pid, log

    def wait(self, timeout_s: float = 600) -> int:
        import threading

        def hung() -> None:
            self.timed_out = True
            os.kill(self.pid, signal.SIGKILL)

        self.timed_out = False
        timer = threading.Timer(timeout_s, hung)
        timer.start()
        try:
            rc = json.loads(self.proc.stdout.readline())["rc"]
        finally:
            timer.cancel()
        assert not self.timed_out, f"fit ran over {timeout_s} s"
        return rc

    def run(self, out, *extra, crash=None) -> tuple[int, str]:
        _, log = self.start(out, *extra, crash=crash)
        return self.wait(), log.read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    f = Forks(tmp_path_factory.mktemp("logs"))
    yield f
    f.close()


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows):
    """The rows less their durations: `time/...`, `perf/...` and a policy's `policy/NAME/time/...`."""
    return [{k: v for k, v in r.items() if not {"time", "perf"} & set(k.split("/")[:3])} for r in rows]


def _trajectories(out):
    """file name -> what each rollout generated, in order."""
    return {p.name: [(t["rollout_id"], [c["response_ids"] for c in t["llm_calls"]])
                     for t in map(json.loads, p.read_text().splitlines())]
            for p in sorted((out / "trajectories").iterdir())}


def _weights(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))}


@pytest.fixture(scope="module")
def whole(forks, tmp_path_factory):
    """The uninterrupted run every interrupted one must equal."""
    out = tmp_path_factory.mktemp("whole") / "run"
    rc, log = forks.run(out)
    assert rc == 0, log[-2000:]
    return out


def test_kill_9_anywhere_then_resume_loses_and_repeats_nothing(forks, whole, tmp_path):
    seed = int(os.environ.get("MAS_FAULT_SEED", time.time_ns() % 1_000_000))
    rnd = random.Random(seed)
    out = tmp_path / "run"
    why = f"(MAS_FAULT_SEED={seed} reproduces this chain)"
    # each line: kill point and the run state it leaves, then the resume that follows
    chain = [
        ("generate", 3),   # during step 1's rollouts: the step-0 evaluation row is on disk, no checkpoint
        ("staged", 1),     # resumed (starts over), killed with the step-2 checkpoint staged, uncommitted
        ("renamed", 2),    # starts over again; step 2 committed; killed mid-commit of step 4
        ("metrics", 2),    # resumes after step 2; killed with half of step 4's row written (step 3's best kept)
        ("best", 1),       # resumes after step 2 (step 3's best goes with its rows); killed with it staged again
        rnd.choice([("generate", rnd.randint(1, 10)), ("trajectories", rnd.randint(1, 2)), ("saving", 1)]),
    ]
    for i, (point, count) in enumerate(chain):
        rc, log = forks.run(out, *(["--resume"] if i else []), crash=(point, count))
        assert rc == -signal.SIGKILL, f"{point}:{count} never happened {why}\n{log[-2000:]}"
        if i in (1, 2):  # nothing to resume: the run starts over, and says so
            assert "has no complete checkpoint" in log and "starting over from step 0" in log, log[-2000:]
        if i == 1:
            assert not (out / "checkpoint").exists() and (out / ".checkpoint-staging" / "policies").exists()
        if i == 2:
            assert not (out / "checkpoint").exists() and json.loads((out / ".checkpoint-old" / "state.json").read_text())["step"] == 2
        if i == 4:
            assert sorted(p.name for p in (out / "best").iterdir()) == [".staging"], why
    # then from outside, at a random moment once the resumed run has done a step
    pid, log = forks.start(out, "--resume")
    deadline = time.time() + 300
    while time.time() < deadline and not re.search(r"step \d+: reward", log.read_text()):
        time.sleep(0.02)
    time.sleep(rnd.uniform(0, 2.0))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended first
        pass
    forks.wait()
    rc, log = forks.run(out, "--resume")
    assert rc == 0, log[-2000:]
    assert _comparable(_rows(out)) == _comparable(_rows(whole)), why
    assert _trajectories(out) == _trajectories(whole), why
    for row in _rows(out):  # each row matches its trajectory file, one file per row
        suffix = "_val" if row["kind"] == "val" else ""
        assert len(_trajectories(out)[f"step_{row['step']:06d}{suffix}.jsonl"]) == row["rollouts"]
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state == json.loads((whole / "checkpoint" / "state.json").read_text()) and state["step"] == 6
    leftovers = [p.name for p in out.iterdir() if p.name.startswith(".checkpoint")] + list((out / "trajectories").glob("*.tmp"))
    assert not leftovers, why
    # the best state.json names, its weights as the uninterrupted run kept them, and no other
    assert state["best"] is not None and [p.name for p in (out / "best").iterdir()] == [f"step_{state['best']['step']:06d}"]
    assert _weights(out / "best") == _weights(whole / "best") != {}, why


def test_ctrl_c_says_what_was_kept_and_resume_loses_and_repeats_nothing(forks, whole, tmp_path):
    """Ctrl-C (SIGINT) in the middle of a run: no traceback, exit status 130, one line naming the
    checkpoint kept; `--resume` then finishes the run exactly as the uninterrupted one."""
    out = tmp_path / "run"
    pid, log = forks.start(out)
    state = out / "checkpoint" / "state.json"
    deadline = time.time() + 300
    while time.time() < deadline and not state.exists():
        time.sleep(0.02)
    time.sleep(0.5)  # into the next step's rollouts or update
    os.kill(pid, signal.SIGINT)
    rc = forks.wait(timeout_s=120)
    text = log.read_text()
    assert rc == 130, text[-2000:]
    assert "Traceback" not in text
    kept = json.loads(state.read_text())["step"]
    assert f"mas-trainer fit: interrupted; {out}: its last checkpoint, step {kept}, is kept: add --resume" in text
    rc, text = forks.run(out, "--resume")
    assert rc == 0, text[-2000:]
    assert _comparable(_rows(out)) == _comparable(_rows(whole))
    assert _trajectories(out) == _trajectories(whole)


def test_commit_makes_records_and_checkpoint_durable_before_the_rename(tmp_path, monkeypatch):
    """Power loss: the trajectory files, metrics rows and staged files a checkpoint covers are
    fsynced before the rename that commits it; the run directory right after it."""
    from mas_trainer.run.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.create("{}\n")
    run.append_metrics({"kind": "train", "step": 1})
    traj = run.write_trajectories(1, ['{"rollout_id": "a"}'])
    staging = run.staging()
    policy = run.policy_dir("p", staging)
    policy.mkdir(parents=True)
    (policy / "model.safetensors").write_bytes(b"weights")
    events = []
    fsync, replace = os.fsync, os.replace

    def _fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def _replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", _fsync)
    monkeypatch.setattr(os, "replace", _replace)
    run.commit({"step": 1})
    i = events.index(("replace", str(staging), str(run.checkpoint)))
    before = {e[1] for e in events[:i] if e[0] == "fsync"}
    real = lambda p: os.path.realpath(p)  # noqa: E731
    staged = {real(p) for p in (staging / "state.json", staging, policy / "model.safetensors", policy, staging / "policies")}
    assert {real(traj), real(run.traj_dir), real(run.metrics_path), real(run.root / "config.yaml")} | staged <= before
    assert ("fsync", real(run.root)) in events[i + 1:]
    # the commit's own record (checkpoints.jsonl) is durable only after the rename is
    j = events.index(("fsync", real(run.root)), i + 1)
    assert ("fsync", real(run.commits_path)) in events[j + 1:] and ("fsync", real(run.commits_path)) not in events[:j]
    # cheap: the next checkpoint fsyncs only what was written since this one
    events.clear()
    run.write_trajectories(2, ['{"rollout_id": "b"}'])
    run.staging()
    run.commit({"step": 2})
    folders = {real(p) for p in (run.root, run.traj_dir, staging, staging / "policies")}
    files = {e[1] for e in events if e[0] == "fsync"} - folders
    assert files == {real(run.traj_dir / "step_000002.jsonl"), real(staging / "state.json"), real(run.commits_path)}


def test_a_live_run_directory_is_refused_and_its_lock_dies_with_its_holder(tmp_path):
    from mas_trainer.config import load_config
    from mas_trainer.errors import UserError
    from mas_trainer.run.rundir import RunDir
    from mas_trainer.loop.trainer import fit

    out = tmp_path / "run"
    code = ("import sys, time\nfrom mas_trainer.run.rundir import RunDir\n"
            "with RunDir(sys.argv[1]).locked():\n    print('held', flush=True)\n    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        tasks = [json.loads(line) for line in DATA.read_text().splitlines()][:2]
        with pytest.raises(UserError, match=rf"in use by another running `mas-trainer fit` \(pid {holder.pid}\)"):
            fit(f"{APP}:single", tasks, load_config(overrides=["runtime.execution=local", "steps=1"]), out, resume=True)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunDir(out).locked():  # the kernel released it with its holder
        pass


def _processes_marked(mark: str) -> dict[int, str]:
    """pid -> command line of the live processes whose environment carries `mark` (one run's)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"MAS_TEST_RUN={mark}".encode() in (proc / "environ").read_bytes():
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours
            pass
    return found


_DRIVER = """
import os, subprocess, sys, time
from mas_trainer.cluster import ray_init
mark = ray_init.start_watchdog()
# the raylet: marked, it starts an agent whose environment block does not show the mark (as one
# that retitles itself may), and dies, which leaves the agent an orphan
raylet = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, ray_init.RAY_OWNER_ENV: mark},
                          stdout=subprocess.PIPE, text=True)
print(raylet.stdout.readline().strip(), flush=True)
time.sleep(600)
"""
_RAYLET = """
import subprocess, sys, time
agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env={})
print(agent.pid, flush=True)
time.sleep(6)  # the watchdog scans every second while the driver lives: it sees the agent as this one's child
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_the_watchdog_ends_an_orphan_of_the_instance_whose_environment_hides_the_mark():
    """What the Ray test above meets now and then: Ray's dashboard agent retitles itself, which
    may overwrite the environment block /proc shows, and the raylet that started it dies with the
    driver; the watchdog remembered it as the raylet's child while the driver lived."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc")
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, _RAYLET], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    agent = int(driver.stdout.readline())
    try:
        raylet = _parent(agent)
        deadline = time.monotonic() + 120  # hang guards: the conditions end the waits
        while _parent(agent) == raylet and time.monotonic() < deadline:  # the raylet has died: the agent is
            time.sleep(0.1)  # an orphan with no mark to find
        assert _parent(agent) not in (None, raylet)
        assert _alive(agent) and b"MAS_TRAINER_RAY_OWNER" not in Path(f"/proc/{agent}/environ").read_bytes()
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 120
        while _alive(agent) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(agent)
    finally:
        if driver.poll() is None:
            driver.kill()
        if _alive(agent):
            os.kill(agent, signal.SIGKILL)


def test_killing_the_driver_of_a_ray_run_leaves_no_ray_process(tmp_path):
    """kill -9 of the driver pid alone takes the local Ray instance it started (GCS, raylet, its
    agents) and the worker-group actors with it within seconds: Ray's head processes share the
    driver's fate (parent-death signal), the actors are not detached, and the watchdog of
    `cluster/watchdog.py` ends the dashboard and runtime-env agents, which alone would wait about
    a minute on the dead GCS."""
    pytest.importorskip("ray")
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc")
    mark = uuid.uuid4().hex
    env = {**os.environ, "MAS_TEST_RUN": mark}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mas_trainer.cli", "fit", f"{APP}:graph", "--data", str(DATA), "--output", str(out),
           "runtime.execution=ray", "runtime.num_cpus=2", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_tokens=12",
           "steps=200", "val_fraction=0"]
    with open(tmp_path / "fit.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:  # both actors have trained a step
            if (out / "metrics.jsonl").exists() and any(r["kind"] == "train" for r in _rows(out)):
                break
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "fit.log").read_text()[-3000:]
        running = " | ".join(_processes_marked(mark).values())
        if "raylet" not in running:
            pytest.skip("fit joined a Ray cluster it did not start")
        assert running.count("ray::LocalPolicy") == 2, running
        os.kill(proc.pid, signal.SIGKILL)  # the driver only, not its process group
        proc.wait()
        deadline = time.time() + 20  # Ray's actors go in about 2 s; its agents, unwatched, after 60 s
        while _processes_marked(mark) and time.time() < deadline:
            time.sleep(0.5)
        assert not _processes_marked(mark), _processes_marked(mark)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _processes_marked(mark):  # this run's only
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    assert sys.argv[1:] == ["--zygote"], sys.argv
    _zygote()
