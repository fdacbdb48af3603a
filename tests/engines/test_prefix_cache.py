"""The embedded engine's prompt-prefix cache: token-exact against the engine without it and
against a full recompute, used within a group, across prompts sharing a system prompt and
across turns of one conversation, cleared on a weight update, bounded in bytes."""

from __future__ import annotations

import asyncio
import copy

import pytest

torch = pytest.importorskip("torch")

from mas_trainer.engines.base import EngineMeter, SamplingParams  # noqa: E402
from mas_trainer.engines.chat import HFChatFormat  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.engines.prefix_cache import BLOCK, PrefixCache  # noqa: E402
from mas_trainer.engines.torch_engine import TorchEngine  # noqa: E402
from mas_trainer.engines.config import EngineSettings

SYSTEM = "You are a careful planner. " * 8  # a system prompt of several blocks


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def chats(tiny):
    """Prompts sharing a system prompt, and the two turns of one conversation."""
    fmt = HFChatFormat(tiny[1])
    shared = [fmt.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {i}: " + "go " * i}])
              for i in range(4)]
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    turn2 = turn1 + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and the second one"}]
    return shared, fmt.render(turn1), fmt.render(turn2)


def reference_logprobs(model, prompt, response):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response], dtype=torch.long)).logits[0].to(torch.float64)
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1: -1]
    return lp.gather(1, torch.tensor(response)[:, None])[:, 0]


async def _workload(eng, shared, turn1, turn2):
    """A group of 4 on one prompt, 4 prompts sharing a system prompt, then two turns: seeded,
    so the samples do not depend on the batch they ran in."""
    group = await eng.generate(shared[0], SamplingParams(n=4, max_tokens=10, seed=7))
    others = await asyncio.gather(*(eng.generate(p, SamplingParams(max_tokens=10, seed=i)) for i, p in enumerate(shared)))
    first = await eng.generate(turn1, SamplingParams(max_tokens=6, seed=1))
    second = await eng.generate(turn2, SamplingParams(max_tokens=6, seed=2))
    greedy = await eng.generate(turn2, SamplingParams(max_tokens=6, temperature=0.0))
    # one batch mixing a miss (no system prompt) with hits of two prefix lengths
    mixed = await asyncio.gather(eng.generate(list(range(40, 90)), SamplingParams(max_tokens=5, seed=3)),
                                 eng.generate(turn1, SamplingParams(max_tokens=5, seed=4)),
                                 eng.generate(shared[3], SamplingParams(max_tokens=5, seed=5)))
    return [group, *others, first, second, greedy, *mixed]


async def test_cached_prefixes_give_the_same_tokens_and_logprobs_as_none(tiny, chats):
    model, tok = tiny
    shared, turn1, turn2 = chats
    # float64: prefilling the rest of a prompt on cached K/V runs other matmul shapes than a whole
    # prompt; in fp32 their rounding can flip a sample of the near-uniform random model
    with TorchEngine(copy.deepcopy(model), tok, model_name="off", dtype=torch.float64) as off:
        plain = await _workload(off, shared, turn1, turn2)
    with TorchEngine(copy.deepcopy(model), tok, model_name="on", dtype=torch.float64, settings=EngineSettings(prefix_cache_mb=64, engine_bf16=False)) as on:
        cached = await _workload(on, shared, turn1, turn2)
        saved, prompt_tokens = on.stats["cached_tokens"], on.stats["prompt_tokens"]
        metrics, hits, lookups = on.metrics(), on._prefix.hits, on._prefix.lookups
        meter = EngineMeter(on)
        await on.generate(turn2, SamplingParams(max_tokens=2, seed=0))
        row = meter.read()
    assert [[g.token_ids for g in gens] for gens in cached] == [[g.token_ids for g in gens] for gens in plain]
    prompts = [shared[0], *shared, turn1, turn2, turn2, list(range(40, 90)), turn1, shared[3]]
    for prompt, gens in zip(prompts, cached):
        for g in gens:
            ref = reference_logprobs(on.model, prompt, g.token_ids)
            assert torch.allclose(torch.tensor(g.logprobs, dtype=ref.dtype), ref, atol=1e-4)
    # the group ran its one prompt once; every later prompt reused the system prompt (turn 2: turn 1's blocks)
    assert (hits, lookups) == (9, 11)
    assert metrics["cached_tokens"] == saved >= 9 * 3 * BLOCK and 0 < saved < prompt_tokens == metrics["prompt_tokens"]
    # a step's metrics: the prompt tokens of the step, those the cache saved, their ratio
    cached = BLOCK * ((len(turn2) - 1) // BLOCK)
    assert row["engine/prompt_tokens"] == len(turn2) and row["engine/prefill_tokens_saved"] == cached
    assert row["engine/prefix_hit_rate"] == pytest.approx(cached / len(turn2)) and row["engine/requests"] == 1


async def test_a_weight_update_clears_the_cache(tiny, chats):
    model, tok = tiny
    other, _ = load_model("tiny", seed=1)
    shared, _, _ = chats
    seeded = SamplingParams(max_tokens=8, seed=0)
    with TorchEngine(copy.deepcopy(model), tok, model_name="swap", dtype=torch.float64, settings=EngineSettings(prefix_cache_mb=64, engine_bf16=False)) as eng:
        await eng.generate(shared[0], seeded)
        assert len(eng._prefix) == 1
        eng.update_weights(other.double().state_dict())
        assert len(eng._prefix) == 0
        saved = eng.stats["cached_tokens"]
        (g,) = await eng.generate(shared[1], seeded)
        assert eng.stats["cached_tokens"] == saved  # nothing computed by the old weights was reused
    with TorchEngine(other, tok, model_name="fresh", dtype=torch.float64) as fresh:
        (want,) = await fresh.generate(shared[1], seeded)
    assert g.token_ids == want.token_ids
    assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(want.logprobs), atol=1e-6)


def test_the_cache_keeps_under_its_bound_and_evicts_the_oldest():
    k = torch.zeros(2, 64, 8)  # heads, tokens, dim: 4 KiB per tensor, 8 KiB an entry of 64 tokens
    cache = PrefixCache(max_bytes=20_000, block=16)
    for start in range(4):
        cache.store(list(range(start * 100, start * 100 + 64)), lambda: [(k, k)])
        assert cache.nbytes <= 20_000
    assert len(cache) == 2  # the two most recent
    assert cache.lookup(list(range(0, 80)))[0] == 0  # evicted
    n, kv = cache.lookup(list(range(300, 380)))
    assert n == 64 and kv[0][0].shape == (2, 64, 8)
    assert cache.lookup(list(range(300, 364)))[0] == 48  # the last token is always prefilled: 3 blocks
    assert cache.lookup(list(range(300, 340)) + [9, 9, 9])[0] == 32  # diverges in the third block
    cache.store(list(range(1000, 1000 + 4000)), lambda: [(torch.zeros(2, 4000, 8),) * 2])  # bigger than the bound: not kept
    assert len(cache) == 2 and cache.nbytes <= 20_000


def test_a_hash_collision_is_a_miss_not_a_wrong_answer(monkeypatch):
    cache = PrefixCache(max_bytes=1 << 20, block=4)
    k = torch.zeros(1, 8, 2)
    cache.store([1, 2, 3, 4, 5, 6, 7, 8], lambda: [(k, k)])
    monkeypatch.setattr(cache, "_chain", lambda tokens, upto, salt=None: [h for h in cache._index][: upto // 4])  # every prompt "collides"
    assert cache.lookup([9, 9, 9, 9, 9, 9, 9, 9, 9])[0] == 0
