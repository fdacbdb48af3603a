"""Imported traces become training data: an app instrumented with OpenInference (the real
instrumentation, its spans written as OTLP/JSON by the exporter docs/serving.md shows), imported,
scored by `mas-trainer feedback` (a file of feedback, a reward function, one run) and curated by
`data` into tasks and scored SFT lines; what cannot be written is one line, and nothing is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest

pytest.importorskip("openinference.instrumentation.langchain")
pytest.importorskip("opentelemetry.exporter.otlp.proto.common.trace_encoder")

from google.protobuf.json_format import MessageToJson  # noqa: E402
from openinference.instrumentation.langchain import LangChainInstrumentor  # noqa: E402
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402

from mas_trainer.apps import load_object  # noqa: E402
from mas_trainer.cli import main  # noqa: E402
from mas_trainer.production.record import FEEDBACK_PER_RUN, read_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
APP = '''
from typing import TypedDict

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langgraph.graph import END, START, MessagesState, StateGraph

REFERENCE = {"capital of France?": "Paris", "capital of Spain?": "Madrid", "capital of Italy?": "Rome"}


class State(TypedDict, total=False):
    question: str
    answer: str


def reward(task, state, trajectory):
    return 1.0 if state["answer"] == REFERENCE[task["question"]] else 0.0


def strict(task, state, trajectory):
    if "Spain" in task["question"]:
        raise ValueError("no reference for Spain")
    return 1.0


def only_france(task, state, trajectory):
    return 1.0 if "France" in task["question"] else None


def chat_reward(task, state, trajectory):
    return 1.0 if state["messages"][-1].content == "Paris" else 0.0


def _graph(replies):
    llm = GenericFakeChatModel(messages=iter([AIMessage(r) for r in replies]))
    g = StateGraph(State)
    g.add_node("answer", lambda s: {"answer": llm.invoke(s["question"]).content})
    g.add_edge(START, "answer")
    g.add_edge("answer", END)
    return g.compile()


graph = _graph(["Paris", "Lisbon", "Rome"])
more = _graph(["Berlin"])

chat_llm = GenericFakeChatModel(messages=iter([AIMessage("Paris")]))
_chat = StateGraph(MessagesState)
_chat.add_node("answer", lambda s: {"messages": [chat_llm.invoke(s["messages"])]})
_chat.add_edge(START, "answer")
_chat.add_edge("answer", END)
chat = _chat.compile()
'''
QUESTIONS = ["capital of France?", "capital of Spain?", "capital of Italy?"]


class OTLPJsonFile(SpanExporter):
    """docs/serving.md's exporter: each batch of spans as one OTLP/JSON export request a line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.path.open("a") as f:
            f.write(MessageToJson(encode_spans(spans), indent=None) + "\n")
        return SpanExportResult.SUCCESS


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """app.py, and its runs traced by OpenInference: graph.jsonl (3 runs), more.jsonl (1), chat.jsonl (1)."""
    where = tmp_path_factory.mktemp("captured")
    (where / "app.py").write_text(APP)
    exporter = OTLPJsonFile(where / "graph.jsonl")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        graph, more, chat = (load_object(f"{where}/app.py:{name}") for name in ("graph", "more", "chat"))
        for q in QUESTIONS:
            graph.invoke({"question": q})
        exporter.path = where / "more.jsonl"
        more.invoke({"question": "capital of Germany?"})
        exporter.path = where / "chat.jsonl"
        chat.invoke({"messages": [{"role": "user", "content": "capital of France?"}]})
    finally:
        instrumentor.uninstrument()
    yield where


def _import(captured: Path, out: Path, *files: str, key: bool = True) -> dict[str, str]:
    """Import `files` into `out`; question -> run id."""
    assert main(["import-traces", *(str(captured / f) for f in files), "--out", str(out),
                 *(["--input-key", "question"] if key else [])]) == 0
    return {t.task.get("question", t.task.get("input")): t.rollout_id for t, _ in read_runs(out)}


def _data(folder: Path, out: Path, *options: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    assert main(["data", str(folder), "--out", str(out), "--val-fraction", "0", *options]) == 0
    read = lambda name: [json.loads(line) for line in (out / name).read_text().splitlines()]  # noqa: E731
    return read("tasks.jsonl"), read("sft.jsonl")


def test_imported_runs_scored_by_a_reward_give_tasks_and_its_scores(captured: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    runs = _import(captured, tmp_path / "rec", "graph.jsonl")
    assert sorted(runs) == sorted(QUESTIONS)  # --input-key: OpenInference's one-field input is the task again
    capsys.readouterr()
    assert main(["feedback", str(tmp_path / "rec"), "--reward", f"{captured}/app.py:reward"]) == 0
    out = capsys.readouterr().out
    assert "scored 3 of 3 runs" in out and "mean 0.6667" in out
    # the audit: each score says which function gave it, where it is defined, and at which level
    given = {t.rollout_id: fb for t, fb in read_runs(tmp_path / "rec")}
    for question, run_id in runs.items():
        (fb,) = given[run_id]
        assert fb["score"] == (0.0 if "Spain" in question else 1.0)
        assert fb["by"].startswith(f"reward {captured}/app.py:reward defined at ") and fb["by"].endswith(", trajectory level")

    tasks, sft = _data(tmp_path / "rec", tmp_path / "ds", "--min-score", "0")
    assert sorted(t["question"] for t in tasks) == sorted(QUESTIONS)
    assert {line["messages"][0]["content"]: line["score"] for line in sft} == {
        "capital of France?": 1.0, "capital of Spain?": 0.0, "capital of Italy?": 1.0}
    assert {line["completion"]["content"] for line in sft} == {"Paris", "Lisbon", "Rome"}

    # run again once more runs came in: only the new one is scored (a reward does not score a run twice)
    _import(captured, tmp_path / "rec", "more.jsonl")
    assert main(["feedback", str(tmp_path / "rec"), "--reward", f"{captured}/app.py:only_france"]) == 0
    assert "scored 0 of 4 runs" in (out := capsys.readouterr().out) and "1 the reward returned None for" in out
    assert "3 a reward scored before" in out


def test_a_trainable_apps_reward_scores_imported_runs(captured: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`--reward APP`: the reward the app declares with @trainable(reward=...), here the words
    app's share of plain words in the final state's answer."""
    monkeypatch.setenv("OPENAI_API_KEY", "x")  # the app builds its OpenAI client when loaded
    runs = _import(captured, tmp_path / "rec", "graph.jsonl")
    app = f"{ROOT}/tests/fixtures/words_app.py:single"
    assert main(["feedback", str(tmp_path / "rec"), "--reward", app]) == 0
    assert "scored 3 of 3 runs" in capsys.readouterr().out
    given = {t.rollout_id: fb for t, fb in read_runs(tmp_path / "rec")}
    assert {q: given[r][0]["score"] for q, r in runs.items()} == dict.fromkeys(QUESTIONS, 0.0)  # "Paris": not lowercase
    assert given[runs[QUESTIONS[0]]][0]["by"].startswith(f"reward {app} (<lambda>) defined at tests/fixtures/words_app.py:")


def test_a_feedback_file_scores_imported_runs_all_or_nothing(captured: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    runs = _import(captured, tmp_path / "rec", "graph.jsonl")
    france, spain, italy = (runs[q] for q in QUESTIONS)
    unknown = "0123456789abcdef0123456789abcdef"
    lines = [{"run_id": france, "score": 0.9}, {"run_id": spain, "score": 0.1, "label": "wrong"},
             {"run_id": france, "score": 0.7, "comment": "second reviewer"}]
    source = tmp_path / "scores.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in [*lines, {"run_id": unknown, "score": 1.0}]))
    capsys.readouterr()
    assert main(["feedback", str(tmp_path / "rec"), "--from", str(source)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mas-trainer feedback: error: {source}:4: no recorded run {unknown!r} (unknown, or rotated away); "
                   f"nothing was written to {tmp_path / 'rec'}"]
    assert all(fb == [] for _, fb in read_runs(tmp_path / "rec"))

    source.write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n")
    assert main(["feedback", str(tmp_path / "rec"), "--from", str(source)]) == 0
    assert "wrote 3 feedback entries on 2 runs" in capsys.readouterr().out
    assert main(["feedback", str(tmp_path / "rec"), italy, "--score", "0.5"]) == 0
    given = {t.rollout_id: fb for t, fb in read_runs(tmp_path / "rec")}
    assert [fb["by"] for fb in given[france]] == ["file scores.jsonl:1", "file scores.jsonl:3"]
    assert given[italy] == [{"run_id": italy, "score": 0.5, "by": "mas-trainer feedback"}]

    _, sft = _data(tmp_path / "rec", tmp_path / "ds", "--min-score", "0.5")
    assert {line["run_id"]: line["score"] for line in sft} == {france: pytest.approx(0.8), italy: 0.5}
    _, sft = _data(tmp_path / "rec", tmp_path / "ds2", "--label", "wrong")
    assert [line["run_id"] for line in sft] == [spain]


def test_a_reward_that_raises_is_one_line_naming_it_and_nothing_is_written(captured: Path, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    runs = _import(captured, tmp_path / "rec", "graph.jsonl")
    capsys.readouterr()
    assert main(["feedback", str(tmp_path / "rec"), "--reward", f"{captured}/app.py:strict"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mas-trainer feedback: error: reward strict raised ValueError: no reference for Spain at ")
    raised = APP.splitlines().index('        raise ValueError("no reference for Spain")') + 1
    assert f"app.py:{raised} " in line
    assert f"trajectory level, rollout {runs['capital of Spain?']}" in line and "nothing was written" in line
    assert all(fb == [] for _, fb in read_runs(tmp_path / "rec"))


def test_unscored_runs_data_says_how_to_score_them(captured: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _import(captured, tmp_path / "rec", "graph.jsonl")
    capsys.readouterr()
    tasks, sft = _data(tmp_path / "rec", tmp_path / "ds")
    assert len(tasks) == 3 and sft == []
    hints = [line for line in capsys.readouterr().out.splitlines() if "no run has a score" in line]
    assert hints == ["no run has a score or a label, so no call is SFT data: score them with `mas-trainer feedback DIR "
                     "RUN_ID --score S`, `--from FILE.jsonl` or `--reward APP` (imported runs), or POST /v1/feedback "
                     "while serving"]
    assert json.loads((tmp_path / "ds" / "report.json").read_text())["runs_scored"] == 0


def test_without_input_key_a_text_input_is_said_and_kept_as_input(captured: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    runs = _import(captured, tmp_path / "rec", "graph.jsonl", key=False)
    assert sorted(runs) == sorted(QUESTIONS)  # the task is {"input": "capital of France?"}
    out = capsys.readouterr().out
    assert "3 tasks are plain text" in out and "give --input-key FIELD" in out


def test_a_messages_state_comes_back_as_messages_for_a_reward(captured: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """OpenInference writes a state's messages as LangChain's {"type", "data"} dicts; imported,
    they are a served record's, so a reward reads state["messages"][-1].content as on a live run."""
    _import(captured, tmp_path / "rec", "chat.jsonl", key=False)
    ((traj, _),) = list(read_runs(tmp_path / "rec"))
    assert traj.task == {"messages": [{"role": "user", "content": "capital of France?"}]}
    assert [m["type"] for m in traj.final_state["messages"]] == ["human", "ai"]
    capsys.readouterr()
    assert main(["feedback", str(tmp_path / "rec"), "--reward", f"{captured}/app.py:chat_reward"]) == 0
    assert "scored 1 of 1 runs" in capsys.readouterr().out
    ((_, (fb,)),) = list(read_runs(tmp_path / "rec"))
    assert fb["score"] == 1.0


def test_feedback_is_bounded_and_checked_as_the_servers(captured: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    runs = _import(captured, tmp_path / "rec", "graph.jsonl")
    france = runs[QUESTIONS[0]]
    rec = str(tmp_path / "rec")
    source = tmp_path / "many.jsonl"
    cases = {  # file text -> what the one error line says
        "".join(json.dumps({"run_id": france, "score": 1.0}) + "\n" for _ in range(FEEDBACK_PER_RUN + 1)):
            f"many.jsonl:{FEEDBACK_PER_RUN + 1}: run {france} has {FEEDBACK_PER_RUN} feedback entries",
        json.dumps({"run_id": france, "score": 1.0, "by": "reward mine"}) + "\n": "many.jsonl:1: by: Extra inputs are not permitted",
        json.dumps({"run_id": france, "score": "1"}) + "\n": "many.jsonl:1: score: Input should be a valid number",
        json.dumps({"run_id": france, "label": "x" * 9000}) + "\n": "many.jsonl:1: a line over 8 KiB",
        json.dumps({"run_id": france}) + "\n": "many.jsonl:1: give a score or a label",
        "[" * 5000 + "\n": "many.jsonl:1: ",
        "\n\n": "holds no feedback lines",
    }
    for text, said in cases.items():
        source.write_text(text)
        capsys.readouterr()
        assert main(["feedback", rec, "--from", str(source)]) == 2, said
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert said in line, line
    assert all(fb == [] for _, fb in read_runs(tmp_path / "rec"))
    assert main(["feedback", rec, "--from", "/dev/null"]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert main(["feedback", rec, france, "--score", "nan"]) == 2
    assert "score: Input should be a finite number" in capsys.readouterr().err
    assert main(["feedback", rec, "--score", "1", "--from", str(source)]) == 2
    assert "only with RUN_ID" in capsys.readouterr().err
    assert main(["feedback", rec, "--reward", f"{captured}/app.py:graph"]) == 2
    assert "the app declares no trajectory reward" in capsys.readouterr().err
