"""Every LLM call lands once, under the right rollout, node call, role and policy."""

import asyncio
import operator
import time
from typing import Annotated, TypedDict

import openai
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import RetryPolicy, Send
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mas_trainer import trainable
from mas_trainer.trace import otel


class S(TypedDict, total=False):
    tid: str
    out: Annotated[list, operator.add]
    item: str


def _mixed_graph():
    """Sync + async nodes, ChatOpenAI invoke/ainvoke/stream, raw clients, Send, a subgraph."""
    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)

    def plan(s):
        return {"out": [llm.invoke(f"plan {s['tid']}").content]}

    async def critic(s):
        return {"out": [(await llm.ainvoke(f"critic {s['tid']}")).content]}

    def writer(s):
        return {"out": ["".join(c.content for c in llm.stream(f"write {s['tid']}"))]}

    async def streamer(s):
        return {"out": ["".join([c.content async for c in llm.astream(f"astream {s['tid']}")])]}

    def raw(s):
        r = openai.OpenAI(max_retries=0).chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": f"raw {s['tid']}"}])
        return {"out": [r.choices[0].message.content]}

    async def araw(s):
        r = await openai.AsyncOpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": f"araw {s['tid']}"}])
        return {"out": [r.choices[0].message.content]}

    def fan(s):
        return [Send("worker", {"tid": s["tid"], "item": str(i), "out": []}) for i in range(3)]

    def worker(s):
        return {"out": [llm.invoke(f"work {s['tid']} {s['item']}").content]}

    inner = StateGraph(S)
    inner.add_node("search", lambda s: {"out": [llm.invoke(f"search {s['tid']}").content]})
    inner.add_edge(START, "search")

    g = StateGraph(S)
    for name, fn in dict(plan=plan, critic=critic, writer=writer, streamer=streamer, raw=raw, araw=araw, worker=worker).items():
        g.add_node(name, fn)
    g.add_node("research", inner.compile())
    g.add_edge(START, "plan")
    g.add_edge("plan", "critic")
    g.add_edge("critic", "writer")
    g.add_edge("writer", "streamer")
    g.add_edge("streamer", "raw")
    g.add_edge("raw", "araw")
    g.add_conditional_edges("araw", fan, ["worker"])
    g.add_edge("worker", "research")
    g.add_edge("research", END)
    return trainable(
        g.compile(),
        roles={"plan": "planner", "critic": "planner", "writer": "worker", "streamer": "worker", "raw": "worker", "araw": "worker",
               "worker": "worker", "research:search": "searcher"},
        policies={"planner": "tiny", "worker": "tiny", "searcher": "tiny"},
    )


EXPECTED = {"plan": "planner", "critic": "planner", "writer": "worker", "streamer": "worker", "raw": "worker", "araw": "worker",
            "worker": "worker", "research:search": "searcher"}


def test_64_concurrent_rollouts_attribute_every_call(fake_session):
    fake_session.load_app(_mixed_graph())
    tasks = [{"tid": f"T{i:02d}", "out": []} for i in range(64)]
    trajs = fake_session.run(tasks)
    assert [t.task["tid"] for t in trajs] == [t["tid"] for t in tasks]
    for t in trajs:
        assert t.status == "ok", t.error
        nodes = {n.id: n for n in t.nodes}
        assert len(t.llm_calls) == 10  # 7 single nodes (subgraph's search included) + 3 Send branches
        for call in t.llm_calls:
            assert call.node_id in nodes, "call filed under a node of another rollout"
            assert nodes[call.node_id].name == call.node
            assert call.policy == EXPECTED[call.node] and call.role == call.node
            prompt = str(call.messages)
            assert t.task["tid"] in prompt
            assert len(call.response_ids) == len(call.response_logprobs) > 0
        per_node = [c.node_id for c in t.llm_calls]
        assert len(per_node) == len(set(per_node)), "a call recorded twice"
        workers = [n for n in t.nodes if n.name == "worker"]
        assert len(workers) == 3 and len({n.id for n in workers}) == 3
        search = next(n for n in t.nodes if n.name == "research:search")
        assert nodes[search.parent_id].name == "research"


def test_retries_errors_and_partial_trajectories(fake_session):
    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)
    attempts = {}

    def flaky(s):
        llm.invoke(f"flaky {s['tid']}")
        attempts[s["tid"]] = attempts.get(s["tid"], 0) + 1
        if attempts[s["tid"]] == 1:
            raise ConnectionError("transient")
        return {"out": ["ok"]}

    def boom(s):
        llm.invoke("before failing")
        raise RuntimeError("node exploded")

    g = StateGraph(S)
    g.add_node("flaky", flaky, retry_policy=RetryPolicy(max_attempts=2, initial_interval=0.01, retry_on=ConnectionError))
    g.add_node("boom", boom)
    g.add_edge(START, "flaky")
    g.add_edge("flaky", "boom")
    g.add_edge("boom", END)
    fake_session.load_app(g.compile())
    [t] = fake_session.run([{"tid": "x", "out": []}])
    assert t.status == "error" and "node exploded" in t.error
    assert [(n.name, n.attempt, n.status) for n in t.nodes] == [("flaky", 1, "error"), ("flaky", 2, "ok"), ("boom", 1, "error")]
    assert len(t.llm_calls) == 3
    assert t.llm_calls[0].node_id == t.nodes[0].id and t.llm_calls[1].node_id == t.nodes[1].id


def test_recursion_limit_and_timeout_give_status_not_crash(fake_session):
    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)
    g = StateGraph(S)
    g.add_node("loop", lambda s: {"out": [llm.invoke("again").content]})
    g.add_edge(START, "loop")
    g.add_edge("loop", "loop")
    fake_session.load_app(g.compile())
    fake_session.app.recursion_limit = 5
    [t] = fake_session.run([{"tid": "r", "out": []}])
    assert t.status == "error" and t.error.startswith("GraphRecursionError")
    assert len(t.nodes) == 5 and len(t.llm_calls) == 5

    async def slow(s):
        await asyncio.sleep(120)
        return {}

    g2 = StateGraph(S)
    g2.add_node("slow", slow)
    g2.add_edge(START, "slow")
    fake_session.timeout_s = 0.3
    fake_session.load_app(g2.compile())
    start = time.time()
    [t2] = fake_session.run([{"tid": "s", "out": []}])
    assert time.time() - start < 60  # a hang guard: the node sleeps 120 s
    assert t2.status == "timeout" and [n.status for n in t2.nodes] == ["cancelled"]


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_tool_calls_are_recorded_under_their_node(fake_session):
    def agent(s):
        return {"out": []}

    def call_tool(s):
        from langchain_core.messages import AIMessage

        msg = AIMessage(content="", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1"}])
        return {"messages": [msg]}

    from langgraph.graph import MessagesState

    g = StateGraph(MessagesState)
    g.add_node("agent", call_tool)
    g.add_node("tools", ToolNode([add]))
    g.add_edge(START, "agent")
    g.add_edge("agent", "tools")
    g.add_edge("tools", END)
    fake_session.load_app(g.compile())
    [t] = fake_session.run([{"messages": [{"role": "user", "content": "2+3"}]}])
    assert t.status == "ok", t.error
    [tc] = t.tool_calls
    tools_node = next(n for n in t.nodes if n.name == "tools")
    assert (tc.name, tc.id, tc.node_id, str(tc.output)) == ("add", "call_1", tools_node.id, "5")


def test_spans_form_one_trace_per_rollout_with_genai_attributes(fake_session):
    exporter = InMemorySpanExporter()
    otel.add_span_processor(SimpleSpanProcessor(exporter))
    fake_session.load_app(_mixed_graph())
    [t] = fake_session.run([{"tid": "span", "out": []}])
    spans = exporter.get_finished_spans()
    mine = [s for s in spans if format(s.context.trace_id, "032x") == t.trace_id]
    by_id = {format(s.context.span_id, "016x"): s for s in mine}
    kinds = [s.attributes["mas.kind"] for s in mine]
    assert kinds.count("rollout") == 1 and kinds.count("node") == len(t.nodes) and kinds.count("llm") == len(t.llm_calls)
    for call in t.llm_calls:
        span = by_id[call.id]
        assert span.attributes["gen_ai.operation.name"] == "chat"
        assert format(span.parent.span_id, "016x") == call.node_id
        assert span.attributes["mas.role"] == call.role
