"""The gateway speaks enough OpenAI for the official clients, and survives bad requests."""

import json
import logging
import secrets

import httpx
import openai
import pytest

from mas_trainer.engines.base import SamplingParams
from mas_trainer.engines.fake import FakeChatFormat, FakeEngine
from mas_trainer.gateway import Gateway, GatewayServer, Ledger, PolicyBackend, RolloutSampling, Router
from mas_trainer.spec import TrainSpec
from mas_trainer.trace.instrument import rollout_token
from mas_trainer.trace.schema import LLMCall


def signed(rollout, node=None, call=None, role=None, span=None):
    """Headers of one rollout call as this process's instrumentation sends them: the chat
    span in the traceparent and the baggage with the token that signs that span."""
    span = span or secrets.token_hex(8)
    fields = {"mas.rollout": rollout, "mas.node": node, "mas.node_call": call, "mas.role": role,
              "mas.token": rollout_token(rollout, node, call, role, span)}
    return {"traceparent": f"00-0af7651916cd43dd8448eb211c80319c-{span}-01",
            "baggage": ",".join(f"{k}={v}" for k, v in fields.items() if v is not None)}


class Recording(FakeEngine):
    """A fake upstream that remembers the sampling params each request arrived with."""

    def __init__(self, reply: str = "hello there", **kw):
        super().__init__(model_name="fake", latency_s=0.0, reply=reply, **kw)
        self.params = []

    async def generate(self, prompt_ids, params, *, turn_id=None):
        self.params.append(params)
        return await super().generate(prompt_ids, params, turn_id=turn_id)


@pytest.fixture
def served():
    spec = TrainSpec.build({"planner": "p", "coder": "q"}).resolve(["planner", "coder"])
    engines = {"p": Recording("from p"), "q": Recording('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')}
    ledger = Ledger()
    gw = Gateway(Router(spec, model_routes={"gpt-4o-mini": "p"}), ledger, api_key=None, sampling=RolloutSampling(), rollouts=True)
    for name, eng in engines.items():
        gw.add_policy(name, PolicyBackend(eng, FakeChatFormat()))
    with GatewayServer(gw) as server:
        yield server, engines, ledger


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def test_models_and_routing_by_model_name(served):
    server, engines, _ = served
    client = _client(server)
    assert {m.id for m in client.models.list().data} == {"p", "q", "gpt-4o-mini"}
    r = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == "from p"
    raw = r.model_dump()
    assert len(raw["choices"][0]["token_ids"]) == len(raw["choices"][0]["logprobs"]["content"]) > 0
    assert raw["prompt_token_ids"]


def test_sampling_params_are_passed_to_the_engine(served):
    server, engines, _ = served
    client = _client(server)
    r = client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "hi"}], temperature=0.3, top_p=0.9,
        max_tokens=7, stop=["\n"], n=2, seed=11,
    )
    assert len(r.choices) == 2
    p = engines["p"].params[-1]
    assert (p.temperature, p.top_p, p.max_tokens, p.stop, p.n, p.seed) == (0.3, 0.9, 7, ("\n",), 2, 11)


def test_structured_output_and_forced_tools_constrain_the_engine(served):
    server, engines, _ = served
    client = _client(server)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": schema}},
    )
    got = engines["p"].params[-1].json_schema
    assert got["properties"]["answer"]["type"] == "string" and got["properties"]["answer"]["maxLength"] > 0
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice="required")
    forced = engines["p"].params[-1].json_schema
    assert forced["properties"]["name"] == {"const": "add"}


def test_tool_calls_in_model_output_become_openai_tool_calls(served):
    server, _, _ = served
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    r = _client(server).chat.completions.create(model="q", messages=[{"role": "user", "content": "1+1"}], tools=[tool])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "add"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 1}


def test_streaming_matches_the_plain_response(served):
    server, _, _ = served
    client = _client(server)
    chunks = list(client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "from p"
    assert chunks[-1].usage.completion_tokens > 0


def test_baggage_routes_by_node_and_files_tokens_by_rollout(served):
    server, _, ledger = served
    r = httpx.post(f"{server.base_url}/chat/completions", headers=signed("r1", "coder", "abc", "coder", span="b7ad6b7169203331"),
                   json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    [call] = ledger.take("r1")
    assert (call.id, call.node, call.node_id, call.role, call.policy) == ("b7ad6b7169203331", "coder", "abc", "coder", "q")
    assert len(call.response_ids) == len(call.response_logprobs) > 0


def test_validation_temperature_overrides_rollout_requests_only(served):
    server, engines, _ = served
    gw = server.gateway
    body = {"model": "p", "messages": [{"role": "user", "content": "x"}], "temperature": 0.7}
    gw.sampling.reseed(5, temperature=0.0)  # as the session that owns it does between batches
    try:
        assert httpx.post(f"{server.base_url}/chat/completions", headers=signed("r2", "planner", None, "planner"), json=body).status_code == 200
        assert engines["p"].params[-1].temperature == 0.0
        # a request outside any rollout (a user poking the endpoint) keeps its own sampling
        assert httpx.post(f"{server.base_url}/chat/completions", json=body).status_code == 200
        assert engines["p"].params[-1].temperature == 0.7
    finally:
        gw.sampling.reseed(None)
    assert httpx.post(f"{server.base_url}/chat/completions", headers=signed("r2", "planner", None, "planner"), json=body).status_code == 200
    assert engines["p"].params[-1].temperature == 0.7


def test_request_seeds_follow_step_rollout_node_and_call_count():
    sampling = RolloutSampling()
    plain = SamplingParams()
    assert sampling.apply(plain, "r1", "planner") == plain  # not reseeded: requests keep their own
    sampling.reseed(7)
    first = [sampling.apply(plain, "r1", "planner").seed for _ in range(2)]
    other = sampling.apply(plain, "r1", "coder").seed
    assert first[0] != first[1] and other not in first  # k-th call of a node, per node
    assert sampling.apply(plain, None, "planner") == plain  # outside any rollout
    assert sampling.apply(SamplingParams(seed=3), "r1", "planner").seed == 3  # the request's own seed wins
    sampling.reseed(7)  # the step re-run (resume): the same seeds again
    assert [sampling.apply(plain, "r1", "planner").seed for _ in range(2)] == first
    sampling.reseed(8)
    assert sampling.apply(plain, "r1", "planner").seed != first[0]


def test_the_session_owns_the_sampling_its_gateway_reads(fake_session):
    assert fake_session.gateway.sampling is fake_session.sampling
    fake_session.reseed(3, temperature=0.0)
    assert fake_session.gateway.sampling.apply(SamplingParams(temperature=0.9), "r", "n").temperature == 0.0


def test_refusals_fallbacks_and_drops_are_logged(caplog):
    caplog.set_level(logging.INFO, logger="mas_trainer.gateway")
    spec = TrainSpec.build({"planner": "p"}).resolve(["planner"])
    gw = Gateway(Router(spec, fallback="p"), api_key="k")
    gw.add_policy("p", PolicyBackend(FakeEngine(latency_s=0.0, reply="ok"), FakeChatFormat()))
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]}
    with GatewayServer(gw) as server:
        assert httpx.post(f"{server.base_url}/chat/completions", json=body).status_code == 401
        for _ in range(2):
            r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers={"authorization": "Bearer k"})
            assert r.status_code == 200
    by_logger = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert ("mas_trainer.gateway.server", "INFO", "refused a request (401): invalid or missing API key") in by_logger
    fallbacks = [m for name, level, m in by_logger if name == "mas_trainer.gateway.router" and level == "WARNING"]
    assert len(fallbacks) == 1 and "'gpt-4o-mini'" in fallbacks[0] and "fallback policy 'p'" in fallbacks[0]  # once per model

    ledger = Ledger()
    ledger.take("r1")
    ledger.file("r1", LLMCall(id="late", node_id=None, node="planner", role="planner", policy="p", messages=[], output_text="",
                              prompt_ids=[1], response_ids=[2], response_logprobs=[0.0], finish_reason="stop"))
    assert ledger.take("r1") == []
    assert any(r.name == "mas_trainer.gateway.ledger" and "late of rollout r1" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ("not json", 400, "not valid JSON"),
        ({"model": "p"}, 400, "messages"),
        ({"model": "p", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ({"model": "p", "messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, "temperature"),
        ({"model": "p", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "available models"),
        ({"model": "p", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}, 400, "tool"),
    ],
)
def test_malformed_requests_get_4xx_json_and_server_keeps_serving(served, body, status, needle):
    server, _, _ = served
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.base_url}/chat/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == status
    assert needle in r.json()["error"]["message"]
    ok = _client(server).chat.completions.create(model="p", messages=[{"role": "user", "content": "still there?"}])
    assert ok.choices[0].message.content == "from p"


def test_api_key_is_enforced_when_set():
    gw = Gateway(api_key="s3cret")
    gw.add_policy("p", PolicyBackend(FakeEngine(latency_s=0.0, reply="ok"), FakeChatFormat()))
    with GatewayServer(gw) as server:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=server.base_url, api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}]).choices[0].message.content == "ok"


def test_binds_loopback_by_default():
    with GatewayServer(Gateway()) as server:
        assert server.host == "127.0.0.1" and server.base_url.startswith("http://127.0.0.1:")
