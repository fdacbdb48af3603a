"""The verl learner's GPU path, checked on the CPU against verl 0.9.1's own code: the fast
path where flash-attention is installed, the value-model loader on every device, and the
weight copy from verl's stream (MoE experts unpacked by verl's own `unfuse_moe_params`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from mas_trainer.learners.config import LearnerConfig
from mas_trainer.learners.verl_parts import (
    attention_implementation,
    load_streamed_weights,
    training_worker_config,
)

pytest.importorskip("verl")


def _flash_attn(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        if name == "flash_attn":
            return object() if installed else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("dense")
    _dense().save_pretrained(folder)
    return str(folder)


def _fields(cfg) -> tuple[str, bool, bool, bool]:
    return (cfg.model_config.override_config["attn_implementation"], cfg.model_config.use_remove_padding,
            cfg.engine_config.use_remove_padding, cfg.engine_config.use_torch_compile)


def test_cuda_with_flash_attention_takes_verls_packed_path(model_dir, monkeypatch):
    _flash_attn(monkeypatch, True)
    cfg = training_worker_config(model_dir, LearnerConfig(), device="cuda")
    assert _fields(cfg) == ("flash_attention_2", True, True, True)
    # verl's TrainingWorker injects this into every batch: packed sequences on the GPU
    assert cfg.model_config.get("use_remove_padding", False) is True
    # the value model follows the policy
    critic = training_worker_config(model_dir, LearnerConfig(), model_type="value_model", device="cuda")
    assert _fields(critic) == ("flash_attention_2", True, True, True)


def test_cuda_without_flash_attention_keeps_padded_rows_and_sdpa(model_dir, monkeypatch):
    _flash_attn(monkeypatch, False)
    assert _fields(training_worker_config(model_dir, LearnerConfig(), device="cuda")) == ("sdpa", False, False, True)


def test_cpu_path_is_unchanged(model_dir, monkeypatch):
    _flash_attn(monkeypatch, True)  # even where flash_attn were importable, the CPU has no kernels for it
    assert attention_implementation("cpu") == "sdpa"
    assert _fields(training_worker_config(model_dir, LearnerConfig(), device="cpu")) == ("sdpa", False, False, False)


def test_packed_rows_need_flash_attention():
    """Why packing waits for flash-attention: under SDPA a packed row (position ids restarting)
    lets the second sequence attend to the first, so its logits are not its own."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).eval()
    a, b = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        alone = model(b).logits
        packed = model(torch.cat([a, b], 1), position_ids=torch.cat([torch.arange(5), torch.arange(7)])[None]).logits
    assert (packed[:, 5:] - alone).abs().max() > 1e-2


def test_value_models_load_without_flash_attention_on_every_device(tmp_path, monkeypatch):
    """verl's own loader asks for flash_attention_2 (and falls back to trl, which the extras lack);
    the learner installs its loader whatever the device, with the attention it can run."""
    import verl.utils.model as verl_model

    monkeypatch.setattr(verl_model, "load_valuehead_model", verl_model.load_valuehead_model)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64)).save_pretrained(tmp_path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tmp_path, num_labels=1)
    if importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec("trl") is None:
        with pytest.raises((ImportError, RuntimeError)):
            verl_model.load_valuehead_model(str(tmp_path), torch.float32, config, False)
    _flash_attn(monkeypatch, False)
    training_worker_config(str(tmp_path), LearnerConfig(), model_type="value_model", device="cuda")
    model = verl_model.load_valuehead_model(str(tmp_path), torch.float32, config, False)
    assert model.config._attn_implementation == "sdpa"
    assert model.score.out_features == 1  # verl's value head: one value per token


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    twin = type(model)(model.config)
    for p in twin.parameters():
        torch.nn.init.zeros_(p)
    return twin


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _dense(tied: bool = True) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tied))


def test_streamed_dense_weights_land_and_a_tied_head_counts_once():
    src = _dense()
    dst = _copy(src)
    load_streamed_weights(dst, ((k, v) for k, v in src.state_dict().items() if k != "lm_head.weight"))
    assert _same(src, dst)


def test_moe_experts_unpacked_by_verl_land_in_the_packed_tensors():
    """verl's FSDP engine streams `unfuse_moe_params(...)`: vLLM's per-expert names. Each lands
    back in Transformers 5's packed `gate_up_proj` / `down_proj`; nothing is skipped."""
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2, tie_word_embeddings=False)
    src = Qwen3MoeForCausalLM(cfg)
    stream = list(unfuse_moe_params(iter(src.state_dict().items()), cfg.model_type))
    assert any(".mlp.experts.3.up_proj.weight" in name for name, _ in stream)  # verl did unpack them
    dst = _copy(src)
    load_streamed_weights(dst, iter(stream))
    assert _same(src, dst)


def test_a_name_the_model_lacks_is_refused_by_name_after_the_stream_is_read():
    src = _dense()
    read: list[str] = []

    def stream():
        for k, v in [("model.layers.0.mlp.experts.0.w1.weight", torch.zeros(2, 2)), *src.state_dict().items()]:
            read.append(k)
            yield k, v

    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.0\.w1\.weight'.*runtime\.learner=torch"):
        load_streamed_weights(_copy(src), stream())
    assert len(read) == len(src.state_dict()) + 1  # every rank's gathers complete before rank 0 raises


def test_a_tensor_the_stream_leaves_out_is_an_error():
    src = _dense(tied=False)
    with pytest.raises(ValueError, match=r"1 tensor\(s\).*lm_head\.weight"):
        load_streamed_weights(_copy(src), ((k, v) for k, v in src.state_dict().items() if k != "lm_head.weight"))


def test_a_shape_mismatch_is_an_error():
    src = _dense()
    params = dict(src.state_dict())
    params["model.norm.weight"] = torch.ones(31)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' with shape \(31,\)"):
        load_streamed_weights(_copy(src), iter(params.items()))
