"""`mas-trainer data` streams: the same datasets as the in-memory way of reading every run
first, with memory that goes with what is written, not with what is read (issue 40)."""

import hashlib
import json
import tracemalloc

import pytest

from mas_trainer.production import curate
from mas_trainer.production.curate import build_datasets, call_labels, call_score, is_val, make_datasets, task_key
from mas_trainer.production.record import GraphRun, Recorder, read_runs

from test_curate import call, lines, rid


def reference(folders, *, min_score=None, label=None, val_fraction=0.1, seed=0, roles=()):
    """The datasets as `data` chose them before it streamed: every run in memory, in run order."""
    min_score = 1.0 if min_score is None and label is None else min_score
    tasks, val, sft, seen_runs, seen_tasks, seen_examples = [], [], [], set(), set(), set()
    dropped, counts = {}, dict.fromkeys(["runs_read", "calls_read", "runs_duplicate_id", "runs_without_task", "tasks_duplicate",
                                         "runs_train", "runs_val", "feedback_ignored", "sft_runs"], 0)

    def drop(why, n=1):
        dropped[why] = dropped.get(why, 0) + n

    for folder in dict.fromkeys(folders):
        for traj, feedback in read_runs(folder):
            counts["runs_read"] += 1
            counts["calls_read"] += len(traj.llm_calls)
            if traj.rollout_id in seen_runs:
                counts["runs_duplicate_id"] += 1
                drop("duplicate_run", len(traj.llm_calls))
                continue
            seen_runs.add(traj.rollout_id)
            ids = {c.id for c in traj.llm_calls}
            counts["feedback_ignored"] += sum(fb.get("turn") is not None and fb["turn"].removeprefix("chatcmpl-") not in ids
                                              for fb in feedback)
            held_out = False
            if not traj.task or traj.task == {"input": None}:
                counts["runs_without_task"] += 1
            else:
                key = task_key(traj.task)
                held_out = is_val(key, val_fraction, seed)
                if key in seen_tasks:
                    counts["tasks_duplicate"] += 1
                else:
                    seen_tasks.add(key)
                    (val if held_out else tasks).append(traj.task)
            if held_out:
                counts["runs_val"] += 1
                drop("val_task", len(traj.llm_calls))
                continue
            counts["runs_train"] += 1
            before = len(sft)
            for c in traj.llm_calls:
                score = call_score(feedback, c.id)
                why = ("run_not_ok" if traj.status != "ok" else "role_not_selected" if roles and c.role not in roles
                       else "truncated" if c.finish_reason == "length"
                       else "no_score" if min_score is not None and score is None
                       else "below_min_score" if min_score is not None and score < min_score
                       else "no_label" if label is not None and label not in call_labels(feedback, c.id) else None)
                example = json.dumps([c.policy, c.messages, {"role": "assistant", "content": c.output_text,
                                                             "tool_calls": c.tool_calls}], sort_keys=True)
                if why is None and hashlib.sha256(example.encode()).digest() in seen_examples:
                    why = "duplicate"
                if why is not None:
                    drop(why)
                    continue
                seen_examples.add(hashlib.sha256(example.encode()).digest())
                sft.append(curate._sft_line(c, traj.rollout_id, score).model_dump())
            counts["sft_runs"] += len(sft) > before
    return tasks, val, sft, {**counts, "calls_dropped": dropped, "tasks_train": len(tasks), "tasks_val": len(val)}


def fixture(tmp_path):
    """Two folders: runs interleaved and split over small rotated files, repeated tasks and
    examples (a later-started run records its copy first), run and turn feedback, labels, an
    errored run, a truncated call, feedback where earlier builds kept it, a run id in both folders."""
    a = Recorder(tmp_path / "a", file_mb=0.002)
    order = [(1, 1), (2, 2), (1, 3), (3, 4), (2, 5), (4, 6), (3, 7), (5, 8), (1, 9), (6, 10), (7, 11), (6, 12), (8, 13)]
    texts = {4: "shared", 5: "shared", 7: "x", 11: "z"}  # call 4 (run 3) repeats what call 5 (run 2, started first) says
    for run, i in order:
        role = "critic" if i % 3 == 0 else "lead"
        c = call(i, role=role, text=texts.get(i, f"t{i}"), out="same" if i in (4, 5) else f"o{i}",
                 finish="length" if i == 9 else "stop")
        assert a.record(rid(run), c)
    for run, task in [(1, {"q": 1}), (2, {"q": 2}), (3, {"q": 1, "k": [1]}), (4, {"k": [1], "q": 1}), (5, "bare"),
                      (6, {"q": 6}), (8, {"q": 8})]:
        assert a.record_graph(GraphRun(run_id=rid(run), input=task, status="error" if run == 8 else "ok")) is None
    fb = [(1, {"score": 1.0}), (2, {"score": 1.0}), (2, {"score": 0.0, "turn": call(5).id}), (3, {"score": 1.0}),
          (4, {"score": 0.5}), (4, {"score": 1.0}), (5, {"label": "good"}), (6, {"score": 1.0, "label": "good"}),
          (6, {"label": "bad", "turn": "chatcmpl-" + call(12).id}), (7, {"score": 0.75}), (8, {"score": 1.0})]
    for run, given in fb:
        with (tmp_path / "a" / "runs-0000.jsonl").open("a") as f:  # as the recorder writes it, whatever its bounds
            f.write(json.dumps({"run_id": rid(run), "feedback": given}) + "\n")
    (tmp_path / "a" / "feedback.jsonl").write_text(json.dumps({"run_id": rid(7), "score": 1.0, "turn": "nope"}) + "\n")
    b = Recorder(tmp_path / "b")
    for run, i in [(3, 20), (9, 21), (10, 22), (9, 23)]:
        assert b.record(rid(run), call(i, text=f"b{i}", out=f"b{i}"))
    for run, task in [(9, {"q": 2}), (10, {"q": 10})]:
        assert b.record_graph(GraphRun(run_id=rid(run), input=task)) is None
    with (tmp_path / "b" / "runs-0000.jsonl").open("a") as f:
        for run in (3, 9, 10):
            f.write(json.dumps({"run_id": rid(run), "feedback": {"score": 1.0, "label": "good"}}) + "\n")
    assert len(list((tmp_path / "a").glob("runs-*.jsonl"))) >= 3  # rotated: runs span files
    return [tmp_path / "a", tmp_path / "b"]


@pytest.mark.parametrize("options", [{}, {"min_score": 0.7}, {"label": "good"}, {"label": "good", "min_score": 0.5},
                                     {"min_score": 0.0, "roles": ["critic"]}, {"val_fraction": 0.4, "seed": 3},
                                     {"val_fraction": 0.0, "min_score": 0.0}])
def test_streaming_gives_what_reading_every_run_first_gave(tmp_path, options):
    folders = fixture(tmp_path)
    tasks, val, sft, counts = reference(folders, **options)
    data = build_datasets(folders, **options)
    assert (data.tasks, data.val, [line.model_dump() for line in data.sft]) == (tasks, val, sft)
    assert {k: getattr(data.report, k) for k in counts} == counts
    assert data.report.calls_read == data.report.sft_lines + sum(data.report.calls_dropped.values())
    written = make_datasets(folders, tmp_path / "out", **options)
    assert written.report == data.report
    assert (lines(tmp_path / "out" / "tasks.jsonl"), lines(tmp_path / "out" / "val.jsonl")) == (tasks, val)
    assert [line.to_json() for line in data.sft] == (tmp_path / "out" / "sft.jsonl").read_text().splitlines()


def test_the_fixture_covers_what_ordering_decides(tmp_path):
    data = build_datasets(fixture(tmp_path), min_score=0.0, val_fraction=0)
    shared = [line.run_id for line in data.sft if line.messages[0]["content"] == "shared"]
    assert shared == [rid(2)]  # run 2 started first, though run 3 recorded the example first
    r = data.report
    assert r.runs_duplicate_id == 1 and r.tasks_duplicate == 2 and r.feedback_ignored == 1 and r.calls_dropped["truncated"] == 1


def test_memory_goes_with_the_output_not_the_input(tmp_path):
    """Runs of about 10 KB, none kept (no feedback): reading them holds a few hundred bytes per
    run, where holding every run first took about ten times the input."""
    folder = tmp_path / "rec"
    folder.mkdir()
    with (folder / "runs-0000.jsonl").open("w") as f:
        for i in range(400):
            c = call(i, text=f"{i} " + "lorem ipsum " * 800, out="o" * 100)
            f.write(json.dumps({"run_id": rid(i), "call": c.model_dump(mode="json")}) + "\n")
            f.write(json.dumps({"run_id": rid(i), "graph": {"input": {"q": i}}}) + "\n")
    size = (folder / "runs-0000.jsonl").stat().st_size
    assert size > 3_000_000
    tracemalloc.start()
    try:
        written = make_datasets([folder], tmp_path / "out", val_fraction=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert written.report.calls_dropped == {"no_score": 400} and written.report.tasks_train == 400
    assert peak < size / 4, f"peak {peak / 1e6:.1f} MB for {size / 1e6:.1f} MB read"
