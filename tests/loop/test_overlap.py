"""`rollout.max_staleness=1`: the next step's rollouts run during the update, turns carry
their weights version, turns past the bound are never trained, the gap is corrected with
verl's rollout correction, and a run still resumes exactly from a checkpoint."""

import json
from pathlib import Path

import pytest
import torch

from mas_trainer.config import ConfigError, load_config
from mas_trainer.engines.base import Generation
from mas_trainer.cluster.plan import Machine, resolve_plan
from mas_trainer.run.rundir import RunDir
from mas_trainer.loop.trainer import fit
from mas_trainer.policy.turns import TurnStore

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
TASKS = [json.loads(line) for line in DATA.read_text().splitlines()]


def _cfg(*overrides):
    return load_config(overrides=["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "learner.lr=1e-2",
                                  "rollout.max_tokens=8", "seed=3", *overrides])


class _Rec:
    def __init__(self, turn_id):
        self.turn_id = turn_id


def _gen(n=2):
    return Generation(list(range(1, n + 1)), [-0.5] * n, "x", "stop", [1])


def test_an_update_takes_only_its_turns_and_never_one_past_the_bound():
    store = TurnStore("p", max_staleness=1)
    store.record("old", [1], [_gen()], version=3)  # two updates behind at the update from version 5
    store.record("mine", [1], [_gen()], version=4)
    store.record("next", [1], [_gen()], version=5)  # the next step's, generated during the update
    store.record("left", [1], [_gen()], version=3)  # nobody's record (a filtered group), too old now
    pairs = store.take([_Rec("old"), _Rec("mine")], 5)  # an update of weights at version 5: 4 is the oldest
    assert [r.turn_id for r, _ in pairs] == ["mine"] and store.stale == 1
    assert len(store) == 1  # the next step's turn stays; the too-old unnamed one is gone
    assert [r.turn_id for r, _ in store.take([_Rec("next")], 6)] == ["next"] and store.stale == 0
    assert store.stale_metrics() == {"turns/stale": 0.0}
    # without a bound (max_staleness=0) an update empties the store, as before
    store = TurnStore("p")
    store.record("a", [1], [_gen()])
    store.record("b", [1], [_gen()])
    assert len(store.take([_Rec("a")])) == 1 and len(store) == 0 and store.stale_metrics() == {}


def test_the_bound_and_the_correction_are_decided_in_the_plan():
    cfg = _cfg("rollout.max_staleness=1", "runtime.learner=torch")
    plan = resolve_plan(cfg, {"solo": ("tiny", "tiny")}, machine=Machine(gpus=0, cpus=2))
    assert plan.workers["solo"].max_staleness == 1 and plan.workers["solo"].learner.old_logprobs == "rollout_correction"
    plain = resolve_plan(_cfg("runtime.learner=torch"), {"solo": ("tiny", "tiny")}, machine=Machine(gpus=0, cpus=2))
    assert plain.workers["solo"].learner.old_logprobs == "bypass"  # today's behaviour, unchanged


@pytest.mark.parametrize("overrides, words", [
    (["learner.old_logprobs=recompute"], "learner.old_logprobs=recompute"),
    (["runtime.learner=verl", "runtime.execution=ray", "runtime.engine=torch-replica", "runtime.replica.placement=colocated"],
     "placement=separate"),
    (["runtime.learner=verl", "runtime.execution=ray", "runtime.share_gpus=true"], "share_gpus"),
])
def test_overlap_where_it_cannot_run_is_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(overrides=["rollout.max_staleness=1", *overrides])
    with pytest.raises(ConfigError, match="less than or equal to 1"):
        load_config(overrides=["rollout.max_staleness=2"])


def test_next_rollouts_run_during_the_update_and_never_past_a_checkpoint(tmp_path, monkeypatch):

    seen = []  # (the oldest version an update may train, the versions it trained)
    real_take = TurnStore.take

    def take(self, records, version=0):
        pairs = real_take(self, records, version)
        seen.append((version - self.max_staleness, sorted({t.version for _, t in pairs})))
        return pairs

    monkeypatch.setattr(TurnStore, "take", take)
    out = tmp_path / "run"
    rows = fit(f"{APP}:single", TASKS[:6], _cfg("steps=4", "save_every=2", "eval_every=4", "rollout.max_staleness=1"),
               out, val_tasks=TASKS[6:8])
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    # step 2 follows a plain step; step 3 follows step 2's checkpoint (nothing ran past it); 2 and 4 ran ahead
    assert [r["rollout/overlapped"] for r in train] == [0.0, 1.0, 0.0, 1.0]
    assert all(r["policy/solo/turns/stale"] == 0 for r in train)
    assert all("policy/solo/rollout_is_mean" in r and "policy/solo/logprob_diff" in r for r in train)  # corrected
    assert seen and all(min(versions, default=oldest) >= oldest for oldest, versions in seen)
    # every step's trajectories written once, the rollouts of each step under its own ids
    files = sorted(p.name for p in (out / "trajectories").iterdir() if "val" not in p.name)
    assert files == [f"step_{s:06d}.jsonl" for s in (1, 2, 3, 4)]
    for s in (1, 2, 3, 4):
        ids = [json.loads(x)["rollout_id"] for x in (out / "trajectories" / f"step_{s:06d}.jsonl").read_text().splitlines()]
        assert ids and all(i.startswith(f"s{s:06d}-") for i in ids)
    assert RunDir(out).committed() == 4


def test_a_run_stopped_after_a_checkpoint_resumes_with_nothing_lost_or_twice(tmp_path, monkeypatch):
    from mas_trainer.loop import trainer

    out = tmp_path / "run"
    cfg = ("steps=4", "save_every=2", "eval_every=4", "rollout.max_staleness=1")
    real = trainer._Fit.collect

    async def dies_at_step_4(self, session, step, position):
        if step == 4:
            raise RuntimeError("killed")
        return await real(self, session, step, position)

    monkeypatch.setattr(trainer._Fit, "collect", dies_at_step_4)
    with pytest.raises(RuntimeError, match="killed"):
        fit(f"{APP}:single", TASKS[:6], _cfg(*cfg), out, val_tasks=TASKS[6:8])
    monkeypatch.setattr(trainer._Fit, "collect", real)
    rows = fit(f"{APP}:single", TASKS[:6], _cfg(*cfg), out, val_tasks=TASKS[6:8], resume=True)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in RunDir(out).metrics() if r["kind"] == "train"] == [1, 2, 3, 4]


def test_torch_learner_rollout_correction_weights_by_the_truncated_ratio():
    from mas_trainer.learners.batch import Turn
    from mas_trainer.learners.config import LearnerConfig
    from mas_trainer.learners.torch_learner import TorchLearner
    from mas_trainer.engines.models import load_model

    model, _ = load_model("tiny", seed=0)
    learner = TorchLearner(model, LearnerConfig(lr=1e-3, old_logprobs="rollout_correction", rollout_is_threshold=2.0,
                                                mini_batch_size=2, micro_batch_size=2))
    base = Turn("t", [1, 2, 3], [4, 5, 6], [0.0] * 3, 1.0)
    own = learner.log_probs([base])[0].tolist()
    # the engine's log-probs: the learner's own, shifted per token (behaviour more or less likely)
    shift = [0.5, -2.0, 0.0]
    turn = Turn("t", [1, 2, 3], [4, 5, 6], [a + b for a, b in zip(own, shift)], 1.0)
    corrected, metrics = learner._recompute_old([turn])
    want = [min(float(torch.exp(torch.tensor(-b))), 2.0) for b in shift]  # exp(learner - engine), truncated at 2
    assert corrected[0].is_weights == pytest.approx(want, rel=1e-4)
    assert corrected[0].old_logprobs == pytest.approx(own, abs=1e-6)
    assert metrics["logprob_diff"] == pytest.approx(sum(map(abs, shift)) / 3, rel=1e-4)
    out = learner.update([turn])
    assert out["optimizer_steps"] == 1 and out["rollout_is_mean"] == pytest.approx(sum(want) / 3, rel=1e-4)
    # the loss is weighted: at the first step the ratio is 1, so the token-mean loss is -mean(A * weight)
    assert out["pg_loss"] == pytest.approx(-sum(want) / 3, rel=1e-3)


def test_the_step_line_says_when_rollouts_ran_ahead():
    from mas_trainer.run.progress import step_line

    row = {"step": 2, "reward/mean": 0.5, "time/rollout_s": 9.0, "time/update_s": 6.0, "rollout/overlapped": 1.0,
           "time/rollout_wait_s": 3.0}
    assert "rollout 9.0s (ahead, waited 3.0s)  update 6.0s" in step_line(row, 3, None)
    assert "ahead" not in step_line({**row, "rollout/overlapped": 0.0}, 3, None)
