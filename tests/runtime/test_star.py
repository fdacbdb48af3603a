"""The controller's handles on Ray worker groups: an abandoned call does not keep its task running."""

import asyncio
import time

import pytest

ray = pytest.importorskip("ray")

from mas_trainer.runtime.star import WorkerHandle  # noqa: E402


@ray.remote
class Slow:
    def __init__(self) -> None:
        self.state = "idle"

    async def generate(self, seconds: float) -> str:
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


def test_cancelling_the_await_cancels_the_ray_task():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = Slow.remote()
        handle = WorkerHandle("p", actor, remote=True)

        async def abandon() -> None:
            task = asyncio.ensure_future(handle.call("generate", 60.0))
            while ray.get(actor.status.remote()) != "running":
                await asyncio.sleep(0.05)
            task.cancel()  # the gateway does this when the client hangs up
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(abandon())
        deadline = time.time() + 20
        while ray.get(actor.status.remote()) == "running" and time.time() < deadline:
            time.sleep(0.1)
        assert ray.get(actor.status.remote()) == "cancelled"
    finally:
        ray.shutdown()
