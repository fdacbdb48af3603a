"""Imported traces see a deep agent's sub-agents as roles of their own, as live rollouts do
(issue 42): the deep agent of tests/fixtures/deep_agents_app.py, traced in production by the real
OpenInference and OpenLLMetry LangChain instrumentations (their spans written as OTLP/JSON, as
docs/serving.md's exporter does), imports with every LLM call on the path the tracer gives it
(``tools:@researcher:model``, not the main agent's ``model``) and on its own agent's policy; a
plain subgraph's node nests (``research:search``) and an agent that is a node gets no segment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openinference.instrumentation.langchain")
pytest.importorskip("opentelemetry.instrumentation.langchain")
pytest.importorskip("opentelemetry.exporter.otlp.proto.common.trace_encoder")
pytest.importorskip("deepagents")

from mas_trainer.cli import main  # noqa: E402
from mas_trainer.production.record import read_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
INSTRUMENTATIONS = ("openinference", "openllmetry")
# Each instrumentation in turn, on its own tracer provider, its spans one OTLP/JSON export a line:
# the deep agent run against the gateway with the tiny model (its main agent made to delegate), and
# a team agent on fake models: a plain subgraph `research`, and a `writer` agent that is a node.
SCRIPT = f'''
import json, os, sys
sys.path.insert(0, "{ROOT}/tests/fixtures")
os.environ.setdefault("OPENAI_API_KEY", "sk-unused")
from pathlib import Path
from google.protobuf.json_format import MessageToJson
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langgraph.graph import START, MessagesState, StateGraph
from openinference.instrumentation.langchain import LangChainInstrumentor
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.instrumentation.langchain import LangchainInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
import deep_agents_app
from mas_trainer import api


def team():
    fake = lambda text: GenericFakeChatModel(messages=iter([AIMessage(text)]))  # noqa: E731
    searcher = fake("searched")
    research = StateGraph(MessagesState)
    research.add_node("search", lambda s: {{"messages": [searcher.invoke(s["messages"])]}})
    research.add_edge(START, "search")
    g = StateGraph(MessagesState)
    g.add_node("research", research.compile())
    writer = create_agent(fake("written"), tools=[], system_prompt="You write.", name="writer")
    g.add_node("writer", lambda s: writer.invoke(s))  # the agent `writer` runs as the node `writer`
    g.add_edge(START, "research")
    g.add_edge("research", "writer")
    # named as create_agent names its graph: the team is an agent, whose node calls run as `team`
    return g.compile().with_config({{"metadata": {{"lc_agent_name": "team"}}}})


out, live = Path(sys.argv[1]), {{}}
for which, instrumentor in (("openinference", LangChainInstrumentor()), ("openllmetry", LangchainInstrumentor())):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor.instrument(tracer_provider=provider)
    try:
        res = api.trace(deep_agents_app.graph, [{{"messages": [{{"role": "user", "content": "Why is the sky blue?"}}]}}],
                        model="tiny", max_tokens=8)
        team().invoke({{"messages": [{{"role": "user", "content": "Write about the sky."}}]}})
    finally:
        instrumentor.uninstrument()
    [t] = res.trajectories
    assert t.status == "ok", t.error
    live[which] = [c.node for c in t.llm_calls]
    (out / f"{{which}}.jsonl").write_text(MessageToJson(encode_spans(exporter.get_finished_spans()), indent=None) + "\\n")
print(json.dumps(live))
'''
# the app's own policy map (deep_agents_app.graph), with general-purpose on a policy of its own
POLICIES = {"lead": "lead", "researcher": "research", "critic": "critic", "general-purpose": "general"}
# who made a call, by its system prompt; deepagents' general-purpose sub-agent has deepagents' own
PROMPTS = {"You lead.": "lead", "You are the researcher.": "researcher", "You are the critic.": "critic"}


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    """A folder with openinference.jsonl and openllmetry.jsonl; instrumentation -> the live rollout's call paths."""
    where = tmp_path_factory.mktemp("traced")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(where)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return where, json.loads(done.stdout.strip().splitlines()[-1])


def _imported(traced: tuple[Path, dict[str, list[str]]], which: str, out: Path, *roles: str) -> list[list[Any]]:
    """Import one instrumentation's spans into `out`: each run's calls as [node, role, policy, system prompt]."""
    where, _ = traced
    policies = [arg for role, policy in POLICIES.items() for arg in ("--policy", f"{role}={policy}")]
    assert main(["import-traces", str(where / f"{which}.jsonl"), "--out", str(out),
                 *(arg for r in roles for arg in ("--role", r)), *policies]) == 0
    return [[[c.node, c.role, c.policy, c.messages[0]["content"] if c.messages[0]["role"] == "system" else None]
             for c in traj.llm_calls] for traj, _ in read_runs(out)]


def _agent(prompt: str | None) -> str:
    return next((agent for start, agent in PROMPTS.items() if (prompt or "").startswith(start)), "general-purpose")


@pytest.mark.parametrize("which", INSTRUMENTATIONS)
def test_each_imported_call_lands_on_the_policy_of_the_agent_that_made_it(traced, which, tmp_path: Path) -> None:
    runs = _imported(traced, which, tmp_path / "rec", "lead=lead")  # the main agent named by its name
    deep = next(calls for calls in runs if len(calls) == 5)
    made_by = [_agent(prompt) for *_, prompt in deep]
    assert sorted(made_by) == ["critic", "general-purpose", "lead", "lead", "researcher"]
    expected = {"lead": "model", "researcher": "tools:@researcher:model", "critic": "tools:@critic:model",
                "general-purpose": "tools:@general-purpose:model"}
    for (node, role, policy, _), agent in zip(deep, made_by):
        assert (node, role, policy) == (expected[agent], agent, POLICIES[agent])
    assert sorted(node for node, *_ in deep) == sorted(traced[1][which])  # the paths the tracer gave them live

    # the main agent's node named by its node name maps it alone: a sub-agent is a role of its own
    again = _imported(traced, which, tmp_path / "by-node", "model=lead")
    assert sorted((node, role) for node, role, *_ in next(c for c in again if len(c) == 5)) == sorted(
        (expected[agent], agent) for agent in made_by)


@pytest.mark.parametrize("which", INSTRUMENTATIONS)
def test_a_subgraphs_nodes_nest_and_an_agent_that_is_a_node_gets_no_segment(traced, which, tmp_path: Path) -> None:
    runs = _imported(traced, which, tmp_path / "rec", "research=scout", "writer=author")
    team = next(calls for calls in runs if len(calls) == 2)
    # `search` inherits its subgraph node's role; `writer`'s own model is in `writer`, not `writer:@writer`
    assert [(node, role, policy) for node, role, policy, _ in team] == [
        ("research:search", "scout", "scout"), ("writer:model", "author", "author")]
