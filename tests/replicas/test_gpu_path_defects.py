"""The GPU paths of rollout replicas, checked on CPU with fakes of what needs a GPU (issue 43,
point 4): the weights version a step with no turns leaves, generations cut at the context
limit, and colocated vLLM's sleep and wake around the learner (verl's hybrid engine).

The fakes answer as verl 0.9.1 does: a server's answers carry the version it was told
(`set_global_steps`; None before it is told), its vLLM server clamps `max_tokens` to the
context left and reports "completed" for vLLM's stop and length alike, and a colocated
replica's sleep (level 2) drops its weights, so only a weight sync wakes it."""

import asyncio
import contextlib
from types import SimpleNamespace

from verl.workers.rollout.replica import TokenOutput

from mas_trainer.cluster.workers import ReplicaGroupHandle
from mas_trainer.engines.base import SamplingParams, choice_id, max_context
from mas_trainer.policy.contract import StepResult
from mas_trainer.policy.turns import Serving, TurnStore
from mas_trainer.replicas.config import ReplicaConfig
from mas_trainer.replicas.fleet import RolloutFleet

EOS = 2


class Replica:
    """One replica as the fleet and the engine see it: a server told its version, a vLLM that
    sleeps and wakes, and verl's clamp of `max_tokens` (vllm_async_server.py `generate`)."""

    def __init__(self, events: list, max_model_len: int = 4096, eos_at: int | None = None) -> None:
        self.events, self.max_model_len, self.eos_at = events, max_model_len, eos_at
        self.global_steps: int | None = None  # verl's server: None until set_global_steps
        self.awake = True  # verl's hybrid engine starts vLLM with its weights and KV cache
        self.weights = True
        replica = self

        class _Method:
            async def remote(self, version):
                replica.global_steps = version

        self.servers = [SimpleNamespace(set_global_steps=_Method())]

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        assert self.awake and self.weights, "a request reached a sleeping vLLM"
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"Prompt length ({len(prompt_ids)}) leaves no room to generate")
        max_tokens = max(1, min(sampling_params["max_tokens"], room))
        ids = [EOS if k == self.eos_at else 3 + k % 20 for k in range(max_tokens)]
        ids = ids[: ids.index(EOS) + 1] if EOS in ids else ids
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})


class Manager:
    """verl's CheckpointEngineManager over one colocated replica: `sleep_replicas` frees the GPU
    (level 2: the weights go too); `update_weights` (`naive`) is the learner's in-process sync,
    which loads the weights and then wakes the KV cache."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def sleep_replicas(self):
        assert self.replica.awake, "vLLM put to sleep twice"
        self.replica.events.append("sleep")
        self.replica.awake = self.replica.weights = False

    def update_weights(self, global_steps=None):
        self.replica.events.append(f"update_weights {global_steps}")
        self.replica.awake = self.replica.weights = True
        return {}

    def wake_up_replicas(self):  # a level-2 sleep left no weights to wake: verl wakes by update_weights
        raise AssertionError("woke vLLM without its weights")


class Learner:
    """A verl worker group as the handle sees it (`VerlGroup`); every GPU phase of the learner
    checks that the colocated vLLM sleeps."""

    def __init__(self, replica: Replica, updates: int = 0, max_staleness: int = 0, hybrid: bool = True) -> None:
        self.policy, self.plan, self.group = "p", SimpleNamespace(max_staleness=max_staleness), object()
        self.replica, self.updates, self.hybrid = replica, updates, hybrid
        self.trained: list = []

    def _phase(self, what: str) -> None:
        self.replica.events.append(what)
        if self.hybrid:
            assert not self.replica.awake, f"the learner's {what} ran beside an awake vLLM"

    async def train(self, records, turns):
        self._phase("train")
        if not records:
            return StepResult({"turns": 0.0, "updates": float(self.updates)})
        self.trained.append(dict(turns))
        self.updates += 1
        return StepResult({"turns": float(len(records)), "updates": float(self.updates)})

    async def warm_start(self, examples, config):
        self._phase("warm_start")
        return {}

    async def save(self, folder, learner_dir):
        self._phase("save")

    async def load(self, learner_dir):
        self._phase("load")
        return self.updates


class Tokenizer:
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _fleet(replica: Replica, *, colocated: bool, max_model_len: int = 4096) -> RolloutFleet:
    cfg = ReplicaConfig(placement="colocated" if colocated else "separate", max_model_len=max_model_len)
    fleet = RolloutFleet("p", "unused", "torch-replica", cfg, device="cuda")
    fleet.replicas, fleet.client = [replica], replica
    manager = Manager(replica)
    fleet._manager = lambda learner_group: manager  # type: ignore[method-assign]
    return fleet


def _handle(replica: Replica, learner: Learner, *, colocated: bool = True, max_model_len: int = 4096) -> ReplicaGroupHandle:
    return ReplicaGroupHandle(learner, _fleet(replica, colocated=colocated, max_model_len=max_model_len), Tokenizer())


def _records(*turn_ids: str) -> list:
    return [SimpleNamespace(turn_id=t) for t in turn_ids]


# --- (a) the weights version after a step with no turns -------------------------------------
class RankLearner(Learner):
    """A verl worker group of one rank: `PolicyWorker.train` itself (its turn store, its staleness
    rule, its result for a step with nothing to train); only the update is faked."""

    def __init__(self, replica: Replica, monkeypatch, updates: int, max_staleness: int) -> None:
        import torch

        from mas_trainer.policy import verl_rank

        super().__init__(replica, updates, max_staleness, hybrid=False)
        monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda objects, src=0: None)  # one rank: itself

        def update(pairs, advantage, learner):
            self.trained.append({r.turn_id: t for r, t in pairs})
            learner.updates += 1
            return StepResult({"turns": float(len(pairs))})

        monkeypatch.setattr(verl_rank, "policy_step", update)
        self.worker = verl_rank.PolicyWorker.__new__(verl_rank.PolicyWorker)
        self.worker._rank = 0
        self.worker.serving = Serving(None, TurnStore("p", max_staleness))
        self.worker.learner = SimpleNamespace(updates=updates, on_device=contextlib.nullcontext)
        self.worker.sink, self.worker.plan = SimpleNamespace(changed=lambda learner: None), SimpleNamespace(advantage=None)

    async def train(self, records, turns):
        self._phase("train")
        return self.worker.train(records, turns)

    async def load(self, learner_dir):
        self._phase("load")
        return self.worker.learner.updates


def test_a_step_with_no_turns_keeps_the_version_the_replicas_serve_and_the_next_turns_are_trained(monkeypatch):
    """After a step that trained nothing, the replicas still serve the weights of the last update:
    their answers, and the turns filed from them, keep its version. Falling back to 0 filed the
    next step's fresh turns as 5 updates old, and the verl rank refused them as stale."""
    replica = Replica([])
    learner = RankLearner(replica, monkeypatch, updates=5, max_staleness=1)
    group = _handle(replica, learner, colocated=False)

    async def run():
        assert await group.load("ckpt") == 5
        await group.train([])  # a step that trained nothing
        await group.generate([1, 2, 3], SamplingParams(max_tokens=4), "t1")
        return await group.train(_records(choice_id("t1", 0)))

    result = asyncio.run(run())
    assert [t.version for turns in learner.trained for t in turns.values()] == [5]  # trained, as served by update 5
    assert result.metrics["turns/stale"] == 0.0 and result.metrics["replica/stale_turns"] == 0.0
    assert group.fleet.version == 6 and replica.global_steps == 6


def test_a_learner_result_without_updates_leaves_the_replicas_version_as_it_was():
    """A learner that reports no `updates` changed no weights: the fleet keeps its version."""
    events: list = []
    replica = Replica(events)
    learner = Learner(replica, updates=5, max_staleness=1, hybrid=False)

    async def train(records, turns):
        return StepResult({"turns": 0.0})  # a verl rank's result for a step with nothing to train

    learner.train = train  # type: ignore[method-assign]
    group = _handle(replica, learner, colocated=False)
    asyncio.run(group.load("ckpt"))
    asyncio.run(group.train([]))
    assert group.fleet.version == 5 and replica.global_steps == 5


def test_a_verl_rank_reports_the_weights_version_after_a_step_with_no_turns(monkeypatch):
    """What the handle tells the replicas after a step comes from the rank's result."""
    replica = Replica([])
    result = asyncio.run(RankLearner(replica, monkeypatch, updates=5, max_staleness=1).train([], {}))
    assert result.metrics["turns"] == 0.0 and result.metrics["updates"] == 5.0


def test_an_answer_without_a_version_is_filed_with_the_fleets_own():
    """verl's server answers `global_steps` None until it is told one: such a turn was served by
    the fleet's weights, not by version 0 (which a learner 5 updates on refuses as stale)."""
    events: list = []
    replica = Replica(events)
    learner = Learner(replica, updates=5, max_staleness=1, hybrid=False)
    group = _handle(replica, learner, colocated=False)
    group.fleet.version = 5  # e.g. resumed, and this server not told yet
    asyncio.run(group.generate([1, 2], SamplingParams(max_tokens=2), "t"))
    (_, turn), = group.serving.turns.take(_records(choice_id("t", 0)), 5)
    assert turn.version == 5


# --- (c) generations cut at the context limit ------------------------------------------------
def test_an_answer_cut_at_the_context_limit_is_length_not_stop():
    """verl's vLLM server clamps max_tokens to max_model_len - len(prompt): an answer that fills
    what is left of the context stopped for length, though shorter than max_tokens."""
    replica = Replica([], max_model_len=32)
    group = _handle(replica, Learner(replica, hybrid=False), colocated=False, max_model_len=32)
    cut, = asyncio.run(group.generate(list(range(3, 23)), SamplingParams(max_tokens=100), None))
    assert len(cut.token_ids) == 12 and cut.finish_reason == "length"
    replica.eos_at = 11  # the end-of-turn token as the last token the context had room for: vLLM says stop
    ended, = asyncio.run(group.generate(list(range(3, 23)), SamplingParams(max_tokens=100), None))
    assert len(ended.token_ids) == 12 and ended.finish_reason == "stop"
    replica.eos_at = 4
    short, = asyncio.run(group.generate(list(range(3, 23)), SamplingParams(max_tokens=100), None))
    assert short.finish_reason == "stop"
    full, = asyncio.run(group.generate([5], SamplingParams(max_tokens=3), None))  # max_tokens itself reached
    assert len(full.token_ids) == 3 and full.finish_reason == "length"


def test_the_replicas_engine_tells_the_gateway_their_context():
    """The gateway caps max_tokens to the context left and refuses a prompt that leaves no room
    (one 400) by the engine's `max_context`; without it verl's server raises and the replica
    engine fails for good."""
    replica = Replica([], max_model_len=64)
    engine = _fleet(replica, colocated=False, max_model_len=64).engine(Tokenizer())
    assert max_context(engine) == 64


# --- (d) colocated vLLM's memory life cycle beside the learner --------------------------------
def test_colocated_vllm_sleeps_through_every_learner_phase_and_wakes_by_a_weight_sync():
    """verl's order (ray_trainer.py, CheckpointEngineManager): vLLM asleep before the learner
    loads a checkpoint, updates or saves one, woken by `update_weights` (the learner empties its
    CUDA cache, loads the weights, then the KV cache) before the next rollout; never asleep twice,
    never woken without weights. The fakes assert it at each call."""
    events: list = []
    replica = Replica(events)
    learner = Learner(replica, updates=3)
    group = _handle(replica, learner)

    async def step(tid: str):
        await group.generate([1, 2], SamplingParams(max_tokens=2), tid)
        await group.train(_records(choice_id(tid, 0)))

    async def run():
        await group.load("ckpt")  # resume
        await step("a")
        await group.save("folder", "learner")
        await step("b")
        await group.warm_start([], None)
        await group.save("folder", "learner")

    asyncio.run(run())
    assert events == ["sleep", "load", "update_weights 3",
                      "sleep", "train", "update_weights 4",
                      "sleep", "save", "update_weights 4",
                      "sleep", "train", "update_weights 5",
                      "sleep", "warm_start", "update_weights 5",
                      "sleep", "save", "update_weights 5"]
    assert replica.awake and replica.global_steps == 5


def test_replicas_on_gpus_of_their_own_neither_sleep_nor_resync_around_a_checkpoint():
    events: list = []
    replica = Replica(events)
    group = _handle(replica, Learner(replica, updates=3, hybrid=False), colocated=False)
    asyncio.run(group.load("ckpt"))
    asyncio.run(group.save("folder", "learner"))
    assert events == ["load", "save"] and replica.global_steps == 3  # told the checkpoint's version, nothing sent


def test_a_verl_rank_empties_its_cuda_cache_before_waking_its_colocated_vllm(monkeypatch):
    """The learner rank's side of the wake (`PolicyWorker.update_weights`, `naive`), in verl's
    own worker's order: cache emptied, vLLM's weights woken and loaded, then its KV cache."""
    import torch
    import verl.utils.device

    from mas_trainer.policy import verl_rank

    events: list = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: events.append("barrier"))
    monkeypatch.setattr(verl.utils.device, "set_expandable_segments", lambda on: None)

    class Rollout:
        async def resume(self, tags):
            events.append(f"resume {'+'.join(tags)}")

        async def update_weights(self, params, global_steps=None):
            events.append(f"update_weights {global_steps}")

    worker = verl_rank.PolicyWorker.__new__(verl_rank.PolicyWorker)
    worker.sink = verl_rank.ReplicaSink.__new__(verl_rank.ReplicaSink)
    worker.sink.rollout = Rollout()
    worker.learner = SimpleNamespace(params=lambda: iter(()))
    asyncio.run(worker.update_weights(global_steps=4, mode="naive"))
    assert events[:3] == ["empty_cache", "resume weights", "update_weights 4"]
    assert events[-1] == "resume kv_cache" and events.index("barrier") < events.index("resume kv_cache")

