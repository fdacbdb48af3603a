"""`fit` joined, through runtime.ray_address, to Ray's own multi-node test cluster
(`ray.cluster_utils.Cluster`: every node a real raylet with its own resources; `remove_node`
kills one as a lost machine would): where Ray placed each worker, read from Ray's own actor
table; a placement Ray cannot grant; a node lost in the middle of a run, then `--resume` on a
replacement node, compared with an uninterrupted run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[2]
WORDS = ROOT / "tests" / "fixtures" / "words_app.py"
WORDS_DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
def _env() -> dict[str, str]:
    """The runs' environment, read when each starts: Ray's token mode (RAY_AUTH_MODE), which a local
    ray.init earlier in this process turns on, reaches a cluster started since, and the run must join it."""
    return {**os.environ, "OPENAI_API_KEY": "test", "MKL_CBWR": "COMPATIBLE"}
SMALL = ["runtime.learner=verl", "learner.mini_batch_size=2", "learner.micro_batch_size=1", "rollout.tasks_per_step=2",
         "rollout.n=2", "rollout.max_tokens=12", "rollout.max_in_flight=1", "eval_every=10", "learner.lr=1e-2", "seed=5",
         "learner.bf16=false", "runtime.engine_bf16=false"]


def _cluster(*names: str) -> tuple[Cluster, dict[str, object]]:
    """A head without CPUs (the driver's node) and one node of one CPU per name, told apart by a
    custom resource `node_NAME`."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = {name: cluster.add_node(num_cpus=1, resources={f"node_{name}": 1}) for name in names}
    cluster.wait_for_nodes()
    return cluster, nodes


def _fit(app: str, out: Path, cluster: Cluster, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mas_trainer.cli", "fit", f"{WORDS}:{app}", "--data", str(WORDS_DATA), "--output", str(out),
            "--model", "tiny", *SMALL, f"runtime.ray_address={cluster.address}", *extra]


def _placed(cluster: Cluster) -> dict[str, list[str]]:
    """Ray's own record of every actor the cluster ran (alive or dead): class name -> the names
    of the nodes (their `node_NAME` resource) each one ran on."""
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        names = {n["NodeID"]: next((k[5:] for k in n["Resources"] if k.startswith("node_") and ":" not in k), "head")
                 for n in ray.nodes()}
        from ray._private.state import actors  # the GCS actor table; ray.util.state needs a dashboard

        placed: dict[str, list[str]] = {}
        for a in actors().values():
            placed.setdefault(a["ActorClassName"], []).append(names.get(a["Address"]["NodeID"], "?"))
        return placed
    finally:
        ray.shutdown()


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/")) and "/perf/" not in k and "/time/" not in k
             and not k.endswith("/seconds")} for r in rows]


def test_ranks_policies_and_replicas_are_placed_on_nodes_of_their_own(tmp_path):
    """Two policies (lead: one verl rank; crew: one rank and one CPU rollout replica) on three
    one-CPU nodes: each process on a node of its own, as Ray's actor table says."""
    cluster, _ = _cluster("a", "b", "c")
    try:
        r = subprocess.run(_fit("graph", tmp_path / "run", cluster, "steps=1", "policies.crew.engine=torch-replica"),
                           capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        placed = _placed(cluster)
    finally:
        cluster.shutdown()
    ranks = placed["PolicyWorker"]
    replica = [n for cls, nodes in placed.items() if "Rollout" in cls or "Replica" in cls for n in nodes if n != "head"]
    assert len(ranks) == 2 and len(set(ranks)) == 2, placed  # lead's rank and crew's, each on its own node
    assert replica and not set(replica) & set(ranks), placed
    assert "Traceback" not in r.stderr and (tmp_path / "run" / "workers.log").stat().st_size > 0


@pytest.mark.parametrize("extra, said", [
    ("runtime.resources.nodes=2", "policy solo: Ray placed 1 of the 2 placement group(s) of its verl worker group"),
    ("runtime.engine=torch-replica", "policy solo: Ray placed 0 of the 1 placement group(s) of its rollout replica 0"),
])
def test_a_placement_ray_cannot_grant_is_said_within_the_bound(tmp_path, extra, said):
    """Both nodes exist (the plan's check passes), but another job holds one node's CPU: the run
    stops after runtime.placement_timeout_s with one line, instead of waiting for ever, whether
    what waits is a learner's rank or a rollout replica."""
    cluster, _ = _cluster("a", "b")
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)  # the other job
        held = ray.util.placement_group([{"CPU": 1}])
        ray.get(held.ready(), timeout=60)
        t0 = time.monotonic()
        r = subprocess.run(_fit("single", tmp_path / "run", cluster, "steps=1", extra, "runtime.placement_timeout_s=5"),
                           capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
        took = time.monotonic() - t0
        ray.util.remove_placement_group(held)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert said in last and "placement_timeout_s=5" in last, last
    assert "Traceback" not in r.stderr and took < 240, took


def test_a_node_lost_mid_run_stops_in_one_line_and_resume_on_a_new_node_loses_nothing(tmp_path):
    """One policy of two ranks on two nodes (nodes=2). Uninterrupted, then again with the second
    node removed while step 3 or 4 runs: `fit` exits 1 within a bounded time with one line naming
    the lost rank and its node; `--resume` once a replacement node joined finishes the run, and
    its metrics rows equal the uninterrupted run's, none lost or twice."""
    cluster, nodes = _cluster("a", "b")
    try:
        whole = tmp_path / "whole"
        args = ("steps=5", "save_every=1", "runtime.resources.nodes=2")
        done = subprocess.run(_fit("single", whole, cluster, *args), capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        assert sorted(_placed(cluster)["PolicyWorker"]) == ["a", "b"]  # the two ranks on the two nodes

        broken = tmp_path / "broken"
        proc = subprocess.Popen(_fit("single", broken, cluster, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_env(), cwd=ROOT)
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            rows = _rows(broken) if (broken / "metrics.jsonl").exists() else []
            if any(r["kind"] == "train" and r["step"] >= 2 for r in rows):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before the node could be lost"
        t0 = time.monotonic()
        cluster.remove_node(nodes["b"])
        _, err = proc.communicate(timeout=300)
        took = time.monotonic() - t0
        assert proc.returncode == 1, err[-3000:]
        [line] = [ln for ln in err.splitlines() if ln.startswith("mas-trainer fit: error:")]
        assert "policy solo: rank" in line and "was lost (on node" in line and "add --resume" in line, line
        assert "Traceback" not in err and took < 240, (took, err[-2000:])
        assert (broken / "workers.log").stat().st_size > 0

        cluster.add_node(num_cpus=1, resources={"node_c": 1})  # the replacement
        cluster.wait_for_nodes()
        resumed = subprocess.run([*_fit("single", broken, cluster, *args), "--resume"], capture_output=True, text=True,
                                 timeout=600, env=_env(), cwd=ROOT)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    finally:
        cluster.shutdown()
    got, want = _rows(broken), _rows(whole)
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    assert _comparable(got) == _comparable(want)
    assert sorted(p.name for p in (broken / "trajectories").iterdir()) == sorted(p.name for p in (whole / "trajectories").iterdir())
