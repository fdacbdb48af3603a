"""A request's schema never stops a fleet's engine, whatever replicas serve it.

A schema a replica refuses (past the compile deadline, rejected by xgrammar) came back as that
replica's error, and a replica's error fails the engine: fit stopped, or `serve` with replicas
answered 503 from then on, because of one request. The fleet's engine probes every schema under
the embedded engines' deadline before a replica sees it; the project's own servers (`mas-torch`,
`mas-vllm`) are then sent the schema, which they compile themselves. Here the replica is the
project's server as `TorchRolloutServer.generate` runs it (vLLM's sampling fields to the embedded
engine), its errors delivered as Ray delivers an actor's; verl's vLLM servers on GPUs are covered by
test_replica_grammar.py.
"""

from __future__ import annotations

import functools
import traceback

import pytest

pytest.importorskip("xgrammar")

from ray.exceptions import RayTaskError  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.chat import HFChatFormat  # noqa: E402
from mas_trainer.engines.grammar import SchemaGrammars, SchemaRefused  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.engines.torch_engine import TorchEngine  # noqa: E402
from mas_trainer.replicas import fleet as fleet_module  # noqa: E402
from mas_trainer.replicas.config import ReplicaConfig  # noqa: E402
from mas_trainer.replicas.engine import ReplicaEngine, ReplicaError  # noqa: E402
from mas_trainer.replicas.fleet import RolloutFleet  # noqa: E402
from mas_trainer.replicas.torch_replica import sampling_from_vllm  # noqa: E402

DEADLINE_S = 3  # the compile deadline, gateway and replica alike (the default 10 s, shortened)
SLOW = {"type": "string", "pattern": "[a-z0-9]{1,10000}"}  # 25-40 s to compile on the reference machine
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}


def delivered(exc: Exception) -> Exception:
    """An actor's exception as the caller gets it from Ray: a `RayTaskError` that is also an instance of it."""
    return RayTaskError("TorchRolloutServer.generate", "".join(traceback.format_exception(exc)), exc).as_instanceof_cause()


class OwnServer:
    """The project's replica server (`TorchRolloutServer.generate`) on the embedded engine, reached
    through verl's client."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.calls: list[dict] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.calls.append(dict(sampling_params))
        try:
            gen = (await self.engine.generate(list(prompt_ids), sampling_from_vllm(dict(sampling_params))))[0]
        except Exception as exc:
            raise delivered(exc) from None
        return TokenOutput(token_ids=gen.token_ids, log_probs=gen.logprobs, stop_reason="completed")


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    model, tok = load_model("tiny", seed=0)
    folder = tmp_path_factory.mktemp("tiny")
    model.config.save_pretrained(folder)  # the fleet reads the model's vocabulary from its folder
    eng = TorchEngine(model, tok, model_name="replica-0", grammar_timeout_s=DEADLINE_S)
    yield tok, str(folder), eng, HFChatFormat(tok).render([{"role": "user", "content": "hi"}])
    eng.close()


@pytest.mark.parametrize("kind", ["torch", "vllm"])  # on CPU: mas-torch and mas-vllm, the project's own servers
async def test_a_schema_past_the_deadline_fails_its_request_and_the_engine_serves_on(replica, kind, monkeypatch):
    tok, folder, eng, prompt = replica
    monkeypatch.setattr(fleet_module, "SchemaGrammars", functools.partial(SchemaGrammars, timeout_s=DEADLINE_S))
    fleet = RolloutFleet("writer", folder, kind, ReplicaConfig(), device="cpu")
    fleet.client = server = OwnServer(eng)
    engine = fleet.engine(tok)
    try:
        with pytest.raises(ValueError, match=f"^json_schema took over the limit of {DEADLINE_S} s to compile; simplify the schema$"):
            await engine.generate(prompt, SamplingParams(max_tokens=4, json_schema=SLOW))
        assert server.calls == [] and engine.failure is None  # refused before any replica saw it
        (g,) = await engine.generate(prompt, SamplingParams(max_tokens=16, seed=0, json_schema=SCHEMA))
        assert [c["structured_outputs"] for c in server.calls] == [{"json": SCHEMA}]  # the replica compiles it itself
        assert g.finish_reason == "stop" and g.text.startswith('{"a": ')
    finally:
        engine.close()


class Refusing:
    """A replica whose embedded engine raises `error` for its first request, as Ray delivers it, then answers."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.calls += 1
        if self.calls == 1:
            raise delivered(self.error)
        return TokenOutput(token_ids=[5, 6, 2], log_probs=[-0.1, -0.2, -0.3], stop_reason="completed")


async def test_a_schema_a_replica_refuses_after_the_probe_passed_fails_that_request_only():
    """The probe and the replica's own compile race the same deadline; a replica busy decoding may lose."""
    why = f"json_schema took over the limit of {DEADLINE_S} s to compile; simplify the schema"
    engine = ReplicaEngine(Refusing(SchemaRefused(why)), model_name="writer", decode=str, eos_ids=[2])
    with pytest.raises(ValueError) as err:
        await engine.generate([1], SamplingParams(max_tokens=4, json_schema=SLOW))
    assert str(err.value) == why and not isinstance(err.value, ReplicaError) and engine.failure is None
    (g,) = await engine.generate([1], SamplingParams(max_tokens=4, json_schema=SCHEMA))
    assert g.token_ids == [5, 6, 2]


async def test_any_other_error_of_a_replica_still_fails_the_engine():
    engine = ReplicaEngine(Refusing(ValueError("repetition_penalty is not supported by the torch replica")),
                           model_name="writer", decode=str, eos_ids=[2])
    with pytest.raises(ReplicaError, match="rollout replica failed"):
        await engine.generate([1], SamplingParams(max_tokens=4, json_schema=SCHEMA))
    assert engine.failure is not None
    with pytest.raises(ReplicaError):
        await engine.generate([1], SamplingParams(max_tokens=4))
