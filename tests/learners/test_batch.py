"""Packing turns into right-padded, token-aligned tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mas_trainer.learners.batch import Turn, micro_batches, pack_turns  # noqa: E402


def make_turns():
    return [
        Turn("a", [10, 11, 12], [20, 21], [-0.5, -0.6], [1.0, 2.0]),
        Turn("b", [30], [40, 41, 42, 43], [-1.0, -1.1, -1.2, -1.3], 0.5),
    ]


def test_shapes_and_padding():
    batch = pack_turns(make_turns(), pad_id=7)
    assert batch.turn_ids == ["a", "b"]
    assert batch.input_ids.shape == (2, 5) and batch.input_ids.dtype == torch.long
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21], [30, 40, 41, 42, 43]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.prompt_lengths == [3, 1] and batch.response_lengths == [2, 4]
    assert batch.response_start == 1
    assert batch.num_tokens == 10 and batch.num_response_tokens == 6

    short = pack_turns([Turn("c", [1], [2], [-0.1], 1.0), make_turns()[0]], pad_id=7)
    assert short.input_ids[0].tolist() == [1, 2, 7, 7, 7]
    assert short.attention_mask[0].tolist() == [1, 1, 0, 0, 0]
    assert short.response_mask[0].tolist() == [0, 1, 0, 0, 0]


def test_token_aligned_values():
    """Every per-token value sits in the column of the token it describes."""
    batch = pack_turns(make_turns())
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    assert batch.old_log_prob[0].tolist() == pytest.approx([0, 0, 0, -0.5, -0.6])
    assert batch.old_log_prob[1].tolist() == pytest.approx([0, -1.0, -1.1, -1.2, -1.3])
    assert batch.advantages.tolist() == [[0, 0, 0, 1, 2], [0, 0.5, 0.5, 0.5, 0.5]]
    # Where the mask is 1, input_ids holds exactly the response ids, in order.
    for b, turn in enumerate(make_turns()):
        picked = batch.input_ids[b][batch.response_mask[b].bool()].tolist()
        assert picked == list(turn.response_ids)
    # Column 0 is never a response token, so the shifted logits at t-1 always exist.
    assert batch.response_mask[:, 0].sum() == 0


def test_response_values_round_trip():
    batch = pack_turns(make_turns())
    back = batch.response_values(batch.old_log_prob)
    assert [v.tolist() for v in back] == [pytest.approx([-0.5, -0.6]), pytest.approx([-1.0, -1.1, -1.2, -1.3])]


def test_reference_only_when_every_turn_has_it():
    a, b = make_turns()
    assert pack_turns([a, b]).ref_log_prob is None
    a2 = Turn("a", a.prompt_ids, a.response_ids, a.old_logprobs, a.advantages, ref_logprobs=[-0.7, -0.8])
    assert pack_turns([a2, b]).ref_log_prob is None
    b2 = Turn("b", b.prompt_ids, b.response_ids, b.old_logprobs, b.advantages, ref_logprobs=[-2.0] * 4)
    ref = pack_turns([a2, b2]).ref_log_prob
    assert ref.tolist() == [pytest.approx([0, 0, 0, -0.7, -0.8]), pytest.approx([0, -2, -2, -2, -2])]


def test_tensor_inputs_accepted():
    turn = Turn("t", [1, 2], [3, 4], torch.tensor([-0.1, -0.2]), torch.tensor([0.3, 0.4]))
    batch = pack_turns([turn])
    assert batch.advantages[0].tolist() == pytest.approx([0, 0, 0.3, 0.4])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_ids=[], response_ids=[1], old_logprobs=[0.0], advantages=0.0), "empty prompt"),
        (dict(prompt_ids=[1], response_ids=[], old_logprobs=[], advantages=0.0), "empty response"),
        (dict(prompt_ids=[1], response_ids=[2, 3], old_logprobs=[0.0], advantages=0.0), "old_logprobs"),
        (dict(prompt_ids=[1], response_ids=[2, 3], old_logprobs=[0.0, 0.0], advantages=[1.0]), "advantages"),
        (dict(prompt_ids=[1], response_ids=[2], old_logprobs=[0.0], advantages=1.0, ref_logprobs=[]), "ref_logprobs"),
    ],
)
def test_turn_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Turn("x", **kwargs)


def test_empty_batch_refused():
    with pytest.raises(ValueError):
        pack_turns([])


def _turns_of_lengths(lengths):
    return [Turn(f"t{i}", [1] * (n - 1), [2], [0.0], 0.0) for i, n in enumerate(lengths)]


def test_micro_batches_longest_first_within_row_and_token_caps():
    turns = _turns_of_lengths([4, 9, 2, 7, 7, 3, 12, 5])
    micros = micro_batches(turns, max_rows=3, max_tokens=23)
    assert sorted(t.id for m in micros for t in m) == sorted(t.id for t in turns)
    assert [t.length for m in micros for t in m] == [12, 9, 7, 7, 5, 4, 3, 2]
    assert [[t.length for t in m] for m in micros] == [[12], [9, 7], [7, 5, 4], [3, 2]]
    # rows only: plain chunks of the longest-first order
    assert [[t.length for t in m] for m in micro_batches(turns, max_rows=3)] == [[12, 9, 7], [7, 5, 4], [3, 2]]
    # a turn longer than the token cap still gets a micro-batch of its own
    assert [[t.length for t in m] for m in micro_batches(turns, max_rows=8, max_tokens=5)] == [[12], [9], [7], [7], [5], [4], [3], [2]]



# ---------------------------------------------------------------- shared prompts


def _group_turns():
    """Two samples of prompt P (as a GRPO group has), one of prompt Q, one more of P."""
    p, q = [10, 11, 12], [30, 31]
    return [Turn("a", p, [20, 21], [0.0] * 2, 1.0), Turn("b", q, [40], [0.0], 1.0),
            Turn("c", p, [22, 23, 24], [0.0] * 3, 1.0), Turn("d", p, [25], [0.0], 1.0)]


def test_shared_layout_puts_each_prompt_once_and_each_response_where_it_was_alone():
    turns = _group_turns()
    batch = pack_turns(turns, pad_id=0, share=True)
    shared = batch.shared
    assert shared.input_ids.tolist() == [[10, 11, 12, 20, 21, 22, 23, 24, 25], [30, 31, 40, 0, 0, 0, 0, 0, 0]]
    assert shared.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 3]  # every response starts after the prompt
    assert batch.num_tokens == 9 + 3  # what the model runs on: each prompt once (unshared: 5 + 6 + 4 + 3 = 18)
    mask = shared.attention_mask[0, 0]
    # c's first token (column 5) sees the prompt and itself, not a's response (columns 3-4)
    assert mask[5].tolist() == [True, True, True, False, False, True, False, False, False]
    assert mask[8].tolist() == [True, True, True, False, False, False, False, False, True]  # d
    # each response token is predicted from the prompt's last column, then from its own previous token
    assert shared.source.tolist() == [[0, 2], [0, 3], [1, 1], [0, 2], [0, 5], [0, 6], [0, 2]]
    assert shared.target.tolist() == [[0, 3], [0, 4], [1, 2], [2, 3], [2, 4], [2, 5], [3, 3]]
    assert shared.tokens.tolist() == [20, 21, 40, 22, 23, 24, 25]
    # the turn layout the loss reads is unchanged
    assert torch.equal(batch.input_ids, pack_turns(turns, pad_id=0).input_ids)


def test_no_shared_layout_where_no_two_turns_share_a_prompt():
    assert pack_turns(make_turns(), share=True).shared is None
    assert pack_turns(_group_turns(), share=False).shared is None


def test_micro_batches_keep_a_prompts_turns_together_within_the_caps():
    turns = _group_turns() + [Turn("e", [50] * 6, [60], [0.0], 1.0)]
    micros = micro_batches(turns, max_rows=3, share=True)
    ids = [[t.id for t in m] for m in micros]
    assert sorted(sum(ids, [])) == ["a", "b", "c", "d", "e"]
    assert ["c", "a", "d"] in ids  # the group of P (longest row first), cut at max_rows, longest responses first
    assert all(len(m) <= 3 for m in micros)
    # a token cap counts rows of the shared layout: P's row is 3 + 2 + 3 + 1 = 9 tokens
    assert [[t.id for t in m] for m in micro_batches(turns, max_rows=8, max_tokens=9, share=True)] == \
        [["c", "a", "d"], ["e"], ["b"]]
