"""`mas-trainer data`: tasks, held-out tasks and SFT lines from record folders (mas_trainer/production/curate.py)."""

import json

import pytest

from mas_trainer.cli import main
from mas_trainer.production.curate import build_datasets, is_val, make_datasets, run_score, split_by_task, task_key
from mas_trainer.production.record import Feedback, GraphRun, Recorder
from mas_trainer.trace.schema import LLMCall


def rid(i):
    return f"{i:032x}"


def call(i, *, role="lead", node="planner", text="q", out="a", finish="stop", ids=True, tools=(), tool_calls=()):
    return LLMCall(id=f"{i:016x}", node_id=f"n{i}", node=node, role=role, policy=f"p-{role}",
                   messages=[{"role": "user", "content": text}], output_text=out, tool_calls=list(tool_calls), tools=list(tools),
                   prompt_ids=[1, 2] if ids else [], response_ids=[3] if ids else [], response_logprobs=[-0.1] if ids else [],
                   finish_reason=finish)


def add_run(rec, i, task, calls, *, status="ok", feedback=()):
    """Run `i` with its calls, its graph record (task None: none sent) and feedback dicts."""
    for c in calls:
        assert rec.record(rid(i), c)
    if task is not None:
        assert rec.record_graph(GraphRun(run_id=rid(i), input=task, status=status)) is None
    for fb in feedback:
        rec.feedback(Feedback(run_id=rid(i), **fb))


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tasks_are_deduplicated_and_runs_without_one_counted(tmp_path):
    rec = Recorder(tmp_path / "rec")
    add_run(rec, 1, {"a": 1, "b": [1, 2]}, [call(1)])
    add_run(rec, 2, {"b": [1, 2], "a": 1}, [call(2)])  # the same task, keys in another order
    add_run(rec, 3, None, [call(3)])  # the app sent no graph record
    add_run(rec, 4, {"q": "x"}, [call(4)], status="error")  # an errored run's input is still a task
    rec.record(rid(5), call(5))
    rec.record_graph(GraphRun(run_id=rid(5), output={"o": 1}))  # a graph record without an input
    add_run(rec, 6, "a bare string input", [call(6)])
    data = build_datasets([tmp_path / "rec"], val_fraction=0)
    assert data.tasks == [{"a": 1, "b": [1, 2]}, {"q": "x"}, {"input": "a bare string input"}] and data.val == []
    r = data.report
    assert (r.runs_read, r.runs_without_task, r.tasks_duplicate, r.tasks_train, r.tasks_val) == (6, 2, 1, 3, 0)
    assert task_key({"a": 1, "b": [1, 2]}) == task_key({"b": [1, 2], "a": 1}) != task_key({"a": 1.5, "b": [1, 2]})


def _scored_runs(rec, tasks, first=1):
    """Two runs per task, every call scored 1; returns run id -> task."""
    owner = {}
    for k, task in enumerate(tasks):
        for j in range(2):
            i = first + 2 * k + j
            add_run(rec, i, task, [call(i, text=f"{task} {j}")], feedback=[{"score": 1.0}])
            owner[rid(i)] = task
    return owner


def test_the_split_keeps_a_tasks_runs_on_one_side_and_is_deterministic(tmp_path):
    tasks = [{"question": f"q{k}"} for k in range(40)]
    owner = _scored_runs(Recorder(tmp_path / "a"), tasks[:20])
    owner |= _scored_runs(Recorder(tmp_path / "b"), tasks[20:], first=41)
    data = build_datasets([tmp_path / "a", tmp_path / "b"], val_fraction=0.3, seed=7)
    train, val = {task_key(t) for t in data.tasks}, {task_key(t) for t in data.val}
    assert not train & val and len(train | val) == 40 and 0 < len(val) < 40
    sft_tasks = {task_key(owner[line.run_id]) for line in data.sft}
    assert sft_tasks == train  # every train task's runs give lines, no held-out task's run does
    assert data.report.runs_val == 2 * len(val) and data.report.calls_dropped == {"val_task": 2 * len(val)}
    # the same sides in another folder order, and from the helper; another seed holds out others
    again = build_datasets([tmp_path / "b", tmp_path / "a"], val_fraction=0.3, seed=7)
    assert {task_key(t) for t in again.val} == val and {task_key(t) for t in again.tasks} == train
    assert {task_key(t) for t in split_by_task(reversed(tasks), 0.3, 7)[1]} == val
    other = build_datasets([tmp_path / "a", tmp_path / "b"], val_fraction=0.3, seed=8)
    assert {task_key(t) for t in other.val} != val
    assert all(is_val(k, 0.3, 7) for k in val) and not any(is_val(k, 0.0, 7) for k in train | val)


def test_score_rules_run_and_turn_feedback_labels_errors_and_truncation(tmp_path):
    rec = Recorder(tmp_path)
    add_run(rec, 1, None, [call(1, out="r1")], feedback=[{"score": 1.0}, {"score": 0.5}])  # run score 0.75
    add_run(rec, 2, None, [call(2, out="r2a"), call(3, out="r2b")],  # run 0, its second call 1 (chatcmpl- id)
            feedback=[{"score": 0.0}, {"score": 1.0, "turn": "chatcmpl-" + call(3).id}])
    add_run(rec, 3, None, [call(4, out="r3a"), call(5, out="r3b")],  # run 1, its first call 0
            feedback=[{"score": 1.0}, {"score": 0.0, "turn": call(4).id}])
    add_run(rec, 4, None, [call(6, out="r4")])  # no feedback
    add_run(rec, 5, {"t": 1}, [call(7, out="r5")], status="error", feedback=[{"score": 1.0}])
    add_run(rec, 6, None, [call(8, out="r6", finish="length"), call(9, out="r6b")], feedback=[{"score": 1.0}])
    add_run(rec, 7, None, [call(10, out="r7a"), call(11, out="r7b", role="critic")],  # labels: the call's own win
            feedback=[{"label": "good"}, {"label": "bad", "turn": call(10).id}])
    assert run_score([{"score": 1.0}, {"score": 0.5}, {"score": 0.0, "turn": "x"}, {"label": "good"}]) == 0.75

    def kept(**options):
        data = build_datasets([tmp_path], val_fraction=0, **options)
        assert data.report.calls_read == data.report.sft_lines + sum(data.report.calls_dropped.values())
        return {line.completion["content"]: line.score for line in data.sft}, data.report.calls_dropped

    out, dropped = kept()  # default: --min-score 1.0
    assert out == {"r2b": 1.0, "r3b": 1.0, "r6b": 1.0}
    assert dropped == {"below_min_score": 3, "no_score": 3, "run_not_ok": 1, "truncated": 1}
    assert kept(min_score=0.7)[0] == {"r1": 0.75, "r2b": 1.0, "r3b": 1.0, "r6b": 1.0}
    out, dropped = kept(label="good")
    assert out == {"r7b": None} and dropped["no_label"] == 8
    assert kept(label="good", min_score=0.0)[0] == {}  # both must hold: run 7 has no score
    assert kept(min_score=0.7, roles=["critic"])[0] == {}
    assert kept(label="good", roles=["critic"])[0] == {"r7b": None}


def test_the_sft_line_format(tmp_path):
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    tc = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"x\"}"}}
    rec = Recorder(tmp_path / "rec")
    add_run(rec, 1, {"q": "x"}, [call(1, out=None, tools=[tool], tool_calls=[tc]),
                                 call(2, node=None, text="imported", ids=False)], feedback=[{"score": 2}])
    make_datasets([tmp_path / "rec"], tmp_path / "out", val_fraction=0)
    assert (tmp_path / "out" / "sft.jsonl").read_text().splitlines()[0] == json.dumps(
        {"policy": "p-lead", "role": "lead", "node": "planner", "run_id": rid(1), "score": 2.0,
         "messages": [{"role": "user", "content": "q"}], "completion": {"role": "assistant", "content": None, "tool_calls": [tc]},
         "tools": [tool], "prompt_ids": [1, 2], "response_ids": [3]}, separators=(",", ":"))
    # a call without tools or token ids (an imported trace) omits those keys
    assert lines(tmp_path / "out" / "sft.jsonl")[1] == {
        "policy": "p-lead", "role": "lead", "node": None, "run_id": rid(1), "score": 2.0,
        "messages": [{"role": "user", "content": "imported"}], "completion": {"role": "assistant", "content": "a", "tool_calls": []}}
    assert lines(tmp_path / "out" / "tasks.jsonl") == [{"q": "x"}] and lines(tmp_path / "out" / "val.jsonl") == []


def test_identical_examples_once(tmp_path):
    rec = Recorder(tmp_path)
    add_run(rec, 1, {"q": 1}, [call(1), call(2, role="critic")], feedback=[{"score": 1}])
    add_run(rec, 2, {"q": 1}, [call(3), call(4, out="other")], feedback=[{"score": 1}])  # call 3 repeats call 1
    data = build_datasets([tmp_path], val_fraction=0)
    assert [(line.run_id, line.role, line.completion["content"]) for line in data.sft] == [
        (rid(1), "lead", "a"), (rid(1), "critic", "a"), (rid(2), "lead", "other")]
    assert data.report.calls_dropped == {"duplicate": 1} and data.report.sft_by_role == {"lead": 2, "critic": 1}
    assert data.report.sft_runs == 2 and data.report.tasks_duplicate == 1
    # the same folder twice is read once; a run id found in a second folder is counted, not doubled
    assert build_datasets([tmp_path, tmp_path], val_fraction=0).report.runs_read == 2
    other = Recorder(tmp_path.parent / "copy")
    add_run(other, 1, {"q": 1}, [call(1)], feedback=[{"score": 1}])
    twice = build_datasets([tmp_path, tmp_path.parent / "copy"], val_fraction=0).report
    assert twice.runs_duplicate_id == 1 and twice.calls_dropped == {"duplicate": 1, "duplicate_run": 1}


def test_cli_end_to_end(tmp_path, capsys):
    rec = Recorder(tmp_path / "rec")
    _scored_runs(rec, [{"question": f"q{k}"} for k in range(10)])
    add_run(rec, 99, None, [call(99, role="critic", text="z")], feedback=[{"label": "good"}])
    argv = ["data", str(tmp_path / "rec"), "--out", str(tmp_path / "ds"), "--val-fraction", "0.5", "--seed", "3"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "read 21 runs" in printed and "sft:" in printed and "wrote" in printed
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["report.json", "sft.jsonl", "tasks.jsonl", "val.jsonl"]
    report = json.loads((tmp_path / "ds" / "report.json").read_text())
    assert report["tasks_train"] + report["tasks_val"] == 10 and report["options"]["min_score"] == 1.0
    assert len(lines(tmp_path / "ds" / "val.jsonl")) == report["tasks_val"]
    assert len(lines(tmp_path / "ds" / "sft.jsonl")) == report["sft_lines"] == 2 * report["tasks_train"]
    # an existing dataset is kept unless --force; --force replaces the files and leaves no temporary folder
    assert main(argv) == 2 and "not empty" in capsys.readouterr().err
    assert main([*argv, "--force", "--label", "good", "--role", "critic"]) == 0
    assert [line["role"] for line in lines(tmp_path / "ds" / "sft.jsonl")] == ["critic"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "rec"]


@pytest.mark.parametrize("extra, message", [
    (["--min-score", "nan"], "--min-score nan: give a finite number"),
    (["--val-fraction", "1"], "--val-fraction 1.0: give a fraction"),
    (["--label", ""], "--label is empty"),
])
def test_bad_options_are_one_line(tmp_path, capsys, extra, message):
    Recorder(tmp_path / "rec").record(rid(1), call(1))
    assert main(["data", str(tmp_path / "rec"), "--out", str(tmp_path / "ds"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mas-trainer data: error: " + message) and err.count("\n") == 1
    assert not (tmp_path / "ds").exists()


def test_bad_folders_and_outputs_are_one_line(tmp_path, capsys):
    Recorder(tmp_path / "rec").record(rid(1), call(1))
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    cases = [([str(tmp_path / "missing")], tmp_path / "ds", "not found"),
             ([str(tmp_path / "empty")], tmp_path / "ds", "holds no runs-NNNN.jsonl"),
             ([str(tmp_path / "rec")], tmp_path / "rec", "inside record folder"),
             ([str(tmp_path / "rec")], tmp_path / "rec" / "ds", "inside record folder"),
             ([str(tmp_path / "rec")], tmp_path / "file", "is a file")]
    for folders, out, message in cases:
        assert main(["data", *folders, "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == ["runs-0000.jsonl"]


def test_crafted_lines_are_counted_not_fatal(tmp_path):
    rec = Recorder(tmp_path)
    add_run(rec, 1, {"q": 1}, [call(1)], feedback=[{"score": 1}])
    for i in (2, 3, 4, 5):
        rec.record(rid(i), call(i, out=f"r{i}"))
    rec.record_graph(GraphRun(run_id=rid(2), input={"x": json.loads("[" * 200 + "]" * 200)}))  # parses, too deep
    rec.record_graph(GraphRun(run_id=rid(3), input={"x": "y" * (1 << 20)}))  # over 1 MiB
    deep = {"role": "user", "content": json.loads("[" * 100 + "]" * 100)}
    rec.record(rid(6), call(6).model_copy(update={"messages": [deep]}))
    with (tmp_path / "runs-0000.jsonl").open("a") as f:
        f.write('{"run_id": "%s", "graph": {"input": {"x": NaN}}}\n' % rid(4))  # not plain JSON
        f.write('{"run_id": "%s", "graph": {"input": %s}}\n' % (rid(5), "[" * 100000 + "]" * 100000))  # json gives up
    with (tmp_path / "feedback.jsonl").open("a") as f:
        for i in (2, 3, 4, 5, 6):
            f.write(json.dumps({"run_id": rid(i), "score": 1}) + "\n")
        for bad in ({"score": "1"}, {"score": True}, {"score": float("nan")}, {"label": 5}, {"score": 1, "turn": ["x"]},
                    {"score": 1, "turn": "ffff"}):
            f.write(json.dumps({"run_id": rid(5), **bad}) + "\n")
    data = build_datasets([tmp_path], val_fraction=0)
    r = data.report
    assert r.runs_task_unusable == {"too_deep": 1, "too_large": 1, "not_json": 1}
    assert r.feedback_ignored == 6 and r.runs_without_task == 2  # run 5's graph line was unreadable
    assert r.lines_skipped == {"too_deep": 1}
    assert data.tasks == [{"q": 1}] and data.report.calls_dropped == {"task_unusable": 3, "unusable": 1}
    assert sorted(line.completion["content"] for line in data.sft) == ["a", "r5"]
    make_datasets([tmp_path], tmp_path.parent / "out")  # and it writes


def test_a_failed_write_leaves_no_dataset(tmp_path, monkeypatch):
    rec = Recorder(tmp_path / "rec")
    add_run(rec, 1, {"q": 1}, [call(1)], feedback=[{"score": 1}])
    (tmp_path / "empty").mkdir()
    make_datasets([tmp_path / "rec"], tmp_path / "empty", val_fraction=0)  # an empty folder is filled without --force
    assert lines(tmp_path / "empty" / "tasks.jsonl") == [{"q": 1}]

    def broken(fd):
        raise OSError("disk full")

    monkeypatch.setattr("mas_trainer.production.curate.os.fsync", broken)
    with pytest.raises(OSError, match="disk full"):
        make_datasets([tmp_path / "rec"], tmp_path / "new")
    with pytest.raises(OSError, match="disk full"):
        make_datasets([tmp_path / "rec"], tmp_path / "empty", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "rec"]  # no half dataset, no temporary folder
    assert lines(tmp_path / "empty" / "tasks.jsonl") == [{"q": 1}]  # the previous one is untouched
