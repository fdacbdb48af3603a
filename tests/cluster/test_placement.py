"""A worker lost with its node is one line naming the rank and the node; the workers' output
goes to the run's file; verl's micro-batches fit each rank's share of a mini-batch."""

import asyncio
import time

import pytest

from mas_trainer.cluster.groups import ActorGroup
from mas_trainer.cluster.placement import WorkerLost, lost_worker
from mas_trainer.errors import RunStopped, where_lost
from mas_trainer.engines.base import SamplingParams
from mas_trainer.errors import UserError

ray = pytest.importorskip("ray")

# the text of Ray's ActorDiedError for an actor whose node was removed (Ray 2.60)
DIED = """The actor died unexpectedly before finishing this task.
\tclass_name: PolicyWorker
\tactor_id: 49762c68dde3d5ef5decbb9e01000000
\tpid: 5154
\tname: xkfWXgPolicyWorker_1:0
\tip: 192.0.2.7
The actor died because its node has died. Node Id: f94eeae0456a724380693784d085aa9bf3951516aa6841f97400ae23
\tthe actor's node was terminated expectedly: received SIGTERM"""


def test_a_lost_actor_is_named_with_its_node_and_any_other_error_is_left_alone():
    assert where_lost(DIED) == ("on node 192.0.2.7 (id f94eeae0): its node has died "
                               "(terminated expectedly: received SIGTERM)")
    assert where_lost("something else") == "on node unknown: its process died"
    err = lost_worker(ray.exceptions.ActorDiedError(), "lead", "rank 1")
    assert isinstance(err, WorkerLost) and isinstance(err, RunStopped) and str(err).startswith("policy lead: rank 1 was lost (")
    assert "\n" not in str(err) and "resumable" in str(err)
    assert lost_worker(ValueError("a worker's own bug"), "lead", "rank 1") is None


class _Method:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def remote(self, *args):
        async def fail():
            raise self.exc
        return fail()


class _Actor:
    def __init__(self, exc: BaseException) -> None:
        self.generate = self.train = _Method(exc)


def test_the_group_whose_process_is_gone_says_so_once_and_reports_it_as_its_failure():
    group = ActorGroup("crew", _Actor(ray.exceptions.ActorDiedError()))
    with pytest.raises(WorkerLost, match=r"^policy crew: its worker process \(the torch learner and engine\) was lost"):
        asyncio.run(group.generate([1, 2], SamplingParams(max_tokens=4)))
    assert isinstance(group.failure(), WorkerLost)  # the trainer raises it when the step's rollouts failed
    with pytest.raises(WorkerLost):
        asyncio.run(group.train([]))
    mine = ActorGroup("crew", _Actor(UserError("a bad task")))  # a worker's own error stays what it is
    with pytest.raises(UserError, match="a bad task"):
        asyncio.run(mine.generate([1], SamplingParams(max_tokens=4)))
    assert mine.failure() is None


@pytest.mark.parametrize("mini, world, micro, want", [(16, 1, 4, 4), (4, 2, 4, 2), (6, 2, 4, 3), (2, 2, 4, 1), (14, 2, 4, 1)])
def test_verl_micro_batches_divide_each_ranks_share(mini, world, micro, want):
    pytest.importorskip("verl")
    from mas_trainer.engines.models import materialize
    from mas_trainer.learners.config import LearnerConfig
    from mas_trainer.learners.verl_parts import training_worker_config

    cfg = training_worker_config(str(materialize("tiny", seed=0)), LearnerConfig(mini_batch_size=mini, micro_batch_size=micro), world_size=world)
    assert cfg.engine_config.micro_batch_size_per_gpu == want == cfg.engine_config.infer_micro_batch_size_per_gpu


@pytest.mark.verl
def test_the_workers_output_goes_to_the_run_file_not_the_console(tmp_path, capfd):
    from mas_trainer.cluster.ray_init import send_worker_output_to

    @ray.remote(num_cpus=0)
    def say(word):
        print(word, flush=True)

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=True, configure_logging=False)
    log = tmp_path / "workers.log"
    try:
        send_worker_output_to(log)
        ray.get(say.remote("into-the-file"))
        deadline = time.time() + 60
        while "into-the-file" not in (log.read_text() if log.exists() else "") and time.time() < deadline:
            time.sleep(0.1)
        send_worker_output_to(None)
        ray.get(say.remote("back-on-the-console"))
        while "back-on-the-console" not in capfd.readouterr().out and time.time() < deadline:
            time.sleep(0.1)
            ray.get(say.remote("back-on-the-console"))
    finally:
        send_worker_output_to(None)
        ray.shutdown()
    text = log.read_text()
    assert "into-the-file" in text and "pid=" in text and "back-on-the-console" not in text
    assert time.time() < deadline


@pytest.mark.verl
def test_a_ranks_own_error_after_its_peer_died_is_said_as_the_peer_lost():
    """gloo's "connection closed" on rank 0 may reach the driver before rank 1's death does: the
    group then looks for a rank that is gone and says that, not rank 0's traceback."""
    from types import SimpleNamespace

    from mas_trainer.cluster.groups import VerlGroup

    @ray.remote(num_cpus=0)
    class Rank:
        def collective(self):
            raise RuntimeError("[gloo] Connection closed by peer")

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        ranks = [Rank.remote(), Rank.remote()]
        ray.get([r.__ray_ready__.remote() for r in ranks])
        ray.kill(ranks[1])
        group = SimpleNamespace(workers=ranks, train=lambda *args: [ranks[0].collective.remote()])
        handle = VerlGroup(SimpleNamespace(policy="lead"), group)  # type: ignore[arg-type]
        with pytest.raises(WorkerLost, match=r"^policy lead: rank 1 of its verl worker group of 2 was lost"):
            asyncio.run(handle.train([]))
        alone = VerlGroup(SimpleNamespace(policy="lead"), SimpleNamespace(workers=ranks[:1], train=group.train))
        with pytest.raises(RuntimeError, match="Connection closed"):  # no rank gone: the rank's own error
            asyncio.run(alone.train([]))
    finally:
        ray.shutdown()


@pytest.mark.verl
def test_place_pool_makes_the_placement_groups_verl_would():
    """place_pool stands in for verl's get_placement_groups (which waits for ever): the same
    bundles, strategy and names, read from verl's own pool, so a drift of verl's scheme fails here."""
    pytest.importorskip("verl")
    from verl.single_controller.ray.base import RayResourcePool

    from mas_trainer.cluster.placement import place_pool

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)  # two pools of 2 x 2 CPUs
    try:
        theirs = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=2, name_prefix="v")
        ours = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=2, name_prefix="m")
        theirs.get_placement_groups()
        place_pool(ours, policy="p", what="verl worker group", timeout_s=60, address=None)
        table = ray.util.placement_group_table()
        for a, b in zip(theirs.pgs, ours.pgs, strict=True):
            ta, tb = table[a.id.hex()], table[b.id.hex()]
            assert ta["bundles"] == tb["bundles"] and ta["strategy"] == tb["strategy"]
            assert ta["name"][1:] == tb["name"][1:]  # the same name but for the pool's prefix
    finally:
        ray.shutdown()


def test_a_worker_killed_by_rays_memory_monitor_is_one_line_with_the_fix():
    """Ray's `OutOfMemoryError` is no `RayActorError`: it was passed on whole (130 lines, no
    cause, no resume hint). It is a `RunStopped` now, naming the node, the memory and what to lower."""
    from ray.exceptions import OutOfMemoryError

    from mas_trainer.cluster.placement import lost_worker
    from mas_trainer.errors import RunStopped

    text = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.5, ID: 1a2b3c4d5e) "
            "was 15.10GB used / 15.60GB limit (0.968000)\nOOM kill reason: ...")
    lost = lost_worker(OutOfMemoryError(text), "solo", "its worker process (the torch learner and engine)")
    assert isinstance(lost, RunStopped)
    assert str(lost) == ("policy solo: its worker process (the torch learner and engine) was killed by Ray's memory monitor, "
                         "its node out of memory (on node 10.0.0.5: 15.10GB used / 15.60GB limit); lower "
                         "runtime.max_batch_size or rollout.max_in_flight, or give the node more memory; the run stopped, "
                         "resumable from its last checkpoint")
    assert lost_worker(ValueError("a worker's own bug"), "solo", "x") is None
