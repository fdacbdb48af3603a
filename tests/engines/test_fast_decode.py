"""The engine's fast decode (K/V grown in place, grouped K/V heads unrepeated, top-p from the
top k) against the reference path (Hugging Face's plain cache and attention, a full sort): the
same tokens and log-probs, in batches rows join and leave, across a buffer growth, with cached
prefixes; the same nucleus; and a learner sharing the model unchanged."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

torch = pytest.importorskip("torch")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.kv import ATTENTION, SPARE, GrowingLayer, new_cache, use_decode_attention  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.engines.torch_engine import TOP_K_FIRST, TorchEngine, top_p_filter  # noqa: E402
from mas_trainer.engines.config import EngineSettings


@pytest.fixture(scope="module")
def gqa():
    """A random 2-layer Llama with grouped-query attention (4 query heads on 2 K/V heads), sdpa."""
    _, tok = load_model("tiny")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval(), tok


async def _workload(eng: TorchEngine) -> list[list[int]]:
    """Rows joining a running batch (wider and narrower prompts), leaving it at different
    steps, one decoding past a buffer growth, and prompts sharing a prefix."""
    async def steps(n: int) -> None:
        target = eng.stats["decode_steps"] + n
        while eng.stats["decode_steps"] < target:
            await asyncio.sleep(0.001)

    long = asyncio.ensure_future(eng.generate(list(range(5, 25)), SamplingParams(max_tokens=SPARE + 40, seed=1, ignore_eos=True)))
    await steps(3)
    wide = asyncio.ensure_future(eng.generate(list(range(30, 90)), SamplingParams(max_tokens=12, seed=2, n=2, ignore_eos=True)))
    await steps(5)
    narrow = asyncio.ensure_future(eng.generate([7, 8, 9], SamplingParams(max_tokens=30, seed=3, top_p=0.8, ignore_eos=True)))
    shared = [eng.generate(list(range(100, 140)) + [i], SamplingParams(max_tokens=6, seed=4 + i)) for i in range(3)]
    gens = [g for task in (long, wide, narrow, *shared) for g in await task]
    return [g.token_ids for g in gens] + [g.logprobs for g in gens]  # type: ignore[misc]


@pytest.mark.parametrize("prefix_cache_mb", [0, 16])
async def test_fast_decode_decodes_exactly_as_the_plain_cache(gqa, prefix_cache_mb):
    model, tok = gqa
    runs = []
    for fast in (False, True):  # float64: any difference is the method's, not fp32 rounding
        with TorchEngine(copy.deepcopy(model), tok, model_name="kv", dtype=torch.float64, settings=EngineSettings(max_batch_size=8, prefix_cache_mb=prefix_cache_mb, fast_decode=fast, engine_bf16=False)) as eng:
            assert eng.fast_decode is fast and (eng.model.config._attn_implementation == ATTENTION) is fast
            runs.append(await _workload(eng))
            assert max(eng.stats["batch_sizes"]) >= 4  # the rows really shared a batch
    plain, fast = runs
    half = len(plain) // 2
    assert fast[:half] == plain[:half]  # tokens
    for a, b in zip(fast[half:], plain[half:]):  # log-probs
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-10)


def test_decode_attention_matches_and_the_learner_path_is_untouched(gqa):
    """One decode step equals the plain model's; a forward + backward with grad (a learner
    sharing the engine's model) goes through Hugging Face's sdpa unchanged, gradients included."""
    model, _ = gqa
    plain, fast = copy.deepcopy(model).double(), copy.deepcopy(model).double()
    assert use_decode_attention(fast) and fast.config._attn_implementation == ATTENTION
    ids = torch.randint(5, 200, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0  # a left-padded row
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = []
        for net, grow in ((plain, False), (fast, True)):
            cache = new_cache(net.config, grow=grow)
            net(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1], past_key_values=cache)
            logits.append(net(input_ids=ids[:, -1:], attention_mask=mask, position_ids=pos[:, -1:],
                              past_key_values=cache).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-12)
    grads = []
    for net in (plain, fast):
        net.zero_grad()
        net(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_a_growing_layer_copies_once_per_spare_columns_not_every_step():
    layer = GrowingLayer()
    keys = torch.randn(2, 3, 5, 4)
    layer.update(keys, keys + 1)
    buffer = layer._buf["keys"]
    for step in range(SPARE):
        new = torch.full((2, 3, 1, 4), float(step))
        out_k, out_v = layer.update(new, new - 1)
        assert layer._buf["keys"] is buffer  # written in place: no copy of the cache
    assert out_k.shape == (2, 3, 5 + SPARE, 4) and layer.get_seq_length() == 5 + SPARE
    assert torch.equal(out_k[:, :, :5], keys) and torch.equal(out_v[:, :, -1:], new - 1)
    layer.update(new, new)  # past the spare columns: one copy into a bigger buffer
    assert layer._buf["keys"] is not buffer and torch.equal(layer.keys[:, :, :5], keys)
    # the engine's batch edits assign the tensors; the next update grows from them
    layer.keys, layer.values = layer.keys[[1]], layer.values[[1]]
    layer.update(new[:1], new[:1])
    assert layer.keys.shape == (1, 3, 7 + SPARE, 4) and torch.equal(layer.keys[0, :, :5], keys[1])


def test_the_attention_name_is_not_saved_and_other_attentions_are_left_alone(gqa, tmp_path):
    model, _ = gqa
    fast = copy.deepcopy(model)
    use_decode_attention(fast)
    fast.save_pretrained(tmp_path)
    assert ATTENTION not in (tmp_path / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text())
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    assert not use_decode_attention(eager) and eager.config._attn_implementation == "eager"


def test_a_learner_sharing_the_engines_model_keeps_shared_prompts(gqa):
    """The engine routes the model it shares with the torch learner through its attention; the
    learner's shared prompts (4D masks) still run, with the log-probs of the plain model."""
    from mas_trainer.learners import LearnerConfig, TorchLearner, Turn

    model, tok = gqa
    g = torch.Generator().manual_seed(0)
    turns = [Turn(f"p{i}s{j}", prompt, torch.randint(5, 200, (1 + j + i,), generator=g).tolist(), [0.0] * (1 + j + i),
                  [1.0] * (1 + j + i))
             for i, prompt in enumerate(torch.randint(5, 200, (2, 9), generator=g).tolist()) for j in range(3)]
    cfg = LearnerConfig(share_prompts=True, bf16=False, fused_adamw=False, micro_batch_size=6)
    with TorchEngine(copy.deepcopy(model), tok, model_name="shared") as eng:
        shared = TorchLearner(eng.model, cfg).log_probs(turns)
    plain = TorchLearner(copy.deepcopy(model), cfg.model_copy(update={"share_prompts": False})).log_probs(turns)
    for a, b in zip(shared, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_top_p_from_the_top_k_keeps_the_same_nucleus_as_a_full_sort():
    """Peaked rows (the top 256 hold the mass), wider ones (4096 needed), flat ones (the whole
    sort), top_p 0 to nearly 1, in one batch and alone: the same probabilities, bit for bit."""
    g = torch.Generator().manual_seed(0)
    vocab = 49152
    logits = torch.randn(8, vocab, generator=g)
    logits[:3] *= 8  # peaked
    logits[3:5] *= 3
    logits[5:7] *= 0.05  # nearly flat
    probs = torch.softmax(logits, -1)
    for top_p in ([0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 0.9, 0.5], [0.95] * 8):
        p = torch.tensor(top_p)
        want = top_p_filter(probs, p, first_k=())
        assert torch.equal(top_p_filter(probs, p), want)
        for i in range(8):
            assert torch.equal(top_p_filter(probs[i:i + 1], p[i:i + 1]), want[i:i + 1])
        kept = (want > 0).sum(-1)
        if top_p[0] == 0.0:  # rows alone took every path: the first k, the second, the whole sort
            assert kept[0] == 1 and kept[2] <= TOP_K_FIRST[0] < kept[3] <= TOP_K_FIRST[1] < kept[4]
    assert torch.equal(want[want > 0], probs[want > 0])  # the nucleus keeps its probabilities (sampling renormalises)
