"""The supervised warm start (`warm_start.*`, `fit --warm-start`) on the torch learner and the
tiny model: it teaches, the engine serves what it taught, it runs once per run, and its data
file is checked before anything starts. (verl's: tests/policy/test_verl_learner.py.)"""

import asyncio
import json
import logging
from pathlib import Path

import pytest

from mas_trainer.config import ConfigError, load_config
from mas_trainer.engines.base import SamplingParams
from mas_trainer.engines.chat import HFChatFormat
from mas_trainer.engines.models import load_tokenizer
from mas_trainer.run.rundir import RunDir
from mas_trainer.loop.trainer import fit
from mas_trainer.production.warm_start import warm_start_examples

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "fixtures" / "words_app.py"
TASKS = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "words.jsonl").read_text().splitlines()]
TAUGHT = "banana split"


def _line(policy="solo", question="Name a fruit.", **extra):
    return {"policy": policy, "role": "answer", "node": "answer", "run_id": "r1", "score": 1.0,
            "messages": [{"role": "user", "content": question}], "completion": {"role": "assistant", "content": TAUGHT},
            **extra}


def _file(tmp_path, lines, name="sft.jsonl"):
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _examples(cfg, policies=None):
    return warm_start_examples(cfg, policies or {"solo": True}, lambda p: HFChatFormat(load_tokenizer("tiny")))


def _cfg(*overrides):
    return load_config(overrides=["runtime.execution=local", "rollout.tasks_per_step=2", "rollout.n=2", "learner.lr=1e-2",
                                  "rollout.max_tokens=8", "seed=3", *overrides])


def test_torch_warm_start_teaches_and_the_engine_serves_it(tmp_path):
    """A handful of turns teaching one completion: its log-prob rises, the loss falls, and the
    engine's greedy answer afterwards is the taught completion (it was not before)."""
    from mas_trainer.learners.batch import Turn
    from mas_trainer.policy.contract import WorkerPlan
    from mas_trainer.policy.local import LocalPolicy

    data = _file(tmp_path, [_line(question=q["question"]) for q in TASKS[:4]])
    cfg = _cfg(f"warm_start.data={data}", "warm_start.steps=25", "warm_start.lr=1e-2", "warm_start.batch_size=2")
    [(prompt, completion), *_] = examples = _examples(cfg)["solo"]
    tok = load_tokenizer("tiny")
    assert tok.decode(completion) == TAUGHT + "<|im_end|>"  # the template's assistant turn, up to its end of turn
    group = LocalPolicy(WorkerPlan(policy="solo", model="tiny", seed=3, learner=cfg.learner_for("solo")))
    try:
        turn = Turn("t", prompt, completion, [0.0] * len(completion), 0.0)
        greedy = SamplingParams(max_tokens=len(completion) + 2, temperature=0.0)

        def served() -> list[int]:
            return list(asyncio.run(group.generate(prompt, greedy))[0].token_ids)

        before, served_before = float(group.learner.log_probs([turn])[0].sum()), served()
        metrics = asyncio.run(group.warm_start(examples, cfg.warm_start_for("solo")))
        after = float(group.learner.log_probs([turn])[0].sum())
        assert after > before + 5
        assert metrics["sft_loss"] < metrics["sft_loss_first"] / 2
        assert metrics["sft_examples"] == 4 and metrics["sft_steps"] == 25
        assert metrics["sft_tokens"] == 25 * 2 * len(completion)
        assert served_before[: len(completion)] != completion
        assert served()[: len(completion)] == completion
    finally:
        group.close()


def test_warm_start_runs_once_and_never_again_on_resume(tmp_path, monkeypatch):
    """A fresh run warm-starts before step 1 (a row of kind warm_start at step 0, recorded in the
    checkpoint's state); --resume does not again. A run that stopped before its first checkpoint
    starts over, warm start included."""
    from mas_trainer.policy import local
    from mas_trainer.loop import trainer

    calls = []
    real = local.LocalPolicy.warm_start

    async def counted(self, examples, config):
        calls.append(self.policy)
        return await real(self, examples, config)

    monkeypatch.setattr(local.LocalPolicy, "warm_start", counted)
    data = _file(tmp_path, [_line()])
    out = tmp_path / "run"
    real_step = trainer._Fit.collect

    async def dies(self, *args):
        raise KeyboardInterrupt  # a kill after the warm start, before any checkpoint

    monkeypatch.setattr(trainer._Fit, "collect", dies)
    with pytest.raises(KeyboardInterrupt):
        fit(f"{APP}:single", TASKS[:2], _cfg("steps=1", "warm_start.steps=2", f"warm_start.data={data}"), out)
    monkeypatch.setattr(trainer._Fit, "collect", real_step)
    assert calls == ["solo"] and [r["kind"] for r in RunDir(out).metrics()] == ["warm_start"]
    rows = fit(f"{APP}:single", TASKS[:2], _cfg("steps=1", "warm_start.steps=2", f"warm_start.data={data}"), out, resume=True)
    assert calls == ["solo", "solo"]  # started over
    assert [r["kind"] for r in rows] == ["warm_start", "train"]
    assert {"policy/solo/sft_loss", "policy/solo/sft_loss_first", "policy/solo/sft_tokens", "policy/solo/sft_examples"} <= set(rows[0])
    assert json.loads((out / "checkpoint" / "state.json").read_text())["warm_start"] == ["solo"]
    rows = fit(f"{APP}:single", TASKS[:2], _cfg("steps=2", "warm_start.steps=2", f"warm_start.data={data}"), out, resume=True)
    assert calls == ["solo", "solo"]  # not on resume
    assert [r["kind"] for r in rows] == ["warm_start", "train", "train"]
    assert json.loads((out / "checkpoint" / "state.json").read_text())["warm_start"] == ["solo"]


@pytest.mark.parametrize("lines, message", [
    (None, "not found"),
    (["{not json"], "sft.jsonl:1: not a JSON object"),
    ([_line(), {k: v for k, v in _line().items() if k != "completion"}], "sft.jsonl:2: completion: Field required"),
    ([_line(completion={"role": "assistant", "content": None})], "sft.jsonl:1: completion: the completion says nothing"),
    ([_line(prompt_ids=[1, 2])], "sft.jsonl:1: prompt_ids and response_ids come together"),
    ([_line(messages=[{"role": "user", "content": 3}])], "cannot render them (ValueError: unsupported message content"),
    ([_line(messages=[{"role": "robot", "content": "x"}])], "sft.jsonl:1: messages[0].role: Input should be 'system'"),
    ([_line(messages=[{"role": "user", "content": [{"type": "image_url"}]}])],
     "sft.jsonl:1: messages: the chat template of policy 'solo' cannot render them"),
    ([_line(), _line(policy="sollo")], "sft.jsonl:2: policy: the app has no policy 'sollo'; did you mean 'solo'? its policies: solo"),
])
def test_a_bad_data_file_is_one_line(tmp_path, lines, message):
    data = tmp_path / "sft.jsonl" if lines is None else _file(tmp_path, lines)
    with pytest.raises(ConfigError) as err:
        _examples(_cfg(f"warm_start.data={data}"))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_policies_without_lines_frozen_ones_and_filters(tmp_path, caplog):
    data = _file(tmp_path, [_line(), _line(score=0.2), _line(policy="frozen"), _line(prompt_ids=[5, 6], response_ids=[7], score=None)])
    policies = {"solo": True, "other": True, "frozen": False}
    with caplog.at_level(logging.WARNING):
        got = _examples(_cfg(f"warm_start.data={data}"), policies)
    assert list(got) == ["solo"] and len(got["solo"]) == 3 and got["solo"][2] == ([5, 6], [7])  # exact ids as they are
    assert "no line for policy 'other'" in caplog.text and "not trained (frozen)" in caplog.text
    got = _examples(_cfg(f"warm_start.data={data}", "warm_start.min_score=0.5"), policies)
    assert len(got["solo"]) == 1  # score 0.2 and the unscored exact-ids line left out
    assert _examples(_cfg(f"warm_start.data={data}", "policies.solo.warm_start.steps=0"), policies) == {}
    assert _examples(_cfg(), policies) == {}


def test_warm_start_config_is_strict():
    with pytest.raises(ConfigError, match="warm_start"):
        load_config(overrides=["warm_start.epochs=2"])
    with pytest.raises(ConfigError, match="policies.solo.warm_start"):
        load_config(overrides=["policies.solo.warm_start.lr=-1"])
    with pytest.raises(ConfigError, match="the warm-start file is shared"):
        load_config(overrides=["policies.solo.warm_start.data=x.jsonl"])
    assert load_config(overrides=["policies.solo.warm_start.steps=5"]).warm_start_for("solo").steps == 5


def test_fit_refuses_a_missing_file_before_workers_start(tmp_path, monkeypatch):
    from mas_trainer.loop import trainer

    monkeypatch.setattr(trainer, "start_workers", lambda *a: pytest.fail("workers started"))
    with pytest.raises(ConfigError, match="warm_start.data: .*missing.jsonl not found"):
        fit(f"{APP}:single", TASKS[:2], _cfg(f"warm_start.data={tmp_path / 'missing.jsonl'}"), tmp_path / "run")


def test_cli_warm_start_sets_the_data_key(tmp_path, monkeypatch):
    from mas_trainer import api, cli

    seen = {}

    def fake_fit(app, data, *, config, **kw):
        seen["cfg"] = config
        raise SystemExit(0)

    monkeypatch.setattr(api, "fit", fake_fit)
    with pytest.raises(SystemExit):
        cli.main(["fit", f"{APP}:single", "--data", "x.jsonl", "--warm-start", "1.jsonl", "--output", str(tmp_path / "r")])
    assert seen["cfg"].warm_start.data == "1.jsonl"
