"""The deep research example (examples/langgraph_apps/deep_research): a deep agent written with
`model="openai:..."` strings traces and trains unchanged, each agent on its own policy, its calls
on the Responses API; its rewards and data.

The tiny random model never delegates, so the tests add `Delegate` (tests/fixtures/delegate.py),
a test-only middleware that makes the lead's first reply one `task` call to the researcher and
one to the critic; every call is still made to, and recorded from, the model.
"""

import json
import sys
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage

from mas_trainer import api
from mas_trainer.config import load_config
from mas_trainer.engines.chat import HFChatFormat
from mas_trainer.engines.models import load_tokenizer
from mas_trainer.gateway import server
from mas_trainer.loop.trainer import fit
from mas_trainer.trace.schema import LLMCall, Trajectory

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "langgraph_apps" / "deep_research"
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

from delegate import Delegate  # noqa: E402

AGENT_POLICY = {"lead": "lead", "researcher": "research", "critic": "critic"}


def _jsonl(name):
    return [json.loads(line) for line in (APP / name).read_text().splitlines() if line.strip()]


@pytest.fixture
def app(monkeypatch):
    """The example's module; `build` takes the main agent's middleware."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-unused")  # init_chat_model wants a key; the gateway answers with its own
    monkeypatch.syspath_prepend(str(APP.parent))
    monkeypatch.delitem(sys.modules, "deep_research.app", raising=False)
    from deep_research import app

    return app


@pytest.fixture
def responses_requests(monkeypatch):
    """The bodies of the requests the (in-process) gateway answered on /v1/responses."""
    seen: list[dict] = []
    parse = server.parse_responses
    monkeypatch.setattr(server, "parse_responses", lambda body: (seen.append(body), parse(body))[1])
    return seen


def _forced(app):
    return app.build([Delegate(("researcher", "critic"))])


def _check_calls(trajectories, requests):
    calls = [c for t in trajectories for c in t.llm_calls]
    for c in calls:
        assert AGENT_POLICY[c.role] == c.policy, (c.node, c.role, c.policy)  # each agent's calls on its own policy
        assert c.trainable and c.prompt_ids and c.response_ids and len(c.response_logprobs) == len(c.response_ids)
    # every recorded call came in on the Responses API (one request each), none on chat completions
    assert len(requests) == len(calls) and {r["model"] for r in requests} == {"gpt-4o-mini"}
    assert all("input" in r and "messages" not in r for r in requests)


def test_the_openai_string_form_traces_each_agent_on_its_policy_through_responses(app, responses_requests):
    [task] = _jsonl("train.jsonl")[:1]
    [t] = api.trace(_forced(app), [task], model="tiny", max_tokens=8).trajectories
    assert t.status == "ok", t.error
    assert [(c.node, c.role) for c in t.llm_calls] == [
        ("model", "lead"), ("tools:@researcher:model", "researcher"), ("tools:@critic:model", "critic"), ("model", "lead")]
    _check_calls([t], responses_requests)
    # the lead's answer is the Responses API's object, named after the call it records
    assert t.final_state["messages"][-1]["id"] == f"resp_{t.llm_calls[-1].id}"
    assert set(t.rewards.roles) == {"lead", "researcher", "critic"}
    # the teacher's demo of the lead's first turn is rendered to the very prompt this rollout gave the model
    first = _demos(app, [task])[0]
    prompt, completion = HFChatFormat(load_tokenizer("tiny")).render_turn(first["messages"], first["completion"], first["tools"])
    assert prompt == t.llm_calls[0].prompt_ids and completion


def test_fit_warm_starts_from_the_teachers_demos_then_trains_one_step_with_every_agent_on_its_policy(
        app, responses_requests, tmp_path):
    tasks = _jsonl("train.jsonl")[:2]
    demos = tmp_path / "sft.jsonl"
    demos.write_text("".join(json.dumps(line) + "\n" for line in _demos(app, tasks)))
    cfg = load_config(overrides=["runtime.execution=local", "model=tiny", "steps=1", "rollout.tasks_per_step=2",
                                 "rollout.n=2", "rollout.max_tokens=8", "eval_every=100", f"warm_start.data={demos}",
                                 "warm_start.steps=1", "warm_start.batch_size=2"])
    rows = fit(_forced(app), tasks, cfg, tmp_path / "run")
    [warm] = [r for r in rows if r["kind"] == "warm_start"]  # each agent's turns warm-start its own policy
    assert {p: warm[f"policy/{p}/sft_examples"] for p in ("lead", "research", "critic")} == {"lead": 6, "research": 4, "critic": 2}
    [train] = [r for r in rows if r["kind"] == "train"]
    assert {train[f"policy/{p}/turns"] for p in ("lead", "research", "critic")} == {8, 4}  # 2 lead turns, 1 each sub-agent
    assert {"reward/role/lead", "reward/role/researcher", "reward/role/critic"} <= set(train)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint" / "policies").iterdir()) == ["critic", "lead", "research"]
    written = [Trajectory.model_validate_json(line)
               for line in (tmp_path / "run" / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
    assert len(written) == 4
    _check_calls(written, responses_requests)


# ----- the teacher's demonstrations ------------------------------------------------------------


def _demos(app, tasks):
    from deep_research import demos

    return demos.demos(tasks, log=lambda _: None)


def test_the_teachers_demos_earn_every_reward_level_and_are_the_same_each_time(app):
    tasks = _jsonl("train.jsonl")[:3]
    lines = _demos(app, tasks)
    assert lines == _demos(app, tasks)  # deterministic: tool-call ids included
    for task, run in zip(tasks, [lines[i:i + 6] for i in range(0, len(lines), 6)], strict=True):
        assert [(x["role"], x["policy"]) for x in run] == [
            ("lead", "lead"), ("researcher", "research"), ("researcher", "research"), ("lead", "lead"), ("critic", "critic"),
            ("lead", "lead")]
        assert len({x["run_id"] for x in run}) == 1 and all(x["score"] == 1.0 for x in run)
        calls = {role: [_call(role, x["completion"].get("content") or "", [
            (tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in x["completion"].get("tool_calls", [])])
            for x in run if x["role"] == role] for role in ("lead", "researcher", "critic")}
        assert (app.asked_the_researcher(task, calls["lead"]), app.looked_it_up(task, calls["researcher"]),
                app.confirmed(task, calls["critic"])) == (1.0, 1.0, 1.0)
        assert app.answered_right(task, {"messages": [run[-1]["completion"]]}) == 1.0
        # the researcher's prompt holds only what the lead wrote to it, never the task's answer (the critic is sent
        # the draft, which the lead took from the researcher's facts)
        for x in run:
            if x["role"] == "researcher":
                assert task["answer"] not in json.dumps(x["messages"][:2])


def test_a_task_the_teacher_cannot_answer_right_is_refused(app):
    [task] = _jsonl("train.jsonl")[:1]
    with pytest.raises(RuntimeError, match="did not earn the trajectory reward"):
        _demos(app, [{**task, "answer": "Nowhere"}])


# ----- rewards and data ----------------------------------------------------------------------


def _call(role, text="", tool_calls=()):
    return LLMCall(id="c", node_id=None, node=None, role=role, policy=role, messages=[], output_text=text,
                   tool_calls=[{"id": f"t{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                               for i, (n, a) in enumerate(tool_calls)],
                   prompt_ids=[1], response_ids=[2], response_logprobs=[0.0], finish_reason="stop")


def test_rewards_are_earned_by_delegating_well_and_by_nothing_else(app):
    task = {"answer": "Sousmil", "entity": "Zeirouth Observatory"}
    blocks = {"messages": [AIMessage(content=[{"type": "text", "text": "It is in Sousmil."}])]}  # a Responses API reply
    assert app.answered_right(task, blocks) == 1.0
    assert app.answered_right(task, {"messages": [{"role": "assistant", "content": "Sousmilton"}]}) == 0.0
    good = _call("lead", tool_calls=[("task", {"description": "Find where Zeirouth is", "subagent_type": "researcher"})])
    wrong_agent = _call("lead", tool_calls=[("task", {"description": "Zeirouth", "subagent_type": "critic"})])
    assert (app.asked_the_researcher(task, [good]), app.asked_the_researcher(task, [wrong_agent])) == (1.0, 0.0)
    assert app.looked_it_up(task, [_call("researcher", tool_calls=[("lookup", {"name": "zeirouth observatory"})])]) == 1.0
    assert app.looked_it_up(task, [_call("researcher", tool_calls=[("lookup", {"name": "Zeiruth"})])]) == 1.0  # misspelt
    assert app.looked_it_up(task, [_call("researcher", tool_calls=[("lookup", {"name": "Faimtres"})])]) == 0.0
    assert app.looked_it_up(task, [_call("researcher", text='lookup("Zeirouth")')]) == 0.0  # a call made, not described
    assert (app.confirmed(task, [_call("critic", "Correct: Sousmil.")]), app.confirmed(task, [_call("critic", "No.")])) == (1.0, 0.0)
    assert app.lookup.invoke({"name": "Zeirouth"}) == ("Zeirouth Observatory: in the town of Sousmil, founded in 1750, "
                                                       "directed by Ilsa Keltril.")
    assert app.lookup.invoke({"name": "Nowhere"}) == "No observatory named 'Nowhere' is on record."


def test_data_is_what_make_data_writes_and_only_the_researcher_can_read_it(app, tmp_path):
    from deep_research import make_data

    make_data.write(tmp_path)
    for name in ("records.jsonl", "train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_text() == (APP / name).read_text()
    train, heldout = _jsonl("train.jsonl"), _jsonl("heldout.jsonl")
    assert (len(train), len(heldout)) == (40, 20)
    assert not {t["messages"][0]["content"] for t in train} & {t["messages"][0]["content"] for t in heldout}
    records = {r["name"]: r for r in _jsonl("records.jsonl")}
    assert all(records[t["entity"]][t["kind"]] == t["answer"] for t in train + heldout)
    agents = {s["name"]: [tool.name for tool in s["tools"]] for s in app.SUBAGENTS}
    assert agents == {"researcher": ["lookup"], "critic": []}
