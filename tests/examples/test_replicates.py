"""examples/langgraph_apps/replicates.py: which runs are replicates of one command, and the
spread of their held-out scores over runs (the figures the example READMEs report)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

APPS = Path(__file__).resolve().parents[2] / "examples" / "langgraph_apps"
sys.path.insert(0, str(APPS))

import replicates  # noqa: E402


def make_run(path: Path, seed=0, steps=8, lr=2e-5, roles=None, walls=None) -> Path:
    path.mkdir(parents=True)
    config = {"seed": seed, "steps": steps, "save_every": steps, "learner": {"lr": lr, "seed": seed},
              "critic": {"seed": seed}, "reward": {"allocator": "broadcast"}}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "app.json").write_text(json.dumps({"roles": roles or {"answer": "answerer"}}))
    if walls:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in walls))
    return path


def test_replicates_differ_only_in_seed_and_step_count(tmp_path):
    a = make_run(tmp_path / "a", seed=0)
    b = make_run(tmp_path / "b", seed=1, steps=12)       # continued further: still the same command
    c = make_run(tmp_path / "c", seed=2, lr=3e-5)        # another learning rate: another command
    d = make_run(tmp_path / "d", seed=3, roles={"answer": "answerer", "rewrite": "rewriter"})  # another policy map
    e = make_run(tmp_path / "e", seed=4)
    # written before a key existed: equal to a run that has it at its default
    (e / "config.yaml").write_text("seed: 4\nsteps: 8\nlearner:\n  lr: 2.0e-05\nreward:\n  allocator: broadcast\n")
    (a / "config.yaml").write_text("seed: 0\nsteps: 8\nlearner:\n  lr: 2.0e-05\n  share_prompts: false\n"
                                   "reward:\n  allocator: broadcast\n")
    runs = [str(p) for p in (a, b, c, d, e)]
    assert replicates.group_replicates(runs) == [[runs[0], runs[1], runs[4]], [runs[2]], [runs[3]]]
    assert replicates.seed_of(b) == 1
    with pytest.raises(SystemExit, match="has no config.yaml"):
        replicates.command_key(tmp_path)


def test_spread_over_runs_before_after_and_gain_at_the_steps_all_runs_share(tmp_path):
    runs = [str(make_run(tmp_path / f"s{seed}", seed=seed, walls=[
        {"kind": "val", "step": 0, "time/eval_s": 60.0}, {"kind": "train", "step": 1, "time/step_s": 60.0 * (seed + 1)}]))
        for seed in range(3)]
    scores = {runs[0]: {0: {"F1": 0.1}, 8: {"F1": 0.4}},
              runs[1]: {0: {"F1": 0.2}, 8: {"F1": 0.2}, 12: {"F1": 0.9}},  # step 12 only this run has: not compared
              runs[2]: {0: {"F1": 0.0}, 8: {"F1": 0.6}}}
    [group] = replicates.summarise(scores, {r: replicates.wall_time(r) for r in runs})
    assert group["steps"] == [0, 8] and group["seeds"] == [0, 1, 2]
    f1 = group["scores"]["F1"]
    assert f1["before"] == pytest.approx({"n": 3, "mean": 0.1, "sd": 0.1, "min": 0.0, "max": 0.2})
    assert f1["after"]["mean"] == pytest.approx(0.4) and f1["after"]["sd"] == pytest.approx(0.2)  # sample sd
    assert f1["gain"]["min"] == pytest.approx(0.0) and f1["gain"]["max"] == pytest.approx(0.6)
    assert group["wall_min"] == pytest.approx({"n": 3, "mean": 3.0, "sd": 1.0, "min": 2.0, "max": 4.0})
    assert replicates.over_runs([0.5])["sd"] == 0.0
    with pytest.raises(SystemExit, match="share no held-out step"):
        replicates.summarise({runs[0]: {0: {"F1": 0.1}}, runs[1]: {8: {"F1": 0.2}}}, {})


def _val(answer, prediction, hops=1):
    return {"status": "ok", "task": {"answer": answer, "hops": hops}, "final_state": {"prediction": prediction}}


def test_search_report_summarises_seeds_of_one_command_and_plots_every_run(tmp_path):
    for seed, after in ((0, "Quellmoor"), (1, "Dunsmere"), (2, "Quellmoor")):
        run = make_run(tmp_path / f"broadcast-{seed}", seed=seed)
        (run / "trajectories").mkdir()
        for step, prediction in ((0, "born in Dunsmere"), (8, after)):
            (run / "trajectories" / f"step_{step:06d}_val.jsonl").write_text(
                json.dumps(_val("Quellmoor", prediction)) + "\n" + json.dumps(_val("teal", "teal", hops=2)) + "\n")
    out = tmp_path / "scores.json"
    r = subprocess.run([sys.executable, str(APPS / "agentic_search" / "report.py"),
                        *(str(tmp_path / f"broadcast-{s}") for s in range(3)), "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "(seeds 0, 1, 2; held-out step 0 -> 8)" in r.stdout
    # exact match per run: 0.5 -> 1.0, 0.5 -> 0.5, 0.5 -> 1.0
    assert "exact match: 0.500 (sd 0.000 over 3 runs, range 0.500-0.500) -> 0.833 (sd 0.289 over 3 runs, " \
           "range 0.500-1.000); gain +0.333" in r.stdout
    [group] = json.loads(out.read_text())["over runs"]
    assert group["scores"]["exact match"]["after"]["mean"] == pytest.approx(5 / 6)
    assert (tmp_path / "agentic_search_runs.png").stat().st_size > 1000


def _code_row(task_id, passed):
    return {"status": "ok", "task": {"task_id": task_id},
            "final_state": {"all_passed": passed, "attempts": [{"all_passed": passed}]}}


def test_code_gen_report_summarises_seeds_and_keeps_one_runs_json_as_it_was(tmp_path):
    runs = []
    for seed, after in ((0, [True, True]), (1, [True, False])):
        run = make_run(tmp_path / f"code_gen-{seed}", seed=seed)
        (run / "trajectories").mkdir()
        for step, passed in ((0, [False, True]), (3, after)):
            rows = [_code_row("easy/a", passed[0]), _code_row("easy/b", passed[1]), _code_row("HumanEval/53", passed[1])]
            (run / "trajectories" / f"step_{step:06d}_val.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        runs.append(str(run))
    report = APPS / "code_gen" / "report.py"
    r = subprocess.run([sys.executable, str(report), *runs, "--json", str(tmp_path / "all.json"),
                        "--runs-plot", str(tmp_path / "runs.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "held-out all-passed: 0.500 (sd 0.000 over 2 runs, range 0.500-0.500) -> 0.750 (sd 0.354 over 2 runs, " \
           "range 0.500-1.000); gain +0.250" in r.stdout
    summary = json.loads((tmp_path / "all.json").read_text())
    assert set(summary) == {*runs, "over runs"} and summary[runs[0]]["3"]["easy"]["score"]["mean"] == 1.0
    assert summary["over runs"][0]["scores"]["HumanEval pass@1"]["gain"]["mean"] == pytest.approx(-0.5)
    assert (tmp_path / "runs.png").stat().st_size > 1000
    one = subprocess.run([sys.executable, str(report), runs[0], "--json", str(tmp_path / "one.json")],
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and "over runs" not in one.stdout
    assert set(json.loads((tmp_path / "one.json").read_text())) == {"0", "3"}


def test_a_command_run_once_is_said_to_have_no_spread(capsys):
    one = {"runs": ["runs/a-0"], "seeds": [0], "steps": [0, 8], "scores": {"em": {
        k: replicates.over_runs([0.2]) for k in ("before", "after", "gain")}}}
    replicates.print_summary([one])
    out = capsys.readouterr().out
    assert "runs/a-0 is the only run of its command: no spread" in out and "sd 0.000" not in out
