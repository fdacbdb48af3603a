"""One run directory for every node holding the run's actors, checked when `fit` joins a Ray
cluster: verl's ranks write their checkpoint shards into RUN_DIR on their own node, and shards a
node writes to a disk of its own are missing when a resume reads them. Each node writes a probe
(plain text, a random token) that the driver reads back; nothing read here is executed.
"""

from __future__ import annotations

import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

from mas_trainer.config import ConfigError

__all__ = ["PROBE_TIMEOUT_S", "check_shared_rundir", "check_nodes_share", "actor_nodes", "ray_write"]

PROBE_TIMEOUT_S = 60.0  # a node's probe task, from submission to its answer
_SILENT = "no answer"


def check_shared_rundir(root: Path) -> None:
    """Every node holding an alive actor of this Ray job sees `root` as the driver does: one
    probe task per node (`ray_write`), then the driver reads each probe back."""
    check_nodes_share(root, actor_nodes(), ray_write)


def check_nodes_share(root: Path, nodes: Mapping[str, str], write: Callable[[str, Path, str], Any]) -> None:
    """`nodes`: node id -> IP; `write(node, path, token)` writes `token` at `path` on `node`, for
    every node at once. Refuses in one line the first node (by IP) whose probe the driver cannot
    read back; the probes are removed whatever the answer."""
    root = root.absolute()  # a relative path would be another worker's working directory
    run = secrets.token_hex(4)
    probes = {node: (root / f".probe-{run}-{node}", secrets.token_hex(16)) for node in nodes}
    try:
        with ThreadPoolExecutor(max(1, len(probes))) as pool:
            answers = {node: pool.submit(write, node, path, token) for node, (path, token) in probes.items()}
        found = [(nodes[node], node, _problem(answers[node], path, token)) for node, (path, token) in probes.items()]
        bad = sorted(b for b in found if b[2])
    finally:
        for path, _token in probes.values():
            path.unlink(missing_ok=True)
    if bad:
        ip, node, problem = bad[0]
        who = f"node {ip} ({node[:8]})" + (f" and {len(bad) - 1} other node(s)" if len(bad) > 1 else "")
        if problem == _SILENT:
            raise ConfigError(f"{who} did not answer the run directory check within {PROBE_TIMEOUT_S:g} s: see that it is "
                              "alive (ray status) and run again")
        raise ConfigError(f"{who} does not share the run directory {root} with the driver: {problem}; mount the run directory "
                          "at the same path on every node of the Ray cluster (e.g. NFS), or pass --output on a filesystem "
                          "every node shares")


def _problem(answer: Future, path: Path, token: str) -> str:
    """What went wrong with one node's probe, or '' when the driver read back what it wrote. An
    error other than the filesystem's (or no answer) is raised as it is: no mount would mend it."""
    error = answer.exception()
    if isinstance(error, TimeoutError):
        return _SILENT
    if isinstance(error, OSError):
        return f"writing its probe failed ({type(error).__name__}: {' '.join(str(error).split())[:200]})"
    if error is not None:
        raise error
    try:
        seen = path.read_text(encoding="utf-8")
    except OSError:
        return f"its probe {path.name} is not there for the driver"
    return "" if seen == token else f"its probe {path.name} holds something else for the driver"


def actor_nodes() -> dict[str, str]:
    """Node id -> IP of every node holding an alive actor of this Ray job. Read from the GCS,
    as `ray.util.state.list_actors` would through the dashboard, which a cluster (and the local
    instance `init_ray` starts) may run without."""
    import ray
    from ray._private.state import actors

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return {a["Address"]["NodeID"]: a["Address"]["IPAddress"] for a in actors(job_id=job, actor_state_name="ALIVE").values()}


def _write_probe(path: str, token: str) -> str:
    """On the node: the probe written (its directory is not created: a missing one is the answer)."""
    import ray

    Path(path).write_text(token, encoding="utf-8")
    return ray.get_runtime_context().get_node_id()


def ray_write(node: str, path: Path, token: str) -> str:
    """The probe written by a Ray task pinned to `node`; the node it ran on is returned."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pinned = NodeAffinitySchedulingStrategy(node, soft=False)  # no CPU asked: it never waits behind the workers
    ref = ray.remote(num_cpus=0, max_retries=0, scheduling_strategy=pinned)(_write_probe).remote(str(path), token)
    try:
        ran = ray.get(ref, timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise TimeoutError(f"no answer within {PROBE_TIMEOUT_S:g} s") from None
    except ray.exceptions.RayTaskError as exc:  # the node's own error (e.g. no such directory), not Ray's wrapper
        raise exc.cause from None
    if ran != node:
        raise RuntimeError(f"the probe ran on node {ran[:8]}")
    return ran
