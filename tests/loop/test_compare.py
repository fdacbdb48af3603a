"""`eval --compare base`: a run's trained policies and their base models on the same tasks with
the same seeds, each task's rewards paired, the difference and its spread."""

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest

from mas_trainer.cli import main
from mas_trainer.config import load_config
from mas_trainer.engines.models import load_model
from mas_trainer.loop import evaluate as evaluate_module
from mas_trainer.loop.evaluate import compare, evaluate
from mas_trainer.loop.trainer import fit
from mas_trainer.rewards import is_dropped
from mas_trainer.rewards.allocators import rollout_reward
from mas_trainer.run.rundir import run_config, trained_policies

ROOT = Path(__file__).resolve().parents[2]
APP = f"{ROOT / 'tests' / 'fixtures' / 'words_app.py'}:graph"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
TASKS = [json.loads(line) for line in DATA.read_text().splitlines()][:4]
ROLES = ("critic", "planner", "writer")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "run"
    fit(APP, TASKS[:2], load_config(overrides=["runtime.execution=local", "steps=1", "rollout.tasks_per_step=2",
                                               "rollout.n=2", "rollout.max_tokens=8"]), out)
    return out


def _with_tiny_weights(run: Path, dest: Path, seed: int) -> Path:
    """A copy of `run` whose trained policies (the folders eval loads) hold the `tiny` model built with `seed`."""
    shutil.copytree(run, dest)
    for folder in trained_policies(dest).values():
        load_model("tiny", seed=seed)[0].save_pretrained(folder)
    return dest


def _sides(monkeypatch) -> list[list]:
    """The scored trajectories of each evaluation that runs from now on, in order."""
    seen: list[list] = []
    score = evaluate_module.score_rollouts
    monkeypatch.setattr(evaluate_module, "score_rollouts", lambda spec, trajs, *a, **kw: (seen.append(trajs), score(spec, trajs, *a, **kw))[1])
    return seen


def _calls(traj) -> list:
    return [(c.role, c.prompt_ids, c.response_ids) for c in traj.llm_calls]


def test_compare_samples_both_sides_with_the_same_tasks_and_seeds(run, tmp_path, monkeypatch):
    """Trained weights equal to the base's, sampled at temperature 1: with the same tasks and the
    same seed per call, both sides draw the very same tokens, and the difference is exactly 0."""
    same = _with_tiny_weights(run, tmp_path / "same", seed=run_config(run).seed)
    sides = _sides(monkeypatch)
    result = compare(APP, TASKS, run_dir=same, n=2, seed=3, temperature=1.0)
    base, trained = sides
    assert [t.rollout_id for t in base] == [t.rollout_id for t in trained] == [r for row in result["per_task"] for r in row["rollout_ids"]]
    for b, t in zip(base, trained, strict=True):
        assert b.task == t.task and _calls(b) == _calls(t) and len(t.llm_calls) == 3
    assert result["base"]["policies"]["lead"] == result["base"]["policies"]["crew"] == "tiny"
    assert result["trained"]["policies"]["lead"] == str(trained_policies(same)["lead"])
    for key in ("reward/mean", *(f"reward/role/{r}" for r in ROLES)):
        f = result["paired"][key]
        assert f["difference"] == 0 and f["std_error"] == 0 and f["ci95"] == [0, 0] and f["tasks"] == len(TASKS), key

    # the seed is what made them alike: eval alone with it draws the same again, another seed other tokens
    again = evaluate(APP, TASKS, run_dir=same, n=2, seed=3, temperature=1.0)
    evaluate(APP, TASKS, run_dir=same, n=2, seed=4, temperature=1.0)
    assert list(map(_calls, sides[2])) == list(map(_calls, trained)) and again["reward/mean"] == result["trained"]["reward/mean"]
    assert sum(_calls(a) != _calls(b) for a, b in zip(sides[3], trained, strict=True)) >= len(trained) // 2


def test_compare_trained_side_runs_the_runs_weights_and_pairs_each_tasks_rewards(run, tmp_path, monkeypatch):
    other = _with_tiny_weights(run, tmp_path / "other", seed=run_config(run).seed + 1)
    sides = _sides(monkeypatch)
    result = compare(APP, TASKS, run_dir=other, n=2, temperature=1.0)
    base, trained = sides
    # other weights, other answers to the first prompt of each rollout, which both sides saw alike
    assert all(b.llm_calls[0].prompt_ids == t.llm_calls[0].prompt_ids for b, t in zip(base, trained, strict=True))
    assert sum(b.llm_calls[0].response_ids != t.llm_calls[0].response_ids for b, t in zip(base, trained, strict=True)) >= 6

    # each task's rewards, from its trajectories by hand
    for side, trajs in (("base", base), ("trained", trained)):
        for i, row in enumerate(result["per_task"]):
            mine = trajs[2 * i:2 * i + 2]
            assert row[side]["reward/mean"] == statistics.fmean(
                rollout_reward(t.rewards.trajectory, t.rewards.turns.values(), is_dropped(t)) for t in mine)
            for role in ROLES:
                turns = [t.rewards.turns[c.id] for t in mine for c in t.llm_calls if c.role == role]
                assert row[side][f"reward/role/{role}"] == pytest.approx(statistics.fmean(turns))
    # the paired figures, from the per-task rewards by hand
    for key in ("reward/mean", *(f"reward/role/{r}" for r in ROLES)):
        b = [row["base"][key] for row in result["per_task"]]
        t = [row["trained"][key] for row in result["per_task"]]
        d = [y - x for x, y in zip(b, t, strict=True)]
        f = result["paired"][key]
        assert f["tasks"] == 4 and f["base"] == pytest.approx(statistics.fmean(b)) and f["trained"] == pytest.approx(statistics.fmean(t))
        assert f["difference"] == pytest.approx(f["trained"] - f["base"]) == pytest.approx(statistics.fmean(d))
        assert f["std_error"] == pytest.approx(statistics.stdev(d) / math.sqrt(4))
        low, high = f["ci95"]
        assert min(d) <= low <= f["difference"] <= high <= max(d)
    # every rollout scored: the task means weigh like the side's own eval figure
    assert result["paired"]["reward/mean"]["base"] == pytest.approx(result["base"]["reward/mean"])
    assert result["paired"]["reward/mean"]["trained"] == pytest.approx(result["trained"]["reward/mean"])
    assert result["paired"]["reward/mean"]["std_error"] > 0
    assert evaluate_module.paired_figures(result["per_task"], seed=0) == result["paired"]  # the bootstrap is seeded


def test_paired_figures_need_a_task_scored_on_both_sides():
    per_task = [{"base": {"reward/mean": 0.5}, "trained": {"reward/mean": 0.75, "reward/role/a": 1.0}},
                {"base": {"reward/mean": 0.25, "reward/role/a": 0.0}, "trained": {}}]
    assert evaluate_module.paired_figures(per_task) == {
        "reward/mean": {"base": 0.5, "trained": 0.75, "difference": 0.25, "std_error": None, "ci95": None, "tasks": 1}}


def test_eval_compare_cli_prints_the_table_and_writes_the_json(run, tmp_path, capsys):
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(t) + "\n" for t in TASKS[:2]))
    out = tmp_path / "compare.json"
    assert main(["eval", APP, "--data", str(data), "--run", str(run), "--compare", "base", "--max-tokens", "6",
                 "--temperature", "0", "--output", str(out)]) == 0
    printed = capsys.readouterr()
    result = json.loads(printed.out)
    assert result == json.loads(out.read_text()) and result["tasks"] == 2 and set(result["paired"]) == {
        "reward/mean", *(f"reward/role/{r}" for r in ROLES)}
    assert "trained - base" in printed.err and "95% interval" in printed.err
    assert "overall" in printed.err and "role planner" in printed.err


@pytest.mark.parametrize(("args", "says"), [
    (["--compare", "base"], "compare='base' needs a run (eval --run RUN_DIR)"),
    (["--run", "{run}", "--compare", "best"], "compare='best' is not a comparison target: compare a run's trained policies with 'base'"),
    (["--run", "{tmp}", "--compare", "base"], "has no checkpoint; train it with `mas-trainer fit --output"),
])
def test_eval_compare_bad_input_is_one_line(run, tmp_path, capsys, args, says):
    args = [a.format(run=run, tmp=tmp_path) for a in args]
    assert main(["eval", APP, "--data", str(DATA), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mas-trainer eval: error: ") and says in err[0], err
