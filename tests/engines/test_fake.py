"""The torch-free fake engine and chat format."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from mas_trainer.engines import ChatFormat, Engine, FakeChatFormat, FakeEngine, SamplingParams
from mas_trainer.engines.fake import byte_ids, byte_text


def test_protocols():
    assert isinstance(FakeEngine(), Engine)
    assert isinstance(FakeChatFormat(), ChatFormat)


async def test_reply_shape_n_and_eos():
    engine = FakeEngine(reply="Hello", latency_s=0)
    gens = await engine.generate([1, 2, 3], SamplingParams(n=3))
    assert len(gens) == 3
    for g in gens:
        assert g.text == "Hello" and g.finish_reason == "stop"
        assert g.token_ids == byte_ids("Hello") + [2]
        assert g.logprobs == [-0.5] * len(g.token_ids)
        assert g.prompt_ids == [1, 2, 3]
    assert engine.calls[0][0] == [1, 2, 3]


async def test_max_tokens_and_stop():
    engine = FakeEngine(reply="one two three", latency_s=0)
    (g,) = await engine.generate([1], SamplingParams(max_tokens=3))
    assert (g.text, g.finish_reason, len(g.token_ids), len(g.logprobs)) == ("one", "length", 3, 3)
    (g,) = await engine.generate([1], SamplingParams(stop=(" two",)))
    assert (g.text, g.finish_reason) == ("one", "stop")


async def test_callable_reply_and_concurrency():
    engine = FakeEngine(reply=lambda prompt, params, i: f"{len(prompt)}-{i}", latency_s=600.0)
    pending = [asyncio.create_task(engine.generate([0] * k, SamplingParams(n=2))) for k in range(1, 9)]

    async def all_in_flight() -> None:
        while len(engine.calls) < 8:
            await asyncio.sleep(0.01)

    try:  # the latencies overlap: all 8 calls are in theirs at once (one after the other, one would be)
        await asyncio.wait_for(all_in_flight(), timeout=120)  # a hang guard, not a clock: the latency is 600 s
        assert not any(t.done() for t in pending)
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    engine.latency_s = 0.0
    results = await asyncio.gather(*(engine.generate([0] * k, SamplingParams(n=2)) for k in range(1, 9)))
    assert [[g.text for g in r] for r in results][2] == ["3-0", "3-1"]


def test_sync_and_close():
    engine = FakeEngine(reply="x", latency_s=0)
    assert engine.generate_sync([1], SamplingParams())[0].text == "x"
    engine.close()
    try:
        engine.generate_sync([1], SamplingParams())
    except RuntimeError:
        pass
    else:
        raise AssertionError("closed engine generated")


def test_fake_chat_format():
    fmt = FakeChatFormat()
    msgs = [{"role": "user", "content": "héllo"}]
    ids = fmt.render(msgs)
    assert ids == fmt.render(list(msgs)) and "héllo" in byte_text(ids)
    assert fmt.render(msgs, [{"type": "function", "function": {"name": "f"}}]) != ids
    content, calls = fmt.parse('ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert content == "ok" and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_torch_free_import():
    code = "import sys, mas_trainer.engines, mas_trainer.engines.fake, mas_trainer.engines.models; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_stream_and_its_fallback_agree_with_generate():
    from mas_trainer.engines.base import stream_generation
    from mas_trainer.engines.streaming import TextStream

    engine = FakeEngine(reply="Hello, world. Bye", latency_s=0)
    params = SamplingParams(n=2, stop=(". B",))
    want = await engine.generate([1], params)

    class Plain:  # an engine written before `stream` existed
        model_name = "plain"

        async def generate(self, prompt_ids, params, *, turn_id=None):
            return await engine.generate(prompt_ids, params)

    for source in (engine, Plain()):
        texts, ids = ["", ""], [[], []]
        async for d in stream_generation(source, [1], params):
            texts[d.index] += d.text
            ids[d.index] += d.token_ids
        assert texts == [g.text for g in want] == ["Hello, world", "Hello, world"]
        assert ids == [g.token_ids for g in want]
    # a character split over tokens is released whole; a stop string's start is held back
    ts = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"), stops=("xy",))
    assert [ts.push(b) for b in "é".encode()] == ["", "é"]
    assert ts.push(ord("x")) == "" and ts.push(ord("z")) == "xz"
