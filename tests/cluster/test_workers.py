"""The controller's handles on Ray worker groups: an abandoned call does not keep its task running."""

import asyncio
import os
import time

import pytest

ray = pytest.importorskip("ray")

from mas_trainer.errors import UserError  # noqa: E402
from mas_trainer.cluster.groups import ActorGroup  # noqa: E402


@ray.remote
class Slow:
    def __init__(self) -> None:
        self.state = "idle"

    async def generate(self, prompt_ids: list[int], seconds: float, turn_id: str | None) -> str:
        self.state = "running"
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.state = "cancelled"
            raise
        self.state = "finished"
        return "done"

    async def status(self) -> str:
        return self.state

    def load(self, folder: str) -> None:  # as a worker group refuses a planted checkpoint file
        from mas_trainer.errors import UserError

        raise UserError(f"{folder}/optimizer.pt holds a pickle; refused")


def test_cancelling_the_await_cancels_the_ray_task():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = Slow.remote()
        handle = ActorGroup("p", actor)

        async def abandon() -> None:
            task = asyncio.ensure_future(handle.generate([1], 60.0))  # type: ignore[arg-type]
            while ray.get(actor.status.remote()) != "running":
                await asyncio.sleep(0.05)
            task.cancel()  # the gateway does this when the client hangs up
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(abandon())
        deadline = time.time() + 120  # a hang guard
        while ray.get(actor.status.remote()) == "running" and time.time() < deadline:
            time.sleep(0.1)
        assert ray.get(actor.status.remote()) == "cancelled"

        # a worker's UserError reaches the CLI as its own line, not Ray's wrapped traceback
        with pytest.raises(UserError) as err:
            asyncio.run(handle.load("/run/checkpoint"))
        assert str(err.value) == "/run/checkpoint/optimizer.pt holds a pickle; refused"
    finally:
        ray.shutdown()


class _FlakyInit:
    """ray.init that fails the first `failures` times, as a head whose GCS server died does."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) <= self.failures:
            raise RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_0\nmore")


def _runtime(address=None):
    from types import SimpleNamespace

    return SimpleNamespace(ray_address=address, num_cpus=2)


def test_a_local_ray_head_that_fails_to_start_gets_one_more_try(monkeypatch, caplog):
    from mas_trainer.cluster import ray_init

    flaky = _FlakyInit(1)
    monkeypatch.setattr(ray, "init", flaky)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    ray_init.init_ray(_runtime(), 1, {"A": "1"})
    assert len(flaky.calls) == 2 and flaky.calls[0] == flaky.calls[1]
    assert flaky.calls[1]["runtime_env"] == {"env_vars": {"A": "1"}}
    assert "did not start (Timed out waiting for file" in caplog.text and "trying once more" in caplog.text
    assert ray_init.RAY_OWNER_ENV not in os.environ  # the mark is only for ray.init's children


def test_a_second_failure_and_a_cluster_failure_are_raised(monkeypatch):
    from mas_trainer.cluster import ray_init

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    twice = _FlakyInit(2)
    monkeypatch.setattr(ray, "init", twice)
    with pytest.raises(RuntimeError, match="gcs_server_port"):
        ray_init.init_ray(_runtime(), 1, {})
    assert len(twice.calls) == 2
    cluster = _FlakyInit(1)
    monkeypatch.setattr(ray, "init", cluster)
    with pytest.raises(RuntimeError, match="gcs_server_port"):
        ray_init.init_ray(_runtime("ray://head:10001"), 1, {})
    assert len(cluster.calls) == 1


def test_the_gateway_sees_the_context_of_a_worker_groups_engine():
    """Replicas' client or an in-process engine: the gateway caps max_tokens by it and refuses a
    prompt too long with a 400, rather than the engine failing the run; a group whose engine
    lives elsewhere (verl's rank 0) has none to tell."""
    from types import SimpleNamespace

    from mas_trainer.cluster.workers import WorkerEngine
    from mas_trainer.engines.base import max_context

    with_engine = SimpleNamespace(policy="p", engine=SimpleNamespace(max_context=1024))
    assert max_context(WorkerEngine(with_engine)) == 1024
    assert max_context(WorkerEngine(SimpleNamespace(policy="p"))) is None


def test_a_run_stopped_in_a_worker_reaches_the_cli_as_one_still():
    """Ray wraps a worker's exception in a class of the cause's type; the wrapper is unwrapped to
    the cause's one line, and a `RunStopped` (exit 1, the resume hint) stays one."""
    from mas_trainer.cluster.groups import _user_errors
    from mas_trainer.errors import RunStopped

    class Wrapped(RunStopped):  # what Ray's RayTaskError(cause) looks like: the cause's type, a traceback as text
        def __init__(self, cause):
            super().__init__("ray::PolicyWorker.train() ... Traceback ...")
            self.cause = cause

    for cause, kind in ((RunStopped("vLLM engine p: weight reload failed"), RunStopped),
                        (UserError("reward f raised"), UserError)):
        with pytest.raises(kind) as got, _user_errors():
            raise Wrapped(cause)
        assert type(got.value) is kind and str(got.value) == str(cause)
