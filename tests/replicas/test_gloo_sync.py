"""`mas-gloo`, the CPU checkpoint engine: verl's topology and send/receive contract, in buckets."""

import asyncio
import threading

import pytest
import torch

pytest.importorskip("verl")

from verl.checkpoint_engine import CheckpointEngineRegistry  # noqa: E402

import mas_trainer.replicas.gloo_sync  # noqa: E402,F401


def _weights():
    g = torch.Generator().manual_seed(0)
    return [("embed.weight", torch.randn(50, 8, generator=g)), ("norm.weight", torch.randn(8, generator=g).bfloat16()),
            ("head.weight", torch.randn(50, 8, generator=g)), ("steps", torch.tensor([3], dtype=torch.int64))]


def test_learner_rank0_broadcasts_every_tensor_to_every_replica_in_buckets():
    cls = CheckpointEngineRegistry.get("mas-gloo")
    # learner ranks 0 and 1 (rank 1 only walks its stream), two replica workers; 1 KiB buckets
    learner = [cls(bucket_size=1024, is_master=True), cls(bucket_size=1024)]
    replicas = [cls(bucket_size=1024), cls(bucket_size=1024)]
    metadata = [e.prepare() for e in learner + replicas]
    actor_kw, rollout_kw = cls.build_topology(2, 2, metadata)
    assert actor_kw["rank"] == [0, -1] and rollout_kw["rank"] == [1, 2]
    got: dict[int, list] = {}
    walked = []

    def walk(stream):
        for item in stream:
            walked.append(item[0])
            yield item

    def learner_side(i):
        e = learner[i]
        e.init_process_group(**{k: v[i] for k, v in actor_kw.items()})
        asyncio.run(e.send_weights(walk(iter(_weights())) if i else iter(_weights()), global_steps=1))

    def replica_side(i):
        e = replicas[i]
        e.init_process_group(**{k: v[i] for k, v in rollout_kw.items()})

        async def take():
            return [(n, t.clone()) async for n, t in e.receive_weights(global_steps=1)]

        got[i] = asyncio.run(take())

    threads = [threading.Thread(target=learner_side, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=replica_side, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = _weights()
    assert walked == [n for n, _ in want]  # the non-sending rank still produced every tensor
    for i in range(2):
        assert [n for n, _ in got[i]] == [n for n, _ in want]
        for (_, a), (_, b) in zip(got[i], want):
            assert a.dtype == b.dtype and torch.equal(a, b)
    for e in learner + replicas:
        e.finalize()
