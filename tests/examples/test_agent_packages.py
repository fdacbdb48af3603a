"""The apps built with `langgraph-supervisor` and `langgraph-swarm` compile, trace and route.

Each agent is a compiled subgraph named in the policy map; hand-offs are tool calls. The
engines are scripted fakes answering in the gateway's tool-call format, since the bundled
model does not make these hand-offs itself (docs/decorator.md has the measured rates); one
test runs the tiny random model end to end.
"""

import importlib
import json
import sys
from pathlib import Path

import pytest

from mas_trainer.engines.fake import FakeChatFormat, FakeEngine, byte_text
from mas_trainer.gateway import PolicyBackend
from mas_trainer.loop.session import Session

# langgraph-supervisor builds its supervisor with the deprecated create_react_agent
pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")

ROOT = Path(__file__).resolve().parents[2]
APPS_DIR = ROOT / "examples" / "langgraph_apps"

# app -> (agents, nodes inside them, policies)
APPS = {
    "supervisor_pkg": (
        ["supervisor", "math_expert", "research_expert"],
        {"supervisor:agent", "supervisor:tools", "math_expert:model", "math_expert:tools",
         "research_expert:model", "research_expert:tools"},
        {"supervisor", "math", "research"},
    ),
    "swarm_pkg": (
        ["concierge", "math_expert"],
        {"concierge:model", "concierge:tools", "math_expert:model", "math_expert:tools"},
        {"concierge", "math"},
    ),
}


@pytest.fixture
def load_app(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-dummy-for-tests")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.syspath_prepend(str(ROOT))

    def load(name):
        module_name = f"examples.langgraph_apps.{name}"
        monkeypatch.delitem(sys.modules, module_name, raising=False)
        return importlib.import_module(module_name)

    return load


def tasks(name):
    return [json.loads(line) for line in (APPS_DIR / "data" / f"{name}.jsonl").read_text().splitlines() if line.strip()]


def tool_call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def scripted(fn):
    return FakeEngine(reply=lambda ids, params, i: fn(json.loads(byte_text(ids))["messages"]))


def tool_results(messages):
    return [m["content"] for m in messages if m["role"] == "tool"]


@pytest.mark.parametrize("name", list(APPS))
def test_app_compiles_with_a_checkpointer_and_maps_its_agents(load_app, name):
    from mas_trainer.adapters.langgraph import as_graph, node_names

    agents, inner, policies = APPS[name]
    module = load_app(name)
    assert (module.__doc__ or "").strip()
    graph, spec = as_graph(module.graph)
    assert graph.checkpointer is not None
    assert set(node_names(graph)) == set(agents) | inner
    assert list(module.ROLES) == agents and set(module.ROLES.values()) == set(module.POLICIES) == policies
    resolved = spec.resolve(node_names(graph))
    for node in inner:
        agent = node.split(":")[0]
        assert (resolved.route(node).role, resolved.route(node).policy) == (agent, module.ROLES[agent])
    source = (APPS_DIR / f"{name}.py").read_text()
    assert [line for line in source.splitlines() if "mas_trainer" in line] == ["from mas_trainer import trainable"]


@pytest.mark.parametrize("name", list(APPS))
def test_tasks_file(name):
    lines = tasks(name)
    assert 3 <= len(lines) <= 4
    for task in lines:
        assert task["messages"][0]["role"] == "user" and task["answer"]


def test_tools_compute(load_app):
    sup = load_app("supervisor_pkg")
    assert sup.calculate.invoke({"expression": "(120 - 45) / 5"}) == "15"
    assert sup.calculate.invoke({"expression": "__import__('os')"}).startswith("Error")
    assert "Jupiter" in sup.lookup.invoke({"query": "largest planet"})
    swarm = load_app("swarm_pkg")
    assert swarm.convert_length.invoke({"value": 3, "from_unit": "km", "to_unit": "m"}) == "3000 m"
    assert swarm.convert_length.invoke({"value": 100, "from_unit": "m", "to_unit": "ft"}) == "328.084 ft"


def _session_with(app_ref, engines):
    session = Session(backend_factory=lambda _m: PolicyBackend(FakeEngine(reply="unrouted"), FakeChatFormat()), timeout_s=300)
    session.__enter__()
    try:
        app = session.load_app(app_ref, start_engines=False)
        for policy in app.spec.policies:
            session.attach(policy, PolicyBackend(engines.get(policy) or FakeEngine(reply="unrouted"), FakeChatFormat()))
    except BaseException:
        session.__exit__(None, None, None)
        raise
    return session


def test_supervisor_hands_off_to_the_math_expert_and_back(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))

    def supervisor(messages):
        if any("transferred back" in r for r in tool_results(messages)):
            return "The answer is 391."
        return tool_call("transfer_to_math_expert")

    def math(messages):
        if "391" in tool_results(messages):
            return "17 * 23 = 391"
        return tool_call("calculate", expression="17 * 23")

    engines = {"supervisor": scripted(supervisor), "math": scripted(math), "research": FakeEngine(reply="never")}
    session = _session_with("examples/langgraph_apps/supervisor_pkg.py:graph", engines)
    try:
        trajs = session.run([tasks("supervisor_pkg")[0]], n=2)
    finally:
        session.__exit__(None, None, None)
    for t in trajs:
        assert t.status == "ok", t.error
        assert [(c.node, c.role, c.policy) for c in t.llm_calls] == [
            ("supervisor:agent", "supervisor", "supervisor"),
            ("math_expert:model", "math_expert", "math"),
            ("math_expert:model", "math_expert", "math"),
            ("supervisor:agent", "supervisor", "supervisor"),
        ]
        # the hand-off is the supervisor's tool call; the hand-back is written by the package
        # (messages, no tool run), as the supervisor's next prompt shows
        assert [tc.name for tc in t.tool_calls] == ["transfer_to_math_expert", "calculate"]
        assert t.tool_calls[0].output["goto"] == "math_expert"
        assert str(t.tool_calls[1].output) == "391"
        assert "Successfully transferred back to supervisor" in str(t.llm_calls[-1].messages)
        # each rollout has its own thread: the two rollouts of the task do not share messages
        messages = t.final_state["messages"]
        assert [m["content"] for m in messages][:1] + [m["content"] for m in messages][-1:] == [
            "What is 17 * 23?", "The answer is 391."]
        assert len(messages) == 7
    assert not engines["research"].calls


def test_swarm_hands_off_and_remembers_the_active_agent(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))

    def math(messages):
        if "84.0" in tool_results(messages):
            return "12 times 7 is 84."
        return tool_call("multiply", a=12, b=7)

    engines = {"concierge": scripted(lambda m: tool_call("transfer_to_math_expert")), "math": scripted(math)}
    session = _session_with("examples/langgraph_apps/swarm_pkg.py:graph", engines)
    try:
        trajs = session.run([tasks("swarm_pkg")[0]], n=2)
    finally:
        session.__exit__(None, None, None)
    for t in trajs:
        assert t.status == "ok", t.error
        assert [(c.node, c.role, c.policy) for c in t.llm_calls] == [
            ("concierge:model", "concierge", "concierge"),
            ("math_expert:model", "math_expert", "math"),
            ("math_expert:model", "math_expert", "math"),
        ]
        handoff = t.tool_calls[0]
        assert (handoff.name, handoff.output["goto"]) == ("transfer_to_math_expert", "math_expert")
        assert "active_agent" in handoff.output["update_keys"]
        assert t.final_state["active_agent"] == "math_expert"
        assert t.final_state["messages"][-1]["content"] == "12 times 7 is 84."
    # every rollout starts at the default agent (a fresh thread each)
    assert len(engines["concierge"].calls) == 2


@pytest.mark.parametrize("name", list(APPS))
def test_trace_on_the_tiny_model(monkeypatch, name):
    """End to end on a real (random, 2-layer) engine: the first agent answers, under its policy."""
    monkeypatch.syspath_prepend(str(ROOT))
    with Session(model="tiny", timeout_s=300, default_max_tokens=8) as session:
        session.load_app(f"examples/langgraph_apps/{name}.py:graph")
        [t] = session.run([tasks(name)[0]])
    assert t.status == "ok", t.error
    first_agent = APPS[name][0][0]
    assert t.llm_calls and t.llm_calls[0].role == first_agent
    assert t.llm_calls[0].policy == {"supervisor_pkg": "supervisor", "swarm_pkg": "concierge"}[name]
    assert len(t.llm_calls[0].response_ids) == len(t.llm_calls[0].response_logprobs) > 0
