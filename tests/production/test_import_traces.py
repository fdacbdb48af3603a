"""`mas-trainer import-traces`: OTLP/JSON GenAI spans of an app traced elsewhere -> a record folder
that `read_runs` reads like served runs; what cannot be mapped is reported, never guessed."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from mas_trainer.cli import main
from mas_trainer.errors import UserError
from mas_trainer.production.otel_import import ImportReport, Unmapped, import_traces, load_spans
from mas_trainer.production.record import read_runs

T1 = "0af7651916cd43dd8448eb211c80319c"
T2 = "4bf92f3577b34da6a3ce929d0e0e4736"
T3 = "00f067aa0ba902b700f067aa0ba902b7"


def _v(x: Any) -> dict[str, Any]:
    if isinstance(x, bool):
        return {"boolValue": x}
    if isinstance(x, int):
        return {"intValue": str(x)}
    if isinstance(x, float):
        return {"doubleValue": x}
    if isinstance(x, list):
        return {"arrayValue": {"values": [_v(i) for i in x]}}
    return {"stringValue": x}


def span(trace: str, sid: str, parent: str | None, name: str, t: int, **attrs: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"traceId": trace, "spanId": sid, "name": name, "kind": 1,
                         "startTimeUnixNano": str(t * 10**9), "endTimeUnixNano": str(t * 10**9 + 5 * 10**8),
                         "attributes": [{"key": k, "value": _v(v)} for k, v in attrs.items()]}
    if parent:
        s["parentSpanId"] = parent
    return s


def request(*spans: dict[str, Any]) -> dict[str, Any]:
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": _v("app")}]},
                               "scopeSpans": [{"scope": {"name": "test"}, "spans": list(spans)}]}]}


def msgs(*m: dict[str, Any]) -> str:
    return json.dumps(list(m))


def text(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": content}]}


def semconv_trace(trace: str = T1) -> list[dict[str, Any]]:
    """A 2-node LangGraph-like trace, current semconv: planner (a tool call) then writer."""
    meta = lambda node: json.dumps({"langgraph_node": node, "langgraph_step": 1})  # noqa: E731
    return [
        span(trace, "a000000000000001", None, "LangGraph", 1),
        span(trace, "b000000000000001", "a000000000000001", "planner", 1, metadata=meta("planner")),
        span(trace, "c000000000000001", "b000000000000001", "chat gpt-4o", 2, **{
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o",
            "gen_ai.response.finish_reasons": ["tool_calls"],
            "gen_ai.system_instructions": json.dumps([{"type": "text", "content": "You plan."}]),
            "gen_ai.input.messages": msgs(text("user", "capital of France?")),
            "gen_ai.output.messages": msgs({"role": "assistant", "finish_reason": "tool_call", "parts": [
                {"type": "tool_call", "id": "call_1", "name": "search", "arguments": {"q": "France capital"}}]}),
        }),
        span(trace, "b000000000000002", "a000000000000001", "writer", 3, metadata=meta("writer")),
        span(trace, "d000000000000001", "b000000000000002", "RunnableSequence", 3, metadata=meta("writer")),
        span(trace, "c000000000000002", "d000000000000001", "chat gpt-4o", 4, **{
            "gen_ai.operation.name": "chat", "gen_ai.response.model": "gpt-4o-2024",
            "gen_ai.input.messages": msgs(
                text("user", "capital of France?"),
                {"role": "assistant", "parts": [{"type": "tool_call", "id": "call_1", "name": "search",
                                                  "arguments": {"q": "France capital"}}]},
                {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "Paris"}]}),
            "gen_ai.output.messages": msgs({"role": "assistant", "finish_reason": "stop",
                                            "parts": [{"type": "text", "content": "Paris."}]}),
        }),
    ]


def openllmetry_trace(trace: str = T2) -> list[dict[str, Any]]:
    """OpenLLMetry's LangChain instrumentation: node metadata as association properties, indexed prompts."""
    prop = "traceloop.association.properties.langgraph_node"
    return [
        span(trace, "e000000000000001", None, "LangGraph.workflow", 1, **{"traceloop.span.kind": "workflow"}),
        span(trace, "e000000000000002", "e000000000000001", "agent.task", 1, **{
            "traceloop.span.kind": "task", "traceloop.entity.name": "agent", prop: "agent"}),
        span(trace, "e000000000000003", "e000000000000002", "ChatOpenAI.chat", 2, **{
            "llm.request.type": "chat", prop: "agent", "gen_ai.request.model": "gpt-4o-mini",
            "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": "Be brief.",
            "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": "weather?",
            "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.finish_reason": "tool_calls",
            "gen_ai.completion.0.tool_calls.0.id": "call_9", "gen_ai.completion.0.tool_calls.0.name": "weather",
            "gen_ai.completion.0.tool_calls.0.arguments": '{"city": "Oslo"}'}),
    ]


def orphan_trace(trace: str = T3) -> list[dict[str, Any]]:
    """A chat span outside any LangGraph node."""
    return [span(trace, "f000000000000001", None, "chat", 1, **{
        "gen_ai.operation.name": "chat", "gen_ai.input.messages": msgs(text("user", "hi")),
        "gen_ai.output.messages": msgs(text("assistant", "hello"))})]


def write(path: Path, *reqs: dict[str, Any], lines: bool = False) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in reqs) + "\n" if lines else json.dumps(reqs[0]))
    return path


def test_semconv_two_nodes(tmp_path: Path) -> None:
    f = write(tmp_path / "t.json", request(*semconv_trace()))
    report = import_traces([f], tmp_path / "rec", roles={"writer": "author"}, policies={"author": "big"})
    assert (report.runs, report.calls, sum(report.unmapped.values())) == (1, 2, 0)
    ((traj, feedback),) = list(read_runs(tmp_path / "rec"))
    assert traj.rollout_id == T1 and feedback == []
    assert [(n.id, n.name) for n in traj.nodes] == [("b000000000000001", "planner"), ("b000000000000002", "writer")]
    plan, write_ = traj.llm_calls
    assert (plan.node, plan.role, plan.policy, write_.node, write_.role, write_.policy) == (
        "planner", "planner", "planner", "writer", "author", "big")
    assert plan.messages == [{"role": "system", "content": "You plan."}, {"role": "user", "content": "capital of France?"}]
    assert plan.output_text is None and plan.finish_reason == "tool_call" and plan.model == "gpt-4o"
    assert plan.tool_calls == [{"id": "call_1", "type": "function",
                                "function": {"name": "search", "arguments": '{"q": "France capital"}'}}]
    assert write_.messages[1]["tool_calls"][0]["function"]["name"] == "search"
    assert write_.messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "Paris"}
    assert write_.output_text == "Paris." and write_.finish_reason == "stop" and write_.model == "gpt-4o-2024"
    assert plan.prompt_ids == plan.response_ids == plan.response_logprobs == []
    assert (plan.start_time, write_.end_time) == (2.0, 4.5) and traj.duration_s == 2.5


def test_a_span_with_two_choices_is_two_calls_with_the_gateways_choice_ids(tmp_path: Path) -> None:
    """n=2: the first choice keeps the span's id, the second is `{id}-1`, as the gateway names choices."""
    trace = semconv_trace()
    outputs = [{"key": "gen_ai.output.messages", "value": _v(msgs(
        {"role": "assistant", "finish_reason": "stop", "parts": [{"type": "text", "content": "one"}]},
        {"role": "assistant", "finish_reason": "length", "parts": [{"type": "text", "content": "two"}]}))}]
    writer = trace[-1]
    writer["attributes"] = [a for a in writer["attributes"] if a["key"] != "gen_ai.output.messages"] + outputs
    import_traces([write(tmp_path / "t.json", request(*trace))], tmp_path / "rec")
    ((traj, _),) = list(read_runs(tmp_path / "rec"))
    assert [(c.id, c.output_text, c.finish_reason) for c in traj.llm_calls[1:]] == [
        ("c000000000000002", "one", "stop"), ("c000000000000002-1", "two", "length")]


def test_openllmetry_indexed_and_orphan(tmp_path: Path) -> None:
    f = write(tmp_path / "t.jsonl", request(*openllmetry_trace()), request(*orphan_trace()), lines=True)
    report = import_traces([f], tmp_path / "rec")
    assert report.runs == 1 and report.unmapped == {"LLM span with no LangGraph node ancestor": 1}
    assert report.examples["LLM span with no LangGraph node ancestor"] == [f"trace {T3} span f000000000000001"]
    ((traj, _),) = list(read_runs(tmp_path / "rec"))
    (call,) = traj.llm_calls
    assert traj.rollout_id == T2 and [n.name for n in traj.nodes] == ["agent"] and call.node_id == "e000000000000002"
    assert call.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"}]
    assert call.tool_calls == [{"id": "call_9", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    assert call.finish_reason == "tool_calls" and call.model == "gpt-4o-mini"


def test_events_form_and_base64_ids(tmp_path: Path) -> None:
    b64 = lambda h: base64.b64encode(bytes.fromhex(h)).decode()  # noqa: E731
    node = span(b64(T1), b64("1000000000000001"), None, "n", 1, **{"langgraph.node": "solver"})
    chat = span(b64(T1), b64("1000000000000002"), b64("1000000000000001"), "chat", 2, **{"gen_ai.operation.name": "chat"})
    chat["events"] = [
        {"name": "gen_ai.user.message", "attributes": [{"key": "content", "value": _v("2+2?")}]},
        {"name": "gen_ai.choice", "attributes": [
            {"key": "finish_reason", "value": _v("stop")},
            {"key": "message", "value": {"kvlistValue": {"values": [{"key": "content", "value": _v("4")}]}}}]}]
    report = import_traces([write(tmp_path / "t.json", request(node, chat))], tmp_path / "rec")
    assert report.calls == 1 and not report.unmapped
    ((traj, _),) = list(read_runs(tmp_path / "rec"))
    assert traj.rollout_id == T1 and traj.llm_calls[0].id == "1000000000000002"
    assert traj.llm_calls[0].messages == [{"role": "user", "content": "2+2?"}]
    assert (traj.llm_calls[0].output_text, traj.llm_calls[0].finish_reason, traj.llm_calls[0].node) == ("4", "stop", "solver")


def test_openinference_form(tmp_path: Path) -> None:
    m = "llm.input_messages."
    node = span(T1, "2000000000000001", None, "critic", 1, metadata=json.dumps({"langgraph_node": "critic"}),
                **{"openinference.span.kind": "CHAIN"})
    llm = span(T1, "2000000000000002", "2000000000000001", "ChatOpenAI", 2, metadata=json.dumps({"langgraph_node": "critic"}), **{
        "openinference.span.kind": "LLM", "llm.model_name": "gpt-4o",
        m + "0.message.role": "user", m + "0.message.content": "rate it",
        m + "1.message.role": "assistant", m + "1.message.tool_calls.0.tool_call.id": "t1",
        m + "1.message.tool_calls.0.tool_call.function.name": "score",
        m + "1.message.tool_calls.0.tool_call.function.arguments": "{}",
        m + "2.message.role": "tool", m + "2.message.tool_call_id": "t1", m + "2.message.content": "7",
        "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": "7/10"})
    assert import_traces([write(tmp_path / "t.json", request(node, llm))], tmp_path / "rec").calls == 1
    ((traj, _),) = list(read_runs(tmp_path / "rec"))
    (call,) = traj.llm_calls
    assert (call.node, call.node_id, call.output_text, call.model) == ("critic", "2000000000000001", "7/10", "gpt-4o")
    assert call.messages == [
        {"role": "user", "content": "rate it"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t1", "type": "function",
                                                               "function": {"name": "score", "arguments": "{}"}}]},
        {"role": "tool", "content": "7", "tool_call_id": "t1"}]


def test_reimport_is_idempotent_and_appends(tmp_path: Path) -> None:
    f = write(tmp_path / "t.json", request(*semconv_trace()))
    assert import_traces([f], tmp_path / "rec").runs == 1
    again = import_traces([f], tmp_path / "rec")
    assert (again.runs, again.duplicates) == (0, 1)
    g = write(tmp_path / "u.json", request(*openllmetry_trace()))
    assert import_traces([g], tmp_path / "rec").runs == 1
    assert [t.rollout_id for t, _ in read_runs(tmp_path / "rec")] == [T1, T2]
    assert [p.name for p in (tmp_path / "rec").iterdir()] == ["runs-0000.jsonl"]


def test_llm_span_inside_llm_span_counts_once(tmp_path: Path) -> None:
    spans = semconv_trace()
    inner = span(T1, "c100000000000001", "c000000000000001", "openai.chat", 2, **{
        "gen_ai.operation.name": "chat", "gen_ai.input.messages": msgs(text("user", "capital of France?")),
        "gen_ai.output.messages": msgs(text("assistant", "dup"))})
    report = import_traces([write(tmp_path / "t.json", request(*spans, inner))], tmp_path / "rec")
    assert (report.calls, report.nested, sum(report.unmapped.values())) == (2, 1, 0)
    assert "1 LLM spans inside another LLM span counted once" in report.lines()[0]


def test_trace_split_across_lines_is_one_run(tmp_path: Path) -> None:
    spans = semconv_trace()
    f = write(tmp_path / "t.jsonl", request(*spans[:3]), request(*spans[3:]), request(*spans[:2]), lines=True)
    report = import_traces([f], tmp_path / "rec")
    assert (report.runs, report.calls) == (1, 2)


def test_report_reasons(tmp_path: Path) -> None:
    no_msgs = span(T2, "a100000000000002", "a100000000000001", "chat", 2, **{"gen_ai.operation.name": "chat"})
    lines = [json.dumps(request(*semconv_trace())), "{not json", json.dumps({"hello": 1}),
             json.dumps(request(span(T2, "a100000000000001", None, "n", 1, langgraph_node="x"), no_msgs)),
             json.dumps(request(span(T3, "a200000000000001", None, "http GET", 1)))]
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(lines) + "\n")
    report = import_traces([f], tmp_path / "rec")
    assert report.runs == 1
    assert report.unmapped == {"malformed line (not JSON)": 1, "malformed line (JSON, but not an OTLP trace export)": 1,
                               "LLM span without messages": 1, "trace with no LLM spans": 1}
    assert report.examples["malformed line (not JSON)"] == ["t.jsonl:2"]
    text_ = "\n".join(report.lines())
    assert "imported 1 runs (2 LLM calls)" in text_ and "t.jsonl:3" in text_


def test_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path / "t.jsonl", request(*semconv_trace()), request(*orphan_trace()), lines=True)
    with pytest.raises(Unmapped):
        import_traces([f], tmp_path / "rec", strict=True)
    assert not (tmp_path / "rec").exists()
    assert main(["import-traces", str(f), "--out", str(tmp_path / "rec"), "--strict"]) == 1
    err = capsys.readouterr().err
    assert "nothing written" in err and "no LangGraph node ancestor" in err
    assert not (tmp_path / "rec").exists()
    ok = write(tmp_path / "ok.json", request(*semconv_trace()))
    assert main(["import-traces", str(ok), "--out", str(tmp_path / "rec"), "--strict", "--role", "planner=boss"]) == 0
    assert "imported 1 runs (2 LLM calls)" in capsys.readouterr().out
    assert [c.role for t, _ in read_runs(tmp_path / "rec") for c in t.llm_calls] == ["boss", "writer"]


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "garbage.json").write_text("this is not json\nnor this\n")
    (tmp_path / "other.json").write_text(json.dumps({"data": []}))
    cases = {"missing.json": "cannot read it", "garbage.json": "garbage.json:1: not JSON", "other.json": "no resourceSpans"}
    for name, words in cases.items():
        assert main(["import-traces", str(tmp_path / name), "--out", str(tmp_path / "rec")]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert main(["import-traces", str(tmp_path / "other.json"), "--out", str(tmp_path / "rec"), "--role", "x"]) == 2
    assert "KEY=ROLE" in capsys.readouterr().err
    assert main(["import-traces", "--out", str(tmp_path / "rec")]) == 2
    assert main(["import-traces", "--out", str(tmp_path / "rec"), "--listen", "nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 2


def test_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mas_trainer.production.otel_import as oi

    monkeypatch.setattr(oi, "MAX_FILE_BYTES", 100)
    f = write(tmp_path / "t.json", request(*semconv_trace()))
    with pytest.raises(UserError, match="over the .* limit"):
        import_traces([f], tmp_path / "rec")


def test_hostile_input(tmp_path: Path) -> None:
    deep: dict[str, Any] = {"stringValue": "x"}
    for _ in range(80):  # deeper than MAX_DEPTH, shallow enough for the JSON parser
        deep = {"arrayValue": {"values": [deep]}}
    very_deep = "[" * 10_000 + "]" * 10_000
    good = semconv_trace()
    hostile = [
        "not a span", 42, None,
        {**good[1], "spanId": "a300000000000001", "attributes": [{"key": "k", "value": deep}]},
        {**good[1], "spanId": "a300000000000002", "attributes": [{"key": "k", "value": {"intValue": [1, 2]}}]},
        {**good[1], "spanId": "a300000000000003", "attributes": "nope"},
        {**good[1], "spanId": "zz", "traceId": 7},
        {**good[1], "spanId": "zz"},
        # wrong types where strings are expected, and 10k-deep JSON inside a string: the span is reported
        span(T1, "a300000000000004", "b000000000000001", "chat", 5, **{
            "gen_ai.operation.name": "chat", "gen_ai.input.messages": very_deep}),
        span(T1, "a300000000000005", "b000000000000001", "chat", 6, **{
            "gen_ai.operation.name": "chat", "gen_ai.input.messages": 12, "gen_ai.output.messages": ["x"]}),
        span(T1, "a300000000000006", "b000000000000001", "chat", 7, **{
            "gen_ai.operation.name": "chat", "gen_ai.input.messages": msgs({"role": "user", "parts": [{"type": "image"}]})}),
    ]
    lines = [json.dumps(request(*good, *hostile)), "[" * 10_000 + "]" * 10_000,
             json.dumps({"resourceSpans": [None, {"scopeSpans": "x"}, {"scopeSpans": [{"spans": {"a": 1}}]}]})]
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(lines) + "\n")
    report = import_traces([f], tmp_path / "rec")
    assert (report.runs, report.calls) == (1, 2) and report.partial_runs == 1
    assert report.unmapped["malformed line (JSON nested too deep)"] == 1
    assert report.unmapped["malformed span (not a JSON object)"] == 3
    assert report.unmapped["malformed span (an attribute value nested too deep)"] == 1
    assert report.unmapped["malformed span (attributes are not a list)"] == 1
    assert report.unmapped["malformed span (JSON in an attribute nested too deep)"] == 1
    assert report.unmapped["messages attribute is not a JSON list"] == 1
    assert report.unmapped["unsupported message part (image)"] == 1
    assert report.unmapped["malformed export (resourceSpans / scopeSpans / spans not lists of objects)"] == 3
    assert report.examples["malformed span (missing or non-string id)"] == ["t.jsonl:1 span zz"]
    assert report.examples["malformed span (id 'zz' is not 8 bytes in hex or base64)"] == ["t.jsonl:1 span zz"]
    assert sum(report.unmapped.values()) == 15
    # one deep document (not JSON lines) is refused in one line, not a crash
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match="nested too deep"):
        load_spans(tmp_path / "deep.json", ImportReport())


def test_receiver_over_http(tmp_path: Path) -> None:
    import gzip
    import threading
    import urllib.error
    import urllib.request

    from mas_trainer.production.otel_import import Receiver

    receiver = Receiver(tmp_path / "rec")
    server = receiver.server("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"

    def post(body: bytes, ctype: str = "application/json", **headers: str) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(url, data=body, headers={"content-type": ctype, **headers}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        spans = semconv_trace()
        # children first, as a batch span processor sends them; the root closes the trace
        assert post(json.dumps(request(*spans[1:])).encode()) == (200, {})
        assert list(read_runs(tmp_path / "rec")) == []
        status, body = post(gzip.compress(json.dumps(request(spans[0], "junk")).encode()), **{"content-encoding": "gzip"})
        assert status == 200 and body["partialSuccess"]["rejectedSpans"] == "1"
        assert [len(t.llm_calls) for t, _ in read_runs(tmp_path / "rec")] == [2]
        status, body = post(b"\x0a\x00", "application/x-protobuf")
        assert status == 415 and "http/json" in body["error"]
        assert post(b"{nope")[0] == 400 and post(b'{"a": 1}')[0] == 400
        assert post(json.dumps(request(*openllmetry_trace()[1:])).encode())[0] == 200  # no root yet: held
    finally:
        server.shutdown()
        server.server_close()
    report = receiver.close()  # what is held is written at the end
    assert (report.runs, report.calls) == (2, 3)
    assert [t.rollout_id for t, _ in read_runs(tmp_path / "rec")] == [T1, T2]


def test_a_failed_llm_span_is_not_a_trainable_call(tmp_path: Path) -> None:
    """An LLM span whose status is ERROR (a 404, a timeout) answered nothing: it is reported, not
    imported as a call to train on; the run keeps its other calls and counts as partial."""
    spans = semconv_trace()
    spans[2]["status"] = {"code": 2, "message": "Error code: 404 - model not served"}
    f = write(tmp_path / "t.json", request(*spans))
    report = import_traces([f], tmp_path / "rec")
    assert (report.runs, report.calls, report.partial_runs) == (1, 1, 1)
    assert report.unmapped == {"LLM span that failed (its status is ERROR)": 1}
    assert "404 - model not served" in report.examples["LLM span that failed (its status is ERROR)"][0]
    ((traj, _),) = list(read_runs(tmp_path / "rec"))
    assert [c.node for c in traj.llm_calls] == ["writer"]
    spans[2]["status"] = {"code": "STATUS_CODE_ERROR"}  # the enum's name, as some exporters write it
    assert import_traces([write(tmp_path / "u.json", request(*spans))], tmp_path / "rec2").calls == 1
    spans[2]["status"] = {"code": 1}  # OK
    assert import_traces([write(tmp_path / "v.json", request(*spans))], tmp_path / "rec3").calls == 2


def test_the_root_spans_input_becomes_the_runs_task(tmp_path: Path) -> None:
    """OpenInference puts the graph's input and output on the root span (`input.value`,
    `output.value`), OpenLLMetry its `traceloop.entity.input` ({"inputs": ...}): the run gets
    them as a served run's graph record, so `data` finds its task; a failed root is an error run."""
    m = "llm.input_messages."
    root = span(T1, "3000000000000001", None, "LangGraph", 1, **{
        "openinference.span.kind": "CHAIN", "input.value": json.dumps({"question": "capital of France?"}),
        "input.mime_type": "application/json", "output.value": json.dumps({"answer": "Paris"})})
    node = span(T1, "3000000000000002", "3000000000000001", "critic", 1, metadata=json.dumps({"langgraph_node": "critic"}),
                **{"openinference.span.kind": "CHAIN"})
    llm = span(T1, "3000000000000003", "3000000000000002", "ChatOpenAI", 2, **{
        "openinference.span.kind": "LLM", m + "0.message.role": "user", m + "0.message.content": "capital of France?",
        "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": "Paris"})
    traceloop = [dict(s, traceId=T2) for s in openllmetry_trace(T2)]
    traceloop[0]["attributes"] += [{"key": "traceloop.entity.input", "value": {"stringValue": json.dumps(
        {"inputs": {"question": "weather?"}, "tags": []})}}]
    traceloop[0]["status"] = {"code": 2, "message": "boom"}
    report = import_traces([write(tmp_path / "t.json", request(root, node, llm, *traceloop))], tmp_path / "rec")
    assert (report.runs, report.tasks) == (2, 2)
    assert "2 of them with their task from the root span" in report.lines()[0]
    runs = {t.rollout_id: t for t, _ in read_runs(tmp_path / "rec")}
    assert runs[T1].task == {"question": "capital of France?"} and runs[T1].final_state == {"answer": "Paris"}
    assert runs[T1].status == "ok"
    assert runs[T2].task == {"question": "weather?"} and runs[T2].status == "error"


def test_imported_runs_with_a_root_input_are_tasks_for_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`import-traces` then `data`: runs whose root span carries the graph's input are tasks; runs
    without one are said to have none, not that another --seed would help."""
    def run(trace: str, question: str) -> list[dict[str, Any]]:
        root = span(trace, trace[:15] + "1", None, "LangGraph", 1, **{"input.value": json.dumps({"question": question})})
        rest = semconv_trace(trace)
        rest[0]["parentSpanId"] = root["spanId"]
        return [root, *rest]

    f = write(tmp_path / "t.json", request(*run(T1, "capital of France?"), *run(T2, "capital of Spain?")))
    import_traces([f], tmp_path / "rec")
    assert main(["data", str(tmp_path / "rec"), "--out", str(tmp_path / "ds"), "--val-fraction", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "tasks: 1 train, 1 held out" in out
    tasks = [json.loads(line) for p in ("tasks.jsonl", "val.jsonl") for line in (tmp_path / "ds" / p).read_text().splitlines()]
    assert sorted(t["question"] for t in tasks) == ["capital of France?", "capital of Spain?"]

    import_traces([write(tmp_path / "u.json", request(*semconv_trace(T3)))], tmp_path / "bare")
    assert main(["data", str(tmp_path / "bare"), "--out", str(tmp_path / "ds2"), "--val-fraction", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "no run had a task (1 without one)" in out and "another --seed" not in out
