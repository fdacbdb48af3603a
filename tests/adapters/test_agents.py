"""Apps built with LangChain's agent constructors: agents are subgraphs, hand-offs tool calls.

`create_react_agent` (langgraph.prebuilt) and `create_agent` (langchain v1) agents, managed by
`create_supervisor`, compiled with a checkpointer. The policy map names the agents; each
policy's engine is a scripted fake that answers in the gateway's tool-call format
(`<tool_call>{...}</tool_call>`), so hand-offs happen without a model that makes them.
"""

import json

import pytest
from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import create_react_agent
from langgraph_supervisor import create_supervisor

from mas_trainer import trainable
from mas_trainer.adapters.langgraph import as_graph, node_names
from mas_trainer.engines.fake import FakeChatFormat, FakeEngine, byte_text
from mas_trainer.gateway import PolicyBackend
from mas_trainer.spec import FROZEN_POLICY, SpecError

pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")


@pytest.fixture(autouse=True)
def openai_env(monkeypatch):
    """Clients built outside a session need some key and address (nothing is called there)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-dummy")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def tool_call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def scripted(fn):
    """A fake engine whose reply is `fn(messages)`, the request's OpenAI messages."""
    return FakeEngine(reply=lambda ids, params, i: fn(json.loads(byte_text(ids))["messages"]))


def attach_engines(session, app, engines):
    for policy in app.spec.policies:
        engine = engines.get(policy) or FakeEngine(reply="unrouted")
        session.attach(policy, PolicyBackend(engine, FakeChatFormat()))


def _supervisor_app(checkpointer=None, roles=None):
    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)
    math = create_react_agent(llm, [multiply], name="math_expert", prompt="You do arithmetic.")
    writer = create_agent(llm, [], name="writer", system_prompt="You write.")
    graph = create_supervisor([math, writer], model=llm, prompt="Route the work.").compile(checkpointer=checkpointer)
    roles = roles or {"supervisor": "boss", "math_expert": "math", "writer": "words"}
    return trainable(graph, roles=roles, policies={p: "tiny" for p in set(roles.values())})


def test_agent_constructors_expose_their_agents_as_nodes():
    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)
    assert node_names(create_agent(llm, [multiply])) == ["model", "tools"]
    assert node_names(create_react_agent(llm, [multiply])) == ["agent", "tools"]
    graph, _ = as_graph(_supervisor_app())
    assert node_names(graph) == ["supervisor", "supervisor:agent", "supervisor:tools", "math_expert",
                                 "math_expert:agent", "math_expert:tools", "writer", "writer:model"]


def test_policy_map_may_name_agents_or_nodes_inside_them():
    _supervisor_app(roles={"supervisor": "boss", "math_expert:agent": "math"})
    with pytest.raises(SpecError, match="unknown node 'mathematician'; valid nodes: supervisor, supervisor:agent"):
        _supervisor_app(roles={"mathematician": "math"})
    with pytest.raises(SpecError, match=r"'agent' is ambiguous \(supervisor:agent, math_expert:agent\)"):
        _supervisor_app(roles={"agent": "math"})


def test_handoff_is_traced_and_routed_to_the_next_agents_policy(fake_session):
    def boss(messages):
        handed_back = any(m["role"] == "tool" and "transferred back" in m["content"] for m in messages)
        return "It is 42." if handed_back else tool_call("transfer_to_math_expert")

    def math(messages):
        done = any(m["role"] == "tool" and m["content"] == "42" for m in messages)
        return "42" if done else tool_call("multiply", a=6, b=7)

    engines = {"boss": scripted(boss), "math": scripted(math), "words": FakeEngine(reply="never asked")}
    app = fake_session.load_app(_supervisor_app(InMemorySaver()), start_engines=False)
    attach_engines(fake_session, app, engines)
    [t] = fake_session.run([{"messages": [{"role": "user", "content": "What is 6 * 7?"}]}])
    assert t.status == "ok", t.error

    # every LLM call inside an agent plays that agent's role and is served by its policy
    assert [(c.node, c.role, c.policy, c.trainable) for c in t.llm_calls] == [
        ("supervisor:agent", "supervisor", "boss", True),
        ("math_expert:agent", "math_expert", "math", True),
        ("math_expert:agent", "math_expert", "math", True),
        ("supervisor:agent", "supervisor", "boss", True),
    ]
    assert [len(e.calls) for e in engines.values()] == [2, 2, 0]
    assert t.llm_calls[0].tool_calls[0]["function"]["name"] == "transfer_to_math_expert"

    # the hand-off is a tool call of the supervisor's tools node; the math expert's node calls
    # sit under its agent node call
    nodes = {n.id: n for n in t.nodes}
    handoff = next(tc for tc in t.tool_calls if tc.name == "transfer_to_math_expert")
    assert nodes[handoff.node_id].name == "supervisor:tools"
    assert handoff.output["goto"] == "math_expert"
    assert handoff.output["content"] == "Successfully transferred to math_expert"
    for call in t.llm_calls[1:3]:
        assert nodes[nodes[call.node_id].parent_id].name == "math_expert"
    multiplied = next(tc for tc in t.tool_calls if tc.name == "multiply")
    assert str(multiplied.output) == "42" and nodes[multiplied.node_id].name == "math_expert:tools"
    assert t.final_state["messages"][-1]["content"] == "It is 42."


def test_unlisted_agent_is_frozen(fake_session):
    def boss(messages):
        handed_back = any(m["role"] == "tool" and "transferred back" in m["content"] for m in messages)
        return "Done." if handed_back else tool_call("transfer_to_writer")

    app = fake_session.load_app(_supervisor_app(roles={"supervisor": "boss"}), start_engines=False)
    attach_engines(fake_session, app, {"boss": scripted(boss)})
    [t] = fake_session.run([{"messages": [{"role": "user", "content": "Write a line."}]}])
    assert t.status == "ok", t.error
    writer_calls = [c for c in t.llm_calls if c.node == "writer:model"]
    assert [(c.role, c.policy, c.trainable) for c in writer_calls] == [("writer:model", FROZEN_POLICY, False)]


def _counter_app():
    """A chat graph with a checkpointer: a rollout that reused a thread would see old messages."""
    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)

    def chat(state):
        return {"messages": [llm.invoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("chat", chat)
    g.add_edge(START, "chat")
    saver = InMemorySaver()
    return trainable(g.compile(checkpointer=saver), roles={"chat": "p"}, policies={"p": "tiny"}), saver


def test_checkpointer_gets_a_fresh_thread_per_rollout(fake_session):
    graph, saver = _counter_app()
    app = fake_session.load_app(graph, start_engines=False)
    attach_engines(fake_session, app, {"p": scripted(lambda messages: f"seen {len(messages)}")})
    task = {"messages": [{"role": "user", "content": "hi"}]}

    trajs = fake_session.run([task], n=4)
    assert [t.final_state["messages"][-1]["content"] for t in trajs] == ["seen 1"] * 4
    # the same rollout id again (a rerun step): still a fresh thread
    again = [fake_session.loop.run_until_complete(app.run(task, "same-id")) for _ in range(2)]
    assert [r.final_state["messages"][-1].content for r in again] == ["seen 1", "seen 1"]
    assert not saver.storage, "threads the runner made are deleted once their rollout is recorded"

    # a task may name its own thread (LangGraph's invoke(input, config) as task fields): kept
    own = {"input": task, "config": {"configurable": {"thread_id": "mine"}}}
    first, second = fake_session.run([own]), fake_session.run([own])
    assert [first[0].final_state["messages"][-1]["content"], second[0].final_state["messages"][-1]["content"]] == [
        "seen 1", "seen 3"]
    assert set(saver.storage) == {"mine"}
