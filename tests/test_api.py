"""The Python API is what the CLI verbs call: fit, evaluate and export from a script."""

import json
import re
from pathlib import Path

import pytest
from rich.console import Console

import mas_trainer
from mas_trainer import api
from mas_trainer.cli import main
from mas_trainer.config import ConfigError
from mas_trainer.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
APP = f"{ROOT / 'tests' / 'fixtures' / 'words_app.py'}:single"
TASKS = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "words.jsonl").read_text().splitlines()]
QUICK = {"steps": 1, "rollout.tasks_per_step": 2, "rollout.n": 2, "runtime.execution": "local", "logger": ["console"],
         "rollout.max_tokens": 8, "val_fraction": 0.25}


def test_fit_evaluate_and_export_from_a_script(tmp_path):
    out = tmp_path / "run"
    console = Console(record=True, width=200)
    run = mas_trainer.fit(APP, TASKS, output=out, overrides=QUICK, console=console)
    assert isinstance(run, mas_trainer.FitResult) and run.output == out
    assert [r["step"] for r in run.train] == [1] and [r["step"] for r in run.held_out] == [0, 1]
    assert list(run.policies) == ["solo"] and (run.policies["solo"] / "config.json").is_file()
    text = console.export_text()
    # it says what it is doing from its first second, before the first step line
    phases = [line for line in text.splitlines() if line.startswith("fit [")]
    assert [p.split("]: ", 1)[1].split(" ")[0:2] for p in phases] == [["loading", "the"], ["rollouts", "run"],
                                                                      ["checking", "the"], ["starting", "the"],
                                                                      ["held-out", "evaluation"]]
    assert re.search(r"rollouts run with recursion limit \d+ \(LangGraph's default\)", text)  # the app binds none
    assert text.index(phases[-1]) < text.index("step 1/1")
    scores = mas_trainer.evaluate(APP, TASKS[:2], run=out)
    assert scores["rollouts"] == 2 and scores["policies"]["solo"] == str(run.policies["solo"])
    exported = mas_trainer.export(out, tmp_path / "exported")
    assert (exported / "solo" / "config.json").is_file()


def test_fit_config_takes_a_file_a_mapping_or_key_value_strings(tmp_path):
    (tmp_path / "fit.yaml").write_text("steps: 7\nlearner:\n  lr: 0.001\n")
    assert api.fit_config(tmp_path / "fit.yaml", {"learner.lr": 0.5}).learner.lr == 0.5
    assert api.fit_config(tmp_path / "fit.yaml", ["steps=9"]).steps == 9
    cfg = api.fit_config({"steps": 3, "learner": {"lr": 0.25}}, {"rollout.n": 2}, model="tiny")
    assert (cfg.steps, cfg.learner.lr, cfg.rollout.n, cfg.model) == (3, 0.25, 2, "tiny")
    assert api.fit_config(cfg) is cfg and api.fit_config(cfg, {"steps": 4}).steps == 4
    with pytest.raises(ConfigError, match=r"unknown config key 'learner.lrr'; did you mean 'lr'"):
        api.fit_config(None, {"learner.lrr": 1})
    with pytest.raises(UserError, match="^data: task 2 is a str, not a dict$"):
        api.fit(APP, [{"question": "q"}, "not a task"], output=tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_the_cli_verb_is_the_api_call(tmp_path, monkeypatch):
    seen = {}

    def fake_fit(app, data, **kw):
        seen.update(app=app, data=data, **kw)
        return api.FitResult(Path(kw["output"]), [])

    monkeypatch.setattr(api, "fit", fake_fit)
    rc = main(["fit", APP, "--data", "tasks.jsonl", "--output", str(tmp_path / "r"), "--model", "tiny", "steps=2", "learner.lr=0.5"])
    assert rc == 0
    assert seen["app"] == APP and seen["data"] == "tasks.jsonl" and seen["output"] == str(tmp_path / "r")
    assert (seen["config"].steps, seen["config"].learner.lr, seen["config"].model) == (2, 0.5, "tiny")
    assert isinstance(seen["started_at"], float)


def test_trace_runs_and_scores_rollouts_without_training(tmp_path):
    out = tmp_path / "traj.jsonl"
    result = api.trace(APP, TASKS[:2], n=2, output=out, max_tokens=8)
    assert len(result.trajectories) == 4 and result.has_rewards and result.scored and result.failed is None
    assert all(t.status == "ok" and t.rewards.trajectory is not None for t in result.trajectories)
    assert [json.loads(line)["rollout_id"] for line in out.read_text().splitlines()] == [t.rollout_id for t in result.trajectories]
    unscored = api.trace(APP, TASKS[:1], rewards=False, max_tokens=8)
    assert not unscored.scored and unscored.output is None and unscored.trajectories[0].rewards.trajectory is None


def test_a_reward_that_raises_is_reported_per_rollout_not_raised(tmp_path):
    app = tmp_path / "broken.py"
    app.write_text("import sys\nsys.path.insert(0, %r)\nfrom words_app import _single\n\n"
                   "def bad(task, state, traj):\n    raise ValueError('no answer key')\n\ngraph = _single(bad)\n"
                   % str(ROOT / "tests" / "fixtures"))
    result = api.trace(f"{app}:graph", TASKS[:1], n=2, max_tokens=8)
    assert result.has_rewards and len(result.reward_errors) == 2 and result.failed is None
    assert f"{app}:6" in str(result.reward_errors[0]) and "no answer key" in str(result.reward_errors[0])


def test_every_cli_verb_calls_the_api(tmp_path, monkeypatch):
    seen: dict[str, dict] = {}

    def record(name, value=None):
        def fake(*args, **kw):
            seen[name] = {"args": args, **kw}
            return value
        return fake

    monkeypatch.setattr(api, "evaluate", record("evaluate", {"reward/mean": 0.5, "rollouts": 1}))
    monkeypatch.setattr(api, "export", record("export", tmp_path / "x"))
    monkeypatch.setattr(api, "serve", record("serve"))
    monkeypatch.setattr(api, "view", record("view"))
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps(TASKS[0]) + "\n")
    assert main(["eval", APP, "--data", str(data), "--run", "r", "--n", "3"]) == 0
    assert seen["evaluate"]["args"][0] == APP and seen["evaluate"]["run"] == "r" and seen["evaluate"]["n"] == 3
    assert main(["export", "r", str(tmp_path / "x")]) == 0 and seen["export"]["args"] == ("r", str(tmp_path / "x"))
    assert main(["serve", "r", "--port", "9", "--route", "gpt=solo"]) == 0
    assert seen["serve"]["args"] == ("r",) and seen["serve"]["port"] == 9 and seen["serve"]["routes"] == {"gpt": "solo"}
    assert main(["view", "r", "--port", "7"]) == 0 and seen["view"]["port"] == 7 and seen["view"]["html"] is None


def test_the_api_runs_inside_a_running_event_loop(tmp_path):
    """A notebook (Jupyter) runs its cells inside an event loop: trace, evaluate and fit run
    there as they do from a script (here: inside asyncio.run)."""
    import asyncio

    async def in_a_notebook():
        traced = api.trace(APP, TASKS[:2], n=2, max_tokens=8)
        run = mas_trainer.fit(APP, TASKS, output=tmp_path / "run", overrides={**QUICK, "val_fraction": 0}, console=Console(file=None, quiet=True))
        scores = mas_trainer.evaluate(APP, TASKS[:2], run=run.output, max_tokens=8)
        return traced, run, scores

    traced, run, scores = asyncio.run(in_a_notebook())
    assert len(traced.trajectories) == 4 and traced.scored and all(t.status == "ok" for t in traced.trajectories)
    assert [r["step"] for r in run.train] == [1] and list(run.policies) == ["solo"]
    assert scores["rollouts"] == 2 and scores["policies"]["solo"] == str(run.policies["solo"])
    # and from a script again afterwards, on the same rollout loop
    again = api.trace(APP, TASKS[:1], max_tokens=8)
    assert [t.status for t in again.trajectories] == ["ok"]


def test_the_api_prints_no_third_party_progress_bars(tmp_path, capfd, monkeypatch):
    """fit and evaluate from Python keep transformers' and the hub's progress bars (loading
    weights, writing shards) off stderr, as the CLI does: not only when `main` ran first."""
    import huggingface_hub.utils
    import transformers

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    transformers.utils.logging.enable_progress_bar()  # as in a fresh process (an earlier test may have turned them off)
    huggingface_hub.utils.enable_progress_bars()
    run = mas_trainer.fit(APP, TASKS, output=tmp_path / "run", overrides={**QUICK, "val_fraction": 0},
                          console=Console(file=None, quiet=True))
    mas_trainer.evaluate(APP, TASKS[:1], run=run.output, max_tokens=8)
    err = capfd.readouterr().err
    for bar in ("Loading weights", "Writing model shards", "it/s]", "%|"):
        assert bar not in err, err[-2000:]
