"""Reward levels: each callable gets the right arguments, None means not applicable,
and a failing reward is reported by name."""

import pytest

from mas_trainer.errors import UserError
from mas_trainer.rewards import LevelValues, RewardError, RewardSpec, evaluate_levels
from mas_trainer.trace.schema import LLMCall, Trajectory


def call(cid, role, text="x", n=2):
    return LLMCall(id=cid, node_id=None, node=role, role=role, policy="p", messages=[], output_text=text,
                   prompt_ids=[1], response_ids=list(range(n)), response_logprobs=[0.0] * n, finish_reason="stop")


def traj(calls, status="ok", final_state=None):
    return Trajectory(rollout_id="r1", task={"answer": 4}, status=status, llm_calls=calls,
                      final_state=final_state if final_state is not None else {"answer": 4})


def test_each_level_gets_task_subject_and_trajectory():
    t = traj([call("a", "planner", "PLAN: go"), call("b", "coder"), call("c", "planner", "no plan")])
    seen = {}

    def exact(task, state, trajectory):
        seen["traj"] = (task, state, trajectory.rollout_id)
        return float(state["answer"] == task["answer"])

    def plan_format(task, calls, trajectory):
        seen.setdefault("roles", []).append([c.id for c in calls])
        return sum(c.output_text.startswith("PLAN:") for c in calls) / len(calls)

    def length(task, c, trajectory):
        return len(c.response_ids)

    values = evaluate_levels(RewardSpec(trajectory=exact, roles={"planner": plan_format}, turns=length), t)
    assert values == LevelValues(trajectory=1.0, roles={"planner": 0.5}, turns={"a": 2.0, "b": 2.0, "c": 2.0})
    assert seen["traj"] == ({"answer": 4}, {"answer": 4}, "r1")
    assert seen["roles"] == [["a", "c"]]  # only the planner's calls, in order


def test_one_callable_for_every_role_and_turn_mapping_by_role():
    t = traj([call("a", "planner"), call("b", "coder")])
    values = evaluate_levels(
        RewardSpec(roles=lambda task, calls, tr: len(calls), turns={"coder": lambda task, c, tr: 1}), t
    )
    assert values.trajectory is None
    assert values.roles == {"planner": 1.0, "coder": 1.0}
    assert values.turns == {"b": 1.0}  # the planner has no turn reward at all


def test_none_means_not_applicable():
    t = traj([call("a", "planner"), call("b", "coder")])
    values = evaluate_levels(
        RewardSpec(trajectory=lambda *a: None, roles=lambda task, calls, tr: None,
                   turns=lambda task, c, tr: None if c.role == "planner" else 0.0), t
    )
    assert values.trajectory is None
    assert values.roles == {"planner": None, "coder": None}
    assert values.turns == {"a": None, "b": 0.0}


def test_numpy_like_and_bool_values_are_floats():
    class Number:
        def __float__(self):
            return 0.25

    t = traj([call("a", "planner")])
    values = evaluate_levels(RewardSpec(trajectory=lambda *a: True, turns=lambda *a: Number()), t)
    assert values.trajectory == 1.0 and values.turns == {"a": 0.25}


def broken_reward(task, state, trajectory):
    return state["missing"]


def test_raising_reward_names_the_function_and_where():
    with pytest.raises(RewardError) as err:
        evaluate_levels(RewardSpec(trajectory=broken_reward), traj([call("a", "planner")]))
    msg = str(err.value)
    assert "test_levels.broken_reward" in msg and "KeyError" in msg and "trajectory level" in msg and "r1" in msg
    assert isinstance(err.value.__cause__, KeyError)
    assert isinstance(err.value, UserError)


def test_raising_turn_reward_names_the_call():
    def per_turn(task, c, trajectory):
        raise RuntimeError("boom")

    with pytest.raises(RewardError, match=r"per_turn raised RuntimeError: boom .*llm call b of role 'coder'"):
        evaluate_levels(RewardSpec(turns={"coder": per_turn}), traj([call("a", "planner"), call("b", "coder")]))


@pytest.mark.parametrize("bad", ["1.0x", [1.0], float("nan"), float("inf")])
def test_non_numbers_are_errors(bad):
    with pytest.raises(RewardError, match="<lambda>"):
        evaluate_levels(RewardSpec(trajectory=lambda *a: bad), traj([call("a", "planner")]))


def test_spec_rejects_non_callables():
    with pytest.raises(UserError, match="role reward for role 'planner'"):
        RewardSpec(roles={"planner": 1.0})
    with pytest.raises(UserError, match="trajectory reward"):
        RewardSpec(trajectory="exact_match")
    with pytest.raises(UserError, match="turn rewards must be"):
        RewardSpec(turns=3)



# --- a reward in an app file loaded by path: its file and line, not the loader's module name ---

APP_REWARDS = '''
def lookup(state):
    return state["missing"]  # RAISES HERE


def trajectory_reward(task, state, trajectory):
    return lookup(state)


def role_reward(task, calls, trajectory):
    raise ValueError("bad role\\nsecond line")  # ROLE RAISES


def turn_reward(task, call, trajectory):
    return 1 / 0  # TURN RAISES


def words(task, state, trajectory):
    return "three"


class Scorer:
    def __call__(self, task, state, trajectory):
        return state["missing"]  # OBJECT RAISES


scorer = Scorer()
'''


def _line(path, marker):
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text)


@pytest.fixture
def app_rewards(tmp_path):
    from mas_trainer.apps import load_object

    path = tmp_path / "my_app.py"
    path.write_text(APP_REWARDS)
    return path, lambda name: load_object(f"{path}:{name}")


@pytest.mark.parametrize("level, fn, spec_of, marker, where", [
    ("trajectory", "trajectory_reward", lambda f: RewardSpec(trajectory=f), "RAISES HERE", "trajectory level, rollout r1"),
    ("role", "role_reward", lambda f: RewardSpec(roles={"coder": f}), "ROLE RAISES", "role level, role 'coder', rollout r1"),
    ("turn", "turn_reward", lambda f: RewardSpec(turns=f), "TURN RAISES", "turn level, llm call b of role 'coder', rollout r1"),
    ("object", "scorer", lambda f: RewardSpec(trajectory=f), "OBJECT RAISES", "trajectory level, rollout r1"),
])
def test_a_raising_reward_from_an_app_file_names_its_file_and_line(app_rewards, level, fn, spec_of, marker, where):
    path, load = app_rewards
    reward = load(fn)
    assert reward.__module__.startswith("_mas_app_")  # what the loader calls the module
    with pytest.raises(RewardError) as err:
        evaluate_levels(spec_of(reward), traj([call("b", "coder")]))
    msg = str(err.value)
    assert "\n" not in msg and "_mas_app_" not in msg, msg
    assert f" at {path}:{_line(path, marker)} ({where})" in msg, msg  # the last frame in the user's file
    assert msg.startswith(f"reward {'Scorer' if level == 'object' else fn} raised "), msg


def test_a_multi_line_exception_stays_one_line_with_where_it_happened(app_rewards):
    path, load = app_rewards
    with pytest.raises(RewardError) as err:
        evaluate_levels(RewardSpec(roles=load("role_reward")), traj([call("a", "planner")]))
    assert str(err.value).startswith("reward role_reward raised ValueError: bad role second line at ")
    assert "role level, role 'planner', rollout r1" in str(err.value)


def test_a_non_number_from_an_app_file_names_where_the_reward_is_defined(app_rewards):
    path, load = app_rewards
    with pytest.raises(RewardError) as err:
        evaluate_levels(RewardSpec(trajectory=load("words")), traj([call("a", "planner")]))
    msg = str(err.value)
    assert msg.startswith(f"reward words (defined at {path}:{_line(path, 'def words')}) returned 'three' (str)"), msg
    assert "_mas_app_" not in msg


def test_a_reward_file_under_the_working_directory_is_named_relative_to_it(app_rewards, monkeypatch):
    path, load = app_rewards
    monkeypatch.chdir(path.parent)
    with pytest.raises(RewardError, match=rf" at my_app.py:{_line(path, 'RAISES HERE')} \(trajectory level"):
        evaluate_levels(RewardSpec(trajectory=load("trajectory_reward")), traj([call("a", "planner")]))


def test_a_trajectory_reward_reads_the_state_as_langgraph_returns_it():
    """The trajectory keeps the state as JSON (what a record or a resumed run reads back); the
    reward gets LangChain messages again, as `graph.invoke` returns them, with other values as they are."""
    import json

    from langchain_core.messages import AIMessage, HumanMessage

    from mas_trainer.loop.controller import state_json

    live = {"messages": [HumanMessage("6 x 7?"), AIMessage("42", tool_calls=[{"name": "f", "args": {}, "id": "c1"}])],
            "answer": "42", "notes": [{"type": "ai", "content": "a plain dict"}]}
    stored = json.loads(json.dumps(state_json(live)))  # as written to and read from trajectories.jsonl
    seen = {}

    def reward(task, state, trajectory):
        seen["state"] = state
        return float(state["messages"][-1].content == state["answer"])

    assert evaluate_levels(RewardSpec(trajectory=reward), traj([], final_state=stored)).trajectory == 1.0
    got = seen["state"]
    assert [type(m).__name__ for m in got["messages"]] == ["HumanMessage", "AIMessage"]
    assert got["messages"][-1].tool_calls[0]["name"] == "f"
    assert got["notes"] == [{"type": "ai", "content": "a plain dict"}]  # not a message dump: left alone
    assert traj([], final_state=stored).final_state == stored  # the trajectory itself stays JSON
