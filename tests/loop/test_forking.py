"""Forked continuations from LangGraph checkpoints (adapters/langgraph/forks.py) and the
counterfactual credit they give, on an app whose upstream choice decides the reward."""

from pathlib import Path

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from mas_trainer.algo.advantages import turn_records
from mas_trainer.config import RewardConfig
from mas_trainer.engines.fake import FakeChatFormat, FakeEngine
from mas_trainer.errors import UserError
from mas_trainer.gateway import PolicyBackend
from mas_trainer.rewards import RewardSpec, assign_rewards
from mas_trainer.loop.forking import fork_rollouts
from mas_trainer.loop.session import Session
from mas_trainer.spec import SpecError
from mas_trainer.apps import load_object

APP = Path(__file__).resolve().parents[1] / "fixtures" / "credit_app.py"
N = 8


def forked(keywords=None, reward=None, n=N, seed=7, checkpointer=None, builder="build"):
    """The rollouts of one task (forks recorded), their cost, the engine's request count, the app runner
    and what the ledger kept. The fixture app is built inside the session (its client reads the gateway's URL)."""
    served = []

    def reply(ids, params, i):
        served.append(1)
        return load_object(f"{APP}:reply")(ids, params, i)

    with Session(backend_factory=lambda _m: PolicyBackend(FakeEngine(latency_s=0.0, reply=reply), FakeChatFormat()),
                 timeout_s=300) as session:  # a hang guard
        extra = {"checkpointer": checkpointer} if checkpointer is not None else {}
        graph = load_object(f"{APP}:{builder}")(**extra, **(keywords or {}))
        app = session.load_app(graph)
        spec = RewardSpec(app.spec.declared.reward)
        session.reseed(seed)
        ids = [f"s1-t0-r{k}" for k in range(n)]
        reward = reward or RewardConfig(allocator="counterfactual", counterfactual={"k": 8})
        trajs, _forks, cost = session.loop.run_until_complete(
            fork_rollouts(session, [{"question": "q"}], n, ids, spec, reward))
        for t in trajs:
            assign_rewards(t, spec, allocator="counterfactual")
        leftover = session.ledger.take(ids[0])
    return trajs, cost, len(served), app, leftover, graph


def _picker(t):
    return next(c for c in t.llm_calls if c.role == "picker")


def test_counterfactual_credit_ranks_a_good_pick_above_a_rescued_bad_one_where_broadcast_cannot():
    trajs, cost, served, *_ = forked()
    good = [t for t in trajs if _picker(t).output_text == "good"]
    rescued = [t for t in trajs if _picker(t).output_text == "bad" and t.rewards.trajectory == 1.0]
    assert good and rescued, "the seed must give both cases"
    g, b = good[0], rescued[0]
    # broadcast: both picks scored 1
    assert g.rewards.trajectory == b.rewards.trajectory == 1.0
    credit_g, credit_b = g.rewards.turns[_picker(g).id], b.rewards.turns[_picker(b).id]
    assert credit_g > credit_b
    # V after a good pick is 1, the most there is: no good pick is ever blamed; on average a bad pick is
    picks = {o: [t.rewards.turns[_picker(t).id] for t in trajs if _picker(t).output_text == o] for o in ("good", "bad")}
    assert min(picks["good"]) >= 0 and sum(picks["good"]) / len(picks["good"]) > sum(picks["bad"]) / len(picks["bad"])
    # after a good pick the solver is always right: its own turn changed nothing
    solver_g = next(c for c in g.llm_calls if c.role == "solver")
    assert g.rewards.turns[solver_g.id] == pytest.approx(0.0)
    # the audit trail: values before and after, from the forks' returns
    part = g.rewards.detail["calls"][_picker(g).id]["parts"]["counterfactual"]
    values = g.forks.values
    assert part["after"] == values[1].value == 1.0 and part["before"] == values[0].value
    assert part["value"] == pytest.approx(part["after"] - part["before"])
    assert all(len(v.returns) == 8 for v in values.values())  # K continuations per checkpoint
    assert all(v.failed == {} for v in values.values())  # none failed: the viewer marks those that did
    # cost: 3 checkpoints a rollout (before the picker, between, after the solver), K each
    assert cost["forks/points"] == 3 * N and cost["forks/runs"] == 3 * N * 8 and cost["time/fork_s"] > 0


def test_forks_calls_go_through_the_gateway_but_are_never_trained():
    trajs, cost, served, _, leftover, _ = forked()
    assert served > 2 * N  # the continuations asked the engines too
    records = turn_records(trajs)
    own = {c.id for t in trajs for c in t.llm_calls}
    assert len(records) == 2 * N and {r.turn_id for r in records} <= own
    assert all("-cf" not in t.rollout_id for t in trajs) and leftover == []


def test_boundaries_only_and_budget_shrink_the_forks():
    reward = RewardConfig(allocator="counterfactual",
                          counterfactual={"k": 8, "max_forks_per_step": 2 * N, "roles": ["picker"]})
    trajs, cost, *_ = forked(reward=reward)
    assert cost["forks/points"] == 2 * N and cost["forks/runs"] == 2 * N  # K shrank to 1 for the budget
    t = trajs[0]
    assert [s.role for s in t.forks.segments] == ["picker"]
    solver = next(c for c in t.llm_calls if c.role == "solver")
    assert t.rewards.detail["calls"][solver.id]["parts"]["trajectory"]["value"] == t.rewards.trajectory  # broadcast


def test_an_app_declaring_a_side_effect_node_is_refused_by_name():
    with pytest.raises(UserError) as err:
        forked({"no_fork": {"solver"}}, n=1)
    line = str(err.value)
    assert "'solver'" in line and "no_fork" in line and "\n" not in line
    with pytest.raises(SpecError, match="no_fork names unknown node.*'mailer'"):
        forked({"no_fork": {"mailer"}}, n=1)


def test_unknown_role_is_refused():
    with pytest.raises(UserError, match="reward.counterfactual.roles names 'planner'.*picker, solver"):
        forked(reward=RewardConfig(allocator="counterfactual", counterfactual={"roles": ["planner"]}), n=1)


def test_the_apps_own_checkpointer_is_left_as_it_was():
    saver = InMemorySaver()
    trajs, _, _, app, _, graph = forked(checkpointer=saver, n=2)
    assert app.graph is graph and graph.checkpointer is saver
    assert all(t.forks for t in trajs)
    assert not saver.storage and not saver.writes  # every thread the run made (forks included) is deleted


def test_an_app_without_checkpointer_gets_one_only_for_the_forks():
    _, _, _, app, _, graph = forked(n=1)
    assert app.graph is graph and graph.checkpointer is None and app.kept_threads is None


def test_fit_with_counterfactual_credit_on_the_tiny_model(tmp_path):
    import json

    from mas_trainer.config import load_config
    from mas_trainer.loop.trainer import fit

    cfg = load_config(overrides=["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_tokens=6",
                                 "seed=3", "steps=1", "reward.allocator=counterfactual", "reward.counterfactual.k=2",
                                 "advantage.estimator=reinforce_plus_plus"])
    rows = fit(f"{APP}:graph", [{"question": "q"}, {"question": "r"}], cfg, tmp_path / "run", val_tasks=[{"question": "v"}])
    train = next(r for r in rows if r["kind"] == "train")
    # 4 rollouts x 3 checkpoints (before the picker, between, after the solver) x K=2
    assert train["forks/points"] == 12 and train["forks/runs"] == 24
    assert 0 < train["time/fork_s"] <= train["time/rollout_s"] and train["perf/fork_rollouts_per_s"] > 0
    assert all(any(k.startswith(f"policy/{p}/") for k in train) for p in ("lead", "crew"))  # both roles' policies trained
    step = [json.loads(line) for line in (tmp_path / "run" / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
    assert len(step) == 4 and all(t["forks"]["k"] == 2 for t in step)
    assert all(t["rewards"]["detail"]["allocator"] == "counterfactual" for t in step)
    val = (tmp_path / "run" / "trajectories" / "step_000001_val.jsonl").read_text().splitlines()
    assert all(json.loads(line)["forks"] is None for line in val)  # held-out rollouts are scored, not forked
    # the continuations are recorded beside the step, each with its own calls and rewards, and not trained
    forks = [json.loads(line) for line in (tmp_path / "run" / "trajectories" / "step_000001_forks.jsonl").read_text().splitlines()]
    assert len(forks) == 24 and all("-cf" in f["rollout_id"] and f["rewards"]["trajectory"] is not None for f in forks)
    assert sum(len(f["llm_calls"]) for f in forks) == 4 * 2 * 2 + 4 * 2  # from before the picker: both roles; between: the solver
    assert (train["policy/lead/turns"], train["policy/crew/turns"]) == (4, 4) and "forks/trained_turns" not in train
    for t in step:  # each trained call carries the advantages its update used, beside its counterfactual audit trail
        for call in t["llm_calls"]:
            entry = t["rewards"]["detail"]["calls"][call["id"]]
            assert len(entry["advantages"]) == len(call["response_ids"]) and "counterfactual" in entry["parts"]


def test_train_forks_trains_the_continuations_calls_too(tmp_path):
    from mas_trainer.config import load_config
    from mas_trainer.loop.trainer import fit

    cfg = load_config(overrides=["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_tokens=6",
                                 "seed=3", "steps=1", "reward.allocator=counterfactual", "reward.counterfactual.k=2",
                                 "reward.counterfactual.train_forks=true"])
    rows = fit(f"{APP}:graph", [{"question": "q"}, {"question": "r"}], cfg, tmp_path / "run")
    train = next(r for r in rows if r["kind"] == "train")
    # 4 rollouts' own turns, plus 8 continuations from before the picker (picker + solver) and 8 from between (solver)
    assert train["forks/trained_turns"] == 24
    assert (train["policy/lead/turns"], train["policy/crew/turns"]) == (4 + 8, 4 + 16)


def test_an_allocator_registered_as_needing_forks_gets_them_whatever_its_name(monkeypatch):
    from mas_trainer.config import load_config
    from mas_trainer.rewards import allocators
    from mas_trainer.loop.trainer import _Fit

    monkeypatch.setattr(allocators, "_ALLOCATORS", dict(allocators._ALLOCATORS))  # this test's registry only
    monkeypatch.setattr(allocators, "_NEEDS_FORKS", set(allocators._NEEDS_FORKS))
    seen = {}

    @allocators.register_allocator("my_credit", needs_forks=True)
    def my_credit(trajectory, values, weights):
        seen[trajectory.rollout_id] = trajectory.forks
        return {c.id: 0.0 for c in trajectory.llm_calls}

    cfg = load_config(overrides=["reward.allocator=my_credit", "reward.counterfactual.k=2"])
    reply = load_object(f"{APP}:reply")
    with Session(backend_factory=lambda _m: PolicyBackend(FakeEngine(latency_s=0.0, reply=reply), FakeChatFormat()),
                 timeout_s=300) as session:
        app = session.load_app(load_object(f"{APP}:build")())
        fit = _Fit(None, [], cfg, None, [], None)
        fit.reward_spec = RewardSpec(app.spec.declared.reward)
        trajs, forks = session.loop.run_until_complete(fit.rollouts(session, [{"question": "q"}], 2, ["r0", "r1"], 7, fork=True))
        held_out, none = session.loop.run_until_complete(fit.rollouts(session, [{"question": "q"}], 1, ["v0"], 7))
    assert all(t.forks is not None and t.forks.k == 2 and seen[t.rollout_id] is t.forks for t in trajs)
    assert forks and all(seen[f.rollout_id] is None for f in forks)  # continuations are scored, not forked
    assert none == [] and held_out[0].forks is None and seen["v0"] is None


def test_a_continuations_group_is_its_checkpoint():
    from mas_trainer.loop.forking import fork_group

    assert fork_group("s000001d1-t00003-r2-cf12-k3") == ("s000001d1-t00003-r2", 12)


def test_fit_refuses_an_unforkable_app_before_any_rollout(tmp_path):
    from mas_trainer.config import load_config
    from mas_trainer.loop.trainer import fit

    build = load_object(f"{APP}:build")
    cfg = load_config(overrides=["runtime.execution=local", "steps=1", "reward.allocator=counterfactual"])
    with pytest.raises(UserError, match=r"node\(s\) 'solver' not forkable \(no_fork"):
        fit(lambda: build(no_fork={"solver"}), [{"question": "q"}], cfg, tmp_path / "run", val_tasks=[{"question": "v"}])
    assert not list((tmp_path / "run").rglob("step_*"))  # no rollout ran, not even the held-out evaluation of step 0


def test_a_turn_inside_a_subgraph_is_forked_from_its_parents_checkpoints():
    trajs, cost, *_ = forked(builder="build_nested")
    t = trajs[0]
    picker = _picker(t)
    assert picker.node == "team:picker"
    assert [(s.role, s.before, s.after) for s in t.forks.segments] == [("picker", 0, 1), ("solver", 1, 2)]
    good = [t for t in trajs if _picker(t).output_text == "good"]
    assert good and all(t.forks.values[1].value == 1.0 for t in good)  # forks after the subgraph keep its pick
    assert cost["forks/runs"] == 3 * N * 8


def test_the_step_line_shows_the_forks_cost():
    from mas_trainer.run.progress import step_line

    row = {"step": 1, "reward/mean": 0.5, "forks/runs": 24.0, "time/fork_s": 3.2, "time/rollout_s": 4.0}
    assert "forks 24 in 3.2s" in step_line(row, 3, None)
    assert "forks" not in step_line({"step": 1, "reward/mean": 0.5}, 3, None)


def test_a_failed_continuation_counts_as_on_failure_or_not_at_all():
    from mas_trainer.loop.forking import _return
    from mas_trainer.trace.schema import Trajectory

    spec = RewardSpec(lambda task, state, traj: 1.0)
    failed = Trajectory(rollout_id="r-cf1-k0", task={}, status="timeout", error="slow")
    assert _return(spec, failed, 0.0) == 0.0 and _return(spec, failed, -1) == -1.0
    assert _return(spec, failed, "drop") is None  # left out of V's mean (rewards/counterfactual.py mean_return)
    assert _return(spec, Trajectory(rollout_id="r-cf1-k1", task={}, status="ok"), "drop") == 1.0
