"""LoRA (learner.lora_rank) and skip_zero_advantage on the tiny model: what trains, what the
engine generates with, the KL reference, and adapters on disk."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from pydantic import ValidationError  # noqa: E402

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.engines.torch_engine import TorchEngine  # noqa: E402
from mas_trainer.engines.config import EngineSettings
from mas_trainer.errors import UserError  # noqa: E402
from mas_trainer.learners import LearnerConfig, TorchLearner, Turn  # noqa: E402
from mas_trainer.engines.models import is_adapter  # noqa: E402

FP32 = dict(bf16=False, fused_adamw=False)
LORA = dict(lora_rank=4, lora_alpha=8, **FP32)


@pytest.fixture
def tiny():
    return load_model("tiny", seed=0)


def random_turns(n=4, *, seed=0, advantage=1.0):
    g = torch.Generator().manual_seed(seed)
    turns = []
    for i in range(n):
        p, r = 3 + (5 * i) % 11, 2 + (3 * i) % 7
        ids = torch.randint(5, 1000, (p + r,), generator=g).tolist()
        turns.append(Turn(f"t{i}", ids[:p], ids[p:], [0.0] * r, advantage))
    return turns


def with_old_logprobs(learner, turns):
    return [Turn(t.id, t.prompt_ids, t.response_ids, lp.tolist(), t.advantages) for t, lp in zip(turns, learner.log_probs(turns))]


def base_weights(model):
    """The base's own parameters (LoRA matrices left out), with peft's wrapper names undone."""
    return {k.replace(".base_layer", ""): v.detach().clone() for k, v in model.named_parameters() if "lora_" not in k}


def logits(model, ids=((1, 5, 9, 200, 31, 7),)):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def test_only_the_adapter_trains_and_the_engine_generates_with_it(tiny):
    model, tok = tiny
    with TorchEngine(model, tok, model_name="tiny", settings=EngineSettings(max_batch_size=4, engine_bf16=False)) as engine:
        learner = TorchLearner(engine.model, LearnerConfig(lr=5e-2, shuffle=False, **LORA), base_model="tiny")
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        assert {id(p) for p in learner._params} == {id(p) for p in model.parameters() if p.requires_grad}
        prompts = [[1, 30, 31, 32], [1, 40, 41, 42, 43]]
        gens = [engine.generate_sync(p, SamplingParams(max_tokens=6, seed=i, ignore_eos=True))[0] for i, p in enumerate(prompts)]
        turns = [Turn(f"g{i}", p, g.token_ids, g.logprobs, 1.0) for i, (p, g) in enumerate(zip(prompts, gens))]
        learner._unmerge()
        before = base_weights(model)
        learner._merge()
        metrics = engine.run_exclusive(lambda _m: learner.update(turns)).result()
        assert abs(metrics["ppo_kl"]) < 1e-4 and metrics["optimizer_steps"] == 1  # B = 0: the adapter starts as the base
        assert learner.merged  # generation runs on merged weights between updates
        learner._unmerge()
        after = base_weights(model)
        assert all(torch.allclose(before[k], after[k], atol=1e-6) for k in before)  # the base did not move
        learner._merge()
        # the engine samples from base + adapter: its log-probs are the learner's (adapter unmerged) ones
        again = engine.generate_sync(prompts[0], SamplingParams(max_tokens=6, seed=9, ignore_eos=True))[0]
        mine = learner.log_probs([Turn("new", prompts[0], again.token_ids, again.logprobs, 0.0)])[0]
        torch.testing.assert_close(mine, torch.tensor(again.logprobs), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(learner.log_probs(turns[:1])[0], torch.tensor(turns[0].old_logprobs), atol=1e-3)


def test_merged_generation_equals_the_unmerged_adapter(tiny):
    model, _ = tiny
    learner = TorchLearner(model, LearnerConfig(lr=5e-2, **LORA), base_model="tiny")
    learner.update(with_old_logprobs(learner, random_turns()))
    merged = logits(model)
    learner._unmerge()
    unmerged = logits(model)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)


def test_positive_advantage_raises_the_logprob_with_lora(tiny):
    model, _ = tiny
    learner = TorchLearner(model, LearnerConfig(lr=5e-2, **LORA), base_model="tiny")
    turns = with_old_logprobs(learner, random_turns(2))
    before = [lp.sum() for lp in learner.log_probs(turns)]
    learner.update(turns)
    assert all(a > b for a, b in zip((lp.sum() for lp in learner.log_probs(turns)), before))


def test_kl_reference_is_the_base_with_the_adapter_off(tiny):
    model, _ = tiny
    base = copy.deepcopy(model)
    learner = TorchLearner(model, LearnerConfig(lr=5e-2, kl_coef=0.1, **LORA), base_model="tiny")
    assert learner.reference is None  # no copy of the model is kept for the reference
    turns = with_old_logprobs(learner, random_turns())
    first = learner.update(turns)
    assert abs(first["kl"]) < 1e-6  # the adapter starts at zero: the policy is the base
    second = learner.update(with_old_logprobs(learner, random_turns(seed=1)))
    assert second["kl"] > 0
    ref = learner._with_reference([Turn(t.id, t.prompt_ids, t.response_ids, t.old_logprobs, 0.0) for t in turns])
    plain = TorchLearner(base, LearnerConfig(**FP32)).log_probs(turns)
    for turn, expected in zip(ref, plain):
        torch.testing.assert_close(torch.tensor(turn.ref_logprobs), expected, atol=1e-5, rtol=1e-5)
    assert learner.merged


def test_an_adapter_folder_has_its_bases_tokenizer_for_serve_and_the_viewer(tiny, tmp_path):
    """`serve` on replicas and the viewer read a policy folder's tokenizer; for a LoRA policy
    that folder is an adapter (it once raised NameError there)."""
    from mas_trainer.engines.models import load_tokenizer
    from mas_trainer.view.data import _load_tokenizer

    model, tok = tiny
    folder = TorchLearner(model, LearnerConfig(**LORA), base_model="tiny").save_pretrained(tmp_path / "policy", tok)
    text = "Paris is the capital of France."
    for loaded in (load_tokenizer(str(folder)), _load_tokenizer(str(folder))):
        assert loaded.encode(text) == tok.encode(text) and loaded.pad_token_id is not None


@pytest.mark.parametrize("layers", [None, 1])
def test_adapter_checkpoint_loads_merged_and_resumes_exactly(tiny, tmp_path, layers):
    model, tok = tiny
    config = LearnerConfig(lr=5e-2, mini_batch_size=2, lora_layers=layers, **LORA)
    a = TorchLearner(model, config, base_model="tiny")
    turns = with_old_logprobs(a, random_turns())
    a.update(turns)
    folder = a.save_pretrained(tmp_path / "policy", tok)
    assert is_adapter(folder) and (folder / "adapter_model.safetensors").is_file()
    assert not (folder / "model.safetensors").exists()  # the adapter only: megabytes, not the model
    torch.save(a.state_dict(), tmp_path / "optimizer.pt")

    merged, _ = load_model(str(folder), seed=0)  # eval / serve: base + adapter, merged
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), logits(model), atol=1e-5, rtol=1e-5)

    fresh, _ = load_model("tiny", seed=0)  # fit --resume: the base again, the adapter trains on
    b = TorchLearner(fresh, config, adapter=folder)
    b.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=False))
    a.update(turns)
    b.update(turns)
    torch.testing.assert_close(logits(fresh), logits(model), atol=1e-5, rtol=1e-5)
    lora = {k: v for k, v in model.named_parameters() if "lora_" in k}
    for k, v in fresh.named_parameters():
        if "lora_" in k:
            torch.testing.assert_close(v, lora[k], atol=1e-6, rtol=1e-6)


def test_lora_layers_adapts_the_top_layers_only_and_the_backward_stops_below_them(tiny):
    model, _ = tiny
    layers = model.model.layers  # peft wraps the linear layers in place: these stay the model's blocks
    learner = TorchLearner(model, LearnerConfig(lr=5e-2, lora_layers=1, **LORA), base_model="tiny")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".layers.1." in n for n in trainable)
    # every linear layer of the top block has its adapter, as "all-linear" would give it
    assert {n.split(".layers.1.")[1].split(".lora_")[0] for n in trainable} == {
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    needs_grad: dict[int, list[bool]] = {0: [], 1: []}
    hooks = [layers[i].register_forward_hook(lambda _m, _a, out, i=i: needs_grad[i].append(
        (out[0] if isinstance(out, tuple) else out).requires_grad)) for i in (0, 1)]
    turns = with_old_logprobs(learner, random_turns(2))
    before = [lp.sum() for lp in learner.log_probs(turns)]
    needs_grad[0].clear(), needs_grad[1].clear()
    learner.update(turns)
    for hook in hooks:
        hook.remove()
    assert needs_grad[1] and all(needs_grad[1])  # the adapted block is in the autograd graph...
    assert needs_grad[0] and not any(needs_grad[0])  # ...the block below it is not: no backward through it
    assert all(a > b for a, b in zip((lp.sum() for lp in learner.log_probs(turns)), before))


def test_lora_layers_errors_are_one_line(tiny):
    model, _ = tiny
    with pytest.raises(UserError, match=r"lora_layers=3 but the model has 2 layers"):
        TorchLearner(model, LearnerConfig(lora_layers=3, **LORA), base_model="tiny")
    with pytest.raises(ValidationError, match="set lora_rank"):
        LearnerConfig(lora_layers=2)
    with pytest.raises(UserError, match=r"target_modules as a list .* not the pattern '\.\*proj'"):
        TorchLearner(model, LearnerConfig(lora_layers=1, target_modules=".*proj", **LORA), base_model="tiny")


def test_bad_target_module_is_one_line(tiny):
    model, _ = tiny
    with pytest.raises(UserError, match="learner.target_modules"):
        TorchLearner(model, LearnerConfig(target_modules=["no_such_proj"], **LORA), base_model="tiny")


# ---------------------------------------------------------------- skip_zero_advantage


def test_skipping_zero_advantage_turns_equals_training_on_the_rest(tiny):
    model, _ = tiny
    twin = copy.deepcopy(model)
    config = dict(lr=1e-2, shuffle=False, mini_batch_size=8, **FP32)
    a = TorchLearner(model, LearnerConfig(skip_zero_advantage=True, **config))
    b = TorchLearner(twin, LearnerConfig(**config))
    informative = with_old_logprobs(a, random_turns(3, advantage=1.0))
    idle = with_old_logprobs(a, random_turns(3, seed=5, advantage=0.0))
    metrics = a.update(idle[:2] + informative + idle[2:])
    b.update(informative)
    assert metrics["turns"] == 3 and metrics["skipped_turns"] == 3
    for (k, v), (_, w) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)


def test_a_batch_of_zero_advantages_costs_no_update(tiny):
    model, _ = tiny
    learner = TorchLearner(model, LearnerConfig(lr=1e-2, skip_zero_advantage=True, weight_decay=0.1, **FP32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = learner.update(with_old_logprobs(learner, random_turns(advantage=0.0)))
    assert metrics["optimizer_steps"] == 0 and metrics["skipped_turns"] == 4 and learner.updates == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not even weight decay


def test_skip_zero_advantage_refuses_terms_it_would_drop():
    with pytest.raises(ValidationError, match="kl_coef=0 and entropy_coeff=0"):
        LearnerConfig(skip_zero_advantage=True, kl_coef=0.1)
    with pytest.raises(ValidationError, match="skip_zero_advantage"):
        LearnerConfig(skip_zero_advantage=True, entropy_coeff=0.01)
