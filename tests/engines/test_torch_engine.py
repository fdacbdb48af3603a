"""The batched torch engine on the tiny random model (and one check on the bundled model)."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from mas_trainer.engines.base import Engine, Generation, SamplingParams  # noqa: E402
from mas_trainer.engines.chat import HFChatFormat  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.engines.torch_engine import TorchEngine  # noqa: E402
from mas_trainer.engines.config import EngineSettings

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 8}, "score": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "score"],
}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def engine(tiny):
    model, tok = tiny
    eng = TorchEngine(model, tok, model_name="tiny", settings=EngineSettings(max_batch_size=8, engine_bf16=False))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(tiny):
    fmt = HFChatFormat(tiny[1])
    return [fmt.render([{"role": "user", "content": "word " * (1 + 3 * i)}]) for i in range(8)]


def reference_logprobs(model, prompt, response):
    """log p(response | prompt) from one plain full forward pass, no cache, no padding."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(response)[:, None])[:, 0], lp.argmax(-1)


def test_is_an_engine(engine):
    assert isinstance(engine, Engine) and engine.model_name == "tiny"


async def test_n_choices_and_length(engine, prompts):
    gens = await engine.generate(prompts[0], SamplingParams(n=3, max_tokens=7, seed=5))
    assert len(gens) == 3
    for g in gens:
        assert g.finish_reason == "length" and len(g.token_ids) == 7 == len(g.logprobs)
        assert g.prompt_ids == prompts[0]
    assert len({tuple(g.token_ids) for g in gens}) == 3  # the choices are distinct samples


async def test_greedy_is_deterministic_and_is_argmax(engine, prompts, tiny):
    params = SamplingParams(temperature=0, max_tokens=12)
    a, b = await asyncio.gather(engine.generate(prompts[1], params), engine.generate(prompts[1], params))
    assert a[0].token_ids == b[0].token_ids
    _, argmax = reference_logprobs(tiny[0], prompts[1], a[0].token_ids)
    assert argmax.tolist() == a[0].token_ids


async def test_seed_reproducibility(engine, prompts):
    def params(seed):
        return SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=seed)

    first = await engine.generate(prompts[2], params(7))
    # the same seed gives the same sample even when other rows share the batch
    again, *_ = await asyncio.gather(
        engine.generate(prompts[2], params(7)), engine.generate(prompts[3], SamplingParams(max_tokens=20))
    )
    other = await engine.generate(prompts[2], params(8))
    assert first[0].token_ids == again[0].token_ids
    assert first[0].token_ids != other[0].token_ids


async def test_stop_strings_cut_the_text(engine, prompts, tiny):
    tok = tiny[1]
    sampled = SamplingParams(max_tokens=20, seed=11)  # greedy on the random model just repeats "\n"
    (free,) = await engine.generate(prompts[4], sampled)
    k = next(k for k in range(4, 18) if tok.decode(free.token_ids[k : k + 2]).strip())
    stop = tok.decode(free.token_ids[k : k + 2])
    (cut,) = await engine.generate(prompts[4], SamplingParams(max_tokens=20, seed=11, stop=(stop, "never-seen")))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and len(cut.token_ids) <= k + 2
    assert len(cut.logprobs) == len(cut.token_ids)


async def test_concurrent_requests_are_batched_and_logprobs_match_reference(engine, prompts, tiny):
    before = max(engine.stats["batch_sizes"], default=0)
    engine.stats["batch_sizes"].clear()
    results = await asyncio.gather(
        *(engine.generate(p, SamplingParams(max_tokens=6 + 2 * i, seed=i)) for i, p in enumerate(prompts))
    )
    assert max(engine.stats["batch_sizes"]) == 8 >= before
    for prompt, (g,) in zip(prompts, results):
        ref, _ = reference_logprobs(tiny[0], prompt, g.token_ids)
        assert len(g.logprobs) == len(g.token_ids)
        assert torch.allclose(torch.tensor(g.logprobs), ref, atol=1e-4)


async def test_requests_join_a_running_batch(tiny, prompts):
    """Rows admitted mid-batch (continuous batching) decode exactly as if alone."""
    model, tok = tiny
    seeded = SamplingParams(max_tokens=20, seed=3)  # seeded samples do not depend on the batch
    short, longest, middle = prompts[0], prompts[7], prompts[3]

    async def steps(eng, n):
        target = eng.stats["decode_steps"] + n
        while eng.stats["decode_steps"] < target:
            await asyncio.sleep(0.001)

    # float64: a batch of another shape takes other matmul kernels, whose fp32 rounding can flip
    # a sample of the near-uniform random model on some CPUs (seen on AVX2-only ones)
    with TorchEngine(copy.deepcopy(model), tok, model_name="tiny", dtype=torch.float64, settings=EngineSettings(max_batch_size=4, engine_bf16=False)) as eng:
        alone = [(await eng.generate(p, seeded))[0].token_ids for p in (short, longest, middle)]
        prefills = eng.stats["prefills"]
        eng.stats["batch_sizes"].clear()
        first = asyncio.ensure_future(eng.generate(short, SamplingParams(max_tokens=60, seed=3)))
        await steps(eng, 3)
        second = asyncio.ensure_future(eng.generate(longest, seeded))  # wider than the running cache
        await steps(eng, 3)
        third = asyncio.ensure_future(eng.generate(middle, seeded))  # narrower than the running cache
        gens = [(await task)[0] for task in (first, second, third)]
    assert eng.stats["prefills"] == prefills + 3 and max(eng.stats["batch_sizes"]) == 3
    assert [gens[0].token_ids[:20], gens[1].token_ids, gens[2].token_ids] == alone
    for prompt, g in zip((short, longest, middle), gens):
        ref, _ = reference_logprobs(eng.model, prompt, g.token_ids)
        assert torch.allclose(torch.tensor(g.logprobs, dtype=ref.dtype), ref, atol=1e-4)


async def test_json_schema_output_is_valid(engine, prompts):
    gens = await engine.generate(prompts[0], SamplingParams(n=4, max_tokens=40, seed=1, json_schema=SCHEMA))
    for g in gens:
        assert g.finish_reason == "stop", g.text
        value = json.loads(g.text)
        assert set(value) == {"answer", "score"}
        assert isinstance(value["answer"], str) and isinstance(value["score"], int)
        assert len(g.logprobs) == len(g.token_ids) and g.token_ids[-1] == 2
    with pytest.raises(ValueError):
        await engine.generate(prompts[0], SamplingParams(json_schema={"type": "no-such-type"}))


def test_eos_stops_and_ignore_eos(prompts):
    model, tok = load_model("tiny", seed=0)

    def favour_eos(module, args, out):
        out.logits[..., 2] += 100.0

    model.register_forward_hook(favour_eos)
    with TorchEngine(model, tok, model_name="eos") as eng:
        (g,) = eng.generate_sync(prompts[0], SamplingParams(max_tokens=5))
        assert (g.token_ids, g.text, g.finish_reason) == ([2], "", "stop")
        (g,) = eng.generate_sync(prompts[0], SamplingParams(max_tokens=5, ignore_eos=True))
        assert (g.token_ids, g.finish_reason) == ([2] * 5, "length")


async def test_cancelled_request_frees_its_rows(engine, prompts):
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(engine.generate(prompts[0], SamplingParams(max_tokens=5000)), 0.05)
    (g,) = await asyncio.wait_for(engine.generate(prompts[0], SamplingParams(max_tokens=3)), 120)  # a hang guard
    assert len(g.token_ids) == 3


def test_generate_sync_from_threads_and_update_weights(prompts):
    model, tok = load_model("tiny", seed=0)
    other, _ = load_model("tiny", seed=1)
    seeded = SamplingParams(max_tokens=8, seed=0)
    with TorchEngine(model, tok, model_name="swap") as eng:
        out = []
        threads = [threading.Thread(target=lambda p=p: out.append(eng.generate_sync(p, seeded))) for p in prompts[:4]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(out) == 4
        eng.update_weights(other.state_dict())
        (g,) = eng.generate_sync(prompts[0], seeded)
        ref, _ = reference_logprobs(other, prompts[0], g.token_ids)
        assert torch.allclose(torch.tensor(g.logprobs), ref, atol=1e-4)
    with pytest.raises(RuntimeError):
        eng.generate_sync(prompts[0], seeded)


@pytest.mark.model
async def test_bundled_model_answers():
    model, tok = load_model("default")
    fmt = HFChatFormat(tok)
    with TorchEngine(model, tok, model_name="default") as eng:
        prompt = fmt.render([{"role": "user", "content": "What is the capital of France?"}])
        (g,) = await eng.generate(prompt, SamplingParams(temperature=0, max_tokens=24))
    assert g.text.strip() and "\ufffd" not in g.text and "<|im" not in g.text
    assert "Paris" in g.text


async def test_stream_hands_out_the_tokens_generate_would(engine, prompts):
    params = SamplingParams(n=2, max_tokens=12, seed=3, stop=("e",))
    want = await engine.generate(prompts[1], params)
    tokens, texts, finals = {0: [], 1: []}, {0: "", 1: ""}, {}
    async for d in engine.stream(prompts[1], params):
        tokens[d.index] += d.token_ids
        texts[d.index] += d.text
        if d.generation is not None:
            finals[d.index] = d.generation
    for i in (0, 1):
        assert tokens[i] == want[i].token_ids == finals[i].token_ids
        assert texts[i] == want[i].text == finals[i].text  # no stop string leaks into the deltas
        assert finals[i].logprobs == want[i].logprobs


async def test_closing_a_stream_frees_its_rows(engine, prompts):
    stream = engine.stream(prompts[0], SamplingParams(max_tokens=5000))
    async for _ in stream:
        break
    await stream.aclose()
    (g,) = await asyncio.wait_for(engine.generate(prompts[0], SamplingParams(max_tokens=3)), 120)  # a hang guard
    assert len(g.token_ids) == 3
    deadline = time.monotonic() + 120  # a hang guard: the condition ends the wait
    while engine._rows and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not engine._rows and not engine._pending


def test_compiled_grammars_are_bounded(tiny):
    pytest.importorskip("xgrammar")
    model, tok = tiny
    eng = TorchEngine(copy.deepcopy(model), tok, model_name="tiny", max_grammars=3)
    try:
        for i in range(5):
            eng._grammar_for({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
        assert len(eng._grammars) == 3 and eng.max_context == 8192
    finally:
        eng.close()


def test_an_answer_is_counted_in_the_metrics_before_its_caller_has_it(engine, prompts):
    """A step's engine figures are read as soon as its last answer arrives (the worker group's
    discard after a held-out evaluation): tokens counted after the answer went out landed in
    the next step's row, under load (a resumed run then differed from an uninterrupted one)."""
    seen: list[float] = []
    before = engine.metrics()["tokens"]

    def at_finish(index: int, token: int, gen: Generation | None) -> None:
        if gen is not None:  # the row's last token: its answer goes out next
            seen.append(engine.metrics()["tokens"] - before)

    future = engine._submit(prompts[1], SamplingParams(max_tokens=5, seed=1, temperature=0.0), listener=at_finish)
    gens = future.result(timeout=300)
    assert seen == [len(gens[0].token_ids)] == [engine.metrics()["tokens"] - before]
