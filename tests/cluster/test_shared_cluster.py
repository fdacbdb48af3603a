"""A shared Ray cluster stays clean (issue 39, point 4): `fit` joined to a cluster it did not
start (`runtime.ray_address`), on Ray's own multi-node test cluster, checked from Ray's state
through a connection of the test's own.

- A driver killed with `kill -9` leaves no actor, placement group or reserved resource behind
  (Ray ends a dead driver's job and everything it owned), and the next `fit` gets them all.
- Two `fit` runs at once do not collide (actor and placement-group names, the gloo groups'
  master ports, the replicas' weight-sync stores): each trains exactly as it does alone.
"""

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[2]
WORDS = ROOT / "tests" / "fixtures" / "words_app.py"
WORDS_DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
# fp32 everywhere and MKL's reproducible paths: a CPU run is the same number for number
def _env() -> dict[str, str]:
    """The runs' environment, read when each starts: Ray's token mode (RAY_AUTH_MODE), which a local
    ray.init earlier in this process turns on, reaches a cluster started since, and the run must join it."""
    return {**os.environ, "MKL_CBWR": "COMPATIBLE", "OPENAI_API_KEY": "test"}
# the verl learner, one policy ("solo"); two ranks on one node, or one rank and a torch replica
VERL2 = ["runtime.resources.procs_per_node=2"]
REPLICA = ["runtime.engine=torch-replica"]
CLEAN_WAIT_S = 120  # Ray ends a dead driver's job when it sees the driver gone; bounded generously
RUN_TIMEOUT_S = 600  # the machine may be shared with other test runs


def _cmd(out: Path, address: str, *extra: str, app: str = "single", steps: int = 2) -> list[str]:
    return [sys.executable, "-m", "mas_trainer.cli", "fit", f"{WORDS}:{app}", "--data", str(WORDS_DATA), "--output", str(out),
            "--model", "tiny", "runtime.learner=verl", "learner.mini_batch_size=4", "learner.micro_batch_size=2",
            "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_in_flight=1", "rollout.max_tokens=12", f"steps={steps}",
            "eval_every=100", "save_every=100", "learner.lr=1e-2", "seed=5", "learner.bf16=false", "runtime.engine_bf16=false",
            f"runtime.ray_address={address}", *extra]


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _comparable(rows: list[dict]) -> list[dict]:
    """The metrics rows without their timings (tests/policy/test_verl_learner.py compares runs so)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/")) and "/perf/" not in k and "/time/" not in k
             and not k.endswith("/seconds")} for r in rows]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@contextmanager
def _cluster(cpus_per_node: int):
    """Ray's multi-node test cluster (a head without CPUs, nodes a and b), the test joined to it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for name in ("a", "b"):
            cluster.add_node(num_cpus=cpus_per_node, resources={f"node_{name}": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="shared-cluster-observer", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _held(address: str) -> dict[str, list]:
    """What other jobs hold on the cluster at `address` now: live actors, placement groups not
    removed, and resources not available (each node's CPUs and its own resource, as Ray counts
    them). The address is explicit: without one, Ray's state API takes the newest Ray instance
    on this machine, which may be another test's."""
    from ray.util.state import list_actors, list_placement_groups

    me = ray.get_runtime_context().get_job_id()
    actors = [f"{a.class_name} (job {a.job_id}, {a.state})"
              for a in list_actors(address=address, limit=10_000, raise_on_missing_output=False)
              if a.state != "DEAD" and a.job_id != me]
    pgs = [f"{p.name or p.placement_group_id} ({p.state})"
           for p in list_placement_groups(address=address, limit=10_000, raise_on_missing_output=False) if p.state != "REMOVED"]
    total, free = ray.cluster_resources(), ray.available_resources()
    kept = [f"{k}: {free.get(k, 0.0)} of {v} free" for k, v in sorted(total.items())
            if (k == "CPU" or k.startswith("node_") or "_group_" in k) and free.get(k, 0.0) != v]
    return {"actors": actors, "placement groups": pgs, "resources": kept}


def _wait(done, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        got = done()
        if got or time.monotonic() > deadline:
            assert got, f"{what}: not within {timeout_s:.0f} s"
            return got
        time.sleep(poll_s)


def test_a_killed_driver_leaves_nothing_behind_and_the_next_run_gets_every_cpu(tmp_path):
    """`kill -9` of `fit` alone (its Ray workers live under the cluster's raylets, not under it),
    during step 2 of 4; then a run of two 2-rank policies, which needs every CPU of the cluster."""
    with _cluster(cpus_per_node=2) as cluster:
        assert not any(_held(cluster.address).values()), _held(cluster.address)
        killed = tmp_path / "killed"
        proc = subprocess.Popen(_cmd(killed, cluster.address, *VERL2, steps=4), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, start_new_session=True)
        try:
            _wait(lambda: any(r["kind"] == "train" for r in _rows(killed)) or proc.poll() is not None, RUN_TIMEOUT_S,
                  "the first step of the run to be killed")
            assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()[-3000:] if proc.stderr else ''}"
            held = _held(cluster.address)
            # while it runs it holds its two ranks' placement group, CPUs and actors
            assert held["placement groups"] and held["actors"] and any(r.startswith("CPU:") for r in held["resources"]), held
            os.kill(proc.pid, signal.SIGKILL)  # the driver only
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr:
                proc.stderr.close()
        assert [r["step"] for r in _rows(killed) if r["kind"] == "train"][-1] < 4  # it was killed mid-run
        last: dict[str, list] = {}

        def clean() -> bool:
            last.update(_held(cluster.address))
            return not any(last.values())

        t0 = time.monotonic()
        _wait(clean, CLEAN_WAIT_S, f"Ray's clean-up of the killed driver's job (still held: {last})", poll_s=1.0)
        print(f"clean {time.monotonic() - t0:.1f} s after the kill")
        # the next run asks for all four CPUs of the two nodes: two policies, two ranks on one node each
        after = tmp_path / "after"
        _run(_cmd(after, cluster.address, *VERL2, app="graph"))
        assert [r["step"] for r in _rows(after) if r["kind"] == "train"] == [1, 2]
        _wait(lambda: not any(_held(cluster.address).values()), CLEAN_WAIT_S, "the finished run's clean-up")


def test_two_runs_at_once_train_as_if_alone(tmp_path):
    """The same two runs alone, then started at the same moment: each one's metrics equal its solo
    run's, row for row. Both serve from a torch replica of replica rank 0 (verl names its server,
    worker group and pool by that rank) and sync weights over gloo after every update (a store on a
    free port); the first trains a 2-rank verl group (gloo, its master port) for longer, so the
    second's steps and syncs run while it trains. On nodes of 3 CPUs (the runs ask 3 + 2) both fit
    at once whichever Ray places first."""
    runs = {"ranks2": ((*VERL2, *REPLICA), 4), "ranks1": (REPLICA, 2)}
    with _cluster(cpus_per_node=3) as cluster:
        alone = {name: tmp_path / f"{name}-alone" for name in runs}
        for name, out in alone.items():
            _run(_cmd(out, cluster.address, *runs[name][0], steps=runs[name][1]))
        _wait(lambda: not any(_held(cluster.address).values()), CLEAN_WAIT_S, "the solo runs' clean-up")

        together = {name: tmp_path / f"{name}-together" for name in runs}
        procs = {name: subprocess.Popen(_cmd(out, cluster.address, *runs[name][0], steps=runs[name][1]),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
                 for name, out in together.items()}
        from ray.util.state import list_actors

        both_placed = overlapped = False
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
                if not both_placed:  # both runs' learner ranks alive on the cluster at one moment
                    jobs = {a.job_id for a in list_actors(address=cluster.address, raise_on_missing_output=False,
                                                          filters=[("class_name", "=", "PolicyWorker"), ("state", "=", "ALIVE")])}
                    both_placed = len(jobs) == 2
                # a whole step of the second (rollouts on its replica, update, weight sync) done while
                # the first is still training
                first = [r for r in _rows(together["ranks2"]) if r["kind"] == "train"]
                overlapped |= (procs["ranks2"].poll() is None and 0 < len(first) < 4
                               and any(r["kind"] == "train" for r in _rows(together["ranks1"])))
                time.sleep(0.2)
            errs = {name: p.communicate(timeout=60)[1] if p.poll() is not None else "still running" for name, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        for name, p in procs.items():
            assert p.returncode == 0, f"{name}: {errs[name][-3000:]}"
        assert both_placed, "the two runs never held their worker groups at the same time"
        assert overlapped, "no step of the second run finished while the first one trained"
        for name in runs:
            got, want = _rows(together[name]), _rows(alone[name])
            assert [r["step"] for r in got if r["kind"] == "train"] == list(range(1, runs[name][1] + 1)), name
            assert _comparable(got) == _comparable(want), name
        _wait(lambda: not any(_held(cluster.address).values()), CLEAN_WAIT_S, "the concurrent runs' clean-up")
