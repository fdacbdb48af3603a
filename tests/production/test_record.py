"""serve --record: what reaches disk (redacted, rotated, fsync'ed lines) and what feedback is refused."""

import json
import logging

import pytest

from mas_trainer.production.record import Feedback, GraphRun, Recorder, read_runs
from mas_trainer.trace.schema import LLMCall

SECRET = "alice@example.com"


def call(i, text="hi", node="planner"):
    return LLMCall(id=f"{i:016x}", node_id=f"n{i}", node=node, role="lead", policy="lead",
                   messages=[{"role": "user", "content": f"{text} {SECRET}"}], output_text=f"ok {SECRET}",
                   prompt_ids=[1, 2], response_ids=[3], response_logprobs=[-0.1], finish_reason="stop",
                   start_time=1.0, end_time=2.0)


def run_id(i):
    return f"{i:032x}"


def test_runs_and_feedback_read_back_and_survive_a_restart(tmp_path):
    rec = Recorder(tmp_path)
    assert rec.record(run_id(1), call(1)) and rec.record(run_id(1), call(2, node="writer"))
    assert rec.check(run_id(1), None) is None and rec.check(run_id(1), "chatcmpl-" + call(2).id) is None
    rec.feedback(Feedback(run_id=run_id(1), score=0.5, turn=call(2).id))
    again = Recorder(tmp_path)  # the index is rebuilt from the files
    assert again.check(run_id(1), call(1).id) is None
    assert "no recorded run" in again.check(run_id(2), None)
    assert "has no turn" in again.check(run_id(1), "ffff")
    assert "no recorded run" in again.check("../../etc/passwd", None)
    [(traj, fb)] = list(read_runs(tmp_path))
    assert traj.rollout_id == run_id(1) and [c.node for c in traj.llm_calls] == ["planner", "writer"]
    assert [n.name for n in traj.nodes] == ["planner", "writer"] and fb[0]["score"] == 0.5


def test_redaction_is_applied_before_the_disk_and_a_failing_hook_writes_nothing(tmp_path, caplog):
    rec = Recorder(tmp_path / "a", redact=lambda s: s.replace(SECRET, "[email]"))
    rec.record(run_id(1), call(1))
    text = "".join(p.read_text() for p in (tmp_path / "a").iterdir())
    assert SECRET not in text and "[email]" in text

    def broken(s):
        raise RuntimeError("no")

    rec = Recorder(tmp_path / "b", redact=broken)
    with caplog.at_level(logging.ERROR):
        assert not rec.record(run_id(1), call(1))
    assert "not recorded" in caplog.text
    assert all(p.stat().st_size == 0 for p in (tmp_path / "b").iterdir())
    assert "no recorded run" in rec.check(run_id(1), None)


def test_rotation_bounds_the_disk_and_forgets_rotated_runs(tmp_path):
    rec = Recorder(tmp_path, file_mb=1 / 1024, max_mb=3 / 1024)  # 1 KiB files, 3 KiB in all
    for i in range(1, 21):
        rec.record(run_id(i), call(i))
    files = sorted(tmp_path.glob("runs-*.jsonl"))
    assert len(files) >= 2 and sum(p.stat().st_size for p in files) <= 3 * 1024 + 1024
    assert all(p.stat().st_size <= 1024 for p in files)
    assert "rotated away" in rec.check(run_id(1), None)  # the oldest went
    assert rec.check(run_id(20), None) is None
    assert "rotated away" in Recorder(tmp_path, file_mb=1 / 1024, max_mb=3 / 1024).check(run_id(1), None)


def test_feedback_is_kept_with_the_runs_and_rotated_with_them(tmp_path):
    rec = Recorder(tmp_path, file_mb=1 / 1024, max_mb=4 / 1024)  # 1 KiB files, 4 KiB of runs, 1 KiB of feedback
    rec.record(run_id(1), call(1))
    assert rec.feedback(Feedback(run_id=run_id(1), score=1.0, comment="x" * 300)) is None
    [(_, feedback)] = list(read_runs(tmp_path))
    assert [fb["score"] for fb in feedback] == [1.0]
    for i in range(2, 41):  # no feedback file grows without bound: it goes with its run's file
        rec.record(run_id(i), call(i))
        assert rec.feedback(Feedback(run_id=run_id(i), label="good")) is None
    files = list(tmp_path.iterdir())
    assert all(p.name.startswith("runs-") for p in files) and sum(p.stat().st_size for p in files) <= 6 * 1024
    runs = {t.rollout_id: fb for t, fb in read_runs(tmp_path)}
    assert run_id(1) not in runs and runs[run_id(40)] == [{"label": "good", "run_id": run_id(40)}]


def test_a_torn_last_line_is_skipped(tmp_path, caplog):
    rec = Recorder(tmp_path)
    rec.record(run_id(1), call(1))
    with (tmp_path / "runs-0000.jsonl").open("a") as f:
        f.write('{"run_id": "' + run_id(2) + '", "call": {"id')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        assert [t.rollout_id for t, _ in read_runs(tmp_path)] == [run_id(1)]
        assert Recorder(tmp_path).check(run_id(1), None) is None
    assert "torn" in caplog.text


def test_lines_that_are_json_but_not_served_calls_are_skipped(tmp_path, caplog):
    """A crafted or foreign line in a records folder is read past, not trusted and not fatal."""
    rec = Recorder(tmp_path)
    rec.record(run_id(1), call(1))
    crafted = ['[1, 2]', '"text"', '{"call": {}}', '{"run_id": "../../etc/passwd", "call": ' + call(2).model_dump_json() + '}',
               '{"run_id": "' + run_id(3) + '", "call": {"id": 5}}']
    with (tmp_path / "runs-0000.jsonl").open("a") as f:
        f.write("\n".join(crafted) + "\n")
    (tmp_path / "feedback.jsonl").write_text('[1]\n{"score": 1}\n{"run_id": "' + run_id(1) + '", "score": 0.5}\n')
    with caplog.at_level(logging.WARNING):
        runs = list(read_runs(tmp_path))
    assert [(t.rollout_id, len(t.llm_calls), fb) for t, fb in runs] == [(run_id(1), 1, [{"run_id": run_id(1), "score": 0.5}])]
    assert caplog.text.count("not a served call") == len(crafted)


def test_feedback_wire_schema():
    with pytest.raises(ValueError, match="score or a label"):
        Feedback(run_id=run_id(1))
    for bad in ("../x", "A" * 32, run_id(1) + "0", "a" * 31):
        with pytest.raises(ValueError):
            Feedback(run_id=bad, score=1)
    with pytest.raises(ValueError):
        Feedback(run_id=run_id(1), label="x" * 201)
    with pytest.raises(ValueError):
        Feedback(run_id=run_id(1), score=float("nan"))
    assert json.loads(Feedback(run_id=run_id(1), label="good").model_dump_json(exclude_none=True)) == {
        "run_id": run_id(1), "label": "good"}


def test_a_runs_graph_record_is_kept_once_redacted_and_only_for_a_recorded_run(tmp_path):
    rec = Recorder(tmp_path, redact=lambda s: s.replace(SECRET, "[email]"))
    assert rec.record_graph(GraphRun(run_id=run_id(1), input={"q": "x"}))[0] == "unknown"
    rec.record(run_id(1), call(1))
    assert rec.record_graph(GraphRun(run_id=run_id(1), input={"q": f"mail {SECRET}"}, output={"a": 1})) is None
    assert rec.record_graph(GraphRun(run_id=run_id(1), input={"q": "again"}))[0] == "duplicate"
    assert Recorder(tmp_path).record_graph(GraphRun(run_id=run_id(1), input={}))[0] == "duplicate"  # after a restart too
    [(traj, _)] = list(read_runs(tmp_path))
    assert traj.task == {"q": "mail [email]"} and traj.final_state == {"a": 1} and traj.status == "ok"

    def broken(s):
        raise RuntimeError("no")

    rec = Recorder(tmp_path / "b")
    rec.record(run_id(2), call(2))
    rec.redact = broken
    assert rec.record_graph(GraphRun(run_id=run_id(2), input={"q": "x"}))[0] == "redaction"
    assert [t.task for t, _ in read_runs(tmp_path / "b")] == [{}]


def encoded(i, text):
    """A call whose token ids are its text's bytes, so what they decode to can be read back."""
    prompt, answer = f"{text} {SECRET}", f"ok {SECRET}"
    return LLMCall(id=f"{i:016x}", node_id=None, node=None, role="lead", policy="lead",
                   messages=[{"role": "user", "content": prompt}], output_text=answer,
                   tools=[{"type": "function", "function": {"name": "mail", "description": f"writes to {SECRET}"}}],
                   prompt_ids=list(prompt.encode()), response_ids=list(answer.encode()),
                   response_logprobs=[-0.1] * len(answer.encode()), finish_reason="stop")


def test_redaction_reaches_token_ids_and_tools(tmp_path):
    """Token ids of a call the hook changed would decode to what it removed: they are not kept
    (the warm start renders the redacted messages); a call it left alone keeps them."""
    rec = Recorder(tmp_path, redact=lambda s: s.replace(SECRET, "[email]"))
    assert rec.record(run_id(1), encoded(1, "mail")) and rec.record(run_id(2), call(2).model_copy(update={"messages": [
        {"role": "user", "content": "nothing to hide"}], "output_text": "fine"}))
    text = (tmp_path / "runs-0000.jsonl").read_text()
    assert SECRET not in text and "writes to [email]" in text
    runs = {t.rollout_id: t.llm_calls[0] for t, _ in read_runs(tmp_path)}
    changed, untouched = runs[run_id(1)], runs[run_id(2)]
    assert SECRET not in bytes(changed.prompt_ids + changed.response_ids).decode()
    assert (changed.prompt_ids, changed.response_ids, changed.response_logprobs) == ([], [], [])
    assert json.loads(text.splitlines()[0])["ids_dropped"] == "redacted"  # counted where it is kept
    assert (untouched.prompt_ids, untouched.response_ids) == ([1, 2], [3]) and "ids_dropped" not in text.splitlines()[1]


def test_feedback_texts_are_redacted(tmp_path):
    rec = Recorder(tmp_path, redact=lambda s: s.replace(SECRET, "[email]"))
    rec.record(run_id(1), call(1))
    assert rec.feedback(Feedback(run_id=run_id(1), label=f"from {SECRET}", comment=f"{SECRET} liked it")) is None
    text = (tmp_path / "runs-0000.jsonl").read_text()
    assert SECRET not in text and "from [email]" in text and "[email] liked it" in text

    def broken(s):
        raise RuntimeError("no")

    rec.redact = broken
    assert rec.feedback(Feedback(run_id=run_id(1), score=1.0, comment="x"))[0] == "redaction"
    assert rec.feedback(Feedback(run_id=run_id(1), score=1.0)) is None  # nothing to redact: no hook called


def test_a_record_after_a_torn_line_starts_on_a_fresh_one(tmp_path, monkeypatch):
    rec = Recorder(tmp_path)
    rec.record(run_id(1), call(1))
    with (tmp_path / "runs-0000.jsonl").open("a") as f:
        f.write('{"run_id": "' + run_id(2) + '", "call": {"id')  # killed mid-write
    rec = Recorder(tmp_path)  # the restart
    assert rec.record(run_id(3), call(3))
    assert [t.rollout_id for t, _ in read_runs(tmp_path)] == [run_id(1), run_id(3)]

    import mas_trainer.production.record as record

    def full_disk(path, text, mode="a"):  # half the line written, then the disk is full
        with path.open(mode) as f:
            f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(record, "write_synced", full_disk)
    with pytest.raises(OSError):
        rec.record(run_id(4), call(4))
    monkeypatch.undo()
    assert rec.record(run_id(5), call(5))  # the same server goes on
    assert [t.rollout_id for t, _ in read_runs(tmp_path)] == [run_id(1), run_id(3), run_id(5)]
    assert Recorder(tmp_path).check(run_id(5), None) is None


def test_a_feedback_flood_evicts_no_run(tmp_path):
    rec = Recorder(tmp_path, file_mb=4 / 1024, max_mb=16 / 1024)  # 4 KiB files, 16 KiB of runs
    for i in range(1, 11):
        rec.record(run_id(i), call(i))
    refused = [rec.feedback(Feedback(run_id=run_id(i % 10 + 1), score=1.0, comment="y" * 200)) for i in range(503)]
    assert sorted(t.rollout_id for t, _ in read_runs(tmp_path)) == [run_id(i) for i in range(1, 11)]
    assert all(rec.check(run_id(i), None) is None for i in range(1, 11))
    assert {r[0] for r in refused if r is not None} == {"full"}  # a quarter of max_mb: 4 KiB
    assert "(1/4 of --record-max-mb) and is there: more is refused until older runs rotate away" in refused[-1][1]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= (16 + 4) * 1024


def test_feedback_is_bounded_per_run_and_in_all_across_restarts(tmp_path):
    from mas_trainer.production.record import FEEDBACK_PER_RUN, FEEDBACK_RUN_BYTES

    rec = Recorder(tmp_path, file_mb=1, max_mb=1)  # 256 KiB of feedback in all
    for i in range(1, 11):
        rec.record(run_id(i), call(i))
    refused = [rec.feedback(Feedback(run_id=run_id(1), score=1.0)) for _ in range(FEEDBACK_PER_RUN + 3)]
    assert refused.count(None) == FEEDBACK_PER_RUN
    kind, why = refused[-1]
    assert kind == "run_limit" and f"at most {FEEDBACK_PER_RUN} feedback entries and 64 KiB of them are kept per run" in why
    kinds = [(rec.feedback(Feedback(run_id=run_id(i), comment="y" * 2000, label="z")) or ("ok",))[0]
             for i in range(2, 11) for _ in range(40)]
    assert kinds[:31] == ["ok"] * 31 and kinds[31] == "run_limit"  # 64 KiB of 2 KB lines per run
    assert kinds[-1] == "full"
    runs = {t.rollout_id: fb for t, fb in read_runs(tmp_path)}
    assert all(sum(len(json.dumps(f)) for f in fb) <= FEEDBACK_RUN_BYTES for fb in runs.values())
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 2**20 // 4 + 10 * 1024
    again = Recorder(tmp_path, file_mb=1, max_mb=1)
    assert again.feedback(Feedback(run_id=run_id(1), score=1.0))[0] == "run_limit"
    assert again.feedback(Feedback(run_id=run_id(10), score=1.0, comment="y" * 2000))[0] == "full"


@pytest.mark.parametrize("raised", [SystemExit(3), GeneratorExit(), KeyboardInterrupt()])
def test_a_hook_that_exits_fails_its_record_only(tmp_path, caplog, raised):
    """Whatever the hook raises is its failure (served calls are recorded on worker threads);
    only a Ctrl-C on the main thread, where signals land, is the user's."""
    import threading

    def hook(s):
        raise raised

    rec = Recorder(tmp_path, redact=hook)
    got = []
    with caplog.at_level(logging.ERROR):
        worker = threading.Thread(target=lambda: got.append((rec.record(run_id(1), call(1)),
                                                             rec.record_graph(GraphRun(run_id=run_id(1), input="x")))))
        worker.start()
        worker.join()
    assert [(ok, graph[0]) for ok, graph in got] == [(False, "redaction")]
    assert f"redaction hook failed ({type(raised).__name__}" in caplog.text
    if isinstance(raised, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            rec.record(run_id(1), call(1))
    else:
        assert rec.record(run_id(1), call(1)) is False


def test_a_score_must_be_a_number():
    for bad in ("1", True, "nan", float("inf"), 1e400, [1]):
        with pytest.raises(ValueError, match="score"):
            Feedback(run_id=run_id(1), score=bad)
    with pytest.raises(ValueError, match="score"):
        Feedback.model_validate_json('{"run_id": "' + run_id(1) + '", "score": "1"}')
    assert Feedback(run_id=run_id(1), score=1).score == 1.0


def test_read_runs_stays_inside_its_folder_and_survives_any_line(tmp_path, monkeypatch, caplog):
    """The public reader, as `data`'s: no link followed (a runs file or feedback.jsonl symlinked
    out of the folder), a line past the bound read past in pieces, a newer writer's fields ignored."""
    import os

    from mas_trainer.production import record

    outside = tmp_path / "outside"
    Recorder(outside).record(run_id(9), call(9))
    rec_dir = tmp_path / "rec"
    Recorder(rec_dir).record(run_id(1), call(1))
    os.symlink(outside / "runs-0000.jsonl", rec_dir / "runs-0001.jsonl")
    (outside / "fb.jsonl").write_text(json.dumps({"run_id": run_id(1), "score": 0.1}) + "\n")
    os.symlink(outside / "fb.jsonl", rec_dir / "feedback.jsonl")
    monkeypatch.setattr(record, "MAX_LINE_BYTES", 4096)
    newer = {"run_id": run_id(2), "call": {**call(2).model_dump(mode="json"), "added_later": 1}}
    with (rec_dir / "runs-0000.jsonl").open("a") as f:
        f.write('{"run_id": "' + run_id(3) + '", "pad": "' + "x" * 20_000 + '"}\n')  # past the bound
        f.write(json.dumps(newer) + "\n")
    with caplog.at_level(logging.WARNING):
        runs = {t.rollout_id: fb for t, fb in read_runs(rec_dir)}
    assert runs == {run_id(1): [], run_id(2): []}  # nothing from outside, the long line skipped, the newer call kept
    assert "more than 4096 bytes" in caplog.text
    restarted = Recorder(rec_dir)  # the index skips what the reader skips, and counts the long line's bytes
    assert restarted.check(run_id(2), None) is None and "no recorded run" in restarted.check(run_id(9), None)
