"""`mas-trainer import-traces`: OTel GenAI spans of an app traced elsewhere, as a record folder.

Reads OTLP/JSON export requests (`{"resourceSpans": [...]}`: one per file, or one per line as
the collector's file exporter writes them), groups spans by trace id (one trace = one run, run id
= the trace id), turns each LLM span into an `LLMCall` (OpenAI-style messages; no token ids) and
files it under the LangGraph node its ancestors name, by the path a live rollout's tracer gives it
(``outer:inner``; a sub-agent's ``tools:@researcher:model``) where the spans carry LangGraph's
checkpoint namespace and LangChain's agent name. The result is written with the `Recorder`,
so `read_runs(DIR)` reads imported and served runs alike. What cannot be mapped is counted by
reason in an `ImportReport`, never guessed. docs/serving.md lists the forms read.

OTLP JSON is parsed here, not with `opentelemetry-proto`'s protobuf `json_format`: that package is
not a core dependency, and `json_format` reads trace/span ids as base64 where OTLP/JSON writes
hex, and rejects a whole request for one bad span where a report per span is wanted.
"""

from __future__ import annotations

import base64
import hmac
import io
import json
import logging
import re
import socket
import threading
import time
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable, Iterator, NamedTuple

from mas_trainer.engines.base import choice_id
from mas_trainer.errors import UserError
from mas_trainer.production.record import GraphRun, Recorder
from mas_trainer.spec import AGENT_MARK, agent_path, node_path
from mas_trainer.trace.schema import LLMCall

__all__ = ["MAX_FILE_BYTES", "MAX_BODY_BYTES", "MAX_DEPTH", "ImportReport", "Unmapped", "Span", "ListenLimits", "Receiver",
           "load_spans", "map_traces", "import_traces"]

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 512 * 2**20  # one input file
MAX_DEPTH = 64  # nesting of an attribute value (AnyValue arrays / kvlists, JSON inside strings)
EXAMPLES = 3  # examples kept per reason
LLM_OPERATIONS = {"chat", "text_completion", "generate_content"}
# Where instrumentations put LangChain's run metadata (docs/serving.md): `langgraph_node`, and beside it
# `langgraph_checkpoint_ns` (the node call's nesting) and `lc_agent_name` (the agent that runs it)
META_PREFIXES = ("", "langsmith.metadata.", "traceloop.association.properties.")  # plain, LangSmith, OpenLLMetry
NODE_JSON_KEYS = ("metadata",)  # OpenInference: the run's metadata as one JSON string
NODE_KEYS = ("langgraph.node", "mas.node")  # a node's name alone (this project's tracer: its whole path)
INDEXED_INPUT = ("gen_ai.prompt.", "llm.input_messages.")  # OpenLLMetry, OpenInference
INDEXED_OUTPUT = ("gen_ai.completion.", "llm.output_messages.")
EVENT_ROLES = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
               "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}


class Unmapped(Exception):
    """`strict`: something could not be imported; nothing was written. `.report` says what."""

    def __init__(self, report: ImportReport) -> None:
        super().__init__("; ".join(report.lines()))
        self.report = report


class _Bad(ValueError):
    """One span (or line) cannot be read; the message is the report's reason."""


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start: float | None
    end: float | None
    attrs: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    error: str | None = None  # OTLP status ERROR: the span failed, with its message ("" without one)


@dataclass
class ImportReport:
    runs: int = 0
    calls: int = 0
    partial_runs: int = 0  # written with some LLM spans left out
    duplicates: int = 0  # runs already in DIR, skipped
    nested: int = 0  # LLM spans inside another LLM span (one call seen by two instrumentations), counted once
    tasks: int = 0  # runs written with their graph input (their task) from the root span
    text_tasks: int = 0  # of those, inputs that are not an object (kept as {"input": ...})
    unmapped: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.unmapped[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < EXAMPLES:
            ex.append(where)

    def merge(self, other: ImportReport) -> None:
        """Add the counts of `other` (a part parsed or written apart) to these."""
        self.runs, self.calls = self.runs + other.runs, self.calls + other.calls
        self.partial_runs, self.duplicates = self.partial_runs + other.partial_runs, self.duplicates + other.duplicates
        self.nested += other.nested
        self.tasks += other.tasks
        self.text_tasks += other.text_tasks
        for reason, n in other.unmapped.items():
            self.unmapped[reason] += n
            ex = self.examples.setdefault(reason, [])
            ex.extend(other.examples.get(reason, [])[:EXAMPLES - len(ex)])

    def lines(self) -> list[str]:
        out = [f"imported {self.runs} runs ({self.calls} LLM calls); {self.tasks} of them with their task from the root "
               f"span; {self.duplicates} duplicate runs skipped"
               + (f"; {self.partial_runs} runs written without some of their LLM spans" if self.partial_runs else "")
               + (f"; {self.nested} LLM spans inside another LLM span counted once" if self.nested else "")
               + (f"; {self.text_tasks} tasks are plain text, kept as {{\"input\": ...}}: if the graph's input is one "
                  "field, which OpenInference writes as its text alone, give --input-key FIELD" if self.text_tasks else "")]
        for reason, n in self.unmapped.most_common():
            out.append(f"  not imported: {n} x {reason} (e.g. {', '.join(self.examples.get(reason, []))})")
        return out


# ---- OTLP JSON ---------------------------------------------------------------------------------

def _id(value: Any, nbytes: int) -> str:
    """A trace (16 bytes) or span (8 bytes) id: hex as OTLP/JSON writes it, or base64 (protobuf JSON)."""
    if not isinstance(value, str) or not value:
        raise _Bad("malformed span (missing or non-string id)")
    try:
        raw = bytes.fromhex(value) if len(value) == 2 * nbytes else b""
    except ValueError:
        raw = b""
    if not raw:
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError:  # binascii.Error is a ValueError
            pass
    if len(raw) != nbytes or not any(raw):
        raise _Bad(f"malformed span (id {value[:40]!r} is not {nbytes} bytes in hex or base64)")
    return raw.hex()


def _any(value: Any, depth: int = 0) -> Any:
    """An OTLP AnyValue as a plain value; too deep or of an unknown shape -> _Bad."""
    if depth > MAX_DEPTH:
        raise _Bad("malformed span (an attribute value nested too deep)")
    if not isinstance(value, dict) or len(value) > 1:
        raise _Bad("malformed span (an attribute value is not an OTLP AnyValue)")
    if not value:
        return None
    (kind, v), = value.items()
    if kind in ("stringValue", "bytesValue") and isinstance(v, str):
        return v
    if kind == "boolValue" and isinstance(v, bool):
        return v
    if kind == "intValue" and isinstance(v, (int, str)) and not isinstance(v, bool):
        try:
            return int(v)
        except ValueError:
            raise _Bad("malformed span (an intValue is not an integer)") from None
    if kind == "doubleValue" and isinstance(v, (int, float, str)) and not isinstance(v, bool):
        try:
            return float(v)
        except ValueError:
            raise _Bad("malformed span (a doubleValue is not a number)") from None
    if kind == "arrayValue" and isinstance(v, dict) and isinstance(v.get("values", []), list):
        return [_any(x, depth + 1) for x in v.get("values", [])]
    if kind == "kvlistValue" and isinstance(v, dict):
        return _kv(v.get("values", []), depth + 1)
    raise _Bad(f"malformed span (attribute value of kind {str(kind)[:40]!r})")


def _kv(items: Any, depth: int = 0) -> dict[str, Any]:
    if not isinstance(items, list):
        raise _Bad("malformed span (attributes are not a list)")
    out: dict[str, Any] = {}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("key"), str):
            raise _Bad("malformed span (an attribute is not {key, value})")
        out[item["key"]] = _any(item.get("value", {}), depth)
    return out


def _seconds(value: Any) -> float | None:
    try:
        return int(value) / 1e9 if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    except ValueError:
        return None


def _span(raw: Any) -> Span:
    if not isinstance(raw, dict):
        raise _Bad("malformed span (not a JSON object)")
    events = []
    if not isinstance(raw.get("events") or [], list):
        raise _Bad("malformed span (events are not a list)")
    for ev in raw.get("events") or []:
        if not isinstance(ev, dict) or not isinstance(ev.get("name"), str):
            raise _Bad("malformed span (an event is not {name, attributes})")
        events.append((ev["name"], _kv(ev.get("attributes") or [])))
    parent = raw.get("parentSpanId")
    name = raw.get("name")
    raw_status = raw.get("status")
    status: dict[str, Any] = raw_status if isinstance(raw_status, dict) else {}
    # OTLP/JSON's status code: 2 (or "STATUS_CODE_ERROR", as some exporters write the enum) is an error
    failed = status.get("code") in (2, "2", "STATUS_CODE_ERROR")
    message = status.get("message")
    return Span(trace_id=_id(raw.get("traceId"), 16), span_id=_id(raw.get("spanId"), 8),
                parent_id=_id(parent, 8) if parent else None, name=name if isinstance(name, str) else "",
                start=_seconds(raw.get("startTimeUnixNano")), end=_seconds(raw.get("endTimeUnixNano")),
                attrs=_kv(raw.get("attributes") or []), events=events,
                error=(message[:200] if isinstance(message, str) else "") if failed else None)


def _request_spans(req: Any, where: str, report: ImportReport) -> Iterator[Span]:
    bad = "malformed export (resourceSpans / scopeSpans / spans not lists of objects)"
    for rs in req.get("resourceSpans") or []:
        scopes = rs.get("scopeSpans", rs.get("instrumentationLibrarySpans", [])) if isinstance(rs, dict) else None
        if not isinstance(scopes, list):
            report.skip(bad, where)
            continue
        for ss in scopes:
            spans = ss.get("spans", []) if isinstance(ss, dict) else None
            if not isinstance(spans, list):
                report.skip(bad, where)
                continue
            for raw in spans:
                try:
                    yield _span(raw)
                except _Bad as exc:
                    ids = raw if isinstance(raw, dict) else {}
                    report.skip(str(exc), f"{where} span {str(ids.get('spanId'))[:32]}")


def _is_request(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("resourceSpans"), list)


def load_spans(path: str | Path, report: ImportReport) -> list[Span]:
    """The spans of one OTLP/JSON file (one request, or one request per line)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror}); give an OTLP JSON file") from None
    if size > MAX_FILE_BYTES:
        raise UserError(f"{path}: {size / 2**20:.0f} MB is over the {MAX_FILE_BYTES >> 20} MB limit per file; "
                        "split it (the collector's file exporter: rotation.max_megabytes)")
    text = path.read_bytes().decode("utf-8", errors="replace")
    try:
        whole: Any = json.loads(text)
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deep; give OTLP JSON export requests") from None
    except ValueError:
        whole = None
    if whole is not None:
        if not _is_request(whole):
            raise UserError(f"{path}: JSON but not an OTLP trace export (no resourceSpans list); export with "
                            "OTLP/JSON (OTLP HTTP JSON, or the collector's file exporter)")
        return list(_request_spans(whole, path.name, report))
    spans: list[Span] = []
    good, first_bad = 0, ""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            reason = "" if _is_request(req) else "malformed line (JSON, but not an OTLP trace export)"
        except RecursionError:
            reason = "malformed line (JSON nested too deep)"
        except ValueError:
            reason = "malformed line (not JSON)"
        if reason:
            report.skip(reason, f"{path.name}:{n}")
            first_bad = first_bad or f"{path}:{n}: {reason.removeprefix('malformed line (').rstrip(')')}"
            continue
        good += 1
        spans.extend(_request_spans(req, f"{path.name}:{n}", report))
    if good == 0:
        raise UserError(f"{first_bad or path}; give OTLP/JSON trace exports: one JSON object with resourceSpans, "
                        "or one per line (the collector's file exporter)")
    return spans


# ---- GenAI messages -> OpenAI chat messages -----------------------------------------------------

def _json(value: Any) -> Any:
    """A value that may be JSON in a string (attributes hold structures as JSON text)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except RecursionError:
            raise _Bad("malformed span (JSON in an attribute nested too deep)") from None
        except ValueError:
            return value
    return value


def _tool_call(id_: Any, name: Any, arguments: Any) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise _Bad("a tool call without a name")
    args = arguments if isinstance(arguments, str) and arguments else json.dumps(arguments or {})
    return {"id": str(id_ or ""), "type": "function", "function": {"name": name, "arguments": args}}


def _content(texts: list[str]) -> Any:
    return texts[0] if len(texts) == 1 else ([{"type": "text", "text": t} for t in texts] if texts else None)


def _semconv_messages(value: Any, system: Any = None) -> list[dict[str, Any]]:
    """`gen_ai.input.messages` / `gen_ai.output.messages` (list of {role, parts}) as chat messages."""
    msgs = _json(value)
    if not isinstance(msgs, list):
        raise _Bad("messages attribute is not a JSON list")
    out: list[dict[str, Any]] = []
    sys_parts = _json(system)
    if isinstance(sys_parts, list) and sys_parts:
        out.extend(_semconv_messages([{"role": "system", "parts": sys_parts}]))
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("parts"), list):
            raise _Bad("a message is not {role, parts}")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for p in m["parts"]:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("content"), str):
                texts.append(p["content"])
            elif kind == "tool_call":
                calls.append(_tool_call(p.get("id"), p.get("name"), p.get("arguments")))
            elif kind == "tool_call_response":
                resp = p.get("response")
                out.append({"role": "tool", "tool_call_id": str(p.get("id") or ""),
                            "content": resp if isinstance(resp, str) else json.dumps(resp)})
            elif kind == "reasoning":
                continue  # the model's thinking: not part of the chat messages an OpenAI client sends
            else:
                raise _Bad(f"unsupported message part ({str(kind)[:40]})")
        if texts or calls or m["role"] != "tool":
            msg: dict[str, Any] = {"role": m["role"], "content": _content(texts)}
            if calls:
                msg["tool_calls"] = calls
            if isinstance(m.get("finish_reason"), str):
                msg["finish_reason"] = m["finish_reason"]
            out.append(msg)
    return out


def _indexed(attrs: dict[str, Any], prefixes: tuple[str, ...]) -> list[dict[str, Any]]:
    """`gen_ai.prompt.0.role` (OpenLLMetry) / `llm.input_messages.0.message.role` (OpenInference) as messages."""
    rows: dict[int, dict[str, Any]] = {}
    for key, value in attrs.items():
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            continue
        idx, _, rest = key[len(prefix):].partition(".")
        if not idx.isdigit() or len(idx) > 6:
            continue
        rest = rest.removeprefix("message.")
        row = rows.setdefault(int(idx), {"tool_calls": {}})
        head, _, sub = rest.partition(".")
        if head == "tool_calls":
            j, _, tkey = sub.partition(".")
            if j.isdigit() and len(j) <= 6:
                tkey = tkey.removeprefix("tool_call.").removeprefix("function.")
                row["tool_calls"].setdefault(int(j), {})[tkey] = value
        elif rest in ("role", "content", "tool_call_id", "finish_reason"):
            row[rest] = value
    out = []
    for _, row in sorted(rows.items()):
        if not isinstance(row.get("role"), str):
            raise _Bad("an indexed message without a role")
        content = row.get("content")
        msg: dict[str, Any] = {"role": row["role"], "content": content if isinstance(content, str) else None}
        calls = [_tool_call(t.get("id"), t.get("name"), t.get("arguments")) for _, t in sorted(row["tool_calls"].items())]
        if calls:
            msg["tool_calls"] = calls
        if row.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(row["tool_call_id"])
        if isinstance(row.get("finish_reason"), str):
            msg["finish_reason"] = row["finish_reason"]
        out.append(msg)
    return out


def _event_message(name: str, attrs: dict[str, Any]) -> dict[str, Any]:
    """An older-semconv event (`gen_ai.user.message`, `gen_ai.choice`, ...) as a chat message."""
    body = _json(attrs.get("message")) if name == "gen_ai.choice" else attrs
    if not isinstance(body, dict):
        raise _Bad("a gen_ai.choice event without a message")
    content = _json(body.get("content"))
    msg: dict[str, Any] = {"role": body.get("role") if isinstance(body.get("role"), str) else EVENT_ROLES.get(name, "assistant"),
                           "content": content if isinstance(content, str) or content is None else json.dumps(content)}
    raw_calls = _json(body.get("tool_calls"))
    if isinstance(raw_calls, list) and raw_calls:
        msg["tool_calls"] = [_tool_call(c.get("id"), (c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
                             for c in raw_calls if isinstance(c, dict) and isinstance(c.get("function"), dict)]
    if name == "gen_ai.tool.message" and attrs.get("id") is not None:
        msg["tool_call_id"] = str(attrs["id"])
    if isinstance(attrs.get("finish_reason"), str):
        msg["finish_reason"] = attrs["finish_reason"]
    return msg


def _messages(span: Span) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(input messages, output messages) of an LLM span, from the first form it carries."""
    a = span.attrs
    if "gen_ai.input.messages" in a or "gen_ai.output.messages" in a:
        return (_semconv_messages(a.get("gen_ai.input.messages", "[]"), a.get("gen_ai.system_instructions")),
                _semconv_messages(a.get("gen_ai.output.messages", "[]")))
    inputs = _indexed(a, INDEXED_INPUT)
    outputs = _indexed(a, INDEXED_OUTPUT)
    if inputs or outputs:
        return inputs, outputs
    ins = [_event_message(n, e) for n, e in span.events if n in EVENT_ROLES]
    outs = [_event_message(n, e) for n, e in span.events if n == "gen_ai.choice"]
    return ins, outs


# ---- spans -> runs -----------------------------------------------------------------------------

def _is_llm(span: Span) -> bool:
    a = span.attrs
    return (a.get("gen_ai.operation.name") in LLM_OPERATIONS or a.get("llm.request.type") in ("chat", "completion")
            or a.get("openinference.span.kind") == "LLM")


class _Named(NamedTuple):
    """What a span's metadata says of the node call it runs in."""

    node: str
    ns: str | None  # LangGraph's checkpoint namespace of the node call (``outer:<task id>|inner:<task id>``)
    agent: str | None  # `lc_agent_name`: the agent whose graph runs the node


def _node_name(span: Span) -> _Named | None:
    """The node a span names, with its node call's namespace and agent where the metadata has them."""
    a = span.attrs
    for prefix in META_PREFIXES:
        if isinstance(node := a.get(prefix + "langgraph_node"), str) and node:
            return _named(node, a.get(prefix + "langgraph_checkpoint_ns"), a.get(prefix + "lc_agent_name"))
    for key in NODE_JSON_KEYS:
        meta = a.get(key)
        try:
            meta = json.loads(meta) if isinstance(meta, str) else meta
        except (ValueError, RecursionError):
            continue
        if isinstance(meta, dict) and isinstance(node := meta.get("langgraph_node"), str) and node:
            return _named(node, meta.get("langgraph_checkpoint_ns"), meta.get("lc_agent_name"))
    for key in NODE_KEYS:
        if isinstance(v := a.get(key), str) and v:
            return _Named(v, None, None)
    return None


def _named(node: str, ns: Any, agent: Any) -> _Named:
    # the namespace only where it is this node's (its last segment `node:<task id>`), as the tracer takes it
    ns = ns if isinstance(ns, str) and ns.rpartition("|")[2].startswith(f"{node}:") else None
    return _Named(node, ns, agent if isinstance(agent, str) and agent else None)


def _paths(own: dict[str, _Named]) -> dict[str, str]:
    """checkpoint namespace of each node call of a trace -> its path, as the tracer builds it: the
    enclosing node call's path (where that call is in the trace), with the sub-agent's segment where
    the agent changes; else the namespace's node names. Enclosing calls first (fewer segments)."""
    paths: dict[str, str] = {}
    for ns in sorted(own, key=lambda n: n.count("|")):
        outer, nested, _ = ns.rpartition("|")
        up = own.get(outer) if nested else None
        paths[ns] = agent_path(paths[outer], up.agent, own[ns].agent, own[ns].node) if up is not None else node_path(ns)
    return paths


def _ancestry(by_id: dict[str, Span]) -> tuple[dict[str, bool], dict[str, tuple[str, str | None, str | None] | None]]:
    """Per span of one trace: whether an ancestor is an LLM span (the same call seen twice), and its
    (node path, node span id, agent): the nearest span, itself or an ancestor, naming a node; then up
    while the parent is in the same node call (the same checkpoint namespace, or without one the same
    node name: LangChain copies a node's metadata onto every run inside it), so the outermost is the
    node's own span. Only the span itself naming it: the node is known, its execution (node id) is
    not. The path nests as the tracer's does (`_paths`). Each span is looked at once, parents first,
    so a trace costs time linear in its spans however deep its chain (walking up from each call was
    quadratic); a crafted parent cycle is cut where the walk meets it again."""
    parent: dict[str, Span | None] = {}
    order: list[Span] = []  # parents first
    for start in by_id.values():
        path: list[Span] = []
        on_path: set[str] = set()
        cur: Span | None = start
        while cur is not None and cur.span_id not in parent and cur.span_id not in on_path:
            path.append(cur)
            on_path.add(cur.span_id)
            cur = by_id.get(cur.parent_id) if cur.parent_id else None
        above = cur if cur is not None and cur.span_id in parent else None  # None: a root, or a cycle cut
        for s in reversed(path):
            parent[s.span_id], above = above, s
            order.append(s)
    llm_above: dict[str, bool] = {}
    names: dict[str, _Named | None] = {}
    outermost: dict[str, Span] = {}  # a naming span -> the outermost of the run of ancestors in the same node call
    nearest: dict[str, Span | None] = {}  # the span itself or its nearest ancestor naming a node
    own: dict[str, _Named] = {}  # checkpoint namespace -> what the node call's own span says
    for s in order:
        up = parent[s.span_id]
        names[s.span_id] = named = _node_name(s)
        llm_above[s.span_id] = up is not None and (_is_llm(up) or llm_above[up.span_id])
        if named is not None:
            above_named = names[up.span_id] if up is not None else None
            same = above_named is not None and (above_named.ns or above_named.node) == (named.ns or named.node)
            outermost[s.span_id] = outermost[up.span_id] if same and up is not None else s
            nearest[s.span_id] = s
            if named.ns is not None and not same:
                own.setdefault(named.ns, named)
        else:
            nearest[s.span_id] = nearest[up.span_id] if up is not None else None
    paths = _paths(own)
    nodes: dict[str, tuple[str, str | None, str | None] | None] = {}
    for s in order:
        found = nearest[s.span_id]
        if found is None:
            nodes[s.span_id] = None
            continue
        top, named = outermost[found.span_id], names[found.span_id] or _Named("", None, None)
        at = top.span_id if top is not s else None
        nodes[s.span_id] = (paths[named.ns], at, own[named.ns].agent) if named.ns is not None else (named.node, at, named.agent)
    return llm_above, nodes


def _role(node: str, agent: str | None, roles: dict[str, str]) -> str:
    """The role of a call in node `node` (a path) run by `agent`, keyed as `@trainable(roles=...)`
    keys are: the path, or its node's bare name; else the nearest enclosing node keyed. A sub-agent
    is a role of its own, never its enclosing node's: its key (its name, ``@name`` or its path),
    else its name. Outside every sub-agent, a key naming the node call's agent (the app's own
    agent) maps it. Nothing keyed: the path."""
    parts = node.split(":")
    in_agent = any(p.startswith(AGENT_MARK) for p in parts)
    for depth in range(len(parts), 0, -1):
        key = ":".join(parts[:depth])
        if key in roles:
            return roles[key]
        if depth == len(parts) and not in_agent and parts[-1] in roles:
            return roles[parts[-1]]
        if parts[depth - 1].startswith(AGENT_MARK):
            name = parts[depth - 1][len(AGENT_MARK):]
            return _agent_role(name, roles, name)
    return _agent_role(agent, roles, node) if agent else node


def _agent_role(agent: str, roles: dict[str, str], default: str) -> str:
    return roles.get(agent, roles.get(AGENT_MARK + agent, default))


def _calls(span: Span, node: str, node_id: str | None, agent: str | None, roles: dict[str, str],
           policies: dict[str, str]) -> list[LLMCall]:
    inputs, outputs = _messages(span)
    if not inputs and not outputs:
        raise _Bad("LLM span without messages")
    a = span.attrs
    model = next((m for m in (a.get("gen_ai.response.model"), a.get("gen_ai.request.model"), a.get("llm.model_name"))
                  if isinstance(m, str)), None)
    reasons = _json(a.get("gen_ai.response.finish_reasons"))
    reasons = [r for r in reasons if isinstance(r, str)] if isinstance(reasons, list) else []
    role = _role(node, agent, roles)
    calls = []
    for i, out in enumerate(outputs or [{}]):
        finish = out.pop("finish_reason", None) or (reasons[i] if i < len(reasons) else None)
        content = out.get("content")
        text = content if isinstance(content, str) else (
            "".join(p["text"] for p in content) if isinstance(content, list) else None)
        calls.append(LLMCall(
            id=choice_id(span.span_id, i), node_id=node_id, node=node, role=role,
            policy=policies.get(role, role), messages=[{k: v for k, v in m.items() if k != "finish_reason"} for m in inputs],
            output_text=text, tool_calls=out.get("tool_calls", []), prompt_ids=[], response_ids=[], response_logprobs=[],
            finish_reason=finish, model=model, start_time=span.start, end_time=span.end))
    return calls


def map_traces(spans: Iterable[Span], report: ImportReport, roles: dict[str, str] | None = None,
               policies: dict[str, str] | None = None) -> dict[str, list[LLMCall]]:
    """run id (trace id) -> its LLM calls in start order; what cannot be mapped goes to the report."""
    traces: dict[str, dict[str, Span]] = {}
    for s in spans:
        traces.setdefault(s.trace_id, {}).setdefault(s.span_id, s)  # a span exported twice counts once
    runs: dict[str, list[LLMCall]] = {}
    for trace_id, by_id in traces.items():
        calls: list[LLMCall] = []
        left_out = 0
        llm_above, nodes = _ancestry(by_id)
        for span in by_id.values():
            if not _is_llm(span):
                continue
            if llm_above[span.span_id]:
                report.nested += 1
                continue
            where = f"trace {trace_id} span {span.span_id}"
            node = nodes[span.span_id]
            if node is None:
                report.skip("LLM span with no LangGraph node ancestor", where)
                left_out += 1
                continue
            if span.error is not None:  # a call that failed (a 404, a timeout) answered nothing to train on
                report.skip("LLM span that failed (its status is ERROR)", where + (f" ({span.error})" if span.error else ""))
                left_out += 1
                continue
            try:
                calls.extend(_calls(span, *node, roles or {}, policies or {}))
            except _Bad as exc:
                report.skip(str(exc), where)
                left_out += 1
        if not calls:
            if not left_out:
                report.skip("trace with no LLM spans", f"trace {trace_id}")
            continue
        report.partial_runs += bool(left_out)
        runs[trace_id] = sorted(calls, key=lambda c: (c.start_time is None, c.start_time or 0.0))
    return runs


# where instrumentations put a run's graph input and output on its root span: OpenInference's
# `input.value` / `output.value` (JSON text, or plain text), OpenLLMetry's `traceloop.entity.*`
# (JSON text of {"inputs": ...} / {"outputs": ...})
_TRACE_ID = re.compile(r"[0-9a-f]{32}")  # a recorded run's id (GraphRun.run_id)
_ROOT_IO = (("input.value", "output.value", None), ("traceloop.entity.input", "traceloop.entity.output", ("inputs", "outputs")))


def _lc_messages(value: Any, depth: int = 0) -> Any:
    """`value` with each LangChain message in `messages_to_dict`'s form ({"type": "ai", "data":
    {...}}, as OpenInference writes a state's messages) as its own fields (the message's
    `model_dump`, as a served run's record holds it), so a reward gets messages back from either."""
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, list):
        return [_lc_messages(v, depth + 1) for v in value]
    if not isinstance(value, dict):
        return value
    data = value.get("data")
    if len(value) == 2 and isinstance(data, dict) and data.get("type") == value.get("type") and "content" in data:
        return data
    return {k: _lc_messages(v, depth + 1) for k, v in value.items()}


def root_runs(spans: Iterable[Span], input_key: str | None = None) -> dict[str, GraphRun]:
    """trace id -> its graph input and output, from the trace's root span where an
    instrumentation put them there (what becomes the run's task, as a served run's graph
    record does); a root span that failed makes the run's status `error`. `input_key`: an input
    that is not an object becomes {input_key: it} (OpenInference writes a one-field input as
    that field's text alone)."""
    out: dict[str, GraphRun] = {}
    for span in spans:
        if span.parent_id is not None or not _TRACE_ID.fullmatch(span.trace_id):
            continue
        for in_key, out_key, wrapped in _ROOT_IO:
            if in_key not in span.attrs:
                continue
            try:
                value, result = _json(span.attrs.get(in_key)), _json(span.attrs.get(out_key))
            except _Bad:  # JSON nested past Python's limit: the run is written without its task
                break
            if wrapped is not None:
                value = value.get(wrapped[0], value) if isinstance(value, dict) else value
                result = result.get(wrapped[1], result) if isinstance(result, dict) else result
            value, result = _lc_messages(value), _lc_messages(result)
            if input_key is not None and value is not None and not isinstance(value, dict):
                value = {input_key: value}
            out[span.trace_id] = GraphRun(run_id=span.trace_id, input=value, output=result,
                                          status="error" if span.error is not None else "ok",
                                          error=(span.error or "failed")[:2000] if span.error is not None else None)
            break
    return out


def import_traces(files: Iterable[str | Path], out: str | Path, *, roles: dict[str, str] | None = None,
                  policies: dict[str, str] | None = None, strict: bool = False, input_key: str | None = None) -> ImportReport:
    """Import OTLP/JSON files into the record folder `out` (appended; runs already there are skipped).
    Bad input (a missing file, not JSON, not OTLP): UserError. `strict`: anything not imported
    raises Unmapped and nothing is written. `input_key`: see `root_runs`."""
    report = ImportReport()
    spans: list[Span] = []
    for f in files:
        spans.extend(load_spans(f, report))
    runs = map_traces(spans, report, roles, policies)
    if strict and report.unmapped:
        raise Unmapped(report)
    _write_runs(Recorder(out, max_mb=2**30), runs, report, root_runs(spans, input_key))  # never trim: an import only adds
    return report


def _write_runs(recorder: Recorder, runs: dict[str, list[LLMCall]], report: ImportReport,
                graphs: dict[str, GraphRun] | None = None) -> None:
    """Append the runs not already in the recorder's folder, with their graph input and output
    where the root span carried them, counting them in `report`."""
    for run_id, calls in runs.items():
        if recorder.check(run_id, None) is None:
            report.duplicates += 1
            continue
        for call in calls:
            recorder.record(run_id, call)
        graph = (graphs or {}).get(run_id)
        if graph is not None and recorder.record_graph(graph) is None:
            report.tasks += 1
            report.text_tasks += graph.input is not None and not isinstance(graph.input, dict)
        report.runs += 1
        report.calls += len(calls)


# ---- OTLP/HTTP receiver (JSON only) -------------------------------------------------------------

@dataclass(frozen=True)
class ListenLimits:
    """What `import-traces --listen` holds at most, in connections, time and bytes (docs/serving.md)."""

    max_connections: int = 64  # open at once; a new one closes the oldest idle one, or gets a 503 if none is idle
    idle_timeout_s: float = 30.0  # a connection waiting for its next request is closed after this
    read_timeout_s: float = 60.0  # one request's headers and body must arrive within this of its first byte
    max_body_bytes: int = 64 * 2**20  # one request, as sent and unpacked
    max_inflight_bytes: int = 256 * 2**20  # all bodies being received and read at once; past it a 503 (exporters retry)
    idle_s: float = 30.0  # a trace with no new span for this long is written (its root is in another service)
    max_held_spans: int = 200_000  # spans held for their trace's root; past this or max_held_bytes
    max_held_bytes: int = 256 * 2**20  # (their text), the least recently sent traces are written at once
    flush_every_s: float = 1.0  # how often idle traces are looked for
    close_wait_s: float = 5.0  # at the end, requests under way may finish for this long


MAX_BODY_BYTES = ListenLimits.max_body_bytes
LOOPBACK = ("127.0.0.1", "::1", "localhost")
_BUSY_BODY = b'{"error": "too many connections; retry later"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
         b"connection: close\r\nretry-after: 1\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


def _size(value: Any) -> int:
    """About what holding a parsed value costs: its text, and a little per item."""
    if isinstance(value, str):
        return len(value) + 8
    if isinstance(value, dict):
        return sum(len(k) + _size(v) for k, v in value.items()) + 8
    if isinstance(value, list):
        return sum(map(_size, value)) + 8
    return 8


def _span_bytes(span: Span) -> int:
    return 128 + len(span.name) + _size(span.attrs) + sum(len(n) + _size(a) for n, a in span.events)


@dataclass
class _Held:
    spans: list[Span] = field(default_factory=list)
    nbytes: int = 0
    seen: float = 0.0


class Receiver:
    """`import-traces --listen`: POST /v1/traces (OTLP/HTTP, JSON encoding) into the record folder
    `out`. Spans are held per trace until its root span (no parent) arrives, or `limits.idle_s`
    passes without new spans of it (a root in another service: a timer writes it, no other POST
    needed), then mapped and written like a file import; past the held bounds (spans, bytes) the
    least recently sent traces are written at once; `close()` writes what is left. Parsing, mapping
    and writing happen outside the lock on what is held, so a large POST delays no other's intake;
    the record folder is read once, here, and then only appended to. Protobuf bodies get 415."""

    def __init__(self, out: str | Path, *, roles: dict[str, str] | None = None, policies: dict[str, str] | None = None,
                 api_key: str | None = None, limits: ListenLimits | None = None, input_key: str | None = None) -> None:
        self.out, self.roles, self.policies, self.api_key = Path(out), roles, policies, api_key
        self.input_key = input_key
        self.limits = limits or ListenLimits()
        self.report = ImportReport()
        try:
            self._recorder = Recorder(self.out, max_mb=2**30)  # never trim: an import only adds
        except OSError as exc:
            raise UserError(f"--out {self.out}: cannot write there ({exc.strerror}); give a folder you can write to") from None
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently sent first
        self._held_spans = self._held_bytes = self._inflight = 0
        self._lock = threading.Lock()  # what is held and in flight: never kept while parsing, mapping or writing
        self._write_lock = threading.Lock()  # the recorder: one writer at a time
        self._report_lock = threading.Lock()  # the report, added to by every POST: never waits for a write
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None

    def key_ok(self, authorization: str | None) -> bool:
        """`Authorization: Bearer KEY` when a key is set, compared in constant time (as `serve` does)."""
        if not self.api_key:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode())

    def protection(self) -> str:
        return "API key required" if self.api_key else "no API key: anyone who can connect may send traces"

    def reserve(self, nbytes: int) -> bool:
        """Count `nbytes` more of request bodies held; False (nothing counted) past `max_inflight_bytes`."""
        with self._lock:
            if self._inflight + nbytes > self.limits.max_inflight_bytes:
                return False
            self._inflight += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._inflight -= nbytes

    def accept(self, body: bytes | bytearray, content_type: str) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON answer) for one POST /v1/traces body."""
        if "protobuf" in content_type:
            return 415, {"error": "OTLP protobuf is not read here: set the exporter to JSON "
                                  "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json)"}
        try:
            req = json.loads(body)
        except (ValueError, RecursionError):
            return 400, {"error": "the body is not JSON"}
        if not _is_request(req):
            return 400, {"error": "not an OTLP trace export (no resourceSpans list)"}
        parsed = ImportReport()
        spans = [(s, _span_bytes(s)) for s in _request_spans(req, "POST /v1/traces", parsed)]
        del req
        with self._report_lock:
            self.report.merge(parsed)
        self._write(self._hold(spans))
        rejected = sum(parsed.unmapped.values())
        return 200, ({"partialSuccess": {"rejectedSpans": str(rejected), "errorMessage": "malformed spans"}}
                     if rejected else {})

    def _hold(self, spans: list[tuple[Span, int]]) -> list[list[Span]]:
        """Hold `spans`; return the traces due now (their root arrived, or the held bounds are passed)."""
        rooted: set[str] = set()
        with self._lock:
            now = time.monotonic()
            for s, nbytes in spans:
                held = self._held.get(s.trace_id)
                if held is None:
                    held = self._held[s.trace_id] = _Held()
                else:
                    self._held.move_to_end(s.trace_id)
                held.spans.append(s)
                held.nbytes += nbytes
                held.seen = now
                self._held_spans += 1
                self._held_bytes += nbytes
                if s.parent_id is None:
                    rooted.add(s.trace_id)
            due = [self._take(t) for t in rooted]
            while self._held and (self._held_spans > self.limits.max_held_spans or self._held_bytes > self.limits.max_held_bytes):
                due.append(self._take(next(iter(self._held))))
        return due

    def _take(self, trace_id: str) -> list[Span]:
        held = self._held.pop(trace_id)
        self._held_spans -= len(held.spans)
        self._held_bytes -= held.nbytes
        return held.spans

    def _write(self, traces: list[list[Span]]) -> None:
        """Map and write traces taken out of those held; only the writing itself is serialised."""
        if not traces:
            return
        mapped = ImportReport()
        runs = map_traces((s for spans in traces for s in spans), mapped, self.roles, self.policies)
        graphs = root_runs((s for spans in traces for s in spans), self.input_key)
        with self._write_lock:
            _write_runs(self._recorder, runs, mapped, graphs)
        with self._report_lock:
            self.report.merge(mapped)

    def _write_idle(self) -> None:
        """The timer: every `flush_every_s`, write the traces with no new span for `idle_s`."""
        while not self._stop.wait(self.limits.flush_every_s):
            cutoff = time.monotonic() - self.limits.idle_s
            with self._lock:
                due = []
                while self._held and next(iter(self._held.values())).seen < cutoff:
                    due.append(self._take(next(iter(self._held))))
            try:
                self._write(due)
            except Exception:  # a full disk: said, and the timer goes on
                log.exception("import-traces: could not write %d idle traces to %s", len(due), self.out)

    def close(self) -> ImportReport:
        """Stop the timer and write every trace still held; the report of the whole session."""
        self._stop.set()
        if self._timer is not None:
            self._timer.join()
        with self._lock:
            due = [self._take(t) for t in list(self._held)]
        self._write(due)
        return self.report

    def server(self, host: str, port: int) -> _Server:
        """A stdlib HTTP server answering POST /v1/traces within `limits`, and the timer that writes
        idle traces; `serve_forever()` it, then `server_close()` and `close()`."""
        if self.api_key is None and host not in LOOPBACK:
            log.warning("receiving traces on %s without an API key: anyone who can reach it can add runs to %s "
                        "(set MAS_TRAINER_API_KEY or --api-key-file)", host, self.out)
        server = _Server(host, port, self)
        if self._timer is None:
            self._timer = threading.Thread(target=self._write_idle, name="import-traces-timer", daemon=True)
            self._timer.start()
        return server


def _hang_up(sock: socket.socket) -> None:
    """End a connection another thread may be reading: its read returns at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` of them: a new connection closes the
    oldest idle one to make room, or gets a 503 when every one is busy with a request."""

    daemon_threads = True

    def __init__(self, host: str, port: int, receiver: Receiver) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.receiver = receiver
        self.conns: dict[socket.socket, bool] = {}  # open connections, oldest first -> busy with a request
        self.changed = threading.Condition()
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1/traces"

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.changed:
            full = len(self.conns) >= self.receiver.limits.max_connections
            idle = next((c for c, busy in self.conns.items() if not busy), None) if full else None
            if idle is not None:
                del self.conns[idle]
                _hang_up(idle)
            if not full or idle is not None:
                self.conns[request] = False
        if full and idle is None:
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def mark(self, sock: socket.socket, busy: bool) -> None:
        with self.changed:
            if sock in self.conns:
                self.conns[sock] = busy
                self.changed.notify_all()

    def shutdown_request(self, request: Any) -> None:
        with self.changed:
            self.conns.pop(request, None)
            self.changed.notify_all()
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("import-traces: the connection from %s ended with an error", client_address, exc_info=True)

    def server_close(self) -> None:
        """Stop listening and close idle connections; let requests under way end (for `close_wait_s`
        at most), so their spans are held before the receiver writes what it holds."""
        super().server_close()
        deadline = time.monotonic() + self.receiver.limits.close_wait_s
        with self.changed:
            while self.conns:
                left = deadline - time.monotonic()
                for sock, busy in list(self.conns.items()):
                    if not busy or left <= 0:
                        _hang_up(sock)
                if left <= 0 or not any(self.conns.values()):
                    break
                self.changed.wait(min(left, 0.1))


class _Deadline(io.RawIOBase):
    """A connection's reads, each given only what is left of its deadline (a socket timeout alone
    restarts at every byte: a client sending a byte a minute would hold the connection for ever).
    Waiting for a request: `idle_timeout_s`; from its first byte, `read_timeout_s` for all of it."""

    def __init__(self, sock: socket.socket, server: _Server) -> None:
        super().__init__()
        self.sock, self.server, self.busy, self.deadline = sock, server, False, 0.0

    def wait_for_request(self) -> None:
        self.busy, self.deadline = False, time.monotonic() + self.server.receiver.limits.idle_timeout_s
        self.server.mark(self.sock, False)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the connection's time is up")
        self.sock.settimeout(left)
        n = self.sock.recv_into(buffer)
        if n and not self.busy:
            self.busy, self.deadline = True, time.monotonic() + self.server.receiver.limits.read_timeout_s
            self.server.mark(self.sock, True)
        return n


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # exporters keep their connection; an idle one is closed after idle_timeout_s
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.reader = _Deadline(self.connection, self.server)
        self.rfile = io.BufferedReader(self.reader, 64 * 1024)

    def handle_one_request(self) -> None:
        self.reader.wait_for_request()
        super().handle_one_request()

    def _answer(self, status: int, body: dict[str, Any], close: bool = False, retry: bool = False) -> None:
        """Answer; `close` where the body was not read (or the client is to go away)."""
        data = json.dumps(body).encode()
        self.connection.settimeout(self.server.receiver.limits.read_timeout_s)
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        if retry:
            self.send_header("retry-after", "1")
        if close:
            self.send_header("connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        receiver, limits = self.server.receiver, self.server.receiver.limits
        if self.path.split("?")[0] != "/v1/traces":
            return self._answer(404, {"error": "POST OTLP JSON traces to /v1/traces"}, close=True)
        if not receiver.key_ok(self.headers.get("authorization")):
            return self._answer(401, {"error": "invalid or missing API key: send Authorization: Bearer KEY (exporters: "
                                               "OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20KEY)"}, close=True)
        try:
            size = int(self.headers.get("content-length", ""))
        except ValueError:
            return self._answer(411, {"error": "send a content-length"}, close=True)
        too_large = {"error": f"over {limits.max_body_bytes >> 20} MB; export smaller batches"}
        if size > limits.max_body_bytes or size < 0:
            return self._answer(413, too_large, close=True)
        busy = {"error": "the receiver holds too many request bodies at once; retry later"}
        if not receiver.reserve(size):
            return self._answer(503, busy, close=True, retry=True)
        held = size
        try:
            body = bytearray()
            while len(body) < size:
                try:
                    chunk = self.rfile.read1(min(size - len(body), 2**20))
                except TimeoutError:
                    return self._answer(408, {"error": f"the request did not arrive within {limits.read_timeout_s:g} s"},
                                        close=True)
                if not chunk:
                    self.close_connection = True
                    return None
                body += chunk
            encoding = self.headers.get("content-encoding", "").strip().lower()
            if encoding == "gzip":  # the collector's otlphttp exporter compresses by default
                unpacked, inflate = bytearray(), zlib.decompressobj(16 + zlib.MAX_WBITS)
                data: bytes | bytearray = body
                while True:
                    try:
                        out = inflate.decompress(data, 2**20)
                    except zlib.error:
                        return self._answer(400, {"error": "the gzip body is damaged"})
                    data = inflate.unconsumed_tail
                    if not out and not data:
                        break
                    if len(unpacked) + len(out) > limits.max_body_bytes:
                        return self._answer(413, {"error": f"over {limits.max_body_bytes >> 20} MB unpacked; "
                                                           "export smaller batches"})
                    if not receiver.reserve(len(out)):
                        return self._answer(503, busy, retry=True)
                    held += len(out)
                    unpacked += out
                body = unpacked
            elif encoding not in ("", "identity"):
                return self._answer(415, {"error": f"content-encoding {encoding[:20]!r}: send gzip or none"})
            self._answer(*receiver.accept(body, self.headers.get("content-type", "")))
        finally:
            receiver.release(held)
        return None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass
