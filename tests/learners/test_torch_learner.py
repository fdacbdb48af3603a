"""The embedded learner on the tiny random model: alignment, masking, verl parity, state."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl.trainer.ppo.core_algos")

from pydantic import ValidationError  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.models import load_model  # noqa: E402
from mas_trainer.engines.torch_engine import TorchEngine  # noqa: E402
from mas_trainer.engines.config import EngineSettings
from mas_trainer.errors import UserError  # noqa: E402
from mas_trainer.learners import LearnerConfig, TorchLearner, Turn, pack_turns  # noqa: E402

FP32 = dict(bf16=False, fused_adamw=False)


@pytest.fixture
def tiny():
    return load_model("tiny", seed=0)


def random_turns(n=5, *, seed=0, advantage=1.0, vocab=1000):
    """Turns of varied prompt and response lengths with random ids (old log-probs 0)."""
    g = torch.Generator().manual_seed(seed)
    turns = []
    for i in range(n):
        p, r = 3 + (5 * i) % 11, 2 + (3 * i) % 7
        ids = torch.randint(5, vocab, (p + r,), generator=g).tolist()
        adv = advantage if isinstance(advantage, float) else torch.randn(r, generator=g).tolist()
        turns.append(Turn(f"t{i}", ids[:p], ids[p:], [0.0] * r, adv))
    return turns


def with_old_logprobs(learner, turns):
    """The turns with their current log-probs as old log-probs (what the engine returns)."""
    return [
        Turn(t.id, t.prompt_ids, t.response_ids, lp.tolist(), t.advantages)
        for t, lp in zip(turns, learner.log_probs(turns))
    ]


def full_forward_logprobs(model, turn):
    """log p(response | prompt): one plain forward over prompt+response, no padding."""
    with torch.no_grad():
        logits = model(torch.tensor([list(turn.prompt_ids) + list(turn.response_ids)])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(turn.prompt_ids) - 1 : -1]
    return lp.gather(1, torch.tensor(turn.response_ids)[:, None])[:, 0]


def params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- alignment


def test_log_probs_equal_a_plain_full_forward(tiny):
    model, _ = tiny
    learner = TorchLearner(model, LearnerConfig(micro_batch_size=3, **FP32))
    turns = random_turns(7)
    fast = learner.log_probs(turns)
    for turn, got in zip(turns, fast):
        assert got.shape == (len(turn.response_ids),)
        torch.testing.assert_close(got, full_forward_logprobs(model, turn), atol=1e-5, rtol=1e-5)


def test_engine_logprobs_are_the_old_logprobs_and_updates_reach_the_engine(tiny):
    """The engine's sampled log-probs are exactly what the learner computes (fp32), so the
    first PPO pass has ratio 1; after an update on the engine's thread it samples from the new weights."""
    model, tok = tiny
    with TorchEngine(model, tok, model_name="tiny", settings=EngineSettings(max_batch_size=4, engine_bf16=False)) as engine:
        learner = TorchLearner(engine.model, LearnerConfig(lr=1e-2, shuffle=False, **FP32))
        prompts = [[1, 30, 31, 32], [1, 40, 41, 42, 43, 44, 45]]
        gens = [engine.generate_sync(p, SamplingParams(max_tokens=6, seed=i, ignore_eos=True))[0] for i, p in enumerate(prompts)]
        turns = [Turn(f"g{i}", p, g.token_ids, g.logprobs, 1.0) for i, (p, g) in enumerate(zip(prompts, gens))]
        for turn, lp in zip(turns, learner.log_probs(turns)):
            torch.testing.assert_close(lp, torch.tensor(turn.old_logprobs), atol=1e-4, rtol=1e-4)
        metrics = engine.run_exclusive(lambda _model: learner.update(turns)).result()
        assert abs(metrics["ppo_kl"]) < 1e-4 and metrics["pg_clipfrac"] == 0
        again = engine.generate_sync(prompts[0], SamplingParams(max_tokens=6, seed=9, ignore_eos=True))[0]
        turn = Turn("new", prompts[0], again.token_ids, again.logprobs, 0.0)
        torch.testing.assert_close(learner.log_probs([turn])[0], torch.tensor(again.logprobs), atol=1e-4, rtol=1e-4)
        old_now = learner.log_probs(turns[:1])[0]
        assert not torch.allclose(old_now, torch.tensor(turns[0].old_logprobs), atol=1e-3)


def test_positive_advantage_raises_the_response_logprob(tiny):
    model, _ = tiny
    learner = TorchLearner(model, LearnerConfig(lr=1e-3))
    turns = with_old_logprobs(learner, random_turns(2, advantage=1.0))
    before = [lp.sum() for lp in learner.log_probs(turns)]
    learner.update(turns)
    after = [lp.sum() for lp in learner.log_probs(turns)]
    assert all(a > b for a, b in zip(after, before))

    negative = [Turn(t.id, t.prompt_ids, t.response_ids, lp.tolist(), -1.0) for t, lp in zip(turns, learner.log_probs(turns))]
    learner.update(negative)
    assert all(lp.sum() < a for lp, a in zip(learner.log_probs(turns), after))


# ---------------------------------------------------------------- masking and accumulation


def gradients(learner, batch):
    learner.optimizer.zero_grad(set_to_none=True)
    info = learner.actor_config.global_batch_info
    info.clear()
    info.update(dp_size=1, batch_num_tokens=batch.num_response_tokens, global_batch_size=len(batch.turn_ids),
                loss_scale_factor=max(batch.response_lengths))
    loss, _, _ = learner._micro_loss(batch)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in learner.model.named_parameters()}
    learner.optimizer.zero_grad(set_to_none=True)
    return grads


def test_only_response_tokens_reach_the_gradient(tiny):
    """Junk in non-response columns (advantages, old log-probs, pad ids) changes nothing."""
    model, _ = tiny
    learner = TorchLearner(model, LearnerConfig(**FP32))
    turns = with_old_logprobs(learner, random_turns(4, advantage=None))
    batch = pack_turns(turns)
    clean = gradients(learner, batch)
    off = batch.response_mask == 0
    pads = batch.attention_mask == 0
    assert off.any() and pads.any()
    batch.advantages[off] = 100.0
    batch.old_log_prob[off] = -50.0
    batch.input_ids[pads] = 777
    dirty = gradients(learner, batch)
    for k in clean:
        torch.testing.assert_close(dirty[k], clean[k], atol=1e-7, rtol=1e-6)


def step_gradients(learner, turns):
    """The gradients the optimiser sees in one update (its step replaced by a recorder)."""
    seen = []
    learner.optimizer.step = lambda *a, **k: seen.append([p.grad.clone() for p in learner._params])
    learner.update(turns)
    return seen


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_matches_one_big_micro_batch(mode):
    turns = random_turns(6, advantage=None)
    grads = []
    for micro in (1, 6):
        model, _ = load_model("tiny", seed=0)
        cfg = LearnerConfig(mini_batch_size=6, micro_batch_size=micro, loss_agg_mode=mode, **FP32)
        learner = TorchLearner(model, cfg)
        grads.append(step_gradients(learner, with_old_logprobs(learner, turns)))
    assert len(grads[0]) == len(grads[1]) == 1
    for a, b in zip(grads[0][0], grads[1][0]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def grouped_turns(prompts=3, samples=4, *, seed=0, vocab=1000):
    """A GRPO-like batch: `samples` responses of varied length to each of `prompts` prompts."""
    g = torch.Generator().manual_seed(seed)
    turns = []
    for i in range(prompts):
        prompt = torch.randint(5, vocab, (6 + 5 * i,), generator=g).tolist()
        for j in range(samples):
            r = 1 + (2 * j + i) % 6
            turns.append(Turn(f"p{i}s{j}", prompt, torch.randint(5, vocab, (r,), generator=g).tolist(), [0.0] * r,
                              torch.randn(r, generator=g).tolist()))
    return turns


def test_shared_prompts_give_the_same_log_probs_entropies_and_gradients(tiny):
    """Reference vs fast: each prompt forwarded once per micro-batch gives every response the
    log-probs, entropies and update gradients it gets alone, for fewer tokens."""
    turns = grouped_turns()
    model, _ = tiny
    plain = TorchLearner(model, LearnerConfig(micro_batch_size=5, **FP32))
    shared = TorchLearner(model, LearnerConfig(micro_batch_size=5, share_prompts=True, **FP32))
    for a, b in zip(plain.log_probs(turns), shared.log_probs(turns)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    batch = pack_turns(turns, share=True)
    assert batch.shared.input_ids.shape[0] == 3 and batch.num_tokens < pack_turns(turns).num_tokens
    with torch.no_grad():
        lp_a, ent_a = plain._forward(model, pack_turns(turns), entropy=True)
        lp_b, ent_b = shared._forward(model, batch, entropy=True)
    mask = pack_turns(turns).response_mask[:, batch.response_start:].bool()
    torch.testing.assert_close(lp_b[mask], lp_a[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_b[mask], ent_a[mask], atol=1e-5, rtol=1e-5)
    assert not lp_b[~mask].any()
    grads, tokens = [], []
    for share in (False, True):
        model, _ = load_model("tiny", seed=0)
        learner = TorchLearner(model, LearnerConfig(mini_batch_size=12, micro_batch_size=5, share_prompts=share, **FP32))
        old = with_old_logprobs(learner, turns)
        grads.append(step_gradients(learner, old))
        tokens.append(TorchLearner(load_model("tiny", seed=0)[0], learner.config).update(old)["tokens"])
    for a, b in zip(grads[0][0], grads[1][0]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)
    assert tokens[1] < 0.6 * tokens[0]  # 3 prompts of 6-16 tokens once instead of 4 times
    # under bf16 autocast too (the mask is then additive bf16)
    bf16 = [TorchLearner(model, LearnerConfig(bf16=True, share_prompts=share)).log_probs(turns) for share in (False, True)]
    for a, b in zip(*bf16):
        torch.testing.assert_close(b, a, atol=0.05, rtol=0.05)


def test_share_prompts_refuses_attention_without_4d_masks(tiny):
    model, _ = tiny
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UserError, match="share_prompts needs attention that takes a 4D mask"):
        TorchLearner(model, LearnerConfig(share_prompts=True, **FP32))


def test_share_prompts_is_a_torch_learner_option():
    from mas_trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="learner.share_prompts runs on the torch learner"):
        load_config(overrides=["learner.share_prompts=true", "runtime.learner=verl"])


def test_micro_batches_respect_row_and_token_caps(tiny):
    model, _ = tiny
    learner = TorchLearner(model, LearnerConfig(micro_batch_size=3, micro_batch_tokens=40))
    turns = random_turns(8)
    micros = learner._micro_batches(turns)
    assert sorted(t.id for m in micros for t in m) == sorted(t.id for t in turns)
    for m in micros:
        assert len(m) <= 3
        assert len(m) == 1 or len(m) * max(t.length for t in m) <= 40


# ---------------------------------------------------------------- which weights change


def test_zero_advantages_leave_parameters_unchanged(tiny):
    model, _ = tiny
    learner = TorchLearner(model, LearnerConfig(lr=1e-2))
    before = params(model)
    metrics = learner.update(with_old_logprobs(learner, random_turns(3, advantage=0.0)))
    assert metrics["optimizer_steps"] == 1 and metrics["grad_norm"] == 0
    assert same(before, params(model))


def test_non_finite_gradient_skips_the_step(tiny):
    model, _ = tiny
    learner = TorchLearner(model, LearnerConfig(lr=1e-2))
    before = params(model)
    metrics = learner.update(with_old_logprobs(learner, random_turns(2, advantage=float("nan"))))
    assert metrics["skipped_steps"] == 1 and metrics["optimizer_steps"] == 0 and "grad_norm" not in metrics
    assert same(before, params(model))
    assert all(p.grad is None for p in model.parameters())


def test_update_changes_exactly_the_policy_with_turns():
    (m1, _), (m2, _) = load_model("tiny", seed=0), load_model("tiny", seed=0)
    l1, l2 = TorchLearner(m1, LearnerConfig(lr=1e-3, weight_decay=0.1)), TorchLearner(m2, LearnerConfig(lr=1e-3, weight_decay=0.1))
    b1, b2 = params(m1), params(m2)
    l1.update(with_old_logprobs(l1, random_turns(3)))
    empty = l2.update([])
    assert empty["optimizer_steps"] == 0 and empty["turns"] == 0
    assert not same(b1, params(m1))
    assert same(b2, params(m2))


def test_epochs_and_mini_batches(tiny):
    model, _ = tiny
    learner = TorchLearner(model, LearnerConfig(lr=1e-2, ppo_epochs=2, mini_batch_size=3))
    turns = with_old_logprobs(learner, random_turns(5))
    metrics = learner.update(turns)
    assert metrics["optimizer_steps"] == 4 and learner.optimizer_steps == 4
    assert metrics["response_tokens"] == 2 * sum(len(t.response_ids) for t in turns)
    assert metrics["tokens"] == 2 * sum(t.length for t in turns)
    assert metrics["ppo_kl"] != 0  # later passes compare with the engine's pre-update log-probs
    assert metrics["tokens_per_s"] > 0


# ---------------------------------------------------------------- verl parity


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_equals_verl_computed_by_hand(tiny, mode):
    """One micro-batch: our loss == verl's policy loss + entropy + KL on verl's own layout
    (responses left-aligned in a (B, R) tensor), computed from plain full forwards."""
    torch.manual_seed(1234)  # the noise below must not depend on which tests ran before
    model, _ = tiny
    cfg = LearnerConfig(loss_agg_mode=mode, clip_ratio_high=0.28, kl_coef=0.3, entropy_coeff=0.01, **FP32)
    learner = TorchLearner(model, cfg)
    with torch.no_grad():  # make the reference differ from the policy
        for p in learner.reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    turns = random_turns(4, advantage=None)
    # Old log-probs away from the current ones, so clipping is exercised.
    turns = [Turn(t.id, t.prompt_ids, t.response_ids, (lp + 0.3 * torch.randn_like(lp)).tolist(), t.advantages)
             for t, lp in zip(turns, learner.log_probs(turns))]
    turns = learner._with_reference(turns)
    batch = pack_turns(turns)
    info = learner.actor_config.global_batch_info
    info.clear()
    info.update(dp_size=1, batch_num_tokens=batch.num_response_tokens, global_batch_size=4,
                loss_scale_factor=max(batch.response_lengths))
    ours, parts, _ = learner._micro_loss(batch)

    R = max(batch.response_lengths)
    logp, ent, old, adv, ref, mask = (torch.zeros(4, R) for _ in range(6))
    for b, t in enumerate(turns):
        r = len(t.response_ids)
        ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
        logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1].float()
        logp[b, :r] = logits.log_softmax(-1).gather(1, torch.tensor(t.response_ids)[:, None])[:, 0]
        ent[b, :r] = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        old[b, :r], adv[b, :r] = torch.tensor(t.old_logprobs), torch.tensor(t.advantage_list())
        ref[b, :r], mask[b, :r] = torch.tensor(t.ref_logprobs), 1
    from verl.workers.config import ActorConfig

    verl_cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=4, clip_ratio_high=0.28, loss_agg_mode=mode)
    pg, pg_metrics = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask.bool(), mode, verl_cfg)
    kl = core_algos.agg_loss(core_algos.kl_penalty(logp, ref, "low_var_kl"), mask.bool(), mode)
    entropy = core_algos.agg_loss(ent, mask.bool(), mode)
    expected = pg - 0.01 * entropy + 0.3 * kl
    assert 0 < pg_metrics["actor/pg_clipfrac"] < 1
    assert parts["pg_loss"] == pytest.approx(pg.detach().item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(core_algos.POLICY_LOSS_REGISTRY))
def test_every_verl_policy_loss_runs(tiny, name):
    model, _ = tiny
    options = {"dro_beta": 0.1} if name == "dro" else {}
    learner = TorchLearner(model, LearnerConfig(policy_loss=name, policy_loss_options=options, lr=1e-3))
    before = params(model)
    metrics = learner.update(with_old_logprobs(learner, random_turns(4, advantage=None)))
    assert metrics["optimizer_steps"] == 1
    assert not same(before, params(model))


def test_config_errors(tiny):
    model, _ = tiny
    with pytest.raises(UserError, match="vanilla"):
        TorchLearner(model, LearnerConfig(policy_loss="nope"))
    with pytest.raises(UserError, match="policy_loss_options"):
        TorchLearner(model, LearnerConfig(policy_loss_options={"nope": 1}))
    with pytest.raises(ValidationError):
        LearnerConfig(kl_penalty="nope")
    with pytest.raises(ValidationError):
        LearnerConfig(loss_agg_mode="mean")
    with pytest.raises(ValidationError):
        LearnerConfig(learning_rate=1.0)
    assert LearnerConfig(kl_penalty="k3+").kl_penalty == "k3+"
    assert all(f.description for f in LearnerConfig.model_fields.values())


def test_reference_only_with_kl(tiny):
    model, _ = tiny
    assert TorchLearner(model, LearnerConfig()).reference is None
    learner = TorchLearner(model, LearnerConfig(kl_coef=0.1, lr=1e-2))
    ref = learner.reference
    assert ref is not model and not any(p.requires_grad for p in ref.parameters())
    before = params(ref)
    metrics = learner.update(with_old_logprobs(learner, random_turns(3)))
    assert "kl" in metrics and "kl_loss" in metrics
    assert same(before, params(ref))


# ---------------------------------------------------------------- state


def test_optimizer_state_round_trips(tiny, tmp_path):
    model, _ = tiny
    turns = random_turns(4)
    a = TorchLearner(model, LearnerConfig(lr=1e-3, mini_batch_size=2))
    a.update(with_old_logprobs(a, turns))
    torch.save(a.state_dict(), tmp_path / "learner.pt")

    clone = copy.deepcopy(model)
    b = TorchLearner(clone, LearnerConfig(lr=1e-3, mini_batch_size=2))
    b.load_state_dict(torch.load(tmp_path / "learner.pt", weights_only=False))
    assert b.updates == a.updates == 1 and b.optimizer_steps == a.optimizer_steps == 2
    a.update(with_old_logprobs(a, turns))
    b.update(with_old_logprobs(b, turns))
    assert same(params(model), params(clone))


def test_save_pretrained_reloads_with_identical_logits(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = tiny
    learner = TorchLearner(model, LearnerConfig(lr=1e-3))
    learner.update(with_old_logprobs(learner, random_turns(2)))
    path = learner.save_pretrained(tmp_path / "policy", tok)
    assert (path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[1, 5, 9, 200, 31]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(path).eos_token_id == tok.eos_token_id
