"""The tiny model learns a reward it can reach within a minute: answer in plain lowercase words."""

import statistics
from pathlib import Path

from mas_trainer.config import load_config
from mas_trainer.loop.trainer import fit

ROOT = Path(__file__).resolve().parents[2]
APP = f"{ROOT / 'tests' / 'fixtures' / 'words_app.py'}:single"
TASKS = [{"question": q} for q in ("Name a fruit.", "Name a color.", "Say hello.", "Name an animal.",
                                   "Describe the sea.", "Name a tool.", "Say yes.", "Name a city.")]


def test_mean_reward_rises_clearly(tmp_path):
    cfg = load_config(overrides=["runtime.execution=local", "steps=24", "rollout.tasks_per_step=8", "rollout.n=4",
                                 "learner.lr=3e-2", "rollout.max_tokens=12", "save_every=100", "eval_every=100", "seed=1"])
    rows = [r for r in fit(APP, TASKS, cfg, tmp_path / "run") if r["kind"] == "train"]
    rewards = [r["reward/mean"] for r in rows]
    first, last = statistics.fmean(rewards[:4]), statistics.fmean(rewards[-4:])
    assert last > first + 0.2, rewards
