"""The embedded critic on the tiny random model: alignment, verl loss parity, learning, state, GAE."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl.trainer.ppo.core_algos")

from pydantic import ValidationError  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

from mas_trainer.algo.advantages import TurnRecord, compute_policy_advantages  # noqa: E402
from mas_trainer.algo.config import AdvantageConfig  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.learners.batch import Turn  # noqa: E402
from mas_trainer.learners.config import CriticConfig  # noqa: E402
from mas_trainer.learners.critic import TorchCritic  # noqa: E402

FP32 = dict(bf16=False)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)[0]


def random_turns(n=5, *, seed=0, vocab=1000):
    """Turns of varied prompt and response lengths with random ids (so batches pad)."""
    g = torch.Generator().manual_seed(seed)
    turns = []
    for i in range(n):
        p, r = 3 + (5 * i) % 11, 2 + (3 * i) % 7
        ids = torch.randint(5, vocab, (p + r,), generator=g).tolist()
        turns.append(Turn(f"t{i}", ids[:p], ids[p:], [0.0] * r, 0.0))
    return turns


def randomise_head(critic, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = critic.module.value_head
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.3)
        head.bias.fill_(0.1)


def padded(turns, table):
    """Response-only (B, L) tensor of per-turn lists, right-padded with 0."""
    out = torch.zeros(len(turns), max(len(t.response_ids) for t in turns))
    for b, t in enumerate(turns):
        out[b, : len(t.response_ids)] = torch.tensor(table[t.id])
    return out


def test_config_defaults_and_unknown_keys():
    cfg = CriticConfig()
    assert (cfg.lr, cfg.cliprange_value, cfg.loss_agg_mode, cfg.max_grad_norm) == (1e-5, 0.5, "token-mean", 1.0)
    with pytest.raises(ValidationError):
        CriticConfig(learning_rate=1e-4)
    with pytest.raises(ValidationError):
        CriticConfig(loss_agg_mode="mean")


def test_initial_values_are_zero_one_per_response_token(tiny):
    turns = random_turns()
    critic = TorchCritic(tiny, CriticConfig(micro_batch_size=2))
    values = critic.values(turns)
    assert set(values) == {t.id for t in turns}
    for t in turns:
        assert len(values[t.id]) == len(t.response_ids)
        assert all(v == 0.0 for v in values[t.id])
    # The body is a copy: no parameter is shared with the policy.
    policy_ptrs = {p.data_ptr() for p in tiny.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in critic.module.parameters()}


def test_value_of_token_t_is_read_at_position_t_minus_1(tiny):
    """Padded micro-batches give the same values as one unpadded forward per turn."""
    turns = random_turns(6)
    critic = TorchCritic(tiny, CriticConfig(micro_batch_size=4, **FP32))
    randomise_head(critic)
    values = critic.values(turns)
    with torch.no_grad():
        for t in turns:
            ids = torch.tensor([[*t.prompt_ids, *t.response_ids]])
            hidden = critic.module.body(input_ids=ids).last_hidden_state[0]
            expected = critic.module.value_head(hidden[len(t.prompt_ids) - 1 : -1]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(values[t.id]), expected, rtol=1e-4, atol=1e-5)


def test_micro_batch_tokens_caps_the_critic_like_the_learner(tiny):
    """The critic splits as the learner does (learners.batch.micro_batches): its own token cap
    bounds every micro-batch, and values do not depend on the split."""
    turns = random_turns(6)
    capped = TorchCritic(tiny, CriticConfig(micro_batch_size=4, micro_batch_tokens=40, **FP32))
    micros = capped._micro_batches(turns)
    assert len(micros) > len(TorchCritic(tiny, CriticConfig(micro_batch_size=4, **FP32))._micro_batches(turns))
    for m in micros:
        assert len(m) == 1 or len(m) * max(t.length for t in m) <= 40
    whole = TorchCritic(tiny, CriticConfig(micro_batch_size=6, **FP32))
    randomise_head(capped)
    randomise_head(whole)
    got, want = capped.values(turns), whole.values(turns)
    for t in turns:
        torch.testing.assert_close(torch.tensor(got[t.id]), torch.tensor(want[t.id]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("micro", [6, 2])
def test_loss_equals_verl_compute_value_loss(tiny, mode, micro):
    """The reported loss is verl's compute_value_loss on the whole mini-batch, by hand,
    however the mini-batch is split into micro-batches."""
    turns = random_turns(6, seed=3)
    critic = TorchCritic(tiny, CriticConfig(mini_batch_size=6, micro_batch_size=micro, loss_agg_mode=mode, **FP32))
    randomise_head(critic)
    vpreds = critic.values(turns)
    g = torch.Generator().manual_seed(7)
    returns = {t.id: torch.randn(len(t.response_ids), generator=g).tolist() for t in turns}
    # Old values far enough from the predictions that some tokens hit the 0.5 clip.
    old = {t.id: [v + float(torch.randn(1, generator=g)) for v in vpreds[t.id]] for t in turns}
    mask = padded(turns, {t.id: [1.0] * len(t.response_ids) for t in turns}).bool()
    loss, clipfrac = core_algos.compute_value_loss(
        vpreds=padded(turns, vpreds), returns=padded(turns, returns), values=padded(turns, old),
        response_mask=mask, cliprange_value=0.5, loss_agg_mode=mode,
    )
    assert 0 < float(clipfrac) < 1
    metrics = critic.update(turns, returns, old)
    assert metrics["optimizer_steps"] == 1.0
    assert metrics["vf_loss"] == pytest.approx(float(loss), rel=1e-4)
    assert metrics["vf_clipfrac"] == pytest.approx(float(clipfrac), rel=1e-5)
    assert math.isfinite(metrics["grad_norm"])


def test_values_move_toward_constant_returns(tiny):
    turns = random_turns(8, seed=5)
    critic = TorchCritic(tiny, CriticConfig(lr=3e-3, mini_batch_size=4, micro_batch_size=2))
    returns = {t.id: [1.0] * len(t.response_ids) for t in turns}

    def error(values):
        return sum(abs(v - 1.0) for vs in values.values() for v in vs) / sum(len(vs) for vs in values.values())

    values = critic.values(turns)
    assert error(values) == pytest.approx(1.0)
    for _ in range(8):
        metrics = critic.update(turns, returns, values)
        values = critic.values(turns)
    assert metrics["optimizer_steps"] == 2.0 and critic.optimizer_steps == 16
    assert error(values) < 0.3


def test_ppo_epochs_pass_over_the_turns_again_against_the_same_old_values(tiny):
    turns = random_turns(8, seed=6)
    returns = {t.id: [1.0] * len(t.response_ids) for t in turns}
    one = TorchCritic(tiny, CriticConfig(lr=3e-3, mini_batch_size=4, micro_batch_size=2, **FP32))
    three = TorchCritic(tiny, CriticConfig(lr=3e-3, mini_batch_size=4, micro_batch_size=2, ppo_epochs=3, **FP32))
    old = one.values(turns)
    m1, m3 = one.update(turns, returns, old), three.update(turns, returns, old)
    assert (m1["optimizer_steps"], m3["optimizer_steps"]) == (2.0, 6.0) and m3["tokens"] == 3 * m1["tokens"]

    def error(critic):
        values = critic.values(turns)
        return sum(abs(v - 1.0) for vs in values.values() for v in vs)

    assert error(three) < error(one)


def test_state_dict_round_trip_resumes_exactly(tiny, tmp_path):
    turns = random_turns(4, seed=9)
    cfg = CriticConfig(lr=1e-3, mini_batch_size=2, micro_batch_size=1, **FP32)
    returns = {t.id: [0.5] * len(t.response_ids) for t in turns}
    a = TorchCritic(tiny, cfg)
    for _ in range(2):
        a.update(turns, returns, a.values(turns))
    b = TorchCritic(tiny, cfg)
    b.load_state_dict(a.state_dict())
    assert b.values(turns) == a.values(turns) and b.updates == a.updates == 2
    c = TorchCritic(tiny, cfg)  # through a file, as a checkpoint holds it (tensors and numbers only)
    torch.save(a.state_dict(), tmp_path / "critic.pt")
    c.load_state_dict(torch.load(tmp_path / "critic.pt", weights_only=True))
    # One more update on each: equal weights *and* optimiser moments give equal results.
    old = a.values(turns)
    for critic in (a, b, c):
        critic.update(turns, returns, old)
    assert b.values(turns) == a.values(turns) == c.values(turns)
    assert a.values(turns) != old


def test_gae_with_critic_values(tiny):
    turns = random_turns(4, seed=11)
    critic = TorchCritic(tiny, CriticConfig(lr=1e-3, micro_batch_size=2))
    records = [
        TurnRecord(t.id, f"r{i % 2}", i // 2, "solver", "p", len(t.response_ids), float(i % 2))
        for i, t in enumerate(turns)
    ]
    values = critic.values(turns)
    batch = compute_policy_advantages(records, AdvantageConfig(estimator="gae", gamma=1.0, lam=0.95), values=values)
    per_turn = batch.per_turn()
    for t, r in zip(turns, records):
        adv = per_turn[t.id]
        assert adv.advantages.shape == (len(t.response_ids),)
        assert torch.isfinite(adv.advantages).all() and torch.isfinite(adv.returns).all()
        # Values are 0 at the start, so the last token's return is the turn's reward.
        assert float(adv.returns[-1]) == pytest.approx(r.reward)
    # The returns are the critic's next targets, aligned with its own values.
    metrics = critic.update(turns, {tid: a.returns.tolist() for tid, a in per_turn.items()}, values)
    assert metrics["turns"] == 4.0 and math.isfinite(metrics["vf_loss"])


def test_update_checks_inputs(tiny):
    turns = random_turns(2)
    critic = TorchCritic(tiny, CriticConfig())
    values = critic.values(turns)
    with pytest.raises(ValueError, match="no returns"):
        critic.update(turns, {}, values)
    with pytest.raises(ValueError, match="old_values"):
        critic.update(turns, values, {t.id: [0.0] for t in turns})
    assert critic.update([], {}, {})["turns"] == 0.0 and critic.optimizer_steps == 0
