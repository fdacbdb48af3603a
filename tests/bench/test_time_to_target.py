"""bench/bench_time_to_target.py: its new command is the one docs/results/rag_qa.md and
scripts/demo.sh give, its baseline the one they gave before, and it scores a run folder as that
page's figures do."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _overrides(text: str) -> list[str]:
    """The key=value overrides of the first `mas-trainer fit` command in a shell text."""
    block = text[text.index("mas-trainer fit"):]
    block = block[: block.index("\n\n") if "\n\n" in block else len(block)].replace("\\\n", " ")
    command = block.splitlines()[0]
    return [w for w in command.split() if re.fullmatch(r"[a-z_.]+=[^\s]+", w)]


def test_the_new_command_is_the_demo_and_the_results_page_command(load_bench):
    bench = load_bench("bench_time_to_target")
    assert _overrides((ROOT / "scripts" / "demo.sh").read_text()) == bench.NEW
    assert _overrides((ROOT / "docs" / "results" / "rag_qa.md").read_text()) == bench.NEW
    assert bench.OLD != bench.NEW and "steps=55" in bench.OLD
    from mas_trainer.config import load_config

    for command in (bench.OLD, bench.NEW):  # both still valid configs
        load_config(overrides=command)


def test_runs_alternate_and_run_i_of_each_command_uses_seed_i(tmp_path, monkeypatch, load_bench):
    bench = load_bench("bench_time_to_target")
    calls = []
    monkeypatch.setattr(bench, "run", lambda out, args, extra: calls.append((out.name, args is bench.NEW, extra)))
    monkeypatch.setattr(bench, "analyze", lambda d, target: (_ for _ in ()).throw(SystemExit(0)))
    with pytest.raises(SystemExit):
        bench.main(["--old", "1", "--new", "2", "--out", str(tmp_path), "steps=3"])
    assert calls == [("old-0", False, ["seed=0", "steps=3"]), ("new-0", True, ["seed=0", "steps=3"]),
                     ("new-1", True, ["seed=1", "steps=3"])]
    calls.clear()
    with pytest.raises(SystemExit):  # a seed given on the command line holds for every run
        bench.main(["--old", "0", "--new", "2", "--out", str(tmp_path), "seed=7"])
    assert [c[2] for c in calls] == [["seed=7"], ["seed=7"]]
    calls.clear()
    with pytest.raises(SystemExit):  # adding seeds to an earlier measurement
        bench.main(["--old", "1", "--new", "2", "--first-seed", "1", "--out", str(tmp_path)])
    assert [(c[0], c[2]) for c in calls] == [("old-1", ["seed=1"]), ("new-1", ["seed=1"]), ("new-2", ["seed=2"])]


def test_time_to_target_is_the_wall_time_of_the_first_evaluation_at_target(tmp_path, load_bench):
    bench = load_bench("bench_time_to_target")
    run = tmp_path / "new-0"
    (run / "trajectories").mkdir(parents=True)
    answers = {0: ["no", "no"], 5: ["Oslo", "no"], 10: ["Oslo", "Lima"], 15: ["Oslo", "no"]}
    rows = []
    for step, preds in answers.items():
        lines = [json.dumps({"status": "ok", "task": {"answer": ref}, "final_state": {"prediction": p}})
                 for p, ref in zip(preds, ["Oslo", "Lima"])]
        (run / "trajectories" / f"step_{step:06d}_val.jsonl").write_text("\n".join(lines) + "\n")
        rows.append({"kind": "val", "step": step, "time/elapsed_s": 100.0 + 10 * step})
    rows.append({"kind": "train", "step": 15, "time/elapsed_s": 400.0})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = bench.analyze(run, 0.9)
    assert result["reached"] and result["reached_step"] == 10 and result["time_to_target_s"] == 200.0
    assert result["final_em"] == 0.5 and result["best_em"] == 1.0 and result["wall_s"] == 400.0
    never = bench.analyze(run, 1.01)
    assert not never["reached"] and never["time_to_target_s"] == 400.0  # counted as the whole run
