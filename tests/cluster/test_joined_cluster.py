"""A Ray cluster too small for the run's worker groups is said at once, in one line, before
Ray is asked to place anything (it would wait for ever): checked against the joined cluster's
nodes, as verl places a pool (one strict-pack placement group per node)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mas_trainer.cluster.plan import Machine, check_cluster_fits, placement_asks, resolve_plan
from mas_trainer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
WORDS = ROOT / "tests" / "fixtures" / "words_app.py"
TWO = {"lead": ("tiny", "tiny"), "crew": ("tiny", "tiny")}
NODES = [{"CPU": 0.0, "memory": 1e9}, {"CPU": 1.0, "node:a": 1.0}, {"CPU": 1.0, "node:b": 1.0}]  # Ray's test cluster's shape


def _asks(*overrides: str, models=TWO, gpus: int = 0):
    return placement_asks(resolve_plan(load_config(overrides=["runtime.learner=verl", "learner.mini_batch_size=2", *overrides]),
                                       models, machine=Machine(gpus=gpus, cpus=2)))


def test_a_policy_on_two_nodes_fits_two_one_cpu_nodes_and_two_such_policies_do_not():
    one = _asks("runtime.resources.nodes=2", models={"solo": ("tiny", "tiny")})
    assert one == [("solo", {"CPU": 1.0})] * 2
    check_cluster_fits(one, NODES, "ray://head:10001")
    with pytest.raises(ConfigError, match=r"policy (lead|crew) asks 2 placement\(s\) of \{CPU: 1\} each on one node.*"
                                          r"ray://head:10001.*3 node\(s\): CPU 0; CPU 1; CPU 1\): add nodes"):
        check_cluster_fits(_asks("runtime.resources.nodes=2"), NODES, "ray://head:10001")


def test_ranks_of_a_node_stay_on_one_node_and_gpus_are_asked_where_there_are_gpus():
    # two ranks a node need one node with 2 CPUs: two nodes of one CPU each do not hold them
    asks = _asks("runtime.resources.procs_per_node=2", models={"solo": ("tiny", "tiny")})
    assert asks == [("solo", {"CPU": 2.0})]
    with pytest.raises(ConfigError, match="policy solo"):
        check_cluster_fits(asks, NODES, "auto")
    gpu = _asks("runtime.resources.nodes=2", models={"solo": ("tiny", "tiny")}, gpus=2)
    assert gpu == [("solo", {"CPU": 1.0, "GPU": 1.0})] * 2
    with pytest.raises(ConfigError, match="GPU: 1"):
        check_cluster_fits(gpu, NODES, "auto")  # CPU-only nodes
    check_cluster_fits(gpu, [{"CPU": 8.0, "GPU": 1.0}] * 2, "auto")


def test_cpu_replicas_ask_a_cpu_each():
    asks = _asks("runtime.engine=torch-replica", "runtime.replica.replicas=2", models={"solo": ("tiny", "tiny")})
    assert asks == [("solo", {"CPU": 1.0})] * 3  # the learner's rank, then two replicas
    with pytest.raises(ConfigError, match="policy solo"):
        check_cluster_fits(asks, NODES, "auto")


@pytest.mark.verl
def test_fit_joined_to_a_too_small_cluster_says_so_at_once(tmp_path):
    """The case that waited for ever: two policies of two ranks each on a head with no CPUs and
    two one-CPU nodes (Ray's own multi-node test cluster), joined through runtime.ray_address."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for name in ("a", "b"):
            cluster.add_node(num_cpus=1, resources={f"node_{name}": 1})
        cluster.wait_for_nodes()
        env = {**os.environ, "OPENAI_API_KEY": "test"}
        r = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "fit", f"{WORDS}:graph", "--data",
                            str(ROOT / "tests" / "fixtures" / "words.jsonl"), "--output", str(tmp_path / "run"),
                            "--model", "tiny", "steps=1", "runtime.learner=verl", "runtime.resources.nodes=2",
                            "learner.mini_batch_size=2", f"runtime.ray_address={cluster.address}"],
                           capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    finally:
        cluster.shutdown()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert "policy" in last and "cannot hold the run's worker groups" in last and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before the run directory was written


@pytest.mark.verl
def test_a_cluster_with_token_authentication_refused_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    """A cluster Ray 2.60 starts turns token authentication on; a run whose environment is not in
    token mode is refused by it: one line saying what to set, not Ray's traceback."""
    from ray._raylet import Config
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # as a local ray.init turns it on: the cluster's processes inherit it
    Config.initialize("")  # Ray's cached config reads it again
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {"OPENAI_API_KEY": "test"}
            r = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "fit", f"{WORDS}:single", "--data",
                                str(ROOT / "tests" / "fixtures" / "words.jsonl"), "--output", str(tmp_path / "run"), "--model",
                                "tiny", "steps=1", "runtime.learner=verl", f"runtime.ray_address={cluster.address}"],
                               capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        finally:
            cluster.shutdown()
    finally:
        monkeypatch.undo()
        Config.initialize("")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert "could not join the Ray cluster" in last and "set RAY_AUTH_MODE=token" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "config.yaml").exists()
