"""A run joined to a Ray cluster needs one run directory for every node that holds its actors
(verl's ranks write their checkpoint shards there): a node that sees another directory at that
path is named in one line at the start, with what to mount."""

from pathlib import Path

import pytest

from mas_trainer.cluster import storage
from mas_trainer.cluster.storage import check_nodes_share, check_shared_rundir
from mas_trainer.config import ConfigError

NODES = {"a" * 56: "10.0.0.1", "b" * 56: "10.0.0.2"}


def test_nodes_that_see_the_drivers_directory_pass_and_leave_no_probe(tmp_path):
    seen = []

    def write(node: str, path: Path, token: str) -> None:
        seen.append((node, path.parent))
        path.write_text(token)

    check_nodes_share(tmp_path, NODES, write)
    assert sorted(seen) == [(n, tmp_path) for n in sorted(NODES)]
    assert list(tmp_path.iterdir()) == []


def test_a_node_with_its_own_directory_at_that_path_is_named_with_what_to_mount(tmp_path):
    own = tmp_path / "node-b-disk"
    own.mkdir()
    run = tmp_path / "run"
    run.mkdir()

    def write(node: str, path: Path, token: str) -> None:  # node b's RUN_DIR is not the driver's
        (own if node.startswith("b") else path.parent).joinpath(path.name).write_text(token)

    with pytest.raises(ConfigError) as err:
        check_nodes_share(run, NODES, write)
    line = str(err.value)
    assert "\n" not in line and "node 10.0.0.2 (bbbbbbbb)" in line and "10.0.0.1" not in line, line
    assert f"run directory {run}" in line and "same path on every node" in line and "NFS" in line and "--output" in line
    assert list(run.iterdir()) == []


def test_a_node_that_cannot_write_or_does_not_answer_is_one_line(tmp_path):
    def missing(node: str, path: Path, token: str) -> None:
        raise FileNotFoundError(2, "No such file or directory", str(path))

    with pytest.raises(ConfigError, match=r"^node 10\.0\.0\.1 \(aaaaaaaa\) and 1 other node\(s\) does not share .*FileNotFoundError"):
        check_nodes_share(tmp_path, NODES, missing)

    def silent(node: str, path: Path, token: str) -> None:
        raise TimeoutError("no answer")

    with pytest.raises(ConfigError, match=r"^node 10\.0\.0\.1 .* did not answer the run directory check within 60 s"):
        check_nodes_share(tmp_path, NODES, silent)

    def broken(node: str, path: Path, token: str) -> None:
        raise KeyError(node)

    with pytest.raises(KeyError):  # not the filesystem's: no mount would mend it
        check_nodes_share(tmp_path, NODES, broken)


@pytest.mark.verl
def test_every_node_of_ray_s_test_cluster_holding_an_actor_writes_a_probe(tmp_path, monkeypatch):
    """Ray's own multi-node test cluster: a head with no CPUs and two nodes, an actor on each;
    every node runs on this machine, so they share its filesystem. No dashboard: the actors'
    nodes are read from the GCS, as a cluster started without one offers them."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for name in ("node_a", "node_b"):
            cluster.add_node(num_cpus=1, resources={name: 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)

        @ray.remote(num_cpus=1)
        class Holder:
            def node(self) -> str:
                return ray.get_runtime_context().get_node_id()

        holders = [Holder.options(resources={name: 1}).remote() for name in ("node_a", "node_b")]
        held = ray.get([h.node.remote() for h in holders])
        assert len(set(held)) == 2
        assert set(storage.actor_nodes()) == set(held)

        ran, real = [], storage.ray_write
        monkeypatch.setattr(storage, "ray_write", lambda node, path, token: ran.append(real(node, path, token)))
        check_shared_rundir(tmp_path)
        assert sorted(ran) == sorted(held)  # each probe ran on the node it was pinned to
        assert list(tmp_path.iterdir()) == []
        with pytest.raises(ConfigError, match=r"^node \S+ \(\w{8}\) and 1 other node\(s\) does not share .*FileNotFoundError"):
            check_shared_rundir(tmp_path / "absent")  # the node's own error, not Ray's wrapper
    finally:
        ray.shutdown()
        cluster.shutdown()
