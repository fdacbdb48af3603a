"""bench/bench_overlap.py's figures from a run's metrics rows."""

import json


def test_the_summary_counts_wall_time_between_rows_and_splits_overlapped_steps(load_bench, tmp_path):
    bench = load_bench("bench_overlap")
    rows = [{"kind": "val", "step": 0, "time/elapsed_s": 10.0},
            {"kind": "train", "step": 1, "time/elapsed_s": 30.0, "time/step_s": 19.0, "time/rollout_s": 9.0,
             "time/update_s": 10.0, "rollout/overlapped": 0.0, "time/rollout_wait_s": 9.0},
            # overlapped: the step added 13 s by time/step_s, 14 s of wall time (writing and the plot count too)
            {"kind": "train", "step": 2, "time/elapsed_s": 44.0, "time/step_s": 13.0, "time/rollout_s": 12.0,
             "time/update_s": 10.0, "rollout/overlapped": 1.0, "time/rollout_wait_s": 3.0},
            {"kind": "train", "step": 3, "time/elapsed_s": 64.0, "time/step_s": 19.0, "time/rollout_s": 9.0,
             "time/update_s": 10.0, "rollout/overlapped": 0.0, "time/rollout_wait_s": 9.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = bench.summary(tmp_path, 1)
    assert s["wall_per_step_s"] == 17.0  # median of 14 and 20: step 1 warms up and is left out
    assert (s["step_s_overlapped"], s["step_s_plain"], s["rollout_wait_s"]) == (13.0, 19.0, 6.0)
    assert s["wall_s"] == 64.0
