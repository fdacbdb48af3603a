import json

import pytest
from pydantic import ValidationError

from mas_trainer.trace.schema import SCHEMA_VERSION, LLMCall, NodeCall, Trajectory


def _call(**kw):
    base = dict(id="c1", node_id="n1", node="planner", role="planner", policy="p", messages=[{"role": "user", "content": "hi"}],
                output_text="ok", prompt_ids=[1, 2], response_ids=[5, 2], response_logprobs=[-0.1, -0.2], finish_reason="stop")
    return LLMCall(**{**base, **kw})


def test_round_trip_keeps_contract_field_names():
    t = Trajectory(rollout_id="r", task={"q": 1}, status="ok", nodes=[NodeCall(id="n1", name="planner", step=1, parent_id=None, status="ok")],
                   llm_calls=[_call()], final_state={"a": 1})
    back = Trajectory.model_validate_json(t.to_json())
    assert back == t and back.schema_version == SCHEMA_VERSION
    d = t.model_dump()
    assert {"rollout_id", "task", "status", "error", "nodes", "llm_calls", "rewards", "final_state"} <= set(d)
    assert set(d["rewards"]) >= {"trajectory", "roles", "turns"}
    assert {"id", "node_id", "node", "role", "policy", "messages", "output_text", "prompt_ids", "response_ids",
            "response_logprobs", "finish_reason"} <= set(d["llm_calls"][0])
    assert {"id", "name", "step", "parent_id", "status"} <= set(d["nodes"][0])


def test_ids_and_logprobs_must_align():
    with pytest.raises(ValidationError, match="2 response ids but 1 log-probs"):
        _call(response_logprobs=[-0.1])


def test_unknown_status_and_fields_are_rejected():
    with pytest.raises(ValidationError):
        Trajectory(rollout_id="r", task={}, status="maybe")
    with pytest.raises(ValidationError):
        Trajectory(rollout_id="r", task={}, status="ok", extra_field=1)


def test_a_fork_record_round_trips_with_the_json_it_was_written_as():
    record = {"k": 2, "segments": [{"role": "picker", "before": 0, "after": 1, "calls": ["c0"]}],
              "values": {"0": {"checkpoint_id": "ck0", "value": 0.5, "returns": {"f0": 1.0, "f1": 0.0}, "failed": {}},
                         "1": {"checkpoint_id": "ck1", "value": 1.0, "returns": {"f2": 1.0, "f3": None},
                               "failed": {"f3": "error"}}},
              "skipped": {"c9": "its node's superstep is unknown"}}
    t = Trajectory.model_validate_json(json.dumps({"rollout_id": "r", "task": {}, "status": "ok", "forks": record}))
    assert t.forks is not None and t.forks.values[1].failed == {"f3": "error"} and t.forks.segments[0].calls == ["c0"]
    assert json.loads(t.to_json())["forks"] == record
    # written before failed continuations were recorded: none failed
    old = {**record, "values": {"0": {"checkpoint_id": "ck0", "value": 0.5, "returns": {"f0": 1.0}}}}
    back = Trajectory.model_validate_json(json.dumps({"rollout_id": "r", "task": {}, "status": "ok", "forks": old}))
    assert back.forks is not None and back.forks.values[0].failed == {}
    assert Trajectory(rollout_id="r", task={}, status="ok").forks is None
