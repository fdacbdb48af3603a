"""The gateway serves OpenAI's Responses API (`/v1/responses`) on the chat path: what the OpenAI
SDK's `client.responses` and `ChatOpenAI(use_responses_api=True)` (deepagents' `openai:` models)
send is routed, sampled, answered and filed for training as a chat completion is."""

import json
import operator
import secrets
from typing import Annotated, Literal

import httpx
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel
from typing_extensions import TypedDict

from mas_trainer import api, trainable
from mas_trainer.engines.fake import FakeChatFormat, FakeEngine, byte_text
from mas_trainer.gateway import Gateway, GatewayServer, Ledger, PolicyBackend, RolloutSampling, Router
from mas_trainer.spec import TrainSpec
from mas_trainer.trace import instrument
from mas_trainer.trace.instrument import rollout_token

ADD = {"type": "function", "name": "add", "description": "Add one.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
CALL_ADD = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


class Prompted(FakeEngine):
    """A fake engine that keeps the chat messages and sampling params of each request it answers
    (FakeChatFormat renders a prompt as the JSON of its messages)."""

    def __init__(self, reply: str):
        super().__init__(latency_s=0.0, reply=reply)
        self.seen: list[tuple[list[dict], object]] = []

    def _choices(self, prompt_ids, params):
        self.seen.append((json.loads(byte_text(prompt_ids))["messages"], params))
        return super()._choices(prompt_ids, params)


@pytest.fixture
def served():
    spec = TrainSpec.build({"planner": "p", "coder": "q"}).resolve(["planner", "coder"])
    engines = {"p": Prompted("from p"), "q": Prompted(CALL_ADD), "json": Prompted('{"answer": "yes"}')}
    ledger = Ledger()
    gw = Gateway(Router(spec, model_routes={"gpt-4o-mini": "p"}), ledger, api_key=None, sampling=RolloutSampling(), rollouts=True)
    for name, engine in engines.items():
        gw.add_policy(name, PolicyBackend(engine, FakeChatFormat()))
    with GatewayServer(gw) as server:
        yield server, engines, ledger


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def test_text_response_with_the_engines_tokens(served):
    server, engines, _ = served
    r = _client(server).responses.create(model="gpt-4o-mini", instructions="Be brief.", input="hi", max_output_tokens=40,
                                         temperature=0.3, top_p=0.9, store=True)
    assert (r.object, r.status, r.output_text, r.model) == ("response", "completed", "from p", "gpt-4o-mini")
    messages, params = engines["p"].seen[-1]
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (params.max_tokens, params.temperature, params.top_p) == (40, 0.3, 0.9)
    extra = r.model_extra
    assert extra["policy"] == "p" and extra["store"] is False  # stateless: store=true keeps nothing
    assert r.usage.input_tokens == len(extra["prompt_token_ids"]) and r.usage.output_tokens == len(extra["token_ids"]) > 0
    assert [lp["token"] for lp in extra["logprobs"]["content"]] == [f"token_id:{t}" for t in extra["token_ids"]]


def test_input_items_are_the_chat_conversation(served):
    server, engines, _ = served
    _client(server).responses.create(model="p", input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "1+1?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # no reasoning is given back: left out of the prompt
        {"type": "message", "role": "assistant", "id": "msg_1", "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "2"},
    ], tools=[ADD])
    messages, _ = engines["p"].seen[-1]
    assert messages == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "1+1?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}],
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ]


def test_function_tools_and_structured_output(served):
    server, engines, _ = served
    client = _client(server)
    r = client.responses.create(model="q", input="1+1?", tools=[ADD], tool_choice="required")
    [call] = r.output
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 1}
    forced = engines["q"].seen[-1][1].json_schema  # the engine decodes the call under its schema
    assert forced["properties"]["name"] == {"const": "add"} and forced["properties"]["arguments"]["required"] == ["a"]

    class Answer(BaseModel):
        answer: Literal["yes", "no"]

    parsed = client.responses.parse(model="json", input="yes?", text_format=Answer)
    assert parsed.output_parsed == Answer(answer="yes")
    assert engines["json"].seen[-1][1].json_schema["properties"]["answer"]["enum"] == ["yes", "no"]


def test_streams_are_the_event_sequence_the_sdk_accepts(served):
    server, _, _ = served
    client = _client(server)
    with client.responses.stream(model="p", input="hi") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert final.output_text == "from p" and final.model_extra["token_ids"]
    events = list(client.responses.create(model="q", input="1+1?", tools=[ADD], stream=True))
    assert [e.type for e in events][2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                                            "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert json.loads(events[-1].response.output[0].arguments) == {"a": 1}


def test_a_rollout_call_is_filed_as_a_chat_call_is(served):
    server, _, ledger = served
    span = secrets.token_hex(8)
    bag = {"mas.rollout": "r1", "mas.node": "coder", "mas.node_call": "n1", "mas.role": "coder",
           "mas.token": rollout_token("r1", "coder", "n1", "coder", span)}
    headers = {"traceparent": f"00-0af7651916cd43dd8448eb211c80319c-{span}-01", "baggage": ",".join(f"{k}={v}" for k, v in bag.items())}
    r = httpx.post(f"{server.base_url}/responses", headers=headers, json={"model": "gpt-4o-mini", "input": "1+1?", "tools": [ADD]})
    assert r.status_code == 200 and r.headers["x-mas-policy"] == "q"  # the node's policy, not the model name's
    [call] = ledger.take("r1")
    assert (call.id, call.node, call.policy, call.finish_reason) == (span, "coder", "q", "tool_calls")
    assert call.tool_calls[0]["function"]["name"] == "add" and call.tools[0]["function"]["name"] == "add"
    assert call.response_ids == r.json()["token_ids"] and len(call.response_logprobs) == len(call.response_ids)


async def test_async_sdk_calls_in_a_rollout_carry_its_signed_baggage(served, monkeypatch):
    """The instrumentation wraps `responses.create`/`parse` (async here) as it wraps chat: the call is
    routed by its node and filed under its rollout."""
    server, _, ledger = served
    instrument.instrument_openai()
    monkeypatch.setattr(instrument, "current_call", lambda: instrument.CallContext("r2", "coder", "n1", "coder"))
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)

    created = await client.responses.create(model="gpt-4o-mini", input="1+1?", tools=[ADD], tool_choice="required")
    parsed = await client.responses.parse(model="gpt-4o-mini", input="1+1?", tools=[ADD])
    await client.close()
    assert created.model_extra["policy"] == parsed.model_extra["policy"] == "q"  # the node's policy
    calls = ledger.take("r2")
    assert [c.id for c in calls] == [created.id.removeprefix("resp_"), parsed.id.removeprefix("resp_")]
    assert all(c.node == "coder" and c.tool_calls and c.response_ids for c in calls)


@pytest.mark.parametrize("body, status, needle", [
    ({"previous_response_id": "resp_1"}, 400, "send the whole conversation as input"),
    ({"conversation": "conv_1"}, 400, "keeps no conversations"),
    ({"background": True}, 400, "leave background out"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "stateless"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "item 0 has type 'web_search_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input_image"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "reasoning items alone"),
    ({"input": [{"role": "user", "content": "x"}] * 4096}, 400, "at most 4095 items"),
    ({"input": "x" * 5_000_000}, 413, "over"),
    ({"model": "nope"}, 404, "nope"),
])
def test_bad_requests_get_one_line_4xx(served, body, status, needle):
    server, _, _ = served
    r = httpx.post(f"{server.base_url}/responses", json={"model": "p", "input": "hi", **body}, timeout=30)
    message = r.json()["error"]["message"]
    assert r.status_code == status and needle in message and "\n" not in message, message


def test_a_prompt_over_the_context_is_refused_as_in_chat():
    gw = Gateway(api_key=None)
    gw.add_policy("p", PolicyBackend(FakeEngine(max_context=64), FakeChatFormat()))
    with GatewayServer(gw) as server:
        r = httpx.post(f"{server.base_url}/responses", json={"model": "p", "input": "word " * 1000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# --- a LangGraph app on ChatOpenAI(use_responses_api=True), traced on the tiny model -------------------

class State(TypedDict, total=False):
    question: str
    plan: str
    verdict: str
    colour: str
    answered_by: Annotated[list[str], operator.add]  # the ids of the responses the nodes got


class Verdict(BaseModel):
    verdict: Literal["yes", "no"]


@tool
def paint(colour: Literal["red", "blue"]) -> str:
    """Paint in one colour."""
    return colour


def _app():
    llm = ChatOpenAI(model="gpt-4o-mini", use_responses_api=True, max_retries=0, max_tokens=96)  # room for any forced call

    def planner(s: State) -> State:
        chunks = list(llm.stream(f"Plan: {s['question']}"))
        plan = sum(chunks[1:], chunks[0])
        return {"plan": plan.text, "answered_by": [plan.id]}

    def judge(s: State) -> State:
        out = llm.with_structured_output(Verdict, include_raw=True).invoke(f"{s['plan']}\nAnswer yes or no.")
        return {"verdict": out["parsed"].verdict, "answered_by": [out["raw"].id]}

    def painter(s: State) -> State:
        message = llm.bind_tools([paint], tool_choice="required").invoke("Paint the sky.")
        return {"colour": message.tool_calls[0]["args"]["colour"], "answered_by": [message.id]}

    g = StateGraph(State)
    for name, fn in (("planner", planner), ("judge", judge), ("painter", painter)):
        g.add_node(name, fn)
    g.add_edge(START, "planner")
    g.add_edge("planner", "judge")
    g.add_edge("judge", "painter")
    g.add_edge("painter", END)
    return trainable(g.compile(), roles={"planner": "lead", "judge": "crew", "painter": "crew"},
                     policies={"lead": "tiny", "crew": "tiny"})


def test_a_langgraph_app_on_the_responses_api_is_traced_routed_and_recorded(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    result = api.trace(_app(), [{"question": "is the sky blue"}], model="tiny", rewards=False)
    [t] = result.trajectories
    assert t.status == "ok", t.error
    # structured output and the forced call decoded under their schemas, parsed by LangChain
    assert t.final_state["verdict"] in ("yes", "no") and t.final_state["colour"] in ("red", "blue")
    assert [i.split("_")[0] for i in t.final_state["answered_by"]] == ["resp"] * 3  # Responses API answers, not chat completions
    assert [(c.node, c.policy) for c in t.llm_calls] == [("planner", "lead"), ("judge", "crew"), ("painter", "crew")]
    for c in t.llm_calls:
        assert c.response_ids and len(c.response_logprobs) == len(c.response_ids) and c.prompt_ids
    assert t.llm_calls[2].tool_calls[0]["function"]["name"] == "paint"
