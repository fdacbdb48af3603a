"""The example LangGraph apps import, compile, and have the nodes their policy maps name.

Each app module is imported fresh with dummy ``OPENAI_API_KEY`` / ``OPENAI_BASE_URL`` set
before the import (module-level clients read them at construction). Nothing here calls a
model.
"""

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPS_DIR = ROOT / "examples" / "langgraph_apps"
DUMMY_BASE_URL = "http://127.0.0.1:9/v1"
DUMMY_KEY = "sk-dummy-for-tests"

# app -> (nodes of get_graph(xray=True) other than __start__/__end__, number of policies,
#         input fields every task must carry)
APPS = {
    "supervisor": ({"supervisor", "researcher", "writer"}, 3, {"question"}),
    "reflection": ({"generate", "reflect"}, 1, {"task"}),
    "map_reduce": ({"planner", "worker", "reducer"}, 2, {"topic", "num_subtopics"}),
    "subgraph_app": ({"research:search_query", "research:summarize", "final"}, 2, {"question"}),
    "raw_openai": ({"answer", "review"}, 2, {"question"}),
    "tools_agent": ({"agent", "tools"}, 1, {"messages"}),
    "untraced_plain": ({"draft", "polish"}, None, {"topic"}),
}
DECORATED = [name for name, (_, n_policies, _) in APPS.items() if n_policies is not None]


@pytest.fixture
def load_app(monkeypatch):
    """Import ``examples.langgraph_apps.<name>`` afresh with dummy OpenAI settings."""
    monkeypatch.setenv("OPENAI_API_KEY", DUMMY_KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", DUMMY_BASE_URL)
    monkeypatch.syspath_prepend(str(ROOT))

    def load(name):
        module_name = f"examples.langgraph_apps.{name}"
        # monkeypatch restores sys.modules entries (removing the fresh import) after the test.
        monkeypatch.delitem(sys.modules, module_name, raising=False)
        return importlib.import_module(module_name)

    return load


def as_compiled(obj):
    """The graph behind an app object.

    The decorated object is expected to behave like a compiled graph; a decorated builder
    or graph factory that stays a builder or factory is compiled or called here.
    """
    if hasattr(obj, "get_graph"):
        return obj
    if hasattr(obj, "compile"):
        return obj.compile()
    assert callable(obj), f"not a graph, builder or graph factory: {obj!r}"
    return as_compiled(obj())


def graph_nodes(obj) -> set[str]:
    nodes = set(as_compiled(obj).get_graph(xray=True).nodes)
    return nodes - {"__start__", "__end__"}


@pytest.mark.parametrize("name", list(APPS))
def test_app_compiles_with_expected_nodes(load_app, name):
    module = load_app(name)
    expected_nodes, _, _ = APPS[name]
    assert hasattr(module, "graph"), f"{name} exposes no `graph`"
    assert graph_nodes(module.graph) == expected_nodes
    assert (module.__doc__ or "").strip(), f"{name} has no module docstring"


@pytest.mark.parametrize("name", DECORATED)
def test_policy_map_names_real_nodes_and_policies(load_app, name):
    module = load_app(name)
    expected_nodes, n_policies, _ = APPS[name]
    roles, policies = module.ROLES, module.POLICIES
    assert set(roles) <= graph_nodes(module.graph)
    assert set(roles.values()) == set(policies), "every policy serves a role and vice versa"
    assert len(policies) == n_policies
    # the node that runs no model (the ToolNode) is not a role
    llm_nodes = expected_nodes - {"tools"}
    assert set(roles) == llm_nodes


@pytest.mark.parametrize("name", DECORATED)
def test_decorated_with_trainable_and_nothing_else(name):
    source = (APPS_DIR / f"{name}.py").read_text()
    assert "from mas_trainer import trainable" in source
    mentions = [line for line in source.splitlines() if "mas_trainer" in line]
    assert mentions == ["from mas_trainer import trainable"], mentions


def test_untraced_app_is_a_plain_compiled_graph(load_app):
    from langgraph.graph.state import CompiledStateGraph

    source = (APPS_DIR / "untraced_plain.py").read_text()
    assert "mas_trainer" not in source and "trainable(" not in source
    module = load_app("untraced_plain")
    assert type(module.graph) is CompiledStateGraph


def test_module_level_clients_read_the_environment(load_app):
    """Clients are built the ordinary way, so OPENAI_BASE_URL decides where calls go."""
    def base_url(chat_model) -> str:
        return str(chat_model.root_client.base_url).rstrip("/")

    reflection = load_app("reflection")
    assert base_url(reflection.llm) == DUMMY_BASE_URL
    subgraph_app = load_app("subgraph_app")
    assert base_url(subgraph_app.research_llm) == DUMMY_BASE_URL
    assert base_url(subgraph_app.final_model) == DUMMY_BASE_URL
    tools_agent = load_app("tools_agent")
    assert base_url(tools_agent.llm.bound) == DUMMY_BASE_URL
    raw_openai = load_app("raw_openai")
    assert str(raw_openai.client.base_url).rstrip("/") == DUMMY_BASE_URL
    assert raw_openai.client.api_key == DUMMY_KEY


@pytest.mark.parametrize("name", list(APPS))
def test_tasks_file(name):
    _, _, input_fields = APPS[name]
    path = APPS_DIR / "data" / f"{name}.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert 3 <= len(lines) <= 4
    for line in lines:
        task = json.loads(line)
        assert isinstance(task, dict)
        assert input_fields <= set(task), f"{path.name}: task lacks {input_fields - set(task)}"
        assert set(task) - input_fields, f"{path.name}: task has no reference field"


def test_calculator_tool_is_safe(load_app):
    calculator = load_app("tools_agent").calculator
    assert calculator.invoke({"expression": "17 * 23"}) == "391"
    assert calculator.invoke({"expression": "(120 - 45) / 5"}) == "15"
    for bad in ["__import__('os').getcwd()", "9**9**9**9", "1/0", "((", "x + 1", "2" * 500]:
        assert calculator.invoke({"expression": bad}).startswith("Error")


def test_map_reduce_planner_parsing(load_app):
    map_reduce = load_app("map_reduce")
    text = "1. Solar power\n- Wind\n\n* **Hydro**\nb) Geothermal\n"
    assert map_reduce.parse_subtopics(text, 3) == ["Solar power", "Wind", "Hydro"]
    assert map_reduce.parse_subtopics("", 2) == []
    assert map_reduce.requested_count({"num_subtopics": "many"}) == map_reduce.DEFAULT_SUBTOPICS
    assert map_reduce.requested_count({"num_subtopics": 99}) == map_reduce.MAX_SUBTOPICS
