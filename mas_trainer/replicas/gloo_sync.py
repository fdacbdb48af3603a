"""A verl `CheckpointEngine` over gloo: the learner's weights to rollout replicas on CPU.

verl's weight sync (`CheckpointEngineManager.update_weights`) is generic over its checkpoint
engines; the ones it ships move weights over NCCL, NIXL, HCCL, ... and need accelerators.
This one moves them over a gloo process group of its own (a `TCPStore` rendezvous at the
learner's rank 0), so the same manager, replicas and order of calls run on CPU: CI tests
the path a cluster takes with `nccl`. Registered as `mas-gloo`.

Topology as verl's single-sender NCCL engine: learner rank 0 broadcasts, the other learner
ranks only walk the parameter stream (gathering each full tensor is collective over the
learner's shards), every rollout worker receives. Tensors travel in buckets of at most
`bucket_size` bytes; each bucket is preceded by a JSON header (names, dtypes, shapes,
offsets), never pickle: the port is reachable by other local processes.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, AsyncGenerator, Generator, Iterable

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

__all__ = ["GlooCheckpointEngine"]

_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                      torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


@CheckpointEngineRegistry.register("mas-gloo")
class GlooCheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0, **_: Any) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.timeout = timedelta(seconds=timeout_s)
        self.rank: int | None = None
        self._store: Any = None
        self._pg: Any = None

    # --- topology ------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {}
        # the rendezvous store binds a free port at once and keeps it: a port probed and let go
        # could be taken before the bind by another run's sync on the same node (or any process)
        self._store = dist.TCPStore(_host_ip(), 0, is_master=True, timeout=self.timeout, wait_for_workers=False)
        return {"master": {"addr": _host_ip(), "port": self._store.port}}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]) -> tuple[dict, dict]:
        master = metadata[0].get("master")
        assert master is not None, "the learner's rank 0 must be the sync's master"
        world = 1 + rollout_world_size
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "master": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size, "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict[str, Any]) -> None:
        self.rank = rank
        if rank < 0:
            return
        if rank > 0:  # rank 0's store is the one its prepare bound
            self._store = dist.TCPStore(master["addr"], master["port"], world_size, False, timeout=self.timeout)
        self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, self.timeout)

    def finalize(self) -> None:
        self._pg = None
        self._store = None
        self.rank = None

    # --- transfer ------------------------------------------------------------------------
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None) -> dict:
        assert self.rank is not None and self.rank <= 0, "rollout workers receive, they do not send"
        if self.rank < 0:  # producing each full tensor is collective over the learner's ranks
            for _ in weights:
                pass
            return {}
        sent = 0
        for bucket in _buckets(weights, self.bucket_size):
            sent += self._send_bucket(bucket, last=False)
        self._send_bucket([], last=True)
        return {"weight_sync/bytes": float(sent)}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        while True:
            header, data = self._receive_bucket()
            for name, dtype, shape, offset, nbytes in header["tensors"]:
                raw = data[offset: offset + nbytes]
                yield name, raw.view(_DTYPES[dtype]).reshape(shape)
            if header["last"]:
                return

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._pg.broadcast([t], opts).wait()

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], last: bool) -> int:
        entries, offset = [], 0
        for name, t in bucket:
            entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, t.numel() * t.element_size()])
            offset += entries[-1][-1]
        meta = torch.frombuffer(bytearray(json.dumps({"tensors": entries, "last": last}).encode()), dtype=torch.uint8)
        data = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket]) if bucket else torch.zeros(0, dtype=torch.uint8)
        self._broadcast(torch.tensor([meta.numel(), data.numel()], dtype=torch.int64))
        self._broadcast(meta)
        if data.numel():
            self._broadcast(data)
        return int(data.numel())

    def _receive_bucket(self) -> tuple[dict[str, Any], torch.Tensor]:
        sizes = torch.zeros(2, dtype=torch.int64)
        self._broadcast(sizes)
        meta = torch.zeros(int(sizes[0]), dtype=torch.uint8)
        self._broadcast(meta)
        data = torch.zeros(int(sizes[1]), dtype=torch.uint8)
        if data.numel():
            self._broadcast(data)
        return json.loads(bytes(meta.numpy()).decode()), data


def _buckets(weights: Iterable[tuple[str, torch.Tensor]], size: int) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, t in weights:
        t = t.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        if bucket and used + n > size:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, t))
        used += n
    if bucket:
        yield bucket


def _local_only() -> bool:
    import ray

    return not ray.is_initialized() or len(ray.nodes()) <= 1


def _host_ip() -> str:
    if _local_only():
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()
