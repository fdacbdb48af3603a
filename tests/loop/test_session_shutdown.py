"""A session that ends with LLM calls in flight ends quietly and at once.

The engine below answers nothing until it is closed and then fails the way the torch engine
does ("engine ... is closed"). Before the gateway tracked its calls, each call still running
when the session ended printed that error twice (the gateway's "request failed" and
uvicorn's "Exception in ASGI application"), and the app's thread retried the 500s.
"""

import asyncio
import logging
import threading
import time
from typing import TypedDict

import httpx
import pytest
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable
from mas_trainer.engines.fake import FakeChatFormat, FakeEngine
from mas_trainer.gateway import PolicyBackend
from mas_trainer.loop.session import Session

NOISE = ("Traceback", "Exception in ASGI application", "is closed", "request failed")


class HangingEngine:
    """Never answers; when closed, fails what it holds like `TorchEngine._shutdown`."""

    model_name = "hanging"

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.started = threading.Event()
        self.calls = 0
        self.cancelled = 0

    async def generate(self, prompt_ids, params, *, turn_id=None):
        self.calls += 1
        self.started.set()
        try:
            while not self.closed.is_set():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise RuntimeError(f"engine {self.model_name!r} is closed")

    def close(self) -> None:
        self.closed.set()


class State(TypedDict, total=False):
    question: str
    answer: str
    quick: bool


def _app():
    llm = ChatOpenAI(model="m", max_retries=2)  # the default retries: a 5xx would be retried

    def ask(s: State) -> State:  # a sync node: it runs on in its thread after its rollout is cancelled
        if s.get("quick"):
            return {"answer": "-"}
        return {"answer": llm.invoke(s["question"]).content}

    g = StateGraph(State)
    g.add_node("ask", ask)
    g.add_edge(START, "ask")
    g.add_edge("ask", END)
    return trainable(g.compile(), roles={"ask": "p"}, policies={"p": "base"}, reward=lambda task, state, traj: 1.0)


def _noise(capfd, caplog) -> list[str]:
    out, err = capfd.readouterr()
    text = out + err + "\n".join(r.getMessage() + (" Traceback" if r.exc_info else "") for r in caplog.records)
    return [line for line in text.splitlines() if any(n in line for n in NOISE)]


def test_timed_out_rollouts_free_their_calls_and_the_session_ends_quietly(capfd, caplog):
    caplog.set_level(logging.INFO, logger="mas_trainer")  # an in-process CLI test may have left it at WARNING
    engine = HangingEngine()
    # long enough for both calls to reach the engine before their rollouts time out, on a busy machine too
    with Session(backend_factory=lambda _m: PolicyBackend(engine, FakeChatFormat()), timeout_s=10) as session:
        session.load_app(_app())
        t0 = time.monotonic()
        trajs = session.run([{"question": "q1"}, {"question": "q2"}])
        assert [t.status for t in trajs] == ["timeout", "timeout"]
        # the rollouts' calls were cancelled in the engine and refused (503, logged) when the rollouts
        # ended, not when the session did; on a loaded machine the log line follows the cancel a little later
        deadline = time.monotonic() + 60  # a hang guard: the condition ends the wait
        while (engine.cancelled < 2 or not _ended_logged(caplog)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.cancelled == 2 and not engine.closed.is_set()
    assert time.monotonic() - t0 < 120  # a hang guard: the engine never answers
    assert engine.calls == 2  # answered 503 with x-should-retry: false, so the client did not retry
    assert _noise(capfd, caplog) == []
    assert _ended_logged(caplog)


def _ended_logged(caplog) -> bool:
    return any("has ended (timed out or failed)" in r.getMessage() for r in list(caplog.records))


def test_a_call_in_flight_when_the_session_ends_is_answered_503_before_the_engine_closes(capfd, caplog):
    caplog.set_level(logging.INFO, logger="mas_trainer")  # an in-process CLI test may have left it at WARNING
    engine = HangingEngine()
    replies: list[httpx.Response] = []
    with Session(backend_factory=lambda _m: PolicyBackend(engine, FakeChatFormat())) as session:
        session.load_app(_app())
        url, key = session.server.base_url, session.api_key

        def call() -> None:  # a call naming no rollout (the API key), e.g. from the app's own thread
            replies.append(httpx.post(f"{url}/chat/completions", json={"model": "p", "messages": [{"role": "user", "content": "x"}]},
                                      headers={"authorization": f"Bearer {key}"}, timeout=300))

        thread = threading.Thread(target=call)
        thread.start()
        assert engine.started.wait(120)  # hang guards: the engine never answers
    thread.join(120)
    assert not thread.is_alive()  # a hang guard: the engine never answers
    (reply,) = replies
    assert reply.status_code == 503 and reply.headers["x-should-retry"] == "false"
    assert reply.json()["error"]["code"] == "shutting_down"
    assert engine.cancelled == 1  # stopped before the engine closed: it never failed a call
    assert _noise(capfd, caplog) == []


def test_an_interrupted_run_cancels_its_rollouts_and_ends_quietly(capfd, caplog):
    caplog.set_level(logging.INFO, logger="mas_trainer")  # an in-process CLI test may have left it at WARNING
    engine = HangingEngine()

    def interrupt(traj):  # the quick rollout ends while the other waits on the engine: Ctrl-C now
        assert engine.started.wait(120)  # a hang guard: the engine never answers
        raise KeyboardInterrupt

    with Session(backend_factory=lambda _m: PolicyBackend(engine, FakeChatFormat()), timeout_s=60) as session:
        session.load_app(_app())
        with pytest.raises(KeyboardInterrupt):
            session.run([{"question": "q1"}, {"question": "q2", "quick": True}], on_done=interrupt)
        pending = [t for t in asyncio.all_tasks(session.loop) if not t.done()]
        assert pending == []  # the hanging rollout was cancelled, not left on the loop
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 60  # a hang guard: the rollout would wait on the engine for ever
    assert _noise(capfd, caplog) == []


def test_a_session_that_ends_with_nothing_in_flight_still_answers_later_calls_503(capfd):
    with Session(backend_factory=lambda _m: PolicyBackend(FakeEngine(reply="hi"), FakeChatFormat())) as session:
        session.load_app(_app())
        url, key = session.server.base_url, session.api_key
        ok = httpx.post(f"{url}/chat/completions", json={"model": "p", "messages": [{"role": "user", "content": "x"}]},
                        headers={"authorization": f"Bearer {key}"}, timeout=30)
        assert ok.status_code == 200
        session.stop_calls()  # what fit does before it closes its worker groups
        refused = httpx.post(f"{url}/chat/completions", json={"model": "p", "messages": [{"role": "user", "content": "x"}]},
                             headers={"authorization": f"Bearer {key}"}, timeout=30)
        assert refused.status_code == 503 and refused.headers["x-should-retry"] == "false"


def test_a_call_a_sync_node_starts_after_its_rollout_timed_out_is_refused_not_served(caplog):
    """A sync node runs on in its thread after its rollout is cancelled; an LLM call it makes
    then still names that rollout, so the gateway refuses it (503, rollout ended) instead of
    serving it, untagged, on the policy its node maps to."""
    caplog.set_level(logging.INFO, logger="mas_trainer")
    engine = FakeEngine(reply="late")
    outcome: list[object] = []
    done, timed_out = threading.Event(), threading.Event()

    def slow(s: State) -> State:
        timed_out.wait(120)  # the rollout times out meanwhile (a hang guard, not a clock)
        try:
            outcome.append(ChatOpenAI(model="m", max_retries=2).invoke(s["question"]).content)
        except Exception as exc:  # noqa: BLE001 - what the thread got is the assertion
            outcome.append(exc)
        finally:
            done.set()
        return {"answer": "-"}

    g = StateGraph(State)
    g.add_node("slow", slow)
    g.add_edge(START, "slow")
    g.add_edge("slow", END)
    app = trainable(g.compile(), roles={"slow": "p"}, policies={"p": "base"}, reward=lambda task, state, traj: 1.0)
    with Session(backend_factory=lambda _m: PolicyBackend(engine, FakeChatFormat()), timeout_s=3) as session:
        session.load_app(app)
        (traj,) = session.run([{"question": "q"}])
        assert traj.status == "timeout"
        timed_out.set()
        assert done.wait(60)
    (got,) = outcome
    assert isinstance(got, Exception) and "has ended" in str(got), got
    assert engine.calls == []  # never reached the engine


def test_interrupting_a_wait_inside_a_running_loop_cancels_the_work():
    """Inside a running event loop (a notebook) the session's loop runs in its own thread; an
    interruption of the waiting thread (the kernel's interrupt) stops the gateway's calls,
    cancels the work and leaves the session's loop stopped, as Ctrl-C does from the CLI."""
    import _thread
    import signal

    cancelled = threading.Event()
    # interrupt_main runs whatever SIGINT handler is installed: an earlier test (or a library) may have left its own
    # (then no KeyboardInterrupt comes); the kernel's is Python's default one
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with Session(backend_factory=lambda _m: PolicyBackend(FakeEngine(reply="hi"), FakeChatFormat())) as session:
        async def forever():
            try:
                await asyncio.sleep(300)  # a hang guard: no interruption, and the test fails instead of waiting
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def cell():
            assert session.complete(asyncio.sleep(0, "same result")) == "same result"
            threading.Timer(0.3, _thread.interrupt_main).start()
            session.complete(forever())

        outer = asyncio.new_event_loop()  # run_until_complete installs no SIGINT handler: the interrupt is raised
        try:
            with pytest.raises(KeyboardInterrupt):
                outer.run_until_complete(cell())
        finally:
            outer.close()
            signal.signal(signal.SIGINT, previous)
        assert cancelled.is_set() and not session.loop.is_running()
        assert session.gateway.flights.closed  # the calls were stopped first, as Session.run does
