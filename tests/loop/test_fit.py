"""`fit` end to end on the tiny model: run directory, which weights move, resume. (kill -9 at
any moment, then resume: tests/loop/test_recovery.py.)"""

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mas_trainer.apps import load_object
from mas_trainer.config import ConfigError, load_config
from mas_trainer.errors import UserError
from mas_trainer.run.rundir import RunDir
from mas_trainer.loop.trainer import fit, take_tasks

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
TASKS = [json.loads(line) for line in DATA.read_text().splitlines()]


def _cfg(*overrides):
    return load_config(overrides=["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "learner.lr=1e-2",
                                  "rollout.max_tokens=12",
                                  "seed=3", *overrides])


def _params(folder):
    model = AutoModelForCausalLM.from_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_run_directory_and_partial_sharing(tmp_path):
    """3 roles on 2 policies: both policies move; the run dir has what DESIGN promises."""
    out = tmp_path / "run"
    rows = fit(f"{APP}:graph", TASKS[:6], _cfg("steps=2", "save_every=1", "eval_every=1"), out, val_tasks=TASKS[6:])
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    assert [r["step"] for r in rows if r["kind"] == "val"] == [0, 1, 2]
    train = [r for r in rows if r["kind"] == "train"]
    assert {"reward/role/planner", "reward/role/writer", "reward/role/critic", "perf/rollouts_per_s", "perf/tokens_per_s"} <= set(train[0])
    assert train[0]["policy/lead/turns"] == 4 and train[0]["policy/crew/turns"] == 8  # planner vs writer+critic
    assert (out / "config.yaml").exists() and (out / "rewards.png").stat().st_size > 1000
    assert sorted(p.name for p in (out / "trajectories").iterdir()) == [
        "step_000000_val.jsonl", "step_000001.jsonl", "step_000001_val.jsonl", "step_000002.jsonl", "step_000002_val.jsonl"]
    traj = json.loads((out / "trajectories" / "step_000001.jsonl").read_text().splitlines()[0])
    assert set(traj["rewards"]["turns"]) == {c["id"] for c in traj["llm_calls"]}
    assert traj["rewards"]["detail"]["allocator"] == "broadcast"
    for policy in ("lead", "crew"):
        folder = out / "checkpoint" / "policies" / policy
        assert (folder / "config.json").exists() and (out / "checkpoint" / "learner" / policy / "optimizer.pt").exists()
        AutoModelForCausalLM.from_pretrained(folder)  # loadable by transformers
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2 and state["position"] == 4


def test_only_policies_with_trainable_turns_change(tmp_path):
    """A policy that no role maps to keeps its weights; the ones that had turns move."""
    # a function returning the graph: built inside fit, once OPENAI_BASE_URL points at the gateway
    graph = lambda: load_object(f"{APP}:build")(  # noqa: E731
        {"lead": "tiny", "crew": "tiny", "idle": "tiny"}, {"planner": "lead", "writer": "crew", "critic": "crew"})
    out = tmp_path / "run"
    cfg = _cfg("steps=1")
    fit(graph, TASKS[:2], cfg, out)
    from mas_trainer.engines.models import load_model

    base = {k: v.clone() for k, v in load_model("tiny", seed=cfg.seed)[0].state_dict().items()}
    for policy, should_move in (("lead", True), ("crew", True), ("idle", False)):
        after = _params(out / "checkpoint" / "policies" / policy)
        moved = any(not torch.equal(after[k], base[k]) for k in base if k in after)
        assert moved == should_move, policy


def test_shared_policy_is_one_set_of_weights(tmp_path):
    graph = lambda: load_object(f"{APP}:build")({"all": "tiny"}, {"planner": "all", "writer": "all", "critic": "all"})  # noqa: E731
    rows = fit(graph, TASKS[:2], _cfg("steps=1"), tmp_path / "run")
    assert rows[-1]["policy/all/turns"] == 12  # 2 tasks x 2 rollouts x 3 roles, one learner
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint" / "policies").iterdir()) == ["all"]


def _sample_groups(run, step):
    """The distinct replies (token ids of every call) of each task's samples at a training step."""
    groups: dict[str, set] = {}
    for line in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines():
        traj = json.loads(line)
        groups.setdefault(traj["task"]["question"], set()).add(tuple(tuple(c["response_ids"]) for c in traj["llm_calls"]))
    return groups


def test_rollout_temperature_overrides_the_apps_in_training_rollouts(tmp_path):
    """rollout.temperature=0 makes every sample of a task the greedy reply (a group without
    spread); without it the app's own sampling (temperature 1) gives the samples apart."""
    def samples(run, *overrides):
        fit(f"{APP}:graph", TASKS[:2], _cfg("steps=1", "rollout.n=3", *overrides), run)
        return _sample_groups(run, 1)

    greedy = samples(tmp_path / "greedy", "rollout.temperature=0")
    assert len(greedy) == 2 and all(len(g) == 1 for g in greedy.values())
    sampled = samples(tmp_path / "sampled")
    assert all(len(g) > 1 for g in sampled.values())


def test_rollout_temperature_schedule_changes_the_temperature_from_its_step_on(tmp_path):
    """Greedy for step 1, the app's sampling again from step 2 ({2: 1.0}); the same tasks both steps."""
    run = tmp_path / "run"
    fit(f"{APP}:graph", TASKS[:2], _cfg("steps=2", "rollout.n=3", "rollout.temperature=0",
                                        "rollout.temperature_schedule={2: 1.0}"), run)
    assert all(len(g) == 1 for g in _sample_groups(run, 1).values())
    assert all(len(g) > 1 for g in _sample_groups(run, 2).values())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/temperature"] for r in rows if r["kind"] == "train"] == [0, 1.0]


def test_temperature_schedule_is_checked_and_looked_up_by_step():
    c = load_config(overrides=["rollout.temperature=0.7", "rollout.temperature_schedule={31: 0.9, 21: 1.0}"]).rollout
    assert [c.temperature_at(s) for s in (1, 20, 21, 30, 31, 99)] == [0.7, 0.7, 1.0, 1.0, 0.9, 0.9]
    assert load_config().rollout.temperature_at(5) is None  # no override: each call's own temperature
    with pytest.raises(ConfigError, match=r"'rollout.temperature_schedule': entry 0: 1.0 must map a training step >= 1"):
        load_config(overrides=["rollout.temperature_schedule={0: 1.0}"])
    with pytest.raises(ConfigError, match=r"entry 5: 3.0 must map a training step >= 1 to a temperature in \[0, 2\]"):
        load_config(overrides=["rollout.temperature_schedule={5: 3}"])


def _flat_tasks(flags):
    return [{"question": t["question"], "flat": flat} for t, flat in zip(TASKS, flags)]


def _step_trajectories(run, step):
    return [json.loads(line) for line in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]


def test_filter_groups_trains_only_on_groups_with_spread_and_draws_until_it_has_a_batch(tmp_path):
    """DAPO's dynamic sampling: `flat` tasks score 0.5 whatever the reply, so their groups are
    left out; each later draw takes as many tasks as groups are still missing, until
    tasks_per_step groups with spread are found."""
    order = take_tasks(8, 0, 4, 3)  # seed 3's data order; draws of 2, then 1, then 1 task(s)
    flat = set(range(8)) - {order[0], order[3]}  # spread in draw 0 (one of two) and in draw 2
    run = tmp_path / "run"
    rows = fit(f"{APP}:some_flat", _flat_tasks([i in flat for i in range(8)]),
               _cfg("steps=1", "rollout.n=3", "rollout.filter_groups=true", "rollout.max_draws=3"), run)
    row, trajs = rows[-1], _step_trajectories(run, 1)
    assert (row["rollout/groups"], row["rollout/groups_kept"], row["rollouts"], len(trajs)) == (4, 2, 12, 12)
    assert row["policy/solo/turns"] == 6  # 2 groups x 3 samples, nothing else
    why = {t["rollout_id"]: t["rewards"]["detail"].get("left_out") for t in trajs}
    assert why == {**{f"s000001-t{order[0]:05d}-r{k}": None for k in range(3)},
                   **{f"s000001-t{order[1]:05d}-r{k}": "no spread" for k in range(3)},
                   **{f"s000001d1-t{order[2]:05d}-r{k}": "no spread" for k in range(3)},
                   **{f"s000001d2-t{order[3]:05d}-r{k}": None for k in range(3)}}
    assert json.loads((run / "checkpoint" / "state.json").read_text())["position"] == 4  # past every task drawn


def test_filter_groups_stops_after_max_draws_and_trains_on_what_it_found(tmp_path):
    run = tmp_path / "run"
    rows = fit(f"{APP}:some_flat", _flat_tasks([True] * 8), _cfg("steps=1", "rollout.filter_groups=true",
                                                                 "rollout.max_draws=2"), run)
    row = rows[-1]
    assert (row["rollout/groups"], row["rollout/groups_kept"], row["policy/solo/turns"]) == (4, 0, 0)
    assert all(t["rewards"]["detail"]["left_out"] == "no spread" for t in _step_trajectories(run, 1))


def test_min_groups_draws_again_only_below_it_and_then_fills_the_whole_batch(tmp_path):
    """tasks_per_step=4, min_groups=2: a first draw with one group with spread is followed by a
    draw of 3 tasks (the gap to tasks_per_step, not to min_groups); a first draw with two is not."""
    order = take_tasks(8, 0, 8, 3)
    cfg = _cfg("steps=1", "rollout.tasks_per_step=4", "rollout.filter_groups=true", "rollout.min_groups=2")

    def step(name, spread):
        run = tmp_path / name
        row = fit(f"{APP}:some_flat", _flat_tasks([i not in spread for i in range(8)]), cfg, run)[-1]
        ids = {t["rollout_id"].split("-r")[0] for t in _step_trajectories(run, 1)}
        return row["rollout/groups"], row["rollout/groups_kept"], ids

    groups, kept, ids = step("short", {order[0], order[5]})
    assert (groups, kept) == (7, 2)
    assert ids == {*(f"s000001-t{i:05d}" for i in order[:4]), *(f"s000001d1-t{i:05d}" for i in order[4:7])}
    groups, kept, ids = step("enough", {order[0], order[1]})
    assert (groups, kept, ids) == (4, 2, {f"s000001-t{i:05d}" for i in order[:4]})


def test_without_filter_groups_a_step_is_one_draw_trained_whole(tmp_path):
    run = tmp_path / "run"
    row = fit(f"{APP}:some_flat", _flat_tasks([True] * 8), _cfg("steps=1"), run)[-1]
    trajs = _step_trajectories(run, 1)
    assert row["policy/solo/turns"] == 4 and "rollout/groups" not in row  # 2 tasks x 2 samples, flat or not
    assert not any("left_out" in t["rewards"]["detail"] for t in trajs)
    assert {t["rollout_id"].split("-")[0] for t in trajs} == {"s000001"}


def test_a_step_across_an_epoch_boundary_gives_a_task_drawn_twice_its_own_rollout_ids(tmp_path):
    """3 tasks, 2 a step: step 2 takes the last task of epoch 0 and the first of epoch 1, which
    with seed 2 are the same task. Its second group counts on from r2 instead of repeating
    r0-r1 (which would merge both groups' calls in the gateway)."""
    assert take_tasks(3, 2, 2, 2) == [1, 1]
    run = tmp_path / "run"
    rows = fit(f"{APP}:some_flat", _flat_tasks([False] * 3), _cfg("steps=2", "seed=2"), run)
    trajs = _step_trajectories(run, 2)
    assert sorted(t["rollout_id"] for t in trajs) == [f"s000002-t00001-r{k}" for k in range(4)]
    assert all(t["status"] == "ok" and len(t["llm_calls"]) >= 1 for t in trajs)
    assert rows[-1]["policy/solo/turns"] == sum(len(t["llm_calls"]) for t in trajs)


def test_filter_groups_without_a_trainable_policy_makes_one_draw_a_step(tmp_path, caplog):
    """Every role frozen: no group is trained on, so drawing again could only waste rollouts."""
    def graph():
        from mas_trainer import trainable

        g = load_object(f"{APP}:build")({"a": "tiny"}, {"planner": "a", "writer": "a", "critic": "a"})
        return trainable(g, frozen=["planner", "writer", "critic"])

    with caplog.at_level(logging.WARNING, logger="mas_trainer.loop.trainer"):
        rows = fit(graph, TASKS[:4], _cfg("steps=1", "rollout.filter_groups=true", "rollout.max_draws=3"), tmp_path / "run")
    [train] = [r for r in rows if r["kind"] == "train"]
    assert train["rollouts"] == 4 and "rollout/groups" not in train
    assert "rollout.filter_groups is ignored: no policy is trainable" in caplog.text


def test_filter_groups_is_checked():
    with pytest.raises(ConfigError, match=r"rollout.max_draws"):
        load_config(overrides=["rollout.filter_groups=true", "rollout.max_draws=0"])
    with pytest.raises(ConfigError, match=r"rollout.filter_groups drops groups .* use a group estimator in advantage.estimator"):
        load_config(overrides=["rollout.filter_groups=true", "advantage.estimator=gae"])
    with pytest.raises(ConfigError, match=r"in policies.p.advantage.estimator"):
        load_config(overrides=["rollout.filter_groups=true", "policies.p.advantage.estimator=gae"])
    with pytest.raises(ConfigError, match=r"rollout.min_groups only applies with rollout.filter_groups=true"):
        load_config(overrides=["rollout.min_groups=2"])
    with pytest.raises(ConfigError, match=r"rollout.min_groups=9 is more than rollout.tasks_per_step=8, .* use at most 8"):
        load_config(overrides=["rollout.filter_groups=true", "rollout.min_groups=9"])
    assert load_config(overrides=["rollout.filter_groups=true", "rollout.min_groups=8"]).rollout.min_groups == 8


def test_config_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"unknown config key 'learner.lrr'; did you mean 'lr'\? valid keys here: lr, "):
        load_config(overrides=["learner.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rollouts'"):
        load_config(overrides=["rollouts.n=2"])
    with pytest.raises(ConfigError, match=r"config key 'steps'"):
        load_config(overrides=["steps=-1"])
    with pytest.raises(ConfigError, match=r"policies.p.learner: unknown config key 'lrr'; did you mean 'lr'\? valid keys here: lr, "):
        load_config(overrides=["policies.p.learner.lrr=1e-5"])
    assert load_config(overrides=["policies.p.learner.lr=0.5"]).learner_for("p").lr == 0.5


def test_resume_refuses_an_existing_run_without_flag(tmp_path):
    out = tmp_path / "run"
    fit(f"{APP}:single", TASKS[:2], _cfg("steps=1"), out)
    with pytest.raises(ConfigError, match="already holds a run; pass --resume"):
        fit(f"{APP}:single", TASKS[:2], _cfg("steps=1"), out)


def _killed_before_first_checkpoint(out):
    """What a run killed during step 2 of its first save interval leaves on disk."""
    run = RunDir(out)
    run.create("seed: 3\n")
    run.append_metrics({"kind": "val", "step": 0, "rollouts": 2})
    run.append_metrics({"kind": "train", "step": 1, "rollouts": 4})
    with run.metrics_path.open("a") as f:
        f.write('{"kind": "train", "st')  # a row cut by the kill
    run.write_trajectories(0, ['{"old": 0}'], name="step_000000_val")
    run.write_trajectories(1, ['{"old": 1}'])
    (out / "trajectories" / "step_000002.tmp").write_text('{"old"')
    (run.staging() / "policies" / "solo").mkdir()
    return run


def test_a_run_killed_before_its_first_checkpoint_is_refused_without_resume(tmp_path):
    """Nothing to resume: a fresh start says what to do, and touches nothing."""
    run = _killed_before_first_checkpoint(tmp_path / "run")
    before = sorted(p.name for p in run.traj_dir.iterdir()), run.metrics_path.read_text()
    with pytest.raises(ConfigError, match=r"stopped before its first checkpoint, so there is nothing to resume; "
                                          r"pass --resume to start it over from step 0"):
        fit(f"{APP}:single", TASKS[:2], _cfg("steps=1"), run.root)
    assert (sorted(p.name for p in run.traj_dir.iterdir()), run.metrics_path.read_text()) == before


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path, caplog):
    """As verl's auto resume: no complete checkpoint -> step 0, the partial records discarded, one clear line."""
    run = _killed_before_first_checkpoint(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="mas_trainer.loop.trainer"):
        rows = fit(f"{APP}:single", TASKS[:2], _cfg("steps=1"), run.root, resume=True)
    assert "has no complete checkpoint (the run stopped before its first one): starting over from step 0; " \
           "discarded 2 metrics rows and 2 trajectory files" in caplog.text
    assert [(r["kind"], r["step"]) for r in rows] == [("train", 1)] == [(r["kind"], r["step"]) for r in run.metrics()]
    assert sorted(p.name for p in run.traj_dir.iterdir()) == ["step_000001.jsonl"]
    assert '"old"' not in (run.traj_dir / "step_000001.jsonl").read_text()
    assert len((run.traj_dir / "step_000001.jsonl").read_text().splitlines()) == 4
    assert json.loads((run.checkpoint / "state.json").read_text())["step"] == 1
    assert not (run.root / ".checkpoint-staging").exists()


def test_resume_on_an_empty_directory_starts_a_run(tmp_path):
    rows = fit(f"{APP}:single", TASKS[:2], _cfg("steps=1"), tmp_path / "new", resume=True)
    assert [r["step"] for r in rows] == [1]


def test_failed_rollouts_get_the_fill_reward_and_training_goes_on(tmp_path):
    from langgraph.graph import END, START, StateGraph

    from mas_trainer import trainable

    from typing import TypedDict

    class State(TypedDict, total=False):
        question: str
        answer: str

    calls = {"n": 0}

    def answer(s):
        from langchain_openai import ChatOpenAI

        out = ChatOpenAI(model="m", max_tokens=8, max_retries=0).invoke(s["question"]).content
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            raise RuntimeError("flaky tool")
        return {"answer": out}

    g = StateGraph(State)
    g.add_node("answer", answer)
    g.add_edge(START, "answer")
    g.add_edge("answer", END)
    graph = trainable(g.compile(), roles={"answer": "p"}, policies={"p": "tiny"}, reward=lambda t, s, tr: 1.0)
    # (the node builds its client per call, so the graph may be built before fit starts)
    rows = fit(graph, TASKS[:2], _cfg("steps=2", "reward.on_failure=-1", "rollout.max_in_flight=1"), tmp_path / "run")
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 2 and all(r["rollouts/error"] == 2 and r["rollouts/ok"] == 2 for r in train)
    assert train[0]["reward/mean"] == 0.0  # two rollouts at 1.0, two filled with -1.0


def test_ray_star_runtime_trains_two_policies_side_by_side(tmp_path):
    """One Ray actor per policy; both update in the same step."""
    ray = pytest.importorskip("ray")
    try:
        rows = fit(f"{APP}:graph", TASKS[:2], load_config(overrides=[
            "runtime.execution=ray", "runtime.num_cpus=2", "rollout.tasks_per_step=2", "rollout.n=2", "steps=1", "seed=3",
            "rollout.max_tokens=12"]),
            tmp_path / "run")
    finally:
        ray.shutdown()
    [train] = [r for r in rows if r["kind"] == "train"]
    assert train["policy/lead/turns"] == 4 and train["policy/crew/turns"] == 8
    assert (tmp_path / "run" / "checkpoint" / "policies" / "crew" / "config.json").exists()


def test_gae_with_a_critic_for_one_policy_grpo_for_the_other(tmp_path):
    cfg = _cfg("steps=2", "save_every=1", "policies.crew.advantage.estimator=gae", "policies.crew.advantage.lam=0.95",
               "critic.lr=1e-3")
    rows = fit(f"{APP}:graph", TASKS[:2], cfg, tmp_path / "run")
    train = [r for r in rows if r["kind"] == "train"]
    assert "policy/crew/critic/vf_loss" in train[0] and "policy/lead/critic/vf_loss" not in train[0]
    state = torch.load(tmp_path / "run" / "checkpoint" / "learner" / "crew" / "optimizer.pt", weights_only=True)
    assert set(state) == {"learner", "critic"}
    # resume restores the critic too
    rows = fit(f"{APP}:graph", TASKS[:2], _cfg("steps=3", "save_every=1", "policies.crew.advantage.estimator=gae",
                                                "critic.lr=1e-3"), tmp_path / "run", resume=True)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]


class _Planted:
    """What a hostile optimizer.pt could hold: unpickling it would run `open(...)`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_refuses_an_optimizer_state_that_would_run_code(tmp_path):
    fit(f"{APP}:graph", TASKS[:2], _cfg("steps=1", "save_every=1"), tmp_path / "run")
    planted = tmp_path / "run" / "checkpoint" / "learner" / "crew" / "optimizer.pt"
    marker = tmp_path / "ran"
    torch.save({"learner": _Planted(marker)}, planted)
    with pytest.raises(UserError, match=r"optimizer\.pt holds more than tensors.*refused"):
        fit(f"{APP}:graph", TASKS[:2], _cfg("steps=2", "save_every=1"), tmp_path / "run", resume=True)
    assert not marker.exists()


def test_full_separation_and_a_frozen_node(tmp_path):
    """3 roles on 3 policies all move; a frozen node is served by the base model, never trained."""
    def graph():
        from mas_trainer import trainable

        g = load_object(f"{APP}:build")({"a": "tiny", "b": "tiny"}, {"planner": "a", "writer": "b"})
        return trainable(g, roles={"planner": "a", "writer": "b"}, policies={"a": "tiny", "b": "tiny"}, frozen=["critic"])

    rows = fit(graph, TASKS[:2], _cfg("steps=1"), tmp_path / "run")
    [train] = [r for r in rows if r["kind"] == "train"]
    assert train["policy/a/turns"] == 4 and train["policy/b/turns"] == 4 and "policy/frozen/turns" not in train
    traj = json.loads((tmp_path / "run" / "trajectories" / "step_000001.jsonl").read_text().splitlines()[0])
    critic = [c for c in traj["llm_calls"] if c["node"] == "critic"]
    assert critic and all(c["policy"] == "frozen" and not c["trainable"] for c in critic)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint" / "policies").iterdir()) == ["a", "b"]


def test_lora_policy_checkpoints_an_adapter_that_resumes_evals_and_exports(tmp_path):
    """learner.lora_rank: the checkpoint is a peft adapter; --resume trains it on, eval and
    serve load it merged, export writes it merged (plain folder) or as the adapter."""
    from safetensors.torch import load_file

    from mas_trainer.engines.models import load_model
    from mas_trainer.engines.models import adapter_base, is_adapter
    from mas_trainer.loop.evaluate import evaluate
    from mas_trainer.production.export import export

    out = tmp_path / "run"
    lora = ("learner.lora_rank=4", "learner.lora_alpha=8", "learner.lr=5e-2", "save_every=1", "eval_every=10")
    fit(f"{APP}:single", TASKS[:4], _cfg("steps=2", *lora), out)
    folder = out / "checkpoint" / "policies" / "solo"
    assert is_adapter(folder) and adapter_base(folder) == "tiny"
    at_two = load_file(folder / "adapter_model.safetensors")
    import io

    from rich.console import Console

    said = io.StringIO()
    rows = fit(f"{APP}:single", TASKS[:4], _cfg("steps=3", *lora), out, resume=True, console=Console(file=said, width=200))
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    assert f"resuming {out} from its checkpoint at step 2 of 3" in said.getvalue()  # where --resume picks up, said
    elapsed = [r["time/elapsed_s"] for r in rows]  # the run's wall time goes on across the resume
    assert elapsed[0] > 0 and elapsed == sorted(elapsed) and len(set(elapsed)) == len(elapsed)
    at_three = load_file(folder / "adapter_model.safetensors")
    assert at_two.keys() == at_three.keys() and any(not torch.equal(at_two[k], at_three[k]) for k in at_two)

    result = evaluate(f"{APP}:single", TASKS[4:6], run_dir=out)
    assert result["policies"]["solo"] == str(folder) and result["rollouts/ok"] == 2

    merged_dir = export(out, tmp_path / "merged") / "solo"
    assert not is_adapter(merged_dir)
    plain = AutoModelForCausalLM.from_pretrained(merged_dir)  # transformers alone, no peft
    ids = torch.tensor([[1, 5, 9, 200, 31]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, load_model(str(folder), seed=3)[0](ids).logits, atol=1e-5, rtol=1e-5)
    from mas_trainer.cli import main

    assert main(["export", str(out), str(tmp_path / "adapter"), "--adapter"]) == 0
    adapter_dir = tmp_path / "adapter" / "solo"
    assert is_adapter(adapter_dir) and json.loads((tmp_path / "adapter" / "mas-trainer.json").read_text())["policies"]["solo"]["adapter"]


def test_an_override_for_a_policy_the_app_does_not_have_stops_fit_before_any_rollout(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^policies.sol: the app has no policy 'sol'; did you mean 'solo'\? its policies: frozen, solo$"):
        fit(f"{APP}:single", TASKS[:2], _cfg("steps=1", "policies.sol.learner.lr=1e-5"), out)
    assert not (out / "trajectories").exists() or not any((out / "trajectories").iterdir())
    assert not (out / "config.yaml").exists()  # a refused config is not left behind as the run's


CHAT_APP = """
from langgraph.graph import END, START, MessagesState, StateGraph
from langchain_openai import ChatOpenAI
from mas_trainer import trainable

llm = ChatOpenAI(model="m", max_retries=0)
g = StateGraph(MessagesState)
g.add_node("chat", lambda s: {"messages": [llm.invoke(s["messages"])]})
g.add_edge(START, "chat")
g.add_edge("chat", END)
graph = trainable(g.compile(), roles={"chat": "p"}, policies={"p": "tiny"}, reward=lambda task, state, traj: 1.0)
"""


def test_a_task_the_graph_cannot_start_from_stops_fit_before_any_worker_and_writes_nothing(tmp_path, monkeypatch):
    """The tasks are checked against the graph's input as soon as the app is loaded, training
    and held-out ones, before the plan and the workers (seconds, not after Ray started), and a
    refused fit leaves the output folder as it was: no config.yaml of a run that never ran."""
    import mas_trainer.loop.trainer as trainer

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker group was started")

    monkeypatch.setattr(trainer, "start_workers", no_workers)
    (tmp_path / "app.py").write_text(CHAT_APP)
    good = {"messages": [{"role": "user", "content": "hi"}]}
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for tasks, val in (([good, {"question": "hi"}], [good]), ([good, good], [{"question": "held out"}])):
        with pytest.raises(UserError, match=r"""^task \{"question": "[a-z ]+"\} has no 'messages', which the graph's input """
                                            r"\(MessagesState\) requires: give each task its conversation.*$") as err:
            fit(f"{tmp_path / 'app.py'}:graph", tasks, _cfg("steps=1"), out, val_tasks=val)
        assert "\n" not in str(err.value)
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # not even the lock file


def test_a_hub_id_that_cannot_be_had_is_one_line_before_any_worker_starts(tmp_path, monkeypatch):
    """On the Ray backend this was a 62-line traceback from the worker; now the driver checks
    every policy's model before anything starts (no network here: the hub is unreachable)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cfg = load_config(overrides=["runtime.execution=ray", "model=nobody-here/no-such-model", "steps=1"])
    with pytest.raises(UserError) as err:
        fit(f"{APP}:single", TASKS[:2], cfg, tmp_path / "run")
    assert "\n" not in str(err.value) and "nobody-here/no-such-model" in str(err.value)


def test_the_prefix_cache_reports_what_it_saved_in_every_step(tmp_path):
    """runtime.prefix_cache_mb: each policy's step metrics say how many prompt tokens the
    embedded engine did not prefill again. The planner's prompts all arrive in one batch (each
    distinct one prefilled once, nothing cached yet); the crew's critic prompts come after its
    writer prompts and share the chat template's system prompt with them."""
    rows = fit(f"{APP}:graph", TASKS[:4], _cfg("steps=2", "runtime.prefix_cache_mb=32"), tmp_path / "run")
    for row in (r for r in rows if r["kind"] == "train"):
        saved, asked = row["policy/crew/engine/prefill_tokens_saved"], row["policy/crew/engine/prompt_tokens"]
        assert 0 < saved < asked and row["policy/crew/engine/prefix_hit_rate"] == pytest.approx(saved / asked)
        assert row["policy/lead/engine/prefill_tokens_saved"] == 0 < row["policy/lead/engine/prompt_tokens"]
    off = fit(f"{APP}:graph", TASKS[:4], _cfg("steps=1"), tmp_path / "off")
    assert not any("prefix" in k for k in off[-1])  # off by default: no such metrics
