"""Structured output cannot stall the engine: schemas are bounded in size, compiles in time,
and a compile runs where nobody else waits behind it and can be stopped.

The slow schemas are tiny: xgrammar compiles `{"type": "string", "pattern": "[a-z0-9]{1,N}"}`
in 25 to 40 s for N = 10,000 on the 2-core reference machine, and for minutes at N = 40,000
(no size bound catches that; the compile deadline does). Every time bound below is a hang guard,
many times what the engine needs.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("xgrammar")

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.chat import HFChatFormat  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.engines.torch_engine import TorchEngine  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
HANG = 60  # seconds: a hang guard, not a speed target


def slow(n: int = 40_000) -> dict:
    """A 50-byte schema that xgrammar compiles for minutes (n = 20,000: 50 to 130 s here; past
    50,000 xgrammar no longer unrolls the repetition and it compiles in half a second)."""
    return {"type": "string", "pattern": f"[a-z0-9]{{1,{n}}}"}


def big_enum(n: int = 8000) -> dict:
    return {"type": "object", "properties": {"v": {"type": "string", "enum": [f"{i} the value of the thing number {i}, it says"
                                                                          for i in range(n)]}}, "required": ["v"]}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def prompt(tiny):
    return HFChatFormat(tiny[1]).render([{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def engine(tiny):
    model, tok = tiny
    eng = TorchEngine(model, tok, model_name="tiny", grammar_timeout_s=600)
    yield eng
    eng.close()


async def _until(cond, what: str) -> None:
    deadline = time.monotonic() + HANG
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


def _pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def _probe_pids() -> set[int]:
    """This process's grammar probe processes (alive, not yet reaped)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"mas_trainer.engines.grammar" in cmd:
            pids.add(int(entry))
    return pids


async def test_an_oversized_enum_is_refused_in_one_line_naming_the_limit(engine, prompt):
    with pytest.raises(ValueError) as err:
        await asyncio.wait_for(engine.generate(prompt, SamplingParams(max_tokens=4, json_schema=big_enum())), HANG)
    assert "1000 enum/const values" in str(err.value) and "\n" not in str(err.value)
    huge = {"type": "object", "description": "x" * 70_000}
    with pytest.raises(ValueError, match="65536 bytes"):
        await asyncio.wait_for(engine.generate(prompt, SamplingParams(max_tokens=4, json_schema=huge)), HANG)
    with pytest.raises(ValueError, match="65536 bytes"):
        engine.generate_sync(prompt, SamplingParams(max_tokens=4, json_schema=huge))
    assert engine._grammars.compiling() == 0  # refused before any compile started


async def test_a_compiled_schema_is_reused(engine, prompt):
    params = SamplingParams(max_tokens=8, seed=0, json_schema=SCHEMA)
    await engine.generate(prompt, params)
    compiles = engine._grammars.compiles
    (g,) = await engine.generate(prompt, params)
    (h,) = engine.generate_sync(prompt, params)
    assert engine._grammars.compiles == compiles and g.token_ids == h.token_ids


async def test_a_slow_compile_holds_up_neither_compiled_schemas_nor_other_requests(engine, prompt):
    compiled = SamplingParams(max_tokens=16, json_schema=SCHEMA)
    await engine.generate(prompt, compiled)  # compiled before the slow one arrives
    stuck = asyncio.create_task(engine.generate(prompt, SamplingParams(max_tokens=4, json_schema=slow())))
    await asyncio.sleep(0.5)
    # the compiled schema is found without waiting for the compile; plain requests and the
    # loop's default executor (chat templating) are not held either
    (g,) = await asyncio.wait_for(engine.generate(prompt, compiled), HANG)
    assert json.loads(g.text)["a"] in range(10)
    (g,) = await asyncio.wait_for(engine.generate(prompt, SamplingParams(max_tokens=3)), HANG)
    assert len(g.token_ids) == 3
    assert await asyncio.wait_for(asyncio.to_thread(lambda: "rendered"), HANG) == "rendered"
    # a second new schema compiles beside the slow one
    other = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
    (g,) = await asyncio.wait_for(engine.generate(prompt, SamplingParams(max_tokens=16, json_schema=other)), HANG)
    assert isinstance(json.loads(g.text)["b"], bool)
    assert not stuck.done() and engine._grammars.compiling() == 1  # still compiling meanwhile
    # the caller leaves: its compile is killed, the probe process with it
    busy = [p.proc.pid for p in engine._grammars._probes if p not in engine._grammars._idle]
    assert len(busy) == 1
    stuck.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stuck
    await _until(lambda: engine._grammars.compiling() == 0 and not _pids_alive(busy), "the abandoned compile is killed")


async def test_a_compile_past_the_deadline_fails_that_request_only(tiny, prompt):
    model, tok = tiny
    with TorchEngine(model, tok, model_name="deadline", grammar_timeout_s=2) as eng:
        start = time.monotonic()
        with pytest.raises(ValueError, match="over the limit of 2 s to compile") as err:
            await asyncio.wait_for(eng.generate(prompt, SamplingParams(max_tokens=4, json_schema=slow(10_000))), 2 * HANG)
        assert "\n" not in str(err.value)
        assert time.monotonic() - start < 2 * HANG
        assert eng._grammars.probes() == 0  # the probe that ran past it is gone
        # the engine keeps serving, schemas included
        (g,) = await asyncio.wait_for(eng.generate(prompt, SamplingParams(max_tokens=16, json_schema=SCHEMA)), 2 * HANG)
        assert json.loads(g.text)["a"] in range(10)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the probe processes in /proc")
async def test_closing_the_engine_mid_compile_returns_promptly_and_leaves_nothing_running(tiny, prompt):
    model, tok = tiny
    before = _probe_pids()
    eng = TorchEngine(model, tok, model_name="closing", grammar_timeout_s=600)
    stuck = asyncio.create_task(eng.generate(prompt, SamplingParams(max_tokens=4, json_schema=slow())))
    deadline = time.monotonic() + HANG
    while not _probe_pids() - before and time.monotonic() < deadline:  # the probe is there: it starts, then compiles
        await asyncio.sleep(0.05)
    await asyncio.sleep(2)
    await asyncio.wait_for(asyncio.to_thread(eng.close), HANG)
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(stuck, HANG)
    assert not _probe_pids() - before
    await _until(lambda: not [t for t in threading.enumerate() if t.name == "grammar-compile"], "the compile threads end")
    with pytest.raises(RuntimeError, match="closed"):
        await eng.generate(prompt, SamplingParams(max_tokens=4, json_schema={"type": "string"}))


def test_a_blocked_sync_caller_is_released_by_close(tiny, prompt):
    model, tok = tiny
    eng = TorchEngine(model, tok, model_name="sync", grammar_timeout_s=600)
    out: list[BaseException] = []

    def call() -> None:
        try:
            eng.generate_sync(prompt, SamplingParams(max_tokens=4, json_schema=slow()))
        except BaseException as exc:  # noqa: BLE001
            out.append(exc)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(1)
    eng.close()
    t.join(HANG)
    assert not t.is_alive() and isinstance(out[0], RuntimeError)


# --- through the gateway: the attack of the report, scaled down ------------------------------------

def _raw(port: int, body: dict) -> socket.socket:
    """A request sent in full whose client never reads the answer (closing it hangs up)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(data), data))
    return s


def _answered(s: socket.socket) -> bool:
    try:
        return bool(s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False


def test_slow_schemas_do_not_stall_serve(engine, tiny):
    from mas_trainer.gateway import Gateway, GatewayServer, PolicyBackend

    gw = Gateway(api_key=None)
    gw.add_policy("tiny", PolicyBackend(engine, HFChatFormat(tiny[1])))
    msgs = [{"role": "user", "content": "hi"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    with GatewayServer(gw) as server:
        url = f"{server.base_url}/chat/completions"
        r = httpx.post(url, json={"model": "tiny", "messages": msgs, "max_tokens": 16, "response_format": fmt}, timeout=HANG)
        assert r.status_code == 200
        # more slow schemas than the loop's default executor has threads (min(32, cores + 4)),
        # which chat templating uses
        socks = [_raw(server.port, {"model": "tiny", "messages": msgs, "max_tokens": 4, "stream": i % 2 == 0, "response_format":
                                    {"type": "json_schema", "json_schema": {"name": "s", "schema": slow(40_000 + i)}}})
                 for i in range(min(32, (os.cpu_count() or 1) + 4) + 2)]
        deadline = time.monotonic() + HANG  # a hang guard: every slow schema has reached the engine
        while engine._grammars.compiling() < len(socks) and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.post(url, json={"model": "tiny", "messages": msgs, "max_tokens": 3}, timeout=HANG)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3, r.text
        r = httpx.post(url, json={"model": "tiny", "messages": msgs, "max_tokens": 16, "response_format": fmt}, timeout=HANG)
        assert r.status_code == 200 and json.loads(r.json()["choices"][0]["message"]["content"])["a"] in range(10), r.text
        r = httpx.post(url, json={"model": "tiny", "messages": msgs, "response_format": {"type": "json_schema", "json_schema":
                                  {"name": "e", "schema": big_enum()}}}, timeout=HANG)
        assert r.status_code == 400 and "1000 enum/const values" in r.json()["error"]["message"]
        # the slow ones were in the engine all along
        assert engine._grammars.compiling() == len(socks), [s.recv(4096, socket.MSG_DONTWAIT) for s in socks if _answered(s)]
        busy = [j.probe.proc.pid for j in engine._grammars._jobs.values() if j.probe is not None]
        assert busy, "no slow schema is compiling"
        left = time.monotonic()
        for s in socks:  # the clients leave: every compile they started is dropped, its probe killed
            s.close()
        while engine._grammars.compiling() or _pids_alive(busy):
            assert time.monotonic() < left + HANG, "abandoned compiles kept running"
            time.sleep(0.05)
