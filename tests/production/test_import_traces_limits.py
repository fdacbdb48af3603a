"""`import-traces` under hostile input: import time linear in the spans, and `--listen` bounded in
time, connections and bytes, keyed like `serve`, and losing nothing held at SIGTERM."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

import mas_trainer.production.otel_import as oi
from mas_trainer.production.otel_import import ImportReport, import_traces, load_spans, map_traces
from mas_trainer.production.record import read_runs

from test_import_traces import T1, msgs, request, span, text


def chain(depth: int, trace: str = T1) -> list[dict[str, Any]]:
    """A parent chain `depth` deep, every link in one node and an LLM call under each: the shape
    that made each call's ancestor walk as long as the chain."""
    meta = json.dumps({"langgraph_node": "deep", "pad": "x" * 50})
    out, parent = [], None
    for i in range(depth):
        sid = f"{i + 1:016x}"
        out.append(span(trace, sid, parent, "link", 1, metadata=meta))
        out.append(span(trace, f"{i + 1:08x}ffffffff", sid, "chat", 2, metadata=meta, **{
            "gen_ai.operation.name": "chat", "gen_ai.input.messages": msgs(text("user", "hi")),
            "gen_ai.output.messages": msgs(text("assistant", "yo"))}))
        parent = sid
    return out


def test_each_span_is_looked_at_once_however_deep_the_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"node": 0, "llm": 0}
    node_name, is_llm = oi._node_name, oi._is_llm

    def counted_node(s: oi.Span) -> str | None:
        calls["node"] += 1
        return node_name(s)

    def counted_llm(s: oi.Span) -> bool:
        calls["llm"] += 1
        return is_llm(s)

    monkeypatch.setattr(oi, "_node_name", counted_node)
    monkeypatch.setattr(oi, "_is_llm", counted_llm)
    f = tmp_path / "t.json"
    f.write_text(json.dumps(request(*chain(300))))
    report = import_traces([f], tmp_path / "rec")
    assert (report.runs, report.calls, report.nested) == (1, 300, 0)
    assert calls["node"] <= 600 and calls["llm"] <= 2 * 600, calls  # once per span, not once per ancestor
    (traj, _), = read_runs(tmp_path / "rec")
    assert {c.node_id for c in traj.llm_calls} == {"0000000000000001"}  # the outermost span of the node


def test_a_6000_deep_chain_maps_in_seconds(tmp_path: Path) -> None:
    f = tmp_path / "t.json"
    f.write_text(json.dumps(request(*chain(6000))))
    report = ImportReport()
    spans = load_spans(f, report)
    start = time.monotonic()
    assert len(map_traces(spans, report)[T1]) == 6000
    assert time.monotonic() - start < 30  # a hang guard: walking up from each call took minutes


def test_a_parent_cycle_ends(tmp_path: Path) -> None:
    a, b = "1000000000000001", "1000000000000002"
    spans = [span(T1, a, b, "n", 1, langgraph_node="loop"), span(T1, b, a, "n", 1, langgraph_node="loop"),
             span(T1, "1000000000000003", a, "chat", 2, **{"gen_ai.operation.name": "chat",
                                                             "gen_ai.input.messages": msgs(text("user", "hi"))})]
    f = tmp_path / "t.json"
    f.write_text(json.dumps(request(*spans)))
    assert import_traces([f], tmp_path / "rec").calls == 1
