"""Fault suite for the gateways of `fit`, `trace` and `serve`: what a hostile or careless client
does must not reach training, stall the server, grow its memory or crash a request (500).

One class of fault per section: injected calls, abandoned requests, oversized requests,
slow or too many connections, malformed fields, memory under load, streaming latency.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import tracemalloc
from collections import deque
from typing import TypedDict

import httpx
import openai
import pytest

from mas_trainer.engines.fake import FakeChatFormat, FakeEngine
from mas_trainer.gateway import Gateway, GatewayServer, Ledger, PolicyBackend, Router, ServerLimits
from mas_trainer.spec import TrainSpec
from mas_trainer.trace.instrument import rollout_token

MSG = [{"role": "user", "content": "hi"}]


SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-0af7651916cd43dd8448eb211c80319c-{SPAN}-01"


def _baggage(rollout, node=None, call=None, role=None, token=None):
    fields = {"mas.rollout": rollout, "mas.node": node, "mas.node_call": call, "mas.role": role, "mas.token": token}
    return ",".join(f"{k}={v}" for k, v in fields.items() if v is not None)


def _signed(rollout, node, call, role, span=SPAN):
    """A rollout call's headers as the run's instrumentation sends them."""
    return {"traceparent": f"00-0af7651916cd43dd8448eb211c80319c-{span}-01",
            "baggage": _baggage(rollout, node, call, role, token=rollout_token(rollout, node, call, role, span))}


def _spec():
    return TrainSpec.build({"planner": "p"}).resolve(["planner", "tools"])


def _gateway(*, rollouts=True, api_key="k", engine=None, **kw):
    ledger = Ledger()
    gw = Gateway(Router(_spec(), known_nodes_only=not rollouts), ledger, api_key=api_key, rollouts=rollouts, **kw)
    engine = engine or FakeEngine(latency_s=0.0, reply="ok")
    gw.add_policy("p", PolicyBackend(engine, FakeChatFormat()))
    gw.add_policy("frozen", PolicyBackend(FakeEngine(latency_s=0.0, reply="base"), FakeChatFormat()))
    return gw, ledger, engine


def _post(server, body, headers=None, **kw):
    return httpx.post(f"{server.base_url}/chat/completions", json=body, headers=headers or {}, **kw)


# --- injected calls: only the run's own rollouts reach training ------------------------------------

@pytest.mark.parametrize(
    "name, baggage",
    [
        ("no token", _baggage("r1", "planner", "c1", "planner")),
        ("wrong token", _baggage("r1", "planner", "c1", "planner", token="0" * 32)),
        ("token of another rollout", _baggage("r1", "planner", "c1", "planner", token=rollout_token("r2", "planner", "c1", "planner", SPAN))),
        ("role relabelled", _baggage("r1", "planner", "c1", "tools", token=rollout_token("r1", "planner", "c1", "planner", SPAN))),
        ("node relabelled", _baggage("r1", "tools", "c1", "planner", token=rollout_token("r1", "planner", "c1", "planner", SPAN))),
        ("token of another call", _baggage("r1", "planner", "c1", "planner",
                                           token=rollout_token("r1", "planner", "c1", "planner", "0123456789abcdef"))),
        ("empty token", _baggage("r1", "planner", "c1", "planner", token="")),
    ],
)
def test_forged_rollout_calls_are_refused_and_never_filed(name, baggage):
    gw, ledger, engine = _gateway()
    with GatewayServer(gw) as server:
        for auth in ({}, {"authorization": "Bearer k"}):  # even with the run's key
            r = _post(server, {"model": "p", "messages": MSG}, {"baggage": baggage, "traceparent": TRACEPARENT, **auth})
            assert r.status_code == 403, name
            assert "rollout" in r.json()["error"]["message"]
        # the run's own call, signed by this process's instrumentation, is filed
        assert _post(server, {"model": "p", "messages": MSG}, _signed("r1", "planner", "c1", "planner")).status_code == 200
    assert len(engine.calls) == 1, "a forged call reached the engine"
    assert [c.node_id for c in ledger.take("r1")] == ["c1"]


def test_a_rollout_token_signs_one_call_once():
    """The attack of issue 26: a token sniffed on the loopback was good for any number of new
    calls while its rollout ran, and a replay with the real call's span id made two calls
    share one turn (fit then crashed on misaligned advantages)."""
    gw, ledger, engine = _gateway()
    body = {"model": "p", "messages": MSG}
    with GatewayServer(gw) as server:
        real = _signed("r1", "planner", "c1", "planner")
        assert _post(server, body, real).status_code == 200
        replay = _post(server, body, real)
        assert replay.status_code == 409 and replay.headers["x-should-retry"] == "false"
        assert "one call, once" in replay.json()["error"]["message"]
        # the same token under another span id (a new call) does not verify
        moved = {**real, "traceparent": "00-0af7651916cd43dd8448eb211c80319c-00000000000000aa-01"}
        assert _post(server, body, moved).status_code == 403
        # and a rollout call without any traceparent names no call a token could sign
        assert _post(server, body, {"baggage": real["baggage"]}).status_code == 403
        assert len(engine.calls) == 1
        assert [c.id for c in ledger.take("r1")] == [SPAN]
        # once the controller collected the rollout, even a fresh signed call of it is over
        late = _post(server, body, _signed("r1", "planner", "c1", "planner", span="00000000000000bb"))
        assert late.status_code == 409 and "collected" in late.json()["error"]["message"]
    assert len(engine.calls) == 1


class Gated(FakeEngine):
    """Answers only once the test opens `go`: what a test checks meanwhile cannot race a clock."""

    def __init__(self, **kw):
        super().__init__(**{"latency_s": 0.0, "reply": "ok", **kw})
        self.entered, self.go = threading.Event(), threading.Event()

    async def generate(self, prompt_ids, params, *, turn_id=None):
        self.entered.set()
        deadline = time.monotonic() + 120  # a hang guard
        while not self.go.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return await super().generate(prompt_ids, params, turn_id=turn_id)


def test_a_replay_while_the_real_call_runs_is_refused_and_a_dropped_call_may_be_retried():
    engine = Gated()
    gw, ledger, _ = _gateway(engine=engine)
    body = {"model": "p", "messages": MSG}
    real = _signed("r1", "planner", "c1", "planner")
    with GatewayServer(gw) as server:
        # a client that hangs up mid-call: nothing filed, and its id is free again (the
        # OpenAI client retries a dropped request with the same headers)
        with pytest.raises(httpx.ReadTimeout):
            _post(server, body, real, timeout=0.5)
        assert engine.entered.wait(120)
        deadline = time.monotonic() + 120
        while ledger._claims.get("r1") and time.monotonic() < deadline:  # the hang-up is seen asynchronously
            time.sleep(0.01)
        engine.entered.clear()
        replies = []
        first = threading.Thread(target=lambda: replies.append(_post(server, body, real, timeout=60)))
        first.start()
        assert engine.entered.wait(120)
        concurrent = _post(server, body, real, timeout=30)  # the same call id, while the retry runs
        assert concurrent.status_code == 409 and "under way" in concurrent.json()["error"]["message"]
        engine.go.set()
        first.join(60)
        assert replies[0].status_code == 200
    assert [c.id for c in ledger.take("r1")] == [SPAN]


def test_calls_outside_rollouts_need_the_run_key_and_are_never_filed():
    gw, ledger, engine = _gateway()
    with GatewayServer(gw) as server:
        assert _post(server, {"model": "p", "messages": MSG}).status_code == 401
        assert _post(server, {"model": "p", "messages": MSG}, {"authorization": "Bearer nope"}).status_code == 401
        assert _post(server, {"model": "p", "messages": MSG}, {"authorization": "Bearer k"}).status_code == 200
    assert len(engine.calls) == 1
    assert not ledger._by_rollout


class _S(TypedDict, total=False):
    x: str
    injected: list


def test_a_neighbour_process_cannot_inject_turns_into_a_running_rollout(fake_session):
    """The attack of issue 10: while a rollout runs, another local process posts a call naming
    it (its id is known: the trainer's ids are predictable). It is refused; the trajectory holds
    only the app's own call."""
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    from mas_trainer import trainable

    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)
    url = f"{fake_session.server.base_url}/chat/completions"

    def node(s):
        statuses = []
        for headers in ({"baggage": _baggage("step0-r0", "node", None, "node")},
                        {"baggage": _baggage("step0-r0", "node", None, "node"), "authorization": "Bearer mas-trainer"}):
            statuses.append(httpx.post(url, json={"model": "gpt-4o-mini", "messages": MSG}, headers=headers).status_code)
        return {"x": llm.invoke("hello").content, "injected": statuses}

    g = StateGraph(_S)
    g.add_node("node", node)
    g.add_edge(START, "node")
    g.add_edge("node", END)
    fake_session.load_app(trainable(g.compile(), roles={"node": "pol"}, policies={"pol": "tiny"}))
    [traj] = fake_session.loop.run_until_complete(fake_session.rollouts([{"x": ""}], ids=["step0-r0"]))
    assert traj.status == "ok", traj.error
    assert traj.final_state["injected"] == [403, 403]
    assert len(traj.llm_calls) == 1 and traj.llm_calls[0].node == "node"
    assert fake_session.server.base_url in fake_session.describe_gateway() and "signed" in fake_session.describe_gateway()


def test_one_rollout_id_given_twice_is_refused_before_anything_runs(fake_session):
    """The gateway files a call under its rollout id: two live rollouts sharing one would
    silently merge their turns into each other's trajectory."""
    from langgraph.graph import END, START, StateGraph

    from mas_trainer import trainable

    g = StateGraph(_S)
    g.add_node("node", lambda s: {"x": "done"})
    g.add_edge(START, "node")
    g.add_edge("node", END)
    fake_session.load_app(trainable(g.compile(), roles={"node": "pol"}, policies={"pol": "tiny"}))
    with pytest.raises(ValueError, match=r"rollout id 's1-t00001-r0' is given twice; give every rollout .* its own id"):
        fake_session.loop.run_until_complete(fake_session.rollouts([{"x": ""}, {"x": ""}], ids=["s1-t00001-r0"] * 2))


def test_serve_files_nothing_even_for_rollout_baggage():
    gw, ledger, _ = _gateway(rollouts=False, api_key=None)
    with GatewayServer(gw) as server:
        assert _post(server, {"model": "p", "messages": MSG}, _signed("r1", "planner", "c1", "planner")).status_code == 200
    assert not ledger._by_rollout


# --- abandoned requests: a client that hangs up frees the engine ------------------------------------

def _raw(port, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              + f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return s


@pytest.fixture(scope="module")
def tiny_backend():
    pytest.importorskip("torch")
    from mas_trainer.engines.chat import HFChatFormat
    from mas_trainer.engines.models import load_model
    from mas_trainer.engines.torch_engine import TorchEngine
    from mas_trainer.engines.config import EngineSettings

    model, tok = load_model("tiny", seed=0)
    engine = TorchEngine(model, tok, model_name="tiny", settings=EngineSettings(max_batch_size=8, batch_wait_ms=1, engine_bf16=False))
    yield PolicyBackend(engine, HFChatFormat(tok))
    engine.close()


def test_twenty_abandoned_long_requests_do_not_hold_the_engine(tiny_backend):
    gw = Gateway(api_key=None)
    gw.add_policy("tiny", tiny_backend)
    engine = tiny_backend.engine
    long = {"model": "tiny", "messages": MSG, "max_tokens": 5000, "temperature": 1.0}
    with GatewayServer(gw) as server:
        socks = [_raw(server.port, {**long, "stream": i % 2 == 0}) for i in range(20)]
        deadline = time.monotonic() + 120  # a hang guard: the condition ends the wait
        while engine.stats["decode_steps"] < 20 and time.monotonic() < deadline:  # 8 rows decoding, the rest waiting
            time.sleep(0.05)
        assert engine._rows and engine._pending
        for s in socks:
            s.close()
        start = time.monotonic()
        r = _post(server, {"model": "tiny", "messages": MSG, "max_tokens": 3}, timeout=60)
        elapsed = time.monotonic() - start
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
        # 20 x 5000 tokens at 8 rows a batch would take minutes; one small request well under a
        # second (the bound only tells the two apart, with room for a loaded machine)
        assert elapsed < 60, f"small request took {elapsed:.1f} s behind abandoned ones"
        deadline = time.monotonic() + 120  # a hang guard
        while (engine._rows or engine._pending) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine._rows and not engine._pending, "abandoned rows still in the engine"


def test_abandoned_fake_stream_is_cancelled():
    class Watched(FakeEngine):
        cancelled = 0

        async def stream(self, *a, **kw):
            try:
                async for d in super().stream(*a, **kw):
                    yield d
            except BaseException:
                Watched.cancelled += 1
                raise

    engine = Watched(latency_s=0.0, reply="x" * 200, token_latency_s=0.02)
    gw, _, _ = _gateway(rollouts=False, api_key=None, engine=engine)
    with GatewayServer(gw) as server:
        s = _raw(server.port, {"model": "p", "messages": MSG, "stream": True})
        assert s.recv(100).startswith(b"HTTP/1.1 200")
        s.close()
        deadline = time.monotonic() + 120  # a hang guard
        while not Watched.cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
    assert Watched.cancelled == 1


# --- oversized requests: refused fast, others keep being served ------------------------------------

def test_oversized_requests_are_refused_fast_while_others_are_served():
    slow = Gated(reply="slow one", max_context=1000)
    gw, _, _ = _gateway(rollouts=False, api_key=None, engine=slow)
    with GatewayServer(gw) as server:
        results = {}
        t = threading.Thread(target=lambda: results.update(slow=_post(server, {"model": "p", "messages": MSG}, timeout=150)))
        t.start()
        assert slow.entered.wait(120)
        huge = b'{"model": "p", "messages": [{"role": "user", "content": "' + b"x" * (5 * 1024 * 1024) + b'"}]}'
        r = httpx.post(f"{server.base_url}/chat/completions", content=huge, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "body over" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: counted while read
            for _ in range(6):
                yield b"x" * (1024 * 1024)

        r = httpx.post(f"{server.base_url}/chat/completions", content=chunks())
        assert r.status_code == 413
        # fits the body limit, not the context: refused before tokenising, then after
        r = _post(server, {"model": "p", "messages": [{"role": "user", "content": "y" * 40_000}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = _post(server, {"model": "p", "messages": [{"role": "user", "content": "y" * 2000}]})
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        assert t.is_alive(), "the refusals waited for the slow request"
        slow.go.set()
        t.join(150)
        assert results["slow"].status_code == 200
        # max_tokens is capped by the context left after the prompt
        slow.latency_s = 0.0
        r = _post(server, {"model": "p", "messages": MSG, "max_tokens": 10**9})
        assert r.status_code == 200
        prompt = r.json()["usage"]["prompt_tokens"]
        assert slow.calls[-1][1].max_tokens == 1000 - prompt


def test_large_prompts_are_rendered_off_the_event_loop():
    rendering, release = threading.Event(), threading.Event()

    class SlowFormat(FakeChatFormat):
        def render(self, messages, tools=None):
            if len(str(messages)) > 1000:  # a long template / tokenisation (the GIL is released, as in tokenizers)
                rendering.set()
                release.wait(120)
            return super().render(messages, tools)

    gw = Gateway(api_key=None)
    gw.add_policy("p", PolicyBackend(FakeEngine(latency_s=0.0, reply="ok"), SlowFormat()))
    with GatewayServer(gw) as server:
        t = threading.Thread(target=_post, args=(server, {"model": "p", "messages": [{"role": "user", "content": "z" * 5000}]}))
        t.start()
        assert rendering.wait(120)
        assert _post(server, {"model": "p", "messages": MSG}, timeout=60).status_code == 200  # a hang guard
        assert t.is_alive(), "the small request waited for the large one's rendering"
        release.set()
        t.join(60)


# --- slow and too many connections -------------------------------------------------------------------

def test_slow_headers_and_bodies_are_cut_and_connections_are_capped():
    gw, _, _ = _gateway(rollouts=False, api_key=None)
    with GatewayServer(gw, limits=ServerLimits(read_timeout_s=0.5, max_connections=8)) as server:
        slow_head = socket.create_connection(("127.0.0.1", server.port))
        slow_head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # never finishes its headers
        slow_body = socket.create_connection(("127.0.0.1", server.port))
        slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
        for s in (slow_head, slow_body):
            s.settimeout(20)  # far past the 0.5 s deadline: a connection left open times out here
            data = s.recv(1000)
            while data and not data.endswith(b"}"):  # a 408 may come before the close
                data = s.recv(1000)
            assert s.recv(1000) == b"", "a slow client kept its connection"
            s.close()
        r = httpx.post(f"{server.base_url}/chat/completions", json={"model": "p", "messages": MSG}, headers={"x-big": "h" * 40_000})
        assert r.status_code in (400, 431)  # headers over 32 KiB
        # eight connections, each with a request served (kept alive): the server is full of
        # admitted clients, and only then is a new connection refused
        body = json.dumps({"model": "p", "messages": MSG}).encode()
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n%s" % (len(body), body))
        admitted = []
        for _ in range(8):
            c = socket.create_connection(("127.0.0.1", server.port))
            c.settimeout(120)  # hang guards
            c.sendall(request)
            assert c.recv(4096).startswith(b"HTTP/1.1 200")
            admitted.append(c)
        extra = socket.create_connection(("127.0.0.1", server.port))
        extra.settimeout(120)
        assert extra.recv(1000).startswith(b"HTTP/1.1 503")
        for s in admitted + [extra]:
            s.close()
        deadline = time.monotonic() + 120  # the handlers see the closed sockets (a hang guard, not a clock)
        while (status := _post(server, {"model": "p", "messages": MSG}).status_code) == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200


def _recv_all(sock):
    sock.settimeout(10)  # a hang guard
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


@pytest.mark.parametrize("rollouts", [False, True])
def test_idle_sockets_without_a_key_cost_the_key_holder_nothing(rollouts):
    """The attack of issue 26: a thousand idle sockets made serve answer the key holder 503
    (and every rollout of a running fit fail). Anonymous connections are evicted, oldest
    first, to make room for new ones; admitted ones are never touched."""
    gw, ledger, engine = _gateway(rollouts=rollouts)
    limits = ServerLimits(max_connections=64, max_anonymous_per_client=16)
    with GatewayServer(gw, limits=limits) as server, httpx.Client(timeout=30) as client:
        url = f"{server.base_url}/chat/completions"
        # a key holder with a kept-alive connection, admitted before the flood
        assert client.post(url, json={"model": "p", "messages": MSG}, headers={"authorization": "Bearer k"}).status_code == 200
        flood = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(300)]
        for i in range(4):
            # the kept-alive connection and new ones (httpx.post opens its own) are both served
            assert client.post(url, json={"model": "p", "messages": MSG}, headers={"authorization": "Bearer k"}).status_code == 200
            fresh = (_signed("r1", "planner", "c1", "planner", span=f"{i + 1:016x}") if rollouts
                     else {"authorization": "Bearer k"})
            assert _post(server, {"model": "p", "messages": MSG}, fresh, timeout=30).status_code == 200
        # most of the flood was closed under it; what is left is within the per-client bound
        closed = [s for s in flood[:-16] if _recv_all(s) == b""]
        assert len(closed) == len(flood) - 16
        for s in flood:
            s.close()
    if rollouts:
        assert len(ledger.take("r1")) == 4


# --- malformed but valid JSON: a 4xx naming the field, never a 500 -----------------------------------

def _deep(n):
    value: object = 1
    for _ in range(n):
        value = {"a": value}
    return value


MALFORMED = [
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 5}}}, "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": [{"type": "json_object"}]}, "response_format"),
    ({"tool_choice": {"function": "add"}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": 5}}}, "tool_choice"),
    ({"tool_choice": 7}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "add"}}], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": ["a"]}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": "add"}, "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": 5}]}]}, "messages.0.tool_calls.0.function"),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "a", "arguments": 5}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "messages.0.tool_calls.0.function.name"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [[["hi"]]]}]}, "messages.0.content"),
    ({"messages": [5]}, "messages.0"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ({"stream_options": 5}, "stream_options"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"seed": 10**30}, "seed"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"n": 100}, "n"),
    ({"model": ""}, "model"),
    ({"model": 5}, "model"),
    ({"metadata": _deep(200)}, "nests JSON deeper"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": _deep(100)}}}, "nests JSON deeper"),
]


@pytest.fixture(scope="module")
def open_server():
    gw, _, _ = _gateway(rollouts=False, api_key=None)
    with GatewayServer(gw) as server:
        yield server


@pytest.mark.parametrize("patch, field", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_fields_get_a_4xx_naming_the_field(open_server, patch, field):
    r = _post(open_server, {"model": "p", "messages": MSG, **patch})
    assert 400 <= r.status_code < 500, r.text
    assert field in r.json()["error"]["message"], r.json()


def test_json_nested_past_the_recursion_limit_is_a_400(open_server):
    body = b'{"model": "p", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{open_server.base_url}/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "deeper" in r.json()["error"]["message"]
    assert _post(open_server, {"model": "p", "messages": MSG}).status_code == 200


# --- memory under sustained load (serve) -------------------------------------------------------------

def test_serve_memory_stays_flat_under_load():
    engine = FakeEngine(latency_s=0.0, reply="ok")
    engine.calls = deque(maxlen=1)  # the fake's own test log is not the server's memory
    gw, ledger, _ = _gateway(rollouts=False, api_key="k", engine=engine)
    auth = {"authorization": "Bearer k"}
    forged = {**auth, "baggage": _baggage("r", "planner", "c", "planner", token="f" * 32)}
    bodies = [
        ({"model": "p", "messages": MSG}, auth),
        ({"model": "p", "messages": MSG, "stream": True}, auth),
        ({"model": "p", "messages": MSG}, forged),
        ({"model": "nope", "messages": MSG}, auth),
        ({"model": "p", "messages": MSG}, {**auth, "baggage": "mas.node=ghost"}),
    ]
    with GatewayServer(gw) as server, httpx.Client() as client:
        url = f"{server.base_url}/chat/completions"

        def load(rounds):
            for i in range(rounds):
                for j, (body, headers) in enumerate(bodies):
                    unique = {**body, "messages": [{"role": "user", "content": f"hi {i} {j}"}], "model": body["model"] if j != 3 else f"m{i}"}
                    assert client.post(url, json=unique, headers=headers).status_code < 500

        load(20)  # warm-up: imports, caches, connection
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            load(100)
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    ours = [tracemalloc.Filter(True, "*mas_trainer*")]
    grown = sum(s.size_diff for s in after.filter_traces(ours).compare_to(before.filter_traces(ours), "filename"))
    assert grown < 64 * 1024, f"serve kept {grown} bytes after 500 requests"
    assert not ledger._by_rollout and not ledger._closed
    assert gw.router._fell_back == set()


# --- streaming sends tokens as they are generated ----------------------------------------------------

def test_stream_sends_the_first_token_long_before_the_last():
    engine = FakeEngine(latency_s=0.0, reply="one two three four five six seven", token_latency_s=0.05)  # ~1.7 s
    gw, _, _ = _gateway(rollouts=False, api_key=None, engine=engine)
    with GatewayServer(gw) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        start = time.monotonic()
        arrivals, text = [], ""
        for chunk in client.chat.completions.create(model="p", messages=MSG, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic() - start)
                text += chunk.choices[0].delta.content
        assert text == "one two three four five six seven"
        assert len(arrivals) > 10  # token by token, not one lump
        assert arrivals[0] < arrivals[-1] / 3 and arrivals[-1] > 1.5, arrivals


def test_stream_with_tools_still_returns_the_calls():
    engine = FakeEngine(latency_s=0.0, reply='<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    gw, _, _ = _gateway(rollouts=False, api_key=None, engine=engine)
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    with GatewayServer(gw) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        chunks = list(client.chat.completions.create(model="p", messages=MSG, tools=[tool], stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "add" and json.loads(calls[0].function.arguments) == {"a": 1}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
