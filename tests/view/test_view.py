"""`mas-trainer view`: data assembly, the local server's refusals, the static file, and the page
rendered by a real headless Chromium.

Run directories come from the example apps (map-reduce with `Send`, a subgraph app, a tool
agent) traced through the real gateway and tracer with scripted engines on the bundled
tokenizer, plus an app with retries, a failing node and markup in model output; and one real
`fit` of the words app on the tiny model (checkpoints, held-out files, advantages).
"""

from __future__ import annotations

import http.client
import json
import math
import operator
import re
import shutil
import subprocess
from pathlib import Path
from typing import Annotated, Callable, TypedDict

import pytest
import yaml

from mas_trainer.config import load_config
from mas_trainer.engines.fake import FakeChatFormat, FakeEngine, byte_text
from mas_trainer.engines.models import load_tokenizer
from mas_trainer.gateway import PolicyBackend
from mas_trainer.rewards import RewardSpec
from mas_trainer.rewards.allocators import assign_rewards
from mas_trainer.run.rundir import RunDir
from mas_trainer.loop.session import Session
from mas_trainer.loop.trainer import fit, summarize, take_tasks
from mas_trainer.view import ViewServer, ViewSource, build_charts, token_pieces, write_html
from mas_trainer.view.page import embed_json

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "langgraph_apps"
WORDS_APP = ROOT / "tests" / "fixtures" / "words_app.py"
WORDS = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "words.jsonl").read_text().splitlines()]
XSS = '<script>document.title="pwned"</script><img src=x onerror="document.body.dataset.pwned=1">'


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


# --- run directories -------------------------------------------------------------------------------
class EdgeState(TypedDict, total=False):
    tid: str
    out: Annotated[list, operator.add]
    item: str


def _edge_app():
    """Send branches, a retried node, a node that fails on one task, markup in model output."""
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import RetryPolicy, Send

    from mas_trainer import trainable

    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)
    attempts: dict[str, int] = {}

    def plan(s):
        return {"out": [llm.invoke(f"xss-plan {s['tid']}").content]}

    def fan(s):
        return [Send("worker", {"tid": s["tid"], "item": str(i)}) for i in range(2)]

    def worker(s):
        return {"out": [llm.invoke(f"work {s['item']}").content]}

    def flaky(s):
        llm.invoke(f"flaky {s['tid']}")
        attempts[s["tid"]] = attempts.get(s["tid"], 0) + 1
        if attempts[s["tid"]] % 2:  # every first attempt (rollouts run one at a time)
            raise ConnectionError("transient failure")
        return {"out": ["flaky ok"]}

    def boom(s):
        if s["tid"] == "bad":
            raise RuntimeError("node exploded <b>bold</b>")
        return {"out": ["fine"]}

    g = StateGraph(EdgeState)
    g.add_node("plan", plan)
    g.add_node("worker", worker)
    g.add_node("flaky", flaky, retry_policy=RetryPolicy(max_attempts=2, initial_interval=0.01, retry_on=ConnectionError))
    g.add_node("boom", boom)
    g.add_edge(START, "plan")
    g.add_conditional_edges("plan", fan, ["worker"])
    g.add_edge("worker", "flaky")
    g.add_edge("flaky", "boom")
    g.add_edge("boom", END)
    return trainable(g.compile(), roles={"plan": "lead", "worker": "crew", "flaky": "crew"},
                     policies={"lead": "tiny", "crew": "tiny"},
                     reward=lambda task, state, traj: len(state.get("out", [])) / 10,
                     role_rewards={"plan": lambda task, calls, traj: 0.5},
                     turn_rewards=lambda task, call, traj: 1.0 if "script" in (call.output_text or "") else None)


def _reply(prompt_ids, params, index):
    """Scripted answers: a tool call until the tool has answered, markup from the planner."""
    prompt = byte_text(prompt_ids)
    if "calculator" in prompt:
        if '"tool"' in prompt:
            return "The answer is 391."
        return '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>'
    if "xss-plan" in prompt:
        return "Plan: " + XSS + " résumé 🙂"
    return f"Paris is the answer, choice {index}."


def _fake_run(out: Path, app: str | Callable, tasks: list[dict], *, steps: int = 2, n: int = 2, allocator: str = "broadcast",
              options: dict | None = None, on_failure: float = 0.0) -> Path:
    """A run directory as `fit` writes it (app.json, config.yaml, metrics, train and held-out
    trajectory files), from the real tracer with scripted engines on the bundled tokenizer."""
    tok = load_tokenizer("tiny")

    def factory(_base: str) -> PolicyBackend:
        return PolicyBackend(FakeEngine(latency_s=0.001, reply=_reply, tokenizer=tok), FakeChatFormat())

    overrides = [f"reward.allocator={allocator}", f"reward.on_failure={on_failure}", f"rollout.n={n}",
                 *(f"reward.options.{k}={v}" for k, v in (options or {}).items())]
    cfg = load_config(overrides=overrides)
    with Session(model="tiny", backend_factory=factory, timeout_s=300, max_in_flight=1) as session:
        runner = session.load_app(app if isinstance(app, str) else app())  # built once the gateway is up
        run = RunDir(out)
        run.create(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        run.write_app(runner.spec)
        spec = RewardSpec.of(runner.spec.declared)
        for step in range(0, steps + 1):
            for kind in (("val", "train") if step else ("val",)):
                k = 1 if kind == "val" else n
                prefix = "v" if kind == "val" else "s"
                ids = [f"{prefix}{step:06d}-t{i:05d}-r{r}" for i in range(len(tasks)) for r in range(k)]
                trajs = session.loop.run_until_complete(session.rollouts(tasks, n=k, ids=ids))
                for t in trajs:
                    assign_rewards(t, spec, allocator=allocator, options=options, on_failure=on_failure)
                    if kind == "train":
                        _record_advantages(t)
                run.write_trajectories(step, (t.to_json() for t in trajs), name=f"step_{step:06d}_val" if kind == "val" else None)
                row = {"kind": kind, "step": step, **summarize(trajs)}
                if kind == "train":
                    row.update({f"policy/{p}/pg_loss": 0.1 * step for p in runner.spec.policies}
                               | {"perf/tokens_per_s": 100.0 + step, "learning/nan": float("nan")})
                run.append_metrics(row)
    return out


def _record_advantages(t) -> None:
    """As fit records them: one value per response token of each trained call."""
    for c in t.llm_calls:
        detail = t.rewards.detail.setdefault("calls", {}).setdefault(c.id, {})
        detail["advantages"] = [round(0.1 * (i % 5) - 0.2, 3) for i in range(len(c.response_ids))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("view-runs")

    def data(name):
        return [json.loads(line) for line in (EXAMPLES / "data" / f"{name}.jsonl").read_text().splitlines()][:2]

    return {
        "map_reduce": _fake_run(base / "map_reduce", f"{EXAMPLES}/map_reduce.py:graph", data("map_reduce")),
        "subgraph": _fake_run(base / "subgraph", f"{EXAMPLES}/subgraph_app.py:graph", data("subgraph_app"), steps=1),
        "tools": _fake_run(base / "tools", f"{EXAMPLES}/tools_agent.py:graph", data("tools_agent")[:1], steps=1),
        "edge": _fake_run(base / "edge", _edge_app, [{"tid": "good"}, {"tid": "bad"}], steps=1,
                          allocator="turn_delta", options={"initial": 0.0}, on_failure=-1.0),
    }


@pytest.fixture(scope="module")
def words_run(tmp_path_factory):
    """A real fit: tiny model, 3 roles on 2 policies, one step, held-out before and after."""
    out = tmp_path_factory.mktemp("view-fit") / "run"
    cfg = load_config(overrides=["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_tokens=8",
                                 "steps=1", "eval_every=1", "seed=3"])
    fit(f"{WORDS_APP}:graph", WORDS[:4], cfg, out, val_tasks=WORDS[4:5])
    return out


# --- data assembly -----------------------------------------------------------------------------------
def test_charts_per_role_policy_held_out_and_more():
    rows = [
        {"kind": "val", "step": 0, "reward/mean": 0.1, "reward/role/a": 0.2},
        {"kind": "train", "step": 1, "reward/mean": 0.3, "reward/role/a": 0.4, "reward/role/b": 0.5,
         "policy/p/pg_loss": 1.0, "policy/q/pg_loss": 2.0, "perf/tokens_per_s": 9.0, "bad": float("nan"), "text": "x"},
        {"kind": "train", "step": 2, "reward/mean": 0.6, "reward/role/a": 0.7, "policy/p/pg_loss": 0.5},
    ]
    main, more = build_charts(rows, {"train": {"p": [[1, 0.4], [2, 0.7]]}, "val": {"p": [[0, 0.2]]}})
    by_id = {c["id"]: c for c in main}
    assert set(by_id) == {"reward-train", "reward-val", "reward-policy"}
    train = {s["name"]: s["points"] for s in by_id["reward-train"]["series"]}
    assert train == {"trajectory mean": [[1, 0.3], [2, 0.6]], "role a": [[1, 0.4], [2, 0.7]], "role b": [[1, 0.5]]}
    assert {s["name"]: s["style"] for s in by_id["reward-policy"]["series"]} == {"p (train)": "train", "p (held-out)": "val"}
    more_by = {c["title"]: c for c in more}
    assert {s["name"] for s in more_by["pg_loss per policy"]["series"]} == {"p", "q"}
    assert "bad" not in more_by and "text" not in more_by  # NaN-only and non-numeric metrics: no chart
    # the trainer's own reward/policy/NAME rows win over the trajectory-derived ones
    main2, _ = build_charts([{"kind": "train", "step": 1, "reward/policy/p": 0.9}], {"train": {"p": [[1, 0.1]]}})
    assert main2[-1]["series"][0]["points"] == [[1, 0.9]]


def test_token_pieces_join_to_the_text_and_wait_for_whole_characters():
    tok = load_tokenizer("tiny")
    text = "Hello wörld 🙂, naïve café\n<|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False) == text
    emoji = tok("🙂", add_special_tokens=False)["input_ids"]
    assert len(emoji) > 1 and token_pieces(tok, emoji)[:-1] == [""] * (len(emoji) - 1)  # bytes of one character
    assert token_pieces(tok, []) == []


def test_map_reduce_send_branches_groups_tokens_and_rewards(runs):
    src = ViewSource(runs["map_reduce"])
    index = src.index()
    assert [s["name"] for s in index["steps"]] == ["step_000000_val", "step_000001_val", "step_000001",
                                                   "step_000002_val", "step_000002"]
    assert index["app"]["roles"] == {"planner": "planner", "worker": "worker", "reducer": "worker"}
    assert {c["id"] for c in index["charts"]} == {"reward-train", "reward-val", "reward-policy"}
    assert index["reward_config"]["allocator"] == "broadcast"
    step = src.step("step_000001")
    assert step["kind"] == "train" and len(step["groups"]) == 2 and all(len(g["rollouts"]) == 2 for g in step["groups"])
    assert step["tokenizers"] == {"planner": "base model tiny", "worker": "base model tiny"}
    r = step["rollouts"][step["groups"][0]["rollouts"][0]]
    names = [(n["name"], n["step"]) for n in r["nodes"]]
    workers = [n for n in r["nodes"] if n["name"] == "worker"]
    assert len(workers) == r["task"]["num_subtopics"] and len({n["step"] for n in workers}) == 1, names  # Send branches
    call = r["llm_calls"][0]
    assert call["role"] == "planner" and "".join(call["pieces"]).startswith("Paris is the answer")
    assert len(call["pieces"]) == len(call["response_ids"]) == len(call["logprobs"])
    assert call["reward"] == r["rewards"]["trajectory"] == call["reward_detail"]["parts"]["trajectory"]["contribution"]
    # advantages: as recorded, one value per token; none on held-out rollouts
    assert step["advantages"]["status"] == "recorded"
    assert call["advantages"] == [round(0.1 * (i % 5) - 0.2, 3) for i in range(len(call["response_ids"]))]
    assert index["advantage_config"] == {p: {"estimator": "grpo", "norm_adv_by_std_in_grpo": True, "rollout_norm": False,
                                             "gamma": 1.0, "lam": 1.0} for p in ("planner", "worker")}
    val = src.step("step_000001_val")
    assert val["advantages"] == {"status": "none", "note": "no advantages: held-out rollouts are not trained on; "
                                                           "colours show each call's allocated reward"}
    assert all(c["advantages"] is None for r in val["rollouts"] for c in r["llm_calls"])
    assert src.step("../config") is None and src.step("nope") is None


def test_subgraph_nodes_nest_under_their_node(runs):
    r = ViewSource(runs["subgraph"]).step("step_000001")["rollouts"][0]
    by_name = {n["name"]: n for n in r["nodes"]}
    assert by_name["research:search_query"]["parent_id"] == by_name["research"]["id"]
    assert by_name["final"]["parent_id"] is None
    assert {c["role"] for c in r["llm_calls"]} == {"research:search_query", "research:summarize", "final"}


def test_tool_calls(runs):
    r = ViewSource(runs["tools"]).step("step_000001")["rollouts"][0]
    assert [t["name"] for t in r["tool_calls"]] == ["calculator"] and r["tool_calls"][0]["output"] == "391"
    assert r["llm_calls"][0]["tool_calls"][0]["function"]["name"] == "calculator"
    assert [n["name"] for n in r["nodes"]] == ["agent", "tools", "agent"]


def test_retries_errors_failed_rollouts_and_turn_delta(runs):
    step = ViewSource(runs["edge"]).step("step_000001")
    good = [r for r in step["rollouts"] if r["task"]["tid"] == "good"][0]
    bad = [r for r in step["rollouts"] if r["task"]["tid"] == "bad"][0]
    assert [(n["name"], n["attempt"], n["status"]) for n in good["nodes"] if n["name"] == "flaky"] == [("flaky", 1, "error"), ("flaky", 2, "ok")]
    assert bad["status"] == "error" and "node exploded" in bad["error"]
    assert bad["rewards"]["detail"]["failed"]["fill"] == -1.0 and all(c["reward"] == -1.0 for c in bad["llm_calls"])
    plan = good["llm_calls"][0]
    assert XSS in plan["output_text"]
    parts = plan["reward_detail"]["parts"]
    assert parts["turn"]["score"] == 1.0 and parts["turn"]["previous"] == 0.0 and parts["role"]["value"] == 0.5


def test_trajectories_file_alone_and_tokenizer_option(runs, tmp_path):
    lone = tmp_path / "trajectories.jsonl"
    shutil.copy(runs["map_reduce"] / "trajectories" / "step_000001.jsonl", lone)
    with lone.open("a") as f:
        f.write('{"cut by a kill')
    src = ViewSource(lone)
    index = src.index()
    assert index["kind"] == "file" and index["charts"] == [] and index["notes"]
    step = src.step("trajectories")
    assert step["advantages"]["status"] == "recorded"  # the file carries them, wherever it lies
    cut = step["warnings"]
    assert len(cut) == 1 and re.fullmatch(r"trajectories\.jsonl line \d+: not valid JSON \(.*\); skipped", cut[0]), cut
    assert index["warnings"] == cut
    call = step["rollouts"][0]["llm_calls"][0]
    assert call["pieces"] is None and call["response_ids"]  # no tokenizer known: ids
    assert "".join(ViewSource(lone, tokenizer="tiny").step("trajectories")["rollouts"][0]["llm_calls"][0]["pieces"]).startswith("Paris")
    # a file inside a run directory still finds the run's settings
    inside = ViewSource(runs["map_reduce"] / "trajectories" / "step_000001.jsonl")
    assert inside.index()["app"] is not None and inside.step("step_000001")["advantages"]["status"] == "recorded"


def test_recorded_advantages_are_the_ones_fit_trained_on(words_run):
    """The token-mean of the advantages fit recorded per policy equals what the worker groups logged."""
    src = ViewSource(words_run)
    step = src.step("step_000001")
    assert step["advantages"]["status"] == "recorded"
    assert step["tokenizers"] == {"lead": "checkpoint/policies/lead", "crew": "checkpoint/policies/crew"}
    row = [r for r in src.metrics() if r["kind"] == "train"][0]
    for policy in ("lead", "crew"):
        calls = [c for r in step["rollouts"] for c in r["llm_calls"] if c["policy"] == policy]
        assert all(len(c["advantages"]) == len(c["response_ids"]) for c in calls)
        adv = [a for c in calls for a in c["advantages"]]
        assert math.isclose(sum(abs(a) for a in adv) / len(adv), row[f"policy/{policy}/adv_abs_mean"], rel_tol=1e-4, abs_tol=1e-6)
        assert math.isclose(sum(adv) / len(adv), row[f"policy/{policy}/adv_mean"], abs_tol=1e-5)


def test_filter_groups_runs_show_each_draw_and_what_was_left_out(tmp_path):
    """rollout.filter_groups: a later draw's groups stay apart (ids s..d1-), left-out groups are
    marked and have no advantages; those of the trained groups are the ones logged."""
    order = take_tasks(8, 0, 3, 3)  # draws of 2 tasks, then 1
    flat = {order[1]}
    tasks = [{"question": t["question"], "flat": i in flat} for i, t in enumerate(WORDS)]
    cfg = load_config(overrides=["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_tokens=8",
                                 "steps=1", "seed=3", "rollout.filter_groups=true"])
    fit(f"{WORDS_APP}:some_flat", tasks, cfg, tmp_path / "run")
    src = ViewSource(tmp_path / "run")
    step = src.step("step_000001")
    assert [g["left_out"] for g in step["groups"]] == [None, "no spread", None]
    assert [g["key"] for g in step["groups"]] == [f"s000001-t{order[0]:05d}", f"s000001-t{order[1]:05d}", f"s000001d1-t{order[2]:05d}"]
    row = [r for r in src.metrics() if r["kind"] == "train"][0]
    adv = [a for g in step["groups"] if not g["left_out"] for i in g["rollouts"]
           for c in step["rollouts"][i]["llm_calls"] for a in c["advantages"]]
    assert math.isclose(sum(abs(a) for a in adv) / len(adv), row["policy/solo/adv_abs_mean"], rel_tol=1e-4)
    assert all(not c["advantages"] for g in step["groups"] if g["left_out"] for i in g["rollouts"]
               for c in step["rollouts"][i]["llm_calls"])


def _rewrite_calls(path: Path, edit: Callable[[dict, dict], None]) -> None:
    """Each line of a trajectory file with `edit(call, its rewards.detail.calls entry)` applied to every call."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for t in rows:
        for c in t["llm_calls"]:
            edit(c, t["rewards"]["detail"]["calls"].setdefault(c["id"], {}))
    path.write_text("".join(json.dumps(t) + "\n" for t in rows))


def test_a_run_without_recorded_advantages_shows_none_and_says_why(runs, tmp_path):
    run = shutil.copytree(runs["map_reduce"], tmp_path / "run")
    _rewrite_calls(run / "trajectories" / "step_000001.jsonl", lambda c, d: d.pop("advantages", None))
    step = ViewSource(run).step("step_000001")
    assert step["advantages"]["status"] == "none" and "none recorded" in step["advantages"]["note"]
    assert "allocated reward" in step["advantages"]["note"]
    assert all(c["advantages"] is None for r in step["rollouts"] for c in r["llm_calls"])


def test_recorded_advantages_are_untrusted_input(runs, tmp_path):
    """Strings, nested lists, NaN and lists longer than the response: never an error, never more
    values than tokens, a value that is no finite number shows as none (null)."""
    run = shutil.copytree(runs["map_reduce"], tmp_path / "run")
    bad = [["0.5"], [[1.0, 2.0], 0.5, float("nan"), "x", None, True, 1e400], [0.25] * 100_000, "0.5", {"a": 1}, [], ["x"]]
    seen: list[dict] = []

    def edit(call: dict, detail: dict) -> None:
        detail["advantages"] = bad[len(seen) % len(bad)]
        seen.append(call)

    _rewrite_calls(run / "trajectories" / "step_000001.jsonl", edit)
    step = ViewSource(run).step("step_000001")
    shown = {c["id"]: c for r in step["rollouts"] for c in r["llm_calls"]}
    assert len(seen) >= len(bad) and step["advantages"]["status"] == "recorded"
    for k, call in enumerate(seen):
        adv, n = shown[call["id"]]["advantages"], len(call["response_ids"])
        kind = k % len(bad)
        if kind == 1:
            assert adv == [None, 0.5, None, None, None, None, None][:n]
        elif kind == 2:
            assert adv == [0.25] * n
        else:  # no number in it: no advantages
            assert adv is None, (kind, adv)
    json.dumps(step, allow_nan=False)  # what the server sends is plain JSON


# --- the page, the static file, the server ------------------------------------------------------------
def test_embedded_json_cannot_close_its_script_element():
    text = embed_json({"x": "</script><script>alert(1)</script>&\u2028"})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"x": "</script><script>alert(1)</script>&\u2028"}


def test_static_html_is_self_contained_and_escapes_model_output(runs, tmp_path):
    out = write_html(ViewSource(runs["edge"]), tmp_path / "edge.html")
    page = out.read_text()
    assert page.count("<script") == 2  # the inert JSON and the viewer's own script, nothing from the run
    assert "<img" not in page and "onerror=" not in page.replace("onerror=\\", "")
    assert "\\u003cscript\\u003edocument.title" in page
    assert not re.search(r"(src|href)=[\"']?https?:", page)  # nothing loaded from the network
    assert "Content-Security-Policy" in page and "connect-src 'none'" in page


def _get(port: int, path: str, host: str | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest(method, path, skip_host=True)
    conn.putheader("Host", host or f"127.0.0.1:{port}")
    conn.endheaders()
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), body


@pytest.fixture(scope="module")
def server(runs):
    srv = ViewServer(ViewSource(runs["map_reduce"]), 0).start()
    yield srv
    srv.stop()


def test_server_binds_loopback_and_serves_the_page_and_api(server):
    assert server.server_address[0] == "127.0.0.1"
    status, headers, body = _get(server.port, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "script-src 'sha256-" in headers["Content-Security-Policy"] and headers["X-Content-Type-Options"] == "nosniff"
    assert b'"initial_step":"step_000002"' in body
    status, _, body = _get(server.port, "/api/step?name=step_000001_val")
    assert status == 200 and json.loads(body)["kind"] == "val"
    status, _, body = _get(server.port, "/api/index")
    assert status == 200 and len(json.loads(body)["steps"]) == 5
    status, headers, body = _get(server.port, "/raw/metrics.jsonl")
    assert status == 200 and headers["Content-Type"].startswith("text/plain") and body.startswith(b'{"kind"')
    assert _get(server.port, "/raw/trajectories/step_000001.jsonl")[0] == 200


@pytest.mark.parametrize("path", [
    "/api/step?name=../../etc/passwd", "/api/step?name=%2e%2e%2fconfig", "/api/step", "/api/step?name=a&name=b",
    "/api/step?name=step_000001&x=1", "/?step=../app", "/?evil=1", "/api/index?x=1",
    "/raw/../config.yaml", "/raw/%2e%2e/%2e%2e/etc/passwd", "/raw/trajectories/..%2f..%2fapp.json", "/raw//etc/passwd",
    "/raw/trajectories%5c..%5capp.json",
])
def test_server_refuses_bad_parameters_and_traversal(server, path):
    status, _, body = _get(server.port, path)
    assert status == 400, (path, body)


@pytest.mark.parametrize("path", ["/api/step?name=step_999999", "/raw/checkpoint/state.json", "/raw/.lock", "/etc/passwd",
                                  "/raw/config.yaml.bak", "/static/view.js"])
def test_server_serves_only_files_of_the_run(server, path):
    assert _get(server.port, path)[0] == 404


def test_server_refuses_other_hosts_and_methods(server):
    assert _get(server.port, "/", host="evil.example:80")[0] == 403  # DNS rebinding
    assert _get(server.port, "/", method="POST")[0] == 405
    assert _get(server.port, "/", host=f"localhost:{server.port}", method="HEAD")[0] == 200


def test_cli_view_html_and_errors(runs, tmp_path, capsys):
    from mas_trainer.cli import main

    out = tmp_path / "one.html"
    assert main(["view", str(runs["map_reduce"]), "--html", str(out), "--steps", "1,step_000002_val"]) == 0
    page = out.read_text()
    assert '"step_000001":{' in page and '"step_000002_val":{' in page and '"step_000002":{' not in page
    assert main(["view", str(tmp_path / "missing"), "--html", str(out)]) == 2
    assert main(["view", str(runs["map_reduce"]), "--html", str(out), "--steps", "7"]) == 2
    assert main(["view", str(tmp_path), "--html", str(out)]) == 2  # a folder that is no run
    err = capsys.readouterr().err
    assert "no such run directory" in err and "no trajectory file for '7'" in err and "not a run directory" in err
    with pytest.raises(SystemExit):
        main(["view", "--help"])
    help_text = capsys.readouterr().out
    assert "--html" in help_text and "--port" in help_text and "127.0.0.1" in help_text


# --- a real browser ------------------------------------------------------------------------------------
chromium = pytest.mark.skipif(_chromium() is None, reason="headless Chromium not installed (Debian: apt-get install chromium; "
                                                          "scripts/setup.sh installs it)")


def _dump_dom(url: str, tmp_path: Path) -> str:
    proc = subprocess.run([_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=8000", "--dump-dom", url],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@chromium
def test_browser_renders_a_real_run(words_run, tmp_path):
    srv = ViewServer(ViewSource(words_run), 0).start()
    try:
        dom = _dump_dom(srv.url, tmp_path)
        # step 1 is inline; the held-out file chosen in the address is fetched from the API
        val = _dump_dom(srv.url + "#step=step_000001_val&group=1&rollout=-1&colour=advantage", tmp_path)
    finally:
        srv.stop()
    assert 'data-step="step_000001"' in dom
    for role in ("planner", "writer", "critic"):
        assert f'data-role="{role}"' in dom and f'data-node="{role}"' in dom
    assert dom.count('class="chart"') >= 3 and "<polyline" in dom and "reward per role (training)" in dom
    assert len(re.findall(r'<span class="tok[ "]', dom)) >= 2 * 3 * 6 and 'class="tok id"' not in dom  # decoded tokens
    assert "checkpoint/policies/lead" in dom and "as fit recorded them" in dom
    assert 'data-step="step_000001_val"' in val and "held-out rollouts are not trained on" in val


@chromium
def test_browser_send_branches_retries_errors_and_no_script_runs(runs, tmp_path):
    srv = ViewServer(ViewSource(runs["map_reduce"]), 0).start()
    try:
        dom = _dump_dom(srv.url + "?step=step_000001", tmp_path)
    finally:
        srv.stop()
    assert "Send 1/" in dom and "Send 2/" in dom and 'data-node="reducer"' in dom

    page = write_html(ViewSource(runs["edge"]), tmp_path / "edge.html")
    dom = _dump_dom(page.as_uri() + "#step=step_000001&group=2", tmp_path)  # the task whose rollouts fail: row 2
    assert "retry: attempt 2" in dom and "node exploded &lt;b&gt;bold&lt;/b&gt;" in dom
    assert "&lt;script&gt;" in dom and "<title>mas-trainer view" in dom and "pwned" not in dom.split("</title>")[0]
    assert "data-pwned" not in dom and "<img" not in dom

    sub = write_html(ViewSource(runs["subgraph"]), tmp_path / "sub.html")
    dom = _dump_dom(sub.as_uri(), tmp_path)
    assert re.search(r'data-node="research".*class="children".*data-node="research:search_query"', dom, re.S)
    tools = write_html(ViewSource(runs["tools"]), tmp_path / "tools.html")
    assert "tool calculator" in _dump_dom(tools.as_uri(), tmp_path)


@chromium
def test_browser_screenshot_is_not_blank(runs, tmp_path):
    page = write_html(ViewSource(runs["map_reduce"]), tmp_path / "mr.html")
    shot = tmp_path / "shot.png"
    proc = subprocess.run([_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1600", f"--screenshot={shot}", page.as_uri()],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stderr[-2000:]
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.size == (1280, 1600)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, charts and coloured tokens, not an empty page
