"""The usual app makes its `ChatOpenAI` clients when it is imported, before any gateway exists
(aimed at api.openai.com), and a notebook trains the object it imported. Every rollout call
still reaches the run's gateway, is routed to its node's policy and recorded. A call the app
got an answer to that the trajectory does not hold fails its rollout in one line: training on
the rest would credit the recorded turns with what the missing one did."""

import importlib.util
import sys
from pathlib import Path

import pytest

import mas_trainer
from mas_trainer import api
from mas_trainer.loop.controller import unrecorded_calls
from mas_trainer.loop.trainer import RolloutsFailed
from mas_trainer.trace.schema import LLMCall

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "clients_at_import.py"
TASKS = [{"question": "name a colour"}, {"question": "name a fruit"}]
QUICK = {"steps": 1, "rollout.tasks_per_step": 2, "rollout.n": 2, "runtime.execution": "local", "logger": ["console"],
         "rollout.max_tokens": 8, "val_fraction": 0}


@pytest.fixture(scope="module")
def app():
    """The fixture app imported as a user's notebook would: no gateway, a placeholder key
    (ChatOpenAI needs one to be built), OPENAI_BASE_URL unset."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OPENAI_BASE_URL", raising=False)
        mp.setenv("OPENAI_API_KEY", "unused")
        spec = importlib.util.spec_from_file_location("_clients_at_import", FIXTURE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        assert str(module.planner_llm.root_client.base_url).startswith("https://api.openai.com")
        yield module
        sys.modules.pop(spec.name, None)


def test_trace_by_object_routes_clients_made_at_import(app):
    result = api.trace(app.graph, TASKS, n=2, model="tiny", max_tokens=8)
    assert [t.status for t in result.trajectories] == ["ok"] * 4, [t.error for t in result.trajectories]
    for t in result.trajectories:
        assert [(c.node, c.policy) for c in t.llm_calls] == [("planner", "lead"), ("writer", "crew")]
        assert all(c.response_ids for c in t.llm_calls)  # the engine's own tokens, recorded
    # the app's own clients are left as they were, for its use outside training
    assert str(app.writer_llm.root_client.base_url).startswith("https://api.openai.com")


def test_fit_by_object_trains_an_app_that_made_its_clients_at_import(app, tmp_path):
    run = mas_trainer.fit(app.graph, TASKS, output=tmp_path / "run", overrides=QUICK)
    train = run.train
    assert len(train) == 1 and train[0].get("rollouts/ok") == 4
    assert train[0]["policy/lead/turns"] == 4 and train[0]["policy/crew/turns"] == 4
    assert set(run.policies) == {"lead", "crew"}


def test_an_answered_call_missing_from_the_trajectory_fails_its_rollout(app, tmp_path):
    """`leaky`'s writer client drops the routing headers: its call is answered but not filed."""
    result = api.trace(app.leaky, TASKS[:1], n=1, model="tiny", max_tokens=8)
    (t,) = result.trajectories
    assert t.status == "error" and [c.node for c in t.llm_calls] == ["planner"]
    assert t.error.startswith("1 of 2 LLM calls answered in this rollout were not recorded") and "node writer" in t.error
    assert "\n" not in t.error
    with pytest.raises(RolloutsFailed, match="were not recorded by the run's gateway"):
        mas_trainer.fit(app.leaky, TASKS, output=tmp_path / "run", overrides=QUICK)


def _call(call_id: str) -> LLMCall:
    return LLMCall(id=call_id, node_id="n", node="writer", role="writer", policy="crew", messages=[], output_text="",
                   prompt_ids=[1], response_ids=[2], response_logprobs=[-0.1], finish_reason="stop")


def test_unrecorded_calls_names_what_is_missing():
    assert unrecorded_calls([], []) is None
    assert unrecorded_calls([("a", "writer")], [_call("a"), _call("a-1")]) is None  # n=2: choice ids after the first
    line = unrecorded_calls([("a", "writer"), ("b", "critic"), ("c", "critic")], [_call("a")])
    assert line.startswith("2 of 3 LLM calls") and "(node critic)" in line
