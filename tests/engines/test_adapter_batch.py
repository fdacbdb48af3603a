"""The batched adapters' forward (`engines/adapter_batch.py`, the fast path) equals peft's own
mixed-batch forward (the reference) row for row, for adapters of different ranks, modules and
layers, base rows included, and follows the adapters' weights when they change."""

import copy

import pytest
import torch

from mas_trainer.engines.adapter_batch import BatchedLora

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters():
    from mas_trainer.engines.models import load_model

    model, _ = load_model("tiny", seed=1)
    torch.manual_seed(0)
    cfg = peft.LoraConfig
    m = peft.get_peft_model(model, cfg(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False),
                            adapter_name="x0")
    m.add_adapter("x1", cfg(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    m.add_adapter("x2", cfg(r=16, lora_alpha=8, target_modules=["o_proj", "down_proj"], layers_to_transform=[1],
                            init_lora_weights=False))
    return m.eval()


def _reference(m, ids, names):
    with torch.no_grad():
        return m(input_ids=ids, adapter_names=[n or "__base__" for n in names]).logits


def _fast(m, ids, names, lora):
    with torch.no_grad(), lora.rows(names):
        return m.get_base_model()(input_ids=ids).logits


def test_every_row_gets_its_own_adapter_as_peft_gives_it(adapters):
    names = ["x0", None, "x2", "x1", "x0", None, "x1"]
    ids = torch.randint(3, 400, (len(names), 9), generator=torch.Generator().manual_seed(2))
    lora = BatchedLora(adapters, ["x0", "x1", "x2"])
    try:
        fast, ref = _fast(adapters, ids, names, lora), _reference(adapters, ids, names)
        torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-5)
        plain = _reference(adapters, ids, [None] * len(names))
        for row, name in enumerate(names):  # not vacuous: every adapter changes its rows, base rows are the base's
            assert (name is None) == torch.allclose(fast[row], plain[row], atol=1e-6), name
        # outside `rows` nothing is added: peft's own path (the learner's forward) is as it was
        adapters.set_adapter("x1")
        with torch.no_grad():
            alone = adapters.get_base_model()(input_ids=ids).logits
        torch.testing.assert_close(alone, _reference(adapters, ids, ["x1"] * len(names)), atol=2e-5, rtol=1e-5)
    finally:
        lora.close()


def test_new_adapter_weights_are_used_after_a_refresh(adapters):
    m = copy.deepcopy(adapters)
    lora = BatchedLora(m, ["x0", "x1", "x2"])
    names = ["x1", "x0", None]
    ids = torch.randint(3, 400, (3, 5), generator=torch.Generator().manual_seed(3))
    before = _fast(m, ids, names, lora)
    with torch.no_grad():
        for module in m.modules():
            if hasattr(module, "lora_B") and "x1" in module.lora_B:
                module.lora_B["x1"].weight.mul_(3.0)
    lora.refresh()
    after = _fast(m, ids, names, lora)
    torch.testing.assert_close(after, _reference(m, ids, names), atol=2e-5, rtol=1e-5)
    assert not torch.allclose(after[0], before[0]) and torch.equal(after[2], before[2])
    lora.close()
