"""One contract for a policy's worker group: the in-process group, the Ray proxies and the
replica group have the same typed methods, and file, take and forget turns alike."""

import asyncio
import inspect
import logging
from types import SimpleNamespace

import pytest

from mas_trainer.engines.base import ENGINE_METRICS, SamplingParams, choice_id
from mas_trainer.engines.fake import FakeEngine
from mas_trainer.policy.contract import WorkerGroupHandle
from mas_trainer.policy.turns import BufferedTurn, Serving, TurnStore
from mas_trainer.cluster.groups import ActorGroup, VerlGroup
from mas_trainer.cluster.workers import ReplicaGroupHandle

METHODS = ("generate", "discard", "train", "warm_start", "save", "load", "failure", "close")


def _groups():
    from mas_trainer.policy.local import LocalPolicy

    from mas_trainer.cluster.groups import SharedActorGroup
    from mas_trainer.policy.shared_base import AdapterPolicy

    return [LocalPolicy, ActorGroup, VerlGroup, ReplicaGroupHandle, AdapterPolicy, SharedActorGroup]


@pytest.mark.parametrize("cls", _groups(), ids=lambda c: c.__name__)
def test_every_group_has_the_protocols_methods_and_signatures(cls):
    for name in METHODS:
        want, have = getattr(WorkerGroupHandle, name), getattr(cls, name)
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(want), (cls.__name__, name)
        wp = list(inspect.signature(want).parameters.values())
        hp = list(inspect.signature(have).parameters.values())
        assert [p.name for p in hp[: len(wp)]] == [p.name for p in wp], (cls.__name__, name)
        # parameters beyond the contract's are optional (verl's train takes the replicas' turns)
        assert all(p.default is not inspect.Parameter.empty for p in hp[len(wp):]), (cls.__name__, name)


class _Metered(FakeEngine):
    def __init__(self) -> None:
        super().__init__("p")
        self.requests = 0

    async def generate(self, prompt_ids, params, *, turn_id=None):
        self.requests += 1
        return await super().generate(prompt_ids, params, turn_id=turn_id)

    def metrics(self):
        return {"requests": float(self.requests), "tokens": 0.0, "busy_s": 0.0}


def _embedded():
    from mas_trainer.policy.local import LocalPolicy

    g = LocalPolicy.__new__(LocalPolicy)  # no model: only the serving side is under test
    g.policy, g.serving = "p", Serving(_Metered(), TurnStore("p"))
    g.learner = SimpleNamespace(updates=3)  # the weights have had 3 updates
    return g


def _verl_rank0():
    pytest.importorskip("verl")
    from mas_trainer.policy.verl_rank import PolicyWorker

    w = PolicyWorker.__new__(PolicyWorker)
    w.serving, w.learner = Serving(_Metered(), TurnStore("p")), SimpleNamespace(updates=3)
    return w


def _replicas():
    engine = _Metered()
    fleet = SimpleNamespace(engine=lambda tokenizer, on_output: engine, version=3)
    return ReplicaGroupHandle(SimpleNamespace(policy="p", plan=SimpleNamespace(max_staleness=0)), fleet, tokenizer=None)


@pytest.mark.parametrize("make", [_embedded, _verl_rank0, _replicas], ids=["embedded", "verl", "replicas"])
def test_every_group_files_choices_by_choice_id_with_their_weights_version_and_discards_them(make):
    group = make()

    async def run():
        gens = await group.generate([5, 6], SamplingParams(n=2, max_tokens=3), "call")
        await group.generate([7], SamplingParams(), None)  # not for training: not kept
        return gens

    gens = asyncio.run(run())
    store = group.serving.turns
    assert len(store) == 2
    pairs = store.take([SimpleNamespace(turn_id=choice_id("call", i)) for i in range(2)])
    # each choice filed with the version of the weights that generated it (rollout.max_staleness bounds it)
    assert [t for _, t in pairs] == [BufferedTurn([5, 6], g.token_ids, g.logprobs, version=3) for g in gens]
    asyncio.run(group.generate([5], SamplingParams(), "again"))
    assert asyncio.run(group.discard()) == 1 and len(store) == 0
    assert set(group.serving.figures()) == set(ENGINE_METRICS.values())


def test_taking_skips_unknown_turns_with_one_warning_and_empties_the_store(caplog):
    store = TurnStore("p")
    store.record("a", [1], [SimpleNamespace(token_ids=[2], logprobs=[-0.1])])
    store.add({"b": BufferedTurn([3], [4], [-0.2])})
    records = [SimpleNamespace(turn_id=t) for t in ("a", "x", "b", "y")]
    with caplog.at_level(logging.WARNING):
        assert dict((r.turn_id, t) for r, t in store.take(records)) == {"a": BufferedTurn([1], [2], [-0.1]), "b": BufferedTurn([3], [4], [-0.2])}
    assert len(store) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 4 records" in warnings[0].getMessage()
    assert store.take(records) == [] and store.clear() == 0


def test_engine_metrics_have_the_same_keys_on_every_engine():
    from mas_trainer.replicas.engine import ReplicaEngine

    replica = ReplicaEngine(SimpleNamespace(), model_name="p", decode=str, eos_ids=[2])
    assert tuple(replica.metrics()) == tuple(ENGINE_METRICS)
    torch = pytest.importorskip("torch")  # noqa: F841
    from mas_trainer.engines.torch_engine import load_engine
    from mas_trainer.engines.config import EngineSettings

    with load_engine("tiny", name="p", settings=EngineSettings(batch_wait_ms=0, engine_bf16=False)) as engine:
        asyncio.run(engine.generate([1, 17, 42], SamplingParams(max_tokens=4, seed=0)))
        meter_keys = tuple(engine.metrics())
        assert meter_keys == tuple(ENGINE_METRICS)
        m = engine.metrics()
        assert m["requests"] == 1 and m["tokens"] >= 1 and m["busy_s"] > 0


def test_replicas_keep_no_answer_version_of_a_call_that_is_not_trained():
    """Each replica answer reports its weights version; with overlap (nothing clears them at the
    update) a call without a turn id (a held-out or untraced call) must not leave its behind."""
    class _Answering(_Metered):
        async def generate(self, prompt_ids, params, *, turn_id=None):
            assert turn_id is not None  # the handle names every call, so it can collect its answers
            for i in range(params.n):
                self.on_output(choice_id(turn_id, i), SimpleNamespace(extra_fields={"global_steps": 2}))
            return await super().generate(prompt_ids, params, turn_id=turn_id)

    engine = _Answering()

    def make_engine(tokenizer, on_output):
        engine.on_output = on_output
        return engine

    fleet = SimpleNamespace(engine=make_engine, version=3)
    group = ReplicaGroupHandle(SimpleNamespace(policy="p", plan=SimpleNamespace(max_staleness=1)), fleet, tokenizer=None)
    asyncio.run(group.generate([7], SamplingParams(n=3), None))
    asyncio.run(group.generate([5, 6], SamplingParams(n=2), "call"))
    assert group._versions == {} and len(group.serving.turns) == 2
    (_, turn), _ = group.serving.turns.take([SimpleNamespace(turn_id=choice_id("call", i)) for i in range(2)], 3)
    assert turn.version == 2  # the version the replica answered with, not the fleet's current one
