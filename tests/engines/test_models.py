"""Model specs: the tiny test model, the bundled tokenizer fixes, local folders, the cache."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from mas_trainer.engines import models  # noqa: E402
from mas_trainer.engines.models import ModelNotFoundError, describe, load_model, load_tokenizer  # noqa: E402


def test_tiny_is_fast_and_uses_im_end_as_eos():
    models.tokenizer_dir()  # the one-time tokenizer conversion is not what we time
    start = time.perf_counter()
    model, tok = load_model("tiny")
    assert time.perf_counter() - start < 2.0
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token_id == 2
    assert model.config.eos_token_id == 2 and model.config.pad_token_id == 2
    assert model.generation_config.eos_token_id == 2
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.vocab_size == len(tok)
    assert not model.training


def test_tiny_weights_follow_the_seed_and_leave_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a, _ = load_model("tiny", seed=0)
    assert torch.rand(1) == expected  # building did not consume the global generator
    b, _ = load_model("tiny", seed=0)
    c, _ = load_model("tiny", seed=1)
    wa, wb, wc = (m.get_input_embeddings().weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_bundled_tokenizer_has_chatml_template():
    tok = load_tokenizer("tiny")
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert tok("<|im_end|>", add_special_tokens=False)["input_ids"] == [2]
    assert tok.decode(tok("a , b", add_special_tokens=False)["input_ids"]) == "a , b"


def test_local_folder_round_trip(tmp_path):
    model, tok = load_model("tiny", seed=3)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, tok2 = load_model(str(tmp_path))
    ids = torch.tensor([[1, 4093, 198, 6004, 2]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, again(ids).logits)
    assert tok2.eos_token_id == 2
    assert models.model_dir_for(str(tmp_path)) == tmp_path
    assert models.model_dir_for("tiny") is None


@pytest.mark.parametrize("spec", ["./no/such/folder", "nobody-at-all/no-such-model-xyz"])
def test_unknown_model_is_one_clear_error(spec, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as info:
        load_model(spec)
    message = str(info.value)
    assert spec in message and "tiny" in message and "default" in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_describe_is_one_line():
    for spec in ("tiny", "default", "/some/path", "org/model"):
        line = describe(spec)
        assert line.startswith(spec) and "\n" not in line


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MAS_TRAINER_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path


def test_publish_is_atomic_and_runs_once(tmp_path):
    target = tmp_path / "thing"

    def broken(tmp):
        (tmp / "half-written").write_text("x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        models._publish(broken, target)
    assert not target.exists() and list(tmp_path.iterdir()) == []

    calls = []

    def build(tmp):
        calls.append(1)
        time.sleep(0.05)
        (tmp / "done").write_text("ok")

    threads = [threading.Thread(target=models._publish, args=(build, target)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and (target / "done").read_text() == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["thing"]
