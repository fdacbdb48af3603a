"""`mas-trainer trace` end to end on the tiny model, and its one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APPS = ROOT / "examples" / "langgraph_apps"


def run_cli(*args, cwd=ROOT, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "mas_trainer.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_trace_map_reduce_on_tiny_model(tmp_path):
    out = tmp_path / "traj.jsonl"
    r = run_cli("trace", f"{APPS}/map_reduce.py:graph", "--data", f"{APPS}/data/map_reduce.jsonl", "--model", "tiny",
                "--output", str(out), "--max-tokens", "16")
    assert r.returncode == 0, r.stderr[-2000:]
    trajs = _read(out)
    tasks = (APPS / "data" / "map_reduce.jsonl").read_text().splitlines()
    assert len(trajs) == len(tasks)
    for t in trajs:
        assert t["schema_version"] == 1 and t["status"] == "ok", t["error"]
        nodes = {n["id"]: n for n in t["nodes"]}
        llm_nodes = [n for n in t["nodes"] if n["name"] in ("planner", "worker", "reducer")]
        assert len(t["llm_calls"]) == len(llm_nodes)  # one call per LLM node call, each once
        for c in t["llm_calls"]:
            assert nodes[c["node_id"]]["name"] == c["node"]
            assert c["policy"] == {"planner": "planner", "worker": "worker", "reducer": "worker"}[c["node"]]
            assert len(c["response_ids"]) == len(c["response_logprobs"]) > 0
    assert "planner" in r.stdout and "worker" in r.stdout  # the tree and the role table


def test_trace_undecorated_graph_with_input(tmp_path):
    out = tmp_path / "t.jsonl"
    task = json.loads((APPS / "data" / "untraced_plain.jsonl").read_text().splitlines()[0])
    r = run_cli("trace", "examples.langgraph_apps.untraced_plain:graph", "--input", json.dumps(task), "--model", "tiny",
                "--output", str(out), "--max-tokens", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    [t] = _read(out)
    assert {c["policy"] for c in t["llm_calls"]} == {"default"}
    assert {c["role"] for c in t["llm_calls"]} == {c["node"] for c in t["llm_calls"]}


@pytest.mark.parametrize(
    "args, needle",
    [
        (["nope.py:graph", "--input", "{}"], "app file not found: nope.py"),
        (["examples/langgraph_apps/map_reduce.py", "--input", "{}"], "APP must be"),
        (["examples/langgraph_apps/map_reduce.py:nothing", "--input", "{}"], "has no attribute 'nothing'"),
        (["no_such_pkg.mod:graph", "--input", "{}"], "module not found: no_such_pkg.mod"),
        (["examples/langgraph_apps/map_reduce.py:graph", "--input", "{bad"], "--input is not valid JSON"),
        (["examples/langgraph_apps/map_reduce.py:graph", "--input", "[1]"], "must be a JSON object"),
        (["examples/langgraph_apps/map_reduce.py:graph", "--data", "missing.jsonl"], "data file not found"),
        (["examples/langgraph_apps/map_reduce.py:graph", "--input", "{}", "--model", "./no/such/model"], "--model"),
        (["examples/langgraph_apps/map_reduce.py:graph", "--input", "{}", "--concurrency", "0"], "--concurrency 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = run_cli("trace", *args, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_bad_data_line_names_file_and_line(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"topic": "a"}\n{oops\n')
    r = run_cli("trace", "examples/langgraph_apps/map_reduce.py:graph", "--data", str(data), timeout=120)
    assert r.returncode == 2 and f"{data}:2: not valid JSON" in r.stderr


def test_every_verb_has_help():
    r = run_cli("trace", "--help", timeout=60)
    assert r.returncode == 0 and "--model" in r.stdout and "--data" in r.stdout


def test_docs_list_every_fit_config_key_with_its_default():
    from mas_trainer.config import describe_keys

    docs = (ROOT / "docs" / "training.md").read_text()
    missing = [line for line in describe_keys() if line not in docs]
    assert not missing, f"docs/training.md lacks (regenerate its key list from describe_keys): {missing}"


@pytest.mark.model
def test_trace_on_the_bundled_model(tmp_path):
    out = tmp_path / "traj.jsonl"
    r = run_cli("trace", f"{APPS}/subgraph_app.py:graph", "--data", f"{APPS}/data/subgraph_app.jsonl", "--model", "default",
                "--output", str(out), "--max-tokens", "24")
    assert r.returncode == 0, r.stderr[-2000:]
    trajs = _read(out)
    for t in trajs:
        assert t["status"] == "ok", t["error"]
        names = {c["node"] for c in t["llm_calls"]}
        assert {"research:search_query", "research:summarize", "final"} <= names
        for c in t["llm_calls"]:
            assert len(c["response_ids"]) == len(c["response_logprobs"]) > 0
            assert c["output_text"] is not None


# node -> policy of each example app (as its @trainable says), or None for undecorated apps
EXAMPLES = {
    "supervisor": {"supervisor": "supervisor_policy", "researcher": "researcher_policy", "writer": "writer_policy"},
    "reflection": {"generate": "shared", "reflect": "shared"},
    "map_reduce": {"planner": "planner", "worker": "worker", "reducer": "worker"},
    "subgraph_app": {"research:search_query": "research", "research:summarize": "research", "final": "writer"},
    "raw_openai": {"answer": "answerer", "review": "reviewer"},
    "tools_agent": {"agent": "agent"},
    "untraced_plain": {"draft": "default", "polish": "default"},
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_app_traces_on_tiny(tmp_path, name):
    out = tmp_path / "t.jsonl"
    r = run_cli("trace", f"{APPS}/{name}.py:graph", "--data", f"{APPS}/data/{name}.jsonl", "--model", "tiny",
                "--output", str(out), "--max-tokens", "12")
    assert r.returncode == 0, r.stderr[-2000:]
    expected = EXAMPLES[name]
    for t in _read(out):
        assert t["status"] == "ok", t["error"]
        nodes = {n["id"]: n for n in t["nodes"]}
        llm_node_calls = [n for n in t["nodes"] if n["name"] in expected]
        assert len(t["llm_calls"]) >= 1
        calls_per_node = {}
        for c in t["llm_calls"]:
            assert nodes[c["node_id"]]["name"] == c["node"]
            assert c["policy"] == expected[c["node"]], (c["node"], c["policy"])
            assert len(c["response_ids"]) == len(c["response_logprobs"]) > 0
            calls_per_node[c["node_id"]] = calls_per_node.get(c["node_id"], 0) + 1
        assert set(calls_per_node) <= {n["id"] for n in llm_node_calls}


def test_tasks_from_a_hugging_face_dataset(tmp_path, monkeypatch):
    import argparse

    import datasets

    from mas_trainer.cli import _load_tasks
    from mas_trainer.errors import UserError

    folder = tmp_path / "my_qa"
    folder.mkdir()
    rows = {"train": [{"question": "q1", "answer": "a1"}, {"question": "q2", "answer": "a2"}],
            "validation": [{"question": "q3", "answer": "a3"}]}
    for split, items in rows.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))

    def load(spec):
        return _load_tasks(argparse.Namespace(input=None, data=spec))

    assert load(f"hf:{folder}:validation") == rows["validation"]
    assert load(f"hf:{folder}") == rows["train"]
    with pytest.raises(UserError, match="hf:NAME:CONFIG:SPLIT"):
        load("hf:a:b:c:d")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what a machine without the hub sees
    with pytest.raises(UserError, match="cannot load Hugging Face dataset 'nobody/no-such-dataset'") as err:
        load("hf:nobody/no-such-dataset:test")
    assert "\n" not in str(err.value)
