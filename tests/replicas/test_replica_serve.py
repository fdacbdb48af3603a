"""`serve --engine torch-replica`: the trained policies answered by rollout replicas behind the
project's router (the path `--engine vllm` takes on GPUs); greedy answers are the embedded
engine's, token for token."""

import json
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from mas_trainer.config import load_config  # noqa: E402
from mas_trainer.gateway import GatewayServer  # noqa: E402
from mas_trainer.loop.trainer import fit  # noqa: E402
from mas_trainer.serve import build_gateway  # noqa: E402

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[2]
WORDS = ROOT / "tests" / "fixtures" / "words_app.py"
TASKS = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "words.jsonl").read_text().splitlines() if line.strip()]


def _ask(server, policy):
    body = {"model": policy, "messages": [{"role": "user", "content": "Say a word."}], "temperature": 0, "max_tokens": 8}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_serve_on_replicas_answers_as_the_embedded_engine(tmp_path):
    run = tmp_path / "run"
    fit(f"{WORDS}:graph", TASKS[:1], load_config(overrides=["runtime.execution=local", "model=tiny", "steps=1",
                                                                 "rollout.tasks_per_step=1", "rollout.n=2", "learner.lr=1e-2"]), run)
    with GatewayServer(build_gateway(run)) as server:
        want = {p: _ask(server, p) for p in ("lead", "crew")}
    gateway = build_gateway(run, engine="torch-replica")
    try:
        assert type(gateway.backends["lead"].engine).__name__ == "ReplicaEngine"
        with GatewayServer(gateway) as server:
            got = {p: _ask(server, p) for p in ("lead", "crew")}
    finally:
        for backend in gateway.backends.values():
            backend.engine.close()
        ray.shutdown()
    for p in ("lead", "crew"):
        assert got[p]["system_fingerprint"] == f"mas-trainer:{p}"
        g, w = got[p]["choices"][0], want[p]["choices"][0]
        assert g["token_ids"] == w["token_ids"] and g["message"]["content"] == w["message"]["content"], json.dumps([g, w])[:800]
        assert [c["logprob"] for c in g["logprobs"]["content"]] == pytest.approx([c["logprob"] for c in w["logprobs"]["content"]], abs=1e-4)
