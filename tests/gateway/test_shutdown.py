"""A gateway that stops with calls in flight answers them (503 / an error event) before it goes,
and ends a rollout's calls when told the rollout ended; nothing is printed."""

import asyncio
import json
import logging
import threading
import time

import httpx

from mas_trainer.engines.base import Delta
from mas_trainer.engines.fake import FakeChatFormat, FakeEngine
from mas_trainer.gateway import Gateway, GatewayServer, Ledger, PolicyBackend, RolloutSampling, Router
from mas_trainer.spec import TrainSpec
from mas_trainer.trace.instrument import rollout_token

MSG = [{"role": "user", "content": "hi"}]


class Slow(FakeEngine):
    """Takes 600 s an answer; streams its first token at once, then nothing for 600 s; records
    how its generations ended."""

    def __init__(self) -> None:
        super().__init__(latency_s=600.0, token_latency_s=600.0, reply="never")
        self.started = threading.Event()
        self.starts: list[str] = []
        self.ended: list[str] = []

    async def generate(self, prompt_ids, params, *, turn_id=None):
        self.starts.append("generate")
        self.started.set()
        try:
            return await super().generate(prompt_ids, params, turn_id=turn_id)
        finally:
            self.ended.append("generate")

    async def stream(self, prompt_ids, params, *, turn_id=None):
        self.starts.append("stream")
        self.started.set()
        try:
            yield Delta(0, [100], "a")  # the status line goes out: from here the stream is the response
            await asyncio.sleep(600)
        finally:
            self.ended.append("stream")


def _serve(engine):
    spec = TrainSpec.build({"ask": "p"}).resolve(["ask"])
    gw = Gateway(Router(spec, model_routes={"m": "p"}), Ledger(), sampling=RolloutSampling(), rollouts=True)
    gw.add_policy("p", PolicyBackend(engine, FakeChatFormat()))
    return gw, GatewayServer(gw).start()


def _quiet(capfd, caplog):
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Exception in ASGI" not in out + err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_stop_answers_a_plain_and_a_streamed_call_in_flight(capfd, caplog):
    caplog.set_level(logging.INFO)
    engine = Slow()
    gw, server = _serve(engine)
    got: dict[str, object] = {}

    def plain():
        got["plain"] = httpx.post(f"{server.base_url}/chat/completions", json={"model": "m", "messages": MSG}, timeout=300)

    def streamed():
        with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=300,
                          json={"model": "m", "messages": MSG, "stream": True}) as r:
            got["stream"] = [line for line in r.iter_lines() if line]

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120  # a hang guard: the condition, not the clock, ends the wait
    while len(engine.starts) < 2 and time.monotonic() < deadline:  # both calls are at the engine
        time.sleep(0.01)
    assert len(engine.starts) == 2
    t0 = time.monotonic()
    server.stop()
    for t in threads:
        t.join(300)
    assert time.monotonic() - t0 < 300  # a hang guard: the engine would answer in 600 s
    plain_reply = got["plain"]
    assert plain_reply.status_code == 503 and plain_reply.headers["x-should-retry"] == "false"
    assert plain_reply.json()["error"]["code"] == "shutting_down"
    assert sorted(engine.ended) == ["generate", "stream"]  # both generations were cancelled in the engine
    events = [json.loads(line[len("data: "):]) for line in got["stream"]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"  # the stream had started
    assert events[-1]["error"]["code"] == "shutting_down"  # and ends with the reason, not a dropped connection
    _quiet(capfd, caplog)


def test_end_rollouts_answers_that_rollouts_calls_and_refuses_its_later_ones(capfd, caplog):
    caplog.set_level(logging.INFO)
    engine = Slow()
    gw, server = _serve(engine)
    bag = {"mas.rollout": "r1", "mas.node": "ask", "mas.node_call": "c1", "mas.role": "ask",
           "mas.token": rollout_token("r1", "ask", "c1", "ask", "b7ad6b7169203331")}
    headers = {"baggage": ",".join(f"{k}={v}" for k, v in bag.items()),
               "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    try:
        replies = []
        thread = threading.Thread(target=lambda: replies.append(httpx.post(
            f"{server.base_url}/chat/completions", json={"model": "m", "messages": MSG}, headers=headers, timeout=300)))
        thread.start()
        assert engine.started.wait(120)  # hang guards: the engine would answer in 600 s
        gw.end_rollouts(["r0"])  # another rollout: this call runs on
        time.sleep(0.2)
        assert thread.is_alive()
        gw.end_rollouts(["r1"])
        thread.join(120)
        (reply,) = replies
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "rollout_ended"
        assert reply.headers["x-should-retry"] == "false" and engine.ended == ["generate"]
        later = httpx.post(f"{server.base_url}/chat/completions", json={"model": "m", "messages": MSG}, headers=headers, timeout=120)
        assert later.status_code == 503 and json.loads(later.text)["error"]["code"] == "rollout_ended"
        assert len(engine.ended) == 1  # refused before it reached the engine
    finally:
        server.stop()
    _quiet(capfd, caplog)
