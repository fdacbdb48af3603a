"""The reward library: SQuAD-style exact match and F1, valid JSON, code tests; at each level."""

from dataclasses import dataclass

import pytest
from pydantic import BaseModel

from mas_trainer.errors import UserError
from mas_trainer.rewards import (
    RewardError,
    RewardSpec,
    code_tests,
    evaluate_levels,
    exact_match,
    f1,
    json_valid,
    normalize_answer,
)
from mas_trainer.trace.schema import LLMCall, Trajectory


def call(cid, role, text):
    return LLMCall(id=cid, node_id=None, node=role, role=role, policy="p", messages=[], output_text=text,
                   prompt_ids=[1], response_ids=[1], response_logprobs=[0.0], finish_reason="stop")


def traj(state, task=None, calls=()):
    return Trajectory(rollout_id="r1", task=task or {"answer": "Paris"}, status="ok", llm_calls=list(calls), final_state=state)


def score(reward, state, task=None):
    t = traj(state, task)
    return reward(t.task, t.final_state, t)


def test_squad_normalisation():
    assert normalize_answer("  The Eiffel-Tower, in PARIS!  ") == "eiffeltower in paris"
    assert normalize_answer(None) == ""


def test_exact_match_normalises_and_takes_any_reference():
    assert score(exact_match(), {"answer": "the paris."}) == 1.0
    assert score(exact_match(), {"answer": "Lyon"}) == 0.0
    assert score(exact_match(), {}) == 0.0  # no answer: scored 0, not an error
    assert score(exact_match(reference="answers"), {"answer": "NYC"}, {"answers": ["New York", "nyc"]}) == 1.0
    assert score(exact_match(), {"answer": 4}, {"answer": 4}) == 1.0  # numbers compare as text


def test_answer_from_messages_or_a_callable():
    messages = {"messages": [{"role": "user", "content": "capital?"}, {"role": "assistant", "content": "Paris"}]}
    assert score(exact_match(answer="messages"), messages) == 1.0
    assert score(exact_match(answer=lambda s: s["out"]["text"]), {"out": {"text": "paris"}}) == 1.0


def test_f1_gives_partial_credit_against_the_best_reference():
    reward = f1(reference="answers")
    # pred {eiffel, tower, paris} vs ref {eiffel, tower}: precision 2/3, recall 1 -> 0.8
    assert score(reward, {"answer": "The Eiffel Tower, Paris"}, {"answers": ["Louvre", "Eiffel Tower"]}) == pytest.approx(0.8)
    assert score(reward, {"answer": "nothing"}, {"answers": ["Eiffel Tower"]}) == 0.0
    assert score(f1(), {"answer": ""}, {"answer": "a"}) == 1.0  # both empty after normalising, as SQuAD counts it


def test_a_missing_reference_is_an_error_naming_the_reward_and_rollout():
    spec = RewardSpec(trajectory=exact_match(reference="gold"))
    with pytest.raises(RewardError, match=r"exact_match\(answer='answer', reference='gold'\).*no 'gold'.*rollout r1"):
        evaluate_levels(spec, traj({"answer": "Paris"}))


def test_role_and_turn_levels_judge_the_calls_text():
    t = traj({}, calls=[call("a", "planner", '{"plan": 1}'), call("b", "planner", "no json"), call("c", "coder", "x")])
    spec = RewardSpec(roles={"planner": json_valid()}, turns={"planner": json_valid()})
    values = evaluate_levels(spec, t)
    assert values.roles == {"planner": 0.5}  # averaged over the role's calls
    assert values.turns == {"a": 1.0, "b": 0.0}


class Plan(BaseModel):
    steps: list[str]


def test_json_valid_with_a_json_schema_a_pydantic_model_or_none():
    schema = {"type": "object", "properties": {"steps": {"type": "array"}}, "required": ["steps"]}
    fenced = 'Here it is:\n```json\n{"steps": ["a", "b"]}\n```'
    for reward in (json_valid(schema), json_valid(Plan)):
        assert score(reward, {"answer": fenced}) == 1.0
        assert score(reward, {"answer": '{"plan": []}'}) == 0.0
        assert score(reward, {"answer": {"steps": ["already", "data"]}}) == 1.0
    assert score(json_valid(), {"answer": "[1, 2]"}) == 1.0
    assert score(json_valid(), {"answer": "not json"}) == 0.0


def test_a_bad_schema_fails_when_the_reward_is_made():
    with pytest.raises(UserError, match="not a valid JSON Schema"):
        json_valid({"type": "no-such-type"})


@dataclass
class Result:  # the shape of the code-gen example's SandboxResult
    passed: int
    total: int


def test_code_tests_wraps_a_user_test_runner():
    seen = []

    def run(code, task):
        seen.append(code)
        return Result(passed=3 if "return a + b" in code else 0, total=4)

    task = {"tests": ["..."]}
    state = {"code": "```python\ndef add(a, b):\n    return a + b\n```"}
    assert score(code_tests(run), state, task) == 0.75
    assert seen[0] == "def add(a, b):\n    return a + b\n"  # the fence is taken off
    assert score(code_tests(run, all_or_nothing=True), state, task) == 0.0
    assert score(code_tests(lambda code, task: True), state, task) == 1.0
    with pytest.raises(RewardError, match="code_tests.*not a fraction"):
        evaluate_levels(RewardSpec(trajectory=code_tests(lambda code, task: 3)), traj(state, task))
