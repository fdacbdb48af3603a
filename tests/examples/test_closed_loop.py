"""The closed loop from served runs back to training (examples/closed_loop/loop.py), end to end
on the tiny model: every step a user runs (serve --record, data, fit --warm-start, serve)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_loop_records_each_user_run_with_its_task_and_feedback_then_trains_and_serves(tmp_path):
    out = tmp_path / "loop"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "closed_loop" / "loop.py"), "--seed", "3", "--model", "tiny",
                           "--users", "4", "--heldout", "2", "--steps", "1", "--out", str(out),
                           "rollout.tasks_per_step=2", "rollout.n=2", "rollout.min_groups=1"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "seed_3" / "result.json").read_text())
    report = result["data"]
    # each user's graph invocation is one run of two calls, with its input (the task) and the user's score
    assert report["runs_read"] == 4 and report["calls_read"] == 8 and report["runs_without_task"] == 0
    tasks = [json.loads(line) for name in ("tasks.jsonl", "val.jsonl")
             for line in (out / "seed_3" / "data" / name).read_text().splitlines()]
    assert len(tasks) == 4 and all(set(t) == {"question", "answer"} for t in tasks)
    rows = [json.loads(line) for line in (out / "seed_3" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1]
    for key in ("heldout_f1_before", "heldout_f1_after", "users_f1"):
        assert 0.0 <= result[key] <= 1.0
