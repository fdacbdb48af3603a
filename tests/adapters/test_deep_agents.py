"""A deep agent's main agent and sub-agents are roles of their own (issue 42, points 1 and 2).

deepagents runs every sub-agent inside the main agent's `tools` node, so LangGraph gives all
their LLM calls the path `tools:model`; the agent's name (`lc_agent_name`) tells them apart and
the policy map names them by it. The app (tests/fixtures/deep_agents_app.py) runs on ChatOpenAI
against the gateway with the tiny model; its main agent's first turn is made to delegate.
"""

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "fixtures"))

from mas_trainer import api, trainable  # noqa: E402
from mas_trainer.adapters.langgraph.trainable import agent_entries, as_graph, node_names  # noqa: E402
from mas_trainer.adapters.langgraph.tracer import _serving_path  # noqa: E402
from mas_trainer.gateway.router import Router  # noqa: E402
from mas_trainer.run.rundir import AppRecord  # noqa: E402
from mas_trainer.spec import FROZEN_POLICY, SpecError  # noqa: E402
from mas_trainer.trace import attributes as A  # noqa: E402

ASK = [{"messages": [{"role": "user", "content": "Why is the sky blue?"}]}]
POLICIES = {"lead": "tiny", "research": "tiny", "critic": "tiny"}


@pytest.fixture(autouse=True)
def openai_env(monkeypatch):
    """ChatOpenAI wants some key when built; in a rollout the gateway answers with its own."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-unused")


@pytest.fixture
def deep_agents_app(openai_env):
    import deep_agents_app

    return deep_agents_app


def test_every_call_lands_on_the_policy_of_the_agent_that_made_it(deep_agents_app):
    result = api.trace(deep_agents_app.graph, ASK, model="tiny", max_tokens=8)
    [t] = result.trajectories
    assert t.status == "ok", t.error
    assert [(c.node, c.role, c.policy) for c in t.llm_calls] == [
        ("model", "lead", "lead"),
        ("tools:@researcher:model", "researcher", "research"),
        ("tools:@critic:model", "critic", "critic"),
        ("tools:@general-purpose:model", "general-purpose", "lead"),  # deepagents' own, mapped by its name
        ("model", "lead", "lead"),
    ]
    assert all(c.trainable and c.response_ids for c in t.llm_calls)
    # role rewards keyed by agent name get that agent's calls, and only them
    assert t.rewards.roles == {"lead": 2.0, "researcher": 1.0, "critic": 1.0}
    # the node calls name the sub-agent they ran in (records, viewer)
    assert {"tools:@researcher:model", "tools:@critic:model"} <= {n.name for n in t.nodes}


def test_agents_are_found_at_decoration(deep_agents_app):
    graph = deep_agents_app.build()
    assert agent_entries(graph) == ["@lead", "tools:@general-purpose", "tools:@researcher", "tools:@critic"]
    assert "tools:model" not in node_names(graph)  # LangGraph's listing cannot see inside a tool
    assert as_graph(deep_agents_app.graph)[1].roles["general-purpose"] == "lead"


def test_an_unknown_agent_name_is_refused_in_one_line_naming_the_valid_ones(deep_agents_app):
    with pytest.raises(SpecError) as err:
        trainable(deep_agents_app.build(), roles={"lead": "lead", "reseacher": "research"}, policies=POLICIES,
                  default_policy="lead")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("unknown agent or node 'reseacher'; did you mean 'researcher'? "
                              "valid agents: lead, general-purpose, researcher, critic; valid nodes: model, tools")


def test_a_sub_agent_nothing_maps_is_named_not_frozen_silently(deep_agents_app):
    # the main agent's node alone: its sub-agents' calls would have been frozen without a word
    with pytest.raises(SpecError, match=r"^agent\(s\) general-purpose, researcher, critic make LLM calls nothing maps: "
                                        r"map each in roles= \(by its name\), list it in frozen="):
        trainable(deep_agents_app.build(), roles={"model": "lead"}, policies=POLICIES)
    with pytest.raises(SpecError, match=r"^agent\(s\) general-purpose make LLM calls nothing maps"):
        trainable(deep_agents_app.build(), roles={"lead": "lead", "researcher": "research", "critic": "critic"},
                  policies=POLICIES)
    # said frozen, or given a default policy: accepted, and a sub-agent never inherits the node it runs in
    said = trainable(deep_agents_app.build(), roles={"tools": "lead", "researcher": "research", "critic": "critic"},
                     frozen=["lead", "general-purpose"], policies=POLICIES)
    _, spec = _resolved(said)
    assert (spec.route("model").policy, spec.route("tools").policy) == (FROZEN_POLICY, "lead")
    assert spec.route("tools:@general-purpose:model").policy == FROZEN_POLICY
    assert not spec.route("tools:@general-purpose:model").unmapped
    _, by_default = _resolved(trainable(deep_agents_app.build(), roles={"researcher": "research"}, policies=POLICIES,
                                        default_policy="lead"))
    critic = by_default.route("tools:@critic:model")
    assert (critic.role, critic.policy) == ("critic", "lead")


def test_agent_roles_survive_the_run_directory_and_route_in_serve(deep_agents_app):
    _, spec = _resolved(deep_agents_app.graph)
    again = AppRecord.from_spec(spec).resolved()  # what serve, export and import rebuild from app.json
    router = Router(again, known_nodes_only=True)
    for node, policy in (("tools:@critic:model", "critic"), ("tools:@researcher:tools", "research"), ("model", "lead")):
        assert router.route({A.BAGGAGE_NODE: node}, "x", again.policies).policy == policy
    # outside a rollout the app's calls name their sub-agent from their own namespace and agent
    assert _serving_path("tools:1f|model:2e", "critic") == "tools:@critic:model"
    assert _serving_path("model:2e", "lead") == "model"
    assert _serving_path("writer:1f|model:2e", "writer") == "writer:model"  # an agent that is a node


def test_an_unmapped_llm_node_is_named_once_at_its_first_call(caplog):
    from words_app import build

    app = build({"lead": "tiny"}, {"planner": "lead", "writer": "lead"})  # critic: nothing maps it
    with caplog.at_level(logging.WARNING, logger="mas_trainer.adapters.langgraph.tracer"):
        [t] = api.trace(app, [{"question": "why"}], n=1, model="tiny", max_tokens=4, rewards=False).trajectories
    assert t.status == "ok", t.error
    assert [c.policy for c in t.llm_calls] == ["lead", "lead", FROZEN_POLICY]
    named = [r.getMessage() for r in caplog.records if "nothing maps" in r.getMessage()]
    assert named == ["LLM calls of node 'critic' are served by the frozen base model because nothing maps them: "
                     "map it in roles=, list it in frozen=, or set default_policy="]


def _resolved(app):
    from mas_trainer.adapters.langgraph.trainable import resolve

    return resolve(app)
