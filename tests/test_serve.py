"""serve: the unedited app, pointed at the endpoint, gets each node's answer from its trained policy."""

import json
import uuid
from pathlib import Path

import openai
import pytest
import torch

from mas_trainer.adapters.langgraph.serving import serving_runs
from mas_trainer.apps import load_object
from mas_trainer.config import ConfigError, load_config
from mas_trainer.gateway import GatewayServer
from mas_trainer.loop.trainer import fit
from mas_trainer.serve import build_gateway

APP = '''
from typing import TypedDict
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from mas_trainer import trainable

llm = ChatOpenAI(model="gpt-4o-mini", temperature=0, max_tokens=8, max_retries=0)

class State(TypedDict, total=False):
    question: str
    plan: str
    answer: str

def planner(s):
    return {"plan": llm.invoke("Plan: " + s["question"]).content}

def writer(s):
    return {"answer": llm.invoke("Write: " + s["plan"]).content}

g = StateGraph(State)
g.add_node("planner", planner)
g.add_node("writer", writer)
g.add_edge(START, "planner")
g.add_edge("planner", "writer")
g.add_edge("writer", END)
graph = trainable(g.compile(), roles={"planner": "lead", "writer": "crew"}, policies={"lead": "tiny", "crew": "tiny"},
                  reward=lambda task, state, traj: float(len(state.get("answer", "")) > 0))
'''


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    (root / "app.py").write_text(APP)
    run = root / "run"
    cfg = load_config(overrides=["runtime.execution=local", "steps=2", "rollout.tasks_per_step=2", "rollout.n=2",
                                 "learner.lr=5e-2", "seed=2"])
    fit(f"{root / 'app.py'}:graph", [{"question": "Name a fruit."}, {"question": "Say hello."}], cfg, run)
    return root, run


def test_unedited_app_gets_each_node_from_its_trained_policy(trained_run, monkeypatch):
    root, run = trained_run
    gateway = build_gateway(run, routes={"gpt-4o-mini": "crew"})
    decisions = []
    route = gateway.router.route

    def spy(bag, model, policies):
        d = route(bag, model, policies)
        decisions.append((d.node, d.policy))
        return d

    gateway.router.route = spy
    with GatewayServer(gateway) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "x")
        graph = load_object(f"{root / 'app.py'}:graph")  # imported as its author would run it
        state = graph.invoke({"question": "Name a fruit."})
        assert decisions == [("planner", "lead"), ("writer", "crew")]
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        direct = client.chat.completions.create(model="lead", messages=[{"role": "user", "content": "Plan: Name a fruit."}],
                                                temperature=0, max_tokens=8)
        assert state["plan"] == direct.choices[0].message.content
        direct = client.chat.completions.create(model="crew", messages=[{"role": "user", "content": "Write: " + state["plan"]}],
                                                temperature=0, max_tokens=8)
        assert state["answer"] == direct.choices[0].message.content
        # no node: served by model name as the routes say; the answer says which policy gave it
        raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
        answer = raw.parse()
        assert raw.headers["x-mas-policy"] == "crew" and answer.model == "gpt-4o-mini" and answer.policy == "crew"
        stream = client.chat.completions.with_raw_response.create(model="lead", messages=[{"role": "user", "content": "hi"}],
                                                                  stream=True, max_tokens=2)
        assert stream.headers["x-mas-policy"] == "lead"
        # unknown names are refused
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])


def test_api_key_and_bad_runs(trained_run, tmp_path):
    _, run = trained_run
    with GatewayServer(build_gateway(run, api_key="k")) as server:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
        ids = {m.id for m in openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0).models.list().data}
        assert {"lead", "crew"} <= ids
    with pytest.raises(ConfigError, match="has no checkpoint"):
        build_gateway(tmp_path)
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        build_gateway(run, routes={"gpt-4o-mini": "nope"})
    with pytest.raises(ConfigError, match=r"unknown policy 'crw'; did you mean 'crew'\? policies of this run: crew, frozen, lead"):
        build_gateway(run, routes={"gpt-4o-mini": "crw"})
    json.loads((Path(run) / "app.json").read_text())


def test_serve_cli_runs_until_sigterm(trained_run):
    import signal
    import socket
    import subprocess
    import sys
    import time

    _, run = trained_run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mas_trainer.cli", "serve", str(run), "--port", str(port),
                             "--route", "gpt-4o-mini=lead"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"127.0.0.1:{port}" in line, line + proc.stderr.read()
        # every node trained: no frozen policy listed
        assert line.startswith("serving crew, lead at "), line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4).choices[0].message is not None
    finally:
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 120  # a hang guard
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
    assert proc.returncode == 0


def test_unknown_nodes_are_refused_and_details_are_behind_the_key(trained_run):
    import httpx

    _, run = trained_run
    with GatewayServer(build_gateway(run, api_key="k", routes={"gpt-4o-mini": "crew"})) as server:
        root = server.base_url.removesuffix("/v1")
        auth = {"authorization": "Bearer k"}
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers={**auth, "baggage": "mas.node=ghost"})
        assert r.status_code == 404 and "'ghost' is not in this run's policy map" in r.json()["error"]["message"]
        assert "planner" in r.json()["error"]["message"]  # lists the nodes it knows
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers={**auth, "baggage": "mas.node=planner"})
        assert r.status_code == 200 and r.json()["system_fingerprint"] == "mas-trainer:lead"
        assert httpx.get(f"{root}/health").json() == {"status": "ok"}  # a bare liveness probe
        assert httpx.get(f"{root}/health", headers=auth).json()["policies"]
        assert httpx.get(f"{root}/openapi.json").status_code == 401
        assert httpx.get(f"{root}/openapi.json", headers=auth).json()["info"]["title"]
        assert httpx.get(f"{root}/docs").status_code == 404


def test_the_api_key_can_come_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from mas_trainer.serve import resolve_api_key

    monkeypatch.delenv("MAS_TRAINER_API_KEY", raising=False)
    assert resolve_api_key() is None
    monkeypatch.setenv("MAS_TRAINER_API_KEY", "from-env")
    assert resolve_api_key() == "from-env"
    (tmp_path / "key").write_text("from-file\n")
    assert resolve_api_key(api_key_file=tmp_path / "key") == "from-file"
    assert resolve_api_key(api_key="flag") == "flag"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve_api_key(api_key_file=tmp_path / "empty")
    with pytest.raises(ConfigError, match="missing"):
        resolve_api_key(api_key_file=tmp_path / "missing")
    with pytest.raises(ConfigError, match="not both"):
        resolve_api_key(api_key="a", api_key_file=tmp_path / "key")


def test_record_runs_and_feedback_over_http(trained_run, tmp_path, monkeypatch):
    import httpx

    from mas_trainer.production.client import feedback
    from mas_trainer.errors import UserError
    from mas_trainer.production.record import Recorder, read_runs

    root, run = trained_run
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi bob@example.com"}], "max_tokens": 2}
    auth = {"authorization": "Bearer k"}
    gateway = build_gateway(run, api_key="k", routes={"gpt-4o-mini": "crew"})
    with GatewayServer(gateway) as server:  # not recording: no run id, and feedback is refused
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers=auth)
        assert r.status_code == 200 and "x-mas-run-id" not in r.headers and "run_id" not in r.json()
        r = httpx.post(f"{server.base_url}/feedback", json={"run_id": "a" * 32, "score": 1}, headers=auth)
        assert r.status_code == 404 and "--record" in r.json()["error"]["message"]
    gateway = build_gateway(run, api_key="k", routes={"gpt-4o-mini": "crew"})  # a closed gateway stays closed
    gateway.recorder = Recorder(tmp_path, redact=lambda s: s.replace("bob@example.com", "[email]"))
    with GatewayServer(gateway) as server:
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        run_id, turn = r.headers["x-mas-run-id"], r.json()["id"]
        assert r.json()["run_id"] == run_id and len(run_id) == 32
        streamed = httpx.post(f"{server.base_url}/chat/completions", json={**body, "stream": True}, headers=auth)
        assert streamed.status_code == 200 and "data:" in streamed.text
        streamed_id = streamed.headers["x-mas-run-id"]
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "k")
        graph_run = uuid.uuid4()  # the invocation's LangChain run id names the recorded run
        load_object(f"{root / 'app.py'}:graph").invoke({"question": "Name a fruit, bob@example.com."},
                                                       config={"run_id": graph_run})
        serving_runs().flush()
        assert not serving_runs()._roots and not serving_runs()._root_of  # nothing kept per finished invocation
        sent = {"run_id": graph_run.hex, "input": {"question": "again"}}  # the app sent its graph run: once only
        r = httpx.post(f"{server.base_url}/runs", json=sent, headers=auth)
        assert r.status_code == 409 and "already" in r.json()["error"]["message"]
        assert httpx.post(f"{server.base_url}/runs", json=sent).status_code == 401
        r = httpx.post(f"{server.base_url}/runs", json={**sent, "run_id": "d" * 32}, headers=auth)
        assert r.status_code == 404 and "no recorded run" in r.json()["error"]["message"]
        r = httpx.post(f"{server.base_url}/runs", json={**sent, "run_id": run_id, "input": "x" * 2_000_000}, headers=auth)
        assert r.status_code == 413
        deep = f'{{"run_id": "{run_id}", "input": ' + "[" * 5000 + "]" * 5000 + "}"
        assert httpx.post(f"{server.base_url}/runs", content=deep, headers=auth).status_code == 422
        # refused: no key, wrong key, unknown run, unknown turn, neither score nor label, huge, traversal
        fb = {"run_id": run_id, "score": 1.0}
        assert httpx.post(f"{server.base_url}/feedback", json=fb).status_code == 401
        assert httpx.post(f"{server.base_url}/feedback", json=fb, headers={"authorization": "Bearer no"}).status_code == 401
        r = httpx.post(f"{server.base_url}/feedback", json={**fb, "run_id": "b" * 32}, headers=auth)
        assert r.status_code == 404 and "no recorded run" in r.json()["error"]["message"]
        assert httpx.post(f"{server.base_url}/feedback", json={**fb, "turn": "nope"}, headers=auth).status_code == 404
        assert httpx.post(f"{server.base_url}/feedback", json={"run_id": run_id}, headers=auth).status_code == 422
        assert httpx.post(f"{server.base_url}/feedback", json={**fb, "comment": "x" * 100_000}, headers=auth).status_code == 413
        for bad in ("../../etc/passwd", "..%2f" * 8, run_id + "/.."):
            assert httpx.post(f"{server.base_url}/feedback", json={**fb, "run_id": bad}, headers=auth).status_code == 422
        with pytest.raises(UserError, match="404"):
            feedback(server.base_url, "c" * 32, score=1, api_key="k")
        assert feedback(server.base_url, run_id, label="good", turn=turn, api_key="k")["status"] == "recorded"
        assert httpx.post(f"{server.base_url}/feedback", json=fb, headers=auth).status_code == 200
    on_disk = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "bob@example.com" not in on_disk and "[email]" in on_disk
    runs = {t.rollout_id: (t, f) for t, f in read_runs(tmp_path)}
    assert [f.get("label") for f in runs[run_id][1]] == ["good", None]
    assert runs.pop(streamed_id)[0].llm_calls[0].output_text is not None  # a streamed answer is recorded too
    # outside a rollout an @trainable graph's invocation is one run: its calls, input (redacted) and final state
    served = runs[graph_run.hex][0]
    assert [c.node for c in served.llm_calls] == ["planner", "writer"]
    assert served.task == {"question": "Name a fruit, [email]."} and served.status == "ok"
    assert served.final_state["answer"] == served.llm_calls[1].output_text
    assert run_id in runs and runs[run_id][0].task == {}  # a bare call: a run of its own, no graph input


def test_recorded_runs_survive_kill_9(trained_run, tmp_path):
    import signal
    import socket
    import subprocess
    import sys

    import httpx

    from mas_trainer.production.record import read_runs

    _, run = trained_run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mas_trainer.cli", "serve", str(run), "--port", str(port),
                             "--route", "gpt-4o-mini=lead", "--record", str(tmp_path / "rec")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "recording runs in" in line, line + proc.stderr.read()
        ids = []
        for i in range(3):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                           json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2})
            ids.append(r.headers["x-mas-run-id"])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert [t.rollout_id for t, _ in read_runs(tmp_path / "rec")] == ids


def test_nothing_is_recorded_without_the_switch(trained_run, tmp_path):
    from mas_trainer.serve import serve as run_serve

    _, run = trained_run
    with pytest.raises(ConfigError, match="--record"):
        run_serve(run, redact="os.path:basename")


def test_an_app_is_served_on_its_base_policies(trained_run, monkeypatch):
    """`serve app.py:graph`: before any training, each node answered by its policy's base model."""
    import httpx

    root, _ = trained_run
    gateway = build_gateway(f"{root / 'app.py'}:graph", routes={"gpt-4o-mini": "crew"})
    assert {"crew", "lead"} <= set(gateway.backends)
    with GatewayServer(gateway) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "x")
        state = load_object(f"{root / 'app.py'}:graph").invoke({"question": "Name a fruit."})
        assert state["plan"] is not None and state["answer"] is not None
        from mas_trainer.engines.models import load_model

        base = load_model("tiny", seed=0)[0].state_dict()  # the app's base model, not a checkpoint
        for policy in ("lead", "crew"):
            served = gateway.backends[policy].engine._model.state_dict()
            assert all(torch.equal(served[k].float(), base[k].float()) for k in base)
        r = httpx.post(f"{server.base_url}/chat/completions",
                       json={"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404
    with pytest.raises(ConfigError, match="--engine vllm serves a run's trained checkpoints"):
        build_gateway(f"{root / 'app.py'}:graph", engine="vllm")
    with pytest.raises(ConfigError, match="--model replaces an app"):
        build_gateway(root / "run", model="tiny")


def test_a_lora_run_is_served_and_viewed_from_its_adapter_folders(tmp_path):
    """A LoRA policy's checkpoint is an adapter folder (no full weights, no tokenizer of its own
    until saved with one): `serve` answers from base + adapter, and the viewer decodes its
    tokens (reading an adapter folder's tokenizer once raised NameError, hidden by the viewer)."""
    from mas_trainer.engines.models import is_adapter
    from mas_trainer.view import ViewSource

    (tmp_path / "app.py").write_text(APP)
    run = tmp_path / "run"
    cfg = load_config(overrides=["runtime.execution=local", "steps=1", "rollout.tasks_per_step=1", "rollout.n=2",
                                 "learner.lora_rank=4", "learner.lr=5e-2", "seed=2"])
    fit(f"{tmp_path / 'app.py'}:graph", [{"question": "Name a fruit."}], cfg, run)
    assert all(is_adapter(run / "checkpoint" / "policies" / p) for p in ("lead", "crew"))
    with GatewayServer(build_gateway(run)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="lead", messages=[{"role": "user", "content": "Plan: Name a fruit."}], temperature=0, max_tokens=4)
        assert raw.headers["x-mas-policy"] == "lead" and raw.parse().choices[0].message.content is not None
    step = ViewSource(run).step("step_000001")
    assert step is not None
    calls = [c for r in step["rollouts"] for c in r["llm_calls"]]
    assert calls and all(c["pieces"] is not None and len(c["pieces"]) == len(c["response_ids"]) for c in calls)
    # read from the adapter folders themselves, not the fallback to the base model a failure would hide behind
    assert step["tokenizers"] == {"lead": "checkpoint/policies/lead", "crew": "checkpoint/policies/crew"}


def test_serving_from_python_gives_back_the_signal_handlers_it_took(trained_run):
    """serve() stops on SIGINT/SIGTERM while it runs; once it returns, a script's or notebook's
    Ctrl-C must raise KeyboardInterrupt again, not set a stop event nobody waits on."""
    import signal
    import threading

    from mas_trainer.serve import serve

    _, run = trained_run
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    ready, stop = threading.Event(), threading.Event()
    threading.Thread(target=lambda: ready.wait(300) and stop.set(), daemon=True).start()
    serve(run, port=0, ready=ready, stop=stop)
    assert {sig: signal.getsignal(sig) for sig in before} == before
