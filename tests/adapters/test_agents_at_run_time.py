"""Agents a policy map names beyond deepagents' `task` tool: LangChain's sub-agents as tools
(found at decoration through the tool's function), agents made inside a tool at run time
(named `@helper`, checked as their calls arrive), and a sub-agent or subgraph decorated with a
map of its own (refused: it would be ignored)."""

import json
import logging

import pytest
from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph

from mas_trainer import trainable
from mas_trainer.adapters.langgraph.trainable import agent_entries
from mas_trainer.engines.fake import FakeChatFormat, FakeEngine, byte_text
from mas_trainer.gateway import PolicyBackend
from mas_trainer.spec import FROZEN_POLICY, SpecError

QUESTION = [{"messages": [{"role": "user", "content": "Ask the helper."}]}]


@pytest.fixture(autouse=True)
def openai_env(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-dummy")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")


def _llm():
    return ChatOpenAI(model="gpt-4o-mini", max_retries=0, api_key="sk-dummy")  # any key: a rollout routes it to the gateway


def _lead_engine():
    """The lead calls `ask_helper` once, then answers with what it said."""

    def reply(ids, params, i):
        messages = json.loads(byte_text(ids))["messages"]
        if any(m["role"] == "tool" for m in messages):
            return "Done."
        return "<tool_call>" + json.dumps({"name": "ask_helper", "arguments": {"question": "why?"}}) + "</tool_call>"

    return FakeEngine(reply=reply)


HELPER = create_agent(_llm(), [], name="helper", system_prompt="You help.")


@tool
def ask_helper(question: str) -> str:
    """Ask the helper agent."""
    return HELPER.invoke({"messages": [{"role": "user", "content": question}]})["messages"][-1].content


@tool
def ask_new_helper(question: str) -> str:
    """Ask a helper agent made for this question."""
    helper = create_agent(_llm(), [], name="helper", system_prompt="You help.")
    return helper.invoke({"messages": [{"role": "user", "content": question}]})["messages"][-1].content


def _lead(helper_tool):
    helper_tool = helper_tool.model_copy(update={"name": "ask_helper"})
    return create_agent(_llm(), [helper_tool], name="lead", system_prompt="You lead.")


def _run(session, graph, engines):
    app = session.load_app(graph, start_engines=False)
    for policy in app.spec.policies:
        session.attach(policy, PolicyBackend(engines.get(policy) or FakeEngine(reply="unrouted"), FakeChatFormat()))
    [t] = session.run(QUESTION)
    return t


def test_a_sub_agent_a_tool_refers_to_is_found_at_decoration_and_is_a_role(fake_session):
    graph = trainable(_lead(ask_helper), roles={"lead": "lead", "helper": "help"}, policies={"lead": "tiny", "help": "tiny"})
    assert agent_entries(graph) == ["@lead", "tools:@helper"]
    helper = FakeEngine(reply="Because.")
    t = _run(fake_session, graph, {"lead": _lead_engine(), "help": helper})
    assert t.status == "ok", t.error
    assert [(c.node, c.role, c.policy) for c in t.llm_calls] == [
        ("model", "lead", "lead"), ("tools:@helper:model", "helper", "help"), ("model", "lead", "lead")]
    assert len(helper.calls) == 1


def test_a_sub_agent_found_at_decoration_that_nothing_maps_is_refused():
    with pytest.raises(SpecError, match=r"^agent\(s\) helper make LLM calls nothing maps"):
        trainable(_lead(ask_helper), roles={"lead": "lead"}, policies={"lead": "tiny"})


def test_an_agent_made_at_run_time_is_named_with_its_mark_and_routed_when_it_runs(fake_session, caplog):
    with pytest.raises(SpecError, match=r"unknown agent or node 'helper'.*named with its mark \(@helper\)"):
        trainable(_lead(ask_new_helper), roles={"lead": "lead", "helper": "help"}, policies={"lead": "tiny", "help": "tiny"})
    graph = trainable(_lead(ask_new_helper), roles={"lead": "lead", "@helper": "help"}, policies={"lead": "tiny", "help": "tiny"},
                      role_rewards={"helper": lambda task, calls, traj: float(len(calls))})
    helper = FakeEngine(reply="Because.")
    with caplog.at_level(logging.WARNING):
        t = _run(fake_session, graph, {"lead": _lead_engine(), "help": helper})
    assert t.status == "ok", t.error
    assert [(c.node, c.role, c.policy) for c in t.llm_calls][1] == ("tools:@helper:model", "helper", "help")
    assert len(helper.calls) == 1
    assert "matched no call" not in caplog.text


def test_an_agent_made_at_run_time_that_nothing_maps_fails_the_rollout_in_one_line(fake_session):
    graph = trainable(_lead(ask_new_helper), roles={"lead": "lead"}, policies={"lead": "tiny"})
    frozen = FakeEngine(reply="served frozen")
    t = _run(fake_session, graph, {"lead": _lead_engine(), FROZEN_POLICY: frozen})
    assert t.status == "error"
    assert t.error.startswith("agent 'helper' (tools:@helper), seen only at run time, makes LLM calls nothing maps")
    assert "map it in roles= as '@helper'" in t.error and "agents: lead" in t.error and "\n" not in t.error
    assert frozen.calls == []  # refused, not served frozen


def test_an_agent_key_no_call_matched_is_named_after_the_first_rollout(fake_session, caplog):
    graph = trainable(_lead(ask_new_helper), roles={"lead": "lead", "@helper": "help", "@helpr": "help"},
                      policies={"lead": "tiny", "help": "tiny"})
    with caplog.at_level(logging.WARNING):
        t = _run(fake_session, graph, {"lead": _lead_engine(), "help": FakeEngine(reply="Because.")})
    assert t.status == "ok", t.error
    [line] = [r.getMessage() for r in caplog.records if "matched no call" in r.getMessage()]
    assert line.startswith("agent key(s) '@helpr' matched no call in the first rollout") and "agents: lead" in line


def test_a_sub_agent_decorated_with_its_own_map_is_refused():
    from deepagents import CompiledSubAgent, create_deep_agent

    inner = trainable(create_agent(_llm(), [], name="researcher"), roles={"model": "research"}, policies={"research": "tiny"})
    with pytest.raises(SpecError, match=r"^sub-agent 'researcher' carries a @trainable map of its own, which would be ignored"):
        trainable(create_deep_agent(model=_llm(), tools=[], name="lead",
                                    subagents=[CompiledSubAgent(name="researcher", description="r", runnable=inner)]),
                  roles={"lead": "lead", "researcher": "research"}, policies={"lead": "tiny", "research": "tiny"})


def test_a_subgraph_decorated_with_its_own_map_is_refused():
    def chat(state):
        return {"messages": [_llm().invoke(state["messages"])]}

    inner = StateGraph(MessagesState)
    inner.add_node("chat", chat)
    inner.add_edge(START, "chat")
    inner_graph = trainable(inner.compile(), roles={"chat": "p"}, policies={"p": "tiny"})
    outer = StateGraph(MessagesState)
    outer.add_node("team", inner_graph)
    outer.add_edge(START, "team")
    with pytest.raises(SpecError, match=r"^subgraph 'team' carries a @trainable map of its own"):
        trainable(outer.compile(), roles={"team": "p"}, policies={"p": "tiny"})


def test_an_agent_key_made_at_run_time_survives_the_run_directory_and_routes_in_serve():
    from mas_trainer.adapters.langgraph.trainable import resolve
    from mas_trainer.gateway.router import Router
    from mas_trainer.run.rundir import AppRecord
    from mas_trainer.trace import attributes as A

    graph = trainable(_lead(ask_new_helper), roles={"lead": "lead", "@helper": "help"}, policies={"lead": "tiny", "help": "tiny"})
    again = AppRecord.from_spec(resolve(graph)[1]).resolved()  # what serve, export and import rebuild from app.json
    assert again.pending == ("@helper",)
    router = Router(again, known_nodes_only=True)
    for node, policy in (("tools:@helper:model", "help"), ("model", "lead")):
        assert router.route({A.BAGGAGE_NODE: node}, "x", again.policies).policy == policy
