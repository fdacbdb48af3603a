"""eval with base and trained policies (as fit measured them); export as Hugging Face folders."""

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM

from mas_trainer.config import load_config
from mas_trainer.runtime import evaluate as evaluate_module
from mas_trainer.runtime.evaluate import evaluate
from mas_trainer.runtime.export import export
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


def test_fit_held_out_score_is_what_eval_measures_on_the_checkpoint(tmp_path, monkeypatch):
    """Greedy, on the engines the run's config describes (bf16 as fit's default, one row per
    batch so no batch-mate changes the rounding): eval --run reproduces fit's last held-out
    evaluation token for token, hence its rewards. The tiny model's greedy tokens hardly
    depend on the precision; their log-probs do, to the last bit: an fp32 engine fails this."""
    run = tmp_path / "run"
    cfg = load_config(overrides=["runtime.backend=local", "steps=1", "rollout.tasks_per_step=2", "rollout.n=2",
                                 "rollout.max_tokens=12", "rollout.val_temperature=0", "runtime.max_batch_size=1", "seed=5",
                                 # bf16 whatever the CPU (auto is off where bf16 is emulated): eval must follow the run
                                 "runtime.engine_bf16=true"])
    rows = fit(APP, TASKS[:4], cfg, run, val_tasks=TASKS[4:])
    held_out = [r for r in rows if r["kind"] == "val"][-1]
    assert held_out["step"] == 1

    scored = []
    assign = evaluate_module.assign_rewards
    monkeypatch.setattr(evaluate_module, "assign_rewards", lambda t, *a, **kw: scored.append(assign(t, *a, **kw)))
    result = evaluate(APP, TASKS[4:], run_dir=run, temperature=0)

    def responses(trajs):
        return sorted((t["task"]["question"], [(c["role"], c["response_ids"], c["response_logprobs"]) for c in t["llm_calls"]])
                      for t in trajs)

    fit_trajs = [json.loads(line) for line in (run / "trajectories" / "step_000001_val.jsonl").read_text().splitlines()]
    assert responses(fit_trajs) == responses(json.loads(t.to_json()) for t in scored)
    for key in ("reward/mean", "reward/role/planner", "reward/role/writer", "reward/role/critic", "tokens/response"):
        assert result[key] == held_out[key], key


def test_eval_cli_prints_json_and_rejects_a_non_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "eval", APP, "--data", str(DATA), "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["rollouts"] == len(TASKS)
    bad = subprocess.run([sys.executable, "-m", "mas_trainer.cli", "eval", APP, "--data", str(DATA), "--run", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "has no checkpoint" in bad.stderr
