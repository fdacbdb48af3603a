"""`mas-trainer data` on hostile record folders: any line is survived and counted, a folder is
read only inside itself, and a newer writer's fields do not lose a record (issue 40)."""

import json
import os

import pytest

from mas_trainer.cli import main
from mas_trainer.errors import UserError
from mas_trainer.production import curate
from mas_trainer.production.curate import build_datasets, make_datasets, run_score
from mas_trainer.production.record import GraphRun, Recorder

from test_curate import add_run, call, lines, rid


def raw(rec_dir, *records):
    """Append lines as given (str: written as is) to the folder's first runs file."""
    with (rec_dir / "runs-0000.jsonl").open("a", encoding="utf-8", errors="surrogatepass") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def call_line(i, **update):
    return {"run_id": rid(i), "call": call(i).model_copy(update=update).model_dump(mode="json")}


def test_scores_at_the_float_limit_average_to_a_finite_score(tmp_path, capsys):
    rec = Recorder(tmp_path / "rec")
    add_run(rec, 1, {"q": 1}, [call(1)], feedback=[{"score": 1.7e308}, {"score": 1.7e308}])
    add_run(rec, 2, {"q": 2}, [call(2, out="b")], feedback=[{"score": -1.7e308}, {"score": 1.7e308}, {"score": 3.0}])
    with (tmp_path / "rec" / "feedback.jsonl").open("w") as f:  # the old place: plain objects, an integer past any float
        f.write(json.dumps({"run_id": rid(2), "score": 10**400}) + "\n")
    assert run_score([{"score": 1.7e308}, {"score": 1.7e308}]) == 1.7e308
    data = build_datasets([tmp_path / "rec"], val_fraction=0)
    assert [(line.run_id, line.score) for line in data.sft] == [(rid(1), 1.7e308), (rid(2), 1.0)]
    assert data.report.feedback_ignored == 1
    assert main(["data", str(tmp_path / "rec"), "--out", str(tmp_path / "ds"), "--val-fraction", "0"]) == 0
    assert lines(tmp_path / "ds" / "sft.jsonl")[0]["score"] == 1.7e308


def test_any_line_is_survived_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(curate, "MAX_LINE_BYTES", 250_000, raising=False)
    rec = Recorder(tmp_path)
    add_run(rec, 1, {"q": 1}, [call(1)], feedback=[{"score": 1}])
    raw(tmp_path,
        call_line(2, messages=[{"role": "user", "content": "\ud800"}]),  # a lone surrogate (json escapes it)
        {"run_id": rid(1), "graph": {"input": {"q": "\udfff"}}},
        call_line(3, output_text="\ud83d\ude00"),  # a pair is one character: kept
        b'{"run_id": "%s", "feedback": {"score": 1, "label": "\xed\xa0\x80"}}'.decode("utf-8", "surrogatepass"),  # as raw bytes
        call_line(4, messages=[{"role": "user", "content": "x" * 300_000}]),  # over the line limit
        '{"run_id": "%s", "graph": {"input": %s}}' % (rid(5), "[" * 300 + "]" * 300),  # past the line's depth
        '{"run_id": "%s", "graph": {"input": %s}}' % (rid(5), "[" * 100000 + "]" * 100000),  # past json's
        '{"run_id": "%s", "call": {"id": 1}}' % rid(6),  # JSON, not a record
        "", "[1, 2]", '{"run_id": "%s", "call": ' % rid(7))  # empty, JSON not a record, torn
    add_run(rec, 8, {"q": 8}, [call(8, out="after")], feedback=[{"score": 1}])  # lines after them are read
    raw(tmp_path, {"run_id": rid(3), "feedback": {"score": 1}})
    data = build_datasets([tmp_path], val_fraction=0)
    r = data.report
    assert r.lines_skipped == {"lone_surrogate": 2, "unreadable": 3, "too_large": 1, "too_deep": 2, "not_a_record": 2}
    assert [line.completion["content"] for line in data.sft] == ["a", "\U0001F600", "after"]
    assert data.tasks == [{"q": 1}, {"q": 8}] and r.runs_read == 3
    out = tmp_path.parent / f"{tmp_path.name}-out"
    make_datasets([tmp_path], out, val_fraction=0)
    assert lines(out / "sft.jsonl")[1]["completion"]["content"] == "\U0001F600"


def test_a_task_with_a_lone_surrogate_is_not_usable():
    with pytest.raises(ValueError, match="not_json"):
        curate.task_key({"q": "\ud800"})


def foreign(tmp_path):
    """A record file outside the folder, with a task of its own."""
    other = tmp_path / "elsewhere"
    Recorder(other)
    add_run(Recorder(other), 9, {"secret": "foreign"}, [call(9, out="foreign")], feedback=[{"score": 1}])
    return other / "runs-0000.jsonl"


def test_a_folder_is_read_only_inside_itself(tmp_path):
    outside = foreign(tmp_path)
    rec = Recorder(tmp_path / "rec")
    add_run(rec, 1, {"q": 1}, [call(1)], feedback=[{"score": 1}])
    os.symlink(outside, tmp_path / "rec" / "runs-0001.jsonl")  # a link out of the folder
    os.symlink("runs-0000.jsonl", tmp_path / "rec" / "runs-0002.jsonl")  # a link inside it: not followed either
    (tmp_path / "elsewhere" / "feedback.jsonl").write_text(json.dumps({"run_id": rid(1), "score": 0}) + "\n")
    os.symlink(tmp_path / "elsewhere" / "feedback.jsonl", tmp_path / "rec" / "feedback.jsonl")
    data = build_datasets([tmp_path / "rec"], val_fraction=0)
    assert data.tasks == [{"q": 1}] and [line.completion["content"] for line in data.sft] == ["a"]
    assert data.report.files_skipped == {"symlink": 3} and data.report.runs_read == 1


def test_a_file_that_is_not_regular_is_not_waited_on(tmp_path):
    rec = Recorder(tmp_path)
    add_run(rec, 1, {"q": 1}, [call(1)], feedback=[{"score": 1}])
    os.mkfifo(tmp_path / "runs-0001.jsonl")  # nothing ever writes it: opening it to read would wait forever
    os.mkdir(tmp_path / "runs-0002.jsonl")
    data = build_datasets([tmp_path], val_fraction=0)
    assert data.report.files_skipped == {"not_regular": 2} and data.tasks == [{"q": 1}]


def test_a_folder_of_links_only_holds_no_runs(tmp_path, capsys):
    (tmp_path / "rec").mkdir()
    os.symlink(foreign(tmp_path), tmp_path / "rec" / "runs-0000.jsonl")
    with pytest.raises(UserError, match="holds no runs-NNNN.jsonl files"):
        build_datasets([tmp_path / "rec"])
    assert main(["data", str(tmp_path / "rec"), "--out", str(tmp_path / "ds")]) == 2
    assert "holds no runs-NNNN.jsonl files" in capsys.readouterr().err and not (tmp_path / "ds").exists()


def test_fields_a_newer_writer_adds_are_ignored_and_counted(tmp_path):
    rec = Recorder(tmp_path)
    rec.record(rid(1), call(1))
    line = call_line(2, output_text="b")
    line["call"]["reasoning_tokens"] = 7
    raw(tmp_path, line,
        {"run_id": rid(2), "graph": {"input": {"q": 2}, "tenant": "t1"}},
        {"run_id": rid(2), "feedback": {"score": 1, "source": "thumbs"}},
        {"run_id": rid(1), "feedback": {"score": 1}, "written_by": "v2"},  # beside the record: as before, ignored, not counted
        {"run_id": rid(3), "call": {**call(3).model_dump(mode="json"), "role": None}},  # really malformed
        {"run_id": rid(3), "feedback": {"score": "high"}})
    rec.record_graph(GraphRun(run_id=rid(1), input={"q": 1}))
    data = build_datasets([tmp_path], val_fraction=0)
    assert data.tasks == [{"q": 1}, {"q": 2}] and [line.run_id for line in data.sft] == [rid(1), rid(2)]
    assert data.report.records_unknown_fields == 3 and data.report.lines_skipped == {"not_a_record": 2}


def test_the_data_command_says_what_it_skipped(tmp_path, capsys):
    rec = Recorder(tmp_path / "rec")
    add_run(rec, 1, {"q": 1}, [call(1)], feedback=[{"score": 1}])
    raw(tmp_path / "rec", "[1, 2]", '{"run_id": "%s", "call": ' % rid(7))  # JSON that is not a record; a torn line
    assert main(["data", str(tmp_path / "rec"), "--out", str(tmp_path / "ds"), "--val-fraction", "0"]) == 0
    said = capsys.readouterr().out
    assert "skipped: 2 lines (not_a_record 1, unreadable 1), 0 files (none); 0 records" in said, said
    clean = Recorder(tmp_path / "clean")
    add_run(clean, 1, {"q": 1}, [call(1)], feedback=[{"score": 1}])
    assert main(["data", str(tmp_path / "clean"), "--out", str(tmp_path / "ds2"), "--val-fraction", "0"]) == 0
    assert "skipped:" not in capsys.readouterr().out  # said only when something was
