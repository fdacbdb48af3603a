"""bench/bench_sharing.py: its modes are the RAG QA objects the README's table names, each run
is the previous main command (the one its README figures were measured with) on that object, and a run folder is scored as the README's figures are."""

from __future__ import annotations

import json
from pathlib import Path

from mas_trainer.adapters.langgraph import spec_of
from mas_trainer.apps import load_object

ROOT = Path(__file__).resolve().parents[2]


def test_each_mode_is_the_policy_map_it_claims(monkeypatch, load_bench):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-dummy-for-tests")  # the app builds its client at import, as fit lets it
    bench = load_bench("bench_sharing")
    specs = {mode: spec_of(load_object(f"{ROOT / bench.APP}:{obj}")) for mode, obj in bench.MODES.items()}
    assert set(specs["shared"].roles.values()) == {"qa"} and set(specs["shared"].roles) == {"rewrite", "answer"}
    assert specs["separate"].roles == {"rewrite": "rewriter", "answer": "answerer"}
    assert specs["answerer"].roles == {"answer": "answerer"} and specs["answerer"].frozen == {"rewrite"}


def test_every_mode_runs_the_previous_main_command_on_its_own_object(tmp_path, load_bench):
    bench = load_bench("bench_sharing")
    old = load_bench("bench_time_to_target")
    commands = {mode: bench.command(mode, tmp_path / f"{mode}-1", 1, ["steps=30"]) for mode in bench.MODES}
    for mode, cmd in commands.items():
        assert cmd[1] == "fit" and cmd[2].endswith(f"rag_qa/app.py:{bench.MODES[mode]}")
        # the same budget: the previous main command's overrides, then the seed, then the caller's (last one wins in fit)
        assert cmd[-len(old.OLD) - 2:] == [*old.OLD, "seed=1", "steps=30"]
    # between the object and the output folder (data, held-out data, model) all runs agree
    assert len({tuple(c[3:c.index("--output")]) for c in commands.values()}) == 1


def _run(folder: Path, answers: dict[int, list[str]], wall: float) -> None:
    (folder / "trajectories").mkdir(parents=True)
    rows = []
    for step, preds in answers.items():
        lines = [json.dumps({"status": "ok", "task": {"answer": ref}, "final_state": {"prediction": p}})
                 for p, ref in zip(preds, ["Oslo", "Lima"])]
        (folder / "trajectories" / f"step_{step:06d}_val.jsonl").write_text("\n".join(lines) + "\n")
        rows.append({"kind": "val", "step": step, "time/elapsed_s": 10.0 * (step + 1)})
    rows.append({"kind": "train", "step": max(answers), "time/elapsed_s": wall})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_runs_are_scored_and_grouped_by_mode(tmp_path, load_bench):
    bench = load_bench("bench_sharing")
    _run(tmp_path / "shared-0", {0: ["no", "no"], 10: ["Oslo", "Lima"]}, 300.0)
    _run(tmp_path / "shared-1", {0: ["no", "no"], 10: ["Oslo", "no"]}, 500.0)
    _run(tmp_path / "separate-0", {0: ["Oslo", "no"], 10: ["no", "no"]}, 700.0)
    results = [bench.analyze(tmp_path / d) for d in ("shared-0", "shared-1", "separate-0")]
    assert results[0]["before_em"] == 0.0 and results[0]["final_em"] == 1.0
    assert results[2]["before_em"] == 0.5 and results[2]["final_em"] == 0.0
    assert results[1]["steps_curve"] == [(0, 0.0, 0.0), (10, 0.5, 0.5)]
    summary = bench.summarise(results)
    assert set(summary) == {"shared", "separate"}
    assert summary["shared"]["runs"] == 2 and summary["shared"]["final_em_mean"] == 0.75
    assert (summary["shared"]["final_em_min"], summary["shared"]["final_em_max"]) == (0.5, 1.0)
    assert summary["shared"]["wall_s_mean"] == 400.0 and summary["separate"]["before_em_mean"] == 0.5
    assert bench.main(["--analyze", *(str(tmp_path / d) for d in ("shared-0", "separate-0"))]) == 0
    assert (tmp_path / "sharing.png").stat().st_size > 0
    assert json.loads((tmp_path / "sharing.json").read_text())["summary"]["separate"]["runs"] == 1


def test_overrides_may_follow_the_lists_of_modes_and_seeds(load_bench):
    args = load_bench("bench_sharing").parse(["--modes", "separate", "steps=30", "--seeds", "0", "1", "learner.lr=1e-5"])
    assert args.modes == ["separate"] and args.seeds == [0, 1] and args.extra == ["steps=30", "learner.lr=1e-5"]
    assert load_bench("bench_sharing").parse(["--out=runs/x", "steps=5"]).out == "runs/x"
