"""The warm-start file's bounds (issue 40): token ids are real ints of the policy's vocabulary,
a turn fits its model's context, and a line, the file, its lines and the tokens kept are bounded;
each refusal is one line naming the file, the line and the field, before the run directory is
written. The file is streamed: one huge line is never read whole."""

import json
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest

from mas_trainer.config import ConfigError, load_config
from mas_trainer.engines.chat import HFChatFormat
from mas_trainer.engines.models import load_tokenizer
from mas_trainer.loop.trainer import fit
from mas_trainer.production import warm_start
from mas_trainer.production.warm_start import warm_start_examples

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
TASKS = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "words.jsonl").read_text().splitlines()]
VOCAB = 49152  # the tiny model's (the bundled SmolLM2 tokenizer's); its context: 8192


def _line(policy="solo", content="Name a fruit.", **extra):
    return {"policy": policy, "role": "answer", "run_id": "r1", "score": 1.0,
            "messages": [{"role": "user", "content": content}], "completion": {"role": "assistant", "content": "a pear"},
            **extra}


def _file(tmp_path, lines):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _examples(data, chat=None):
    cfg = load_config(overrides=[f"warm_start.data={data}"])
    return warm_start_examples(cfg, {"solo": True}, lambda p: chat or HFChatFormat(load_tokenizer("tiny")))


def _refused(data, chat=None) -> str:
    with pytest.raises(ConfigError) as err:
        _examples(data, chat)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("ids, message", [
    (dict(prompt_ids=[1, VOCAB], response_ids=[2]), f"sft.jsonl:1: prompt_ids[1]: {VOCAB} is not a token of policy 'solo'"),
    (dict(prompt_ids=[1], response_ids=[2, 10**30]), "sft.jsonl:1: response_ids[1]: 1000000000000000000000000000000 is not"),
    (dict(prompt_ids=[1, -1], response_ids=[2]), "sft.jsonl:1: prompt_ids[1]: Input should be greater than or equal to 0"),
    (dict(prompt_ids=["1"], response_ids=[2]), "sft.jsonl:1: prompt_ids[0]: Input should be a valid integer"),
    (dict(prompt_ids=[1], response_ids=[True]), "sft.jsonl:1: response_ids[0]: Input should be a valid integer"),
    (dict(prompt_ids=[1.0], response_ids=[2]), "sft.jsonl:1: prompt_ids[0]: Input should be a valid integer"),
])
def test_ids_are_ints_of_the_policys_vocabulary(tmp_path, ids, message):
    assert message in _refused(_file(tmp_path, [_line(**ids)]))


def test_the_last_id_of_the_vocabulary_is_kept(tmp_path):
    assert _examples(_file(tmp_path, [_line(prompt_ids=[0, VOCAB - 1], response_ids=[2])]))["solo"] == [([0, VOCAB - 1], [2])]


def test_fit_refuses_foreign_ids_before_the_run_directory_is_written(tmp_path, monkeypatch):
    """The IndexError of the learner's embedding, after config.yaml was written, is now a line of `fit`."""
    from mas_trainer.loop import trainer

    monkeypatch.setattr(trainer, "start_workers", lambda *a: pytest.fail("workers started"))
    data, out = _file(tmp_path, [_line(), _line(prompt_ids=[1, VOCAB + 5], response_ids=[2])]), tmp_path / "run"
    cfg = load_config(overrides=["runtime.execution=local", f"warm_start.data={data}"])
    with pytest.raises(ConfigError, match=rf"sft.jsonl:2: prompt_ids\[1\]: {VOCAB + 5} is not a token of policy 'solo'"):
        fit(f"{APP}:single", TASKS[:2], cfg, out)
    assert not (out / "config.yaml").exists() and not (out / "metrics.jsonl").exists()


def test_a_turn_past_the_models_context_is_refused(tmp_path):
    """The tiny model's 8192 positions: 200k ids (15 minutes of a learner) are one line at once."""
    at_most = _line(prompt_ids=[5] * 8191, response_ids=[6])
    assert len(_examples(_file(tmp_path, [at_most]))["solo"]) == 1
    message = _refused(_file(tmp_path, [_line(), _line(prompt_ids=[5] * 200_000, response_ids=[6])]))
    assert "sft.jsonl:2: prompt_ids + response_ids: 200001 tokens, past the 8192-token context of policy 'solo'" in message
    message = _refused(_file(tmp_path, [_line(content="pear " * 9000)]))
    assert "sft.jsonl:1: messages + completion: " in message and "past the 8192-token context" in message


def test_the_context_and_vocabulary_are_the_models_config(tmp_path):
    """config.json next to the tokenizer (a local folder, a hub snapshot) states them."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 64, "vocab_size": 100}}))
    tok = load_tokenizer("tiny")
    chat = HFChatFormat(tok)
    tok.name_or_path = str(folder)
    message = _refused(_file(tmp_path, [_line(prompt_ids=[5] * 64, response_ids=[6])]), chat)
    assert "65 tokens, past the 64-token context" in message and "config.json" in message
    assert "prompt_ids[0]: 100 is not a token" in _refused(_file(tmp_path, [_line(prompt_ids=[100], response_ids=[6])]), chat)


def test_a_line_over_the_limit_is_never_read_whole(tmp_path):
    """A 64 MiB line (a sparse file: no disk written) is refused after MAX_LINE_BYTES, in bounded memory."""
    data = tmp_path / "sft.jsonl"
    with data.open("wb") as f:
        f.write(json.dumps(_line()).encode() + b"\n")
        f.truncate(64 << 20)
    tracemalloc.start()
    try:
        message = _refused(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"sft.jsonl:2: the line is over the limit of {warm_start.MAX_LINE_BYTES >> 20} MiB" in message
    assert peak < 4 * warm_start.MAX_LINE_BYTES < 64 << 20  # readline's own copies; not the line


def test_a_line_of_exactly_the_limit_is_read(tmp_path, monkeypatch):
    line = json.dumps(_line())
    monkeypatch.setattr(warm_start, "MAX_LINE_BYTES", len(line), raising=False)
    assert len(_examples(_file(tmp_path, [line, line]))["solo"]) == 2
    assert "sft.jsonl:2: the line is over the limit" in _refused(_file(tmp_path, [line, line + " "]))


def test_the_file_its_lines_and_its_tokens_are_bounded(tmp_path, monkeypatch):
    lines = [_line(content=f"fruit {i}") for i in range(4)]
    monkeypatch.setattr(warm_start, "MAX_FILE_BYTES", 100, raising=False)
    assert "sft.jsonl: " in (message := _refused(_file(tmp_path, lines))) and "over the limit of 100 bytes" in message
    monkeypatch.setattr(warm_start, "MAX_FILE_BYTES", 1 << 30)
    monkeypatch.setattr(warm_start, "MAX_LINES", 3, raising=False)
    assert "sft.jsonl: more than 3 lines" in _refused(_file(tmp_path, lines))
    assert len(_examples(_file(tmp_path, lines[:3]))["solo"]) == 3
    monkeypatch.setattr(warm_start, "MAX_LINES", 100)
    monkeypatch.setattr(warm_start, "MAX_TOKENS", 70, raising=False)
    message = _refused(_file(tmp_path, [_line(prompt_ids=[5] * 30, response_ids=[6] * 10)] * 2))
    assert "sft.jsonl:2: the turns of the policies trained come to more than 70 tokens" in message


def test_not_utf8_is_one_line(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_bytes(json.dumps(_line()).encode() + b"\n\xff\xfe{}\n")
    assert "sft.jsonl:2: not UTF-8" in _refused(data)


def test_a_chat_format_without_a_tokenizer_still_bounds_the_context(tmp_path):
    """A chat format with no Hugging Face tokenizer: no vocabulary to check, the default context bound."""
    chat = SimpleNamespace(render_turn=lambda messages, completion, tools: ([1] * 40_000, [2]))
    assert f"past the {warm_start.DEFAULT_CONTEXT}-token context" in _refused(_file(tmp_path, [_line()]), chat)
