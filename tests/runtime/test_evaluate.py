"""eval with base and trained policies; export as Hugging Face folders."""

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM

from mas_trainer.config import load_config
from mas_trainer.runtime.evaluate import evaluate, export
from mas_trainer.runtime.trainer import fit

ROOT = Path(__file__).resolve().parents[2]
APP = f"{ROOT / 'tests' / 'fixtures' / 'words_app.py'}:graph"
DATA = ROOT / "tests" / "fixtures" / "words.jsonl"
TASKS = [json.loads(line) for line in DATA.read_text().splitlines()]


def test_eval_base_vs_trained_and_export(tmp_path):
    run = tmp_path / "run"
    fit(APP, TASKS[:2], load_config(overrides=["runtime.backend=local", "steps=1", "rollout.tasks_per_step=2",
                                               "rollout.n=2", "rollout.max_tokens=12"]), run)
    base = evaluate(APP, TASKS[:3], max_tokens=12)
    trained = evaluate(APP, TASKS[:3], run_dir=run, max_tokens=12)
    assert base["policies"]["lead"] == base["policies"]["crew"] == "tiny"
    assert trained["policies"]["lead"].endswith("checkpoint/policies/lead")
    for result in (base, trained):
        assert result["rollouts"] == 3 and {"reward/role/planner", "reward/role/writer", "reward/role/critic"} <= set(result)

    out = export(run, tmp_path / "export")
    mapping = json.loads((out / "mas-trainer.json").read_text())
    assert mapping["roles"] == {"planner": "lead", "writer": "crew", "critic": "crew"}
    assert set(mapping["policies"]) == {"lead", "crew"}
    for policy in ("lead", "crew"):
        AutoModelForCausalLM.from_pretrained(out / policy)


def test_eval_cli_prints_json_and_rejects_a_non_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "eval", APP, "--data", str(DATA), "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["rollouts"] == len(TASKS)
    bad = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "eval", APP, "--data", str(DATA), "--run", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "has no checkpoint" in bad.stderr
