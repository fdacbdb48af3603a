"""What `trace` prints of a rollout, and the metrics rows, say of tool calls that did not parse
(issue 42, point 3): they are counted and shown, never lost in the rollout's text."""

from __future__ import annotations

from rich.console import Console

from mas_trainer.engines.chat import parse_tool_calls
from mas_trainer.loop.trainer import summarize
from mas_trainer.trace.report import print_trajectories
from mas_trainer.trace.schema import LLMCall, NodeCall, Trajectory

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


def _call(i: int, text: str, finish: str) -> LLMCall:
    content, calls = parse_tool_calls(text, TOOLS)  # as the gateway parses what the engine wrote
    return LLMCall(id=f"c{i}", node_id="n1", node="agent", role="agent", policy="p", messages=[], output_text=content,
                   tool_calls=calls, tools=TOOLS, prompt_ids=[1], response_ids=[2], response_logprobs=[-0.5],
                   finish_reason="tool_calls" if calls and finish != "length" else finish)


def _rollout(rid: str, *calls: LLMCall) -> Trajectory:
    node = NodeCall(id="n1", name="agent", step=1, parent_id=None, status="ok")
    return Trajectory(rollout_id=rid, task={}, status="ok", nodes=[node], llm_calls=list(calls))


def _printed(trajs: list[Trajectory]) -> str:
    console = Console(record=True, width=300)
    print_trajectories(trajs, console)
    return console.export_text()


def test_cut_and_malformed_tool_calls_are_counted_and_shown():
    whole = _call(0, '{"name": "search", "arguments": {"query": "paris"}}', "stop")
    cut = _call(1, '{"name": "search", "arguments": {"query": "par', "length")  # a forced call cut by max_tokens
    tag = _call(2, 'I will search. <tool_call>{"name": "search", "arguments": {"query": }</tool_call>', "stop")
    assert [c.finish_reason for c in (whole, cut, tag)] == ["tool_calls", "length", "stop"]
    assert cut.tool_calls[0]["function"] == {"name": "search", "arguments": '{"query": "par'}  # a tool call, not text

    trajs = [_rollout("r-clean", whole), _rollout("r-broken", cut, tag)]
    assert summarize(trajs)["tool_calls/unparsed"] == 2
    assert summarize(trajs[:1])["tool_calls/unparsed"] == 0
    out = _printed(trajs)
    assert out.count("did not parse") == 3  # two calls marked, and the summary
    assert "1 tool call did not parse (cut by max_tokens)" in out
    assert "tool calls that did not parse: 2 in 2 LLM calls, 1 of them cut by max_tokens (raise the app's max_tokens)" in out


def test_a_clean_run_prints_nothing_about_unparsed_calls():
    out = _printed([_rollout("r", _call(0, '{"name": "search", "arguments": {"query": "x"}}', "stop"))])
    assert "did not parse" not in out
