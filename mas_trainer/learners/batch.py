"""Turns as the learner trains on them, and their packing into padded tensors.

A :class:`Turn` is one LLM call of one policy: the exact prompt and response token ids the
engine used and produced, the engine's log-prob of each response token (PPO's old
log-probs: the engine returns ``log_softmax`` of raw logits at temperature 1, so no second
forward pass is needed for them) and the advantage of each response token.

:func:`pack_turns` lays a list of turns out as one right-padded batch, every tensor indexed
by the token it describes ("token-aligned"):

- ``input_ids[b, t]`` is token ``t`` of prompt+response (``pad_id`` past the end);
- ``response_mask[b, t]`` is 1 where that token is a response token;
- ``old_log_prob[b, t]``, ``advantages[b, t]`` (and ``ref_log_prob``) belong to that token
  and are 0 elsewhere.

The causal LM shift happens in exactly one place (the learner's log-prob function): the
log-prob of token ``t`` comes from the logits at position ``t - 1``. Right padding keeps
every real token's position id equal to its column, and since pads come after all real
tokens a plain causal mask already keeps them out of every real token's attention.
Prompts are never empty, so column 0 is never a response token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Turn", "PackedTurns", "pack_turns", "micro_batches", "mini_batches", "update_mini_batches"]


@dataclass(frozen=True)
class Turn:
    """One trainable LLM call of a policy, as the learner needs it.

    ``advantages`` is one float per response token, or one float broadcast to all of them.
    ``ref_logprobs`` (optional) are the frozen reference model's log-probs of the response
    tokens; the learner fills them itself when it keeps a reference model.
    """

    id: str
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    old_logprobs: Sequence[float]
    advantages: Sequence[float] | float
    ref_logprobs: Sequence[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not self.prompt_ids:
            raise ValueError(f"turn {self.id}: empty prompt_ids")
        if n == 0:
            raise ValueError(f"turn {self.id}: empty response_ids")
        if len(self.old_logprobs) != n:
            raise ValueError(f"turn {self.id}: {len(self.old_logprobs)} old_logprobs for {n} response tokens")
        if not isinstance(self.advantages, (int, float)) and len(self.advantages) != n:
            raise ValueError(f"turn {self.id}: {len(self.advantages)} advantages for {n} response tokens")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"turn {self.id}: {len(self.ref_logprobs)} ref_logprobs for {n} response tokens")

    @property
    def length(self) -> int:
        """Prompt plus response tokens: the number of columns this turn occupies."""
        return len(self.prompt_ids) + len(self.response_ids)

    def advantage_list(self) -> list[float]:
        """One advantage per response token (a scalar broadcast)."""
        if isinstance(self.advantages, (int, float)):
            return [float(self.advantages)] * len(self.response_ids)
        return [float(a) for a in self.advantages]


@dataclass
class PackedTurns:
    """Right-padded, token-aligned tensors of a list of turns (row b is ``turn_ids[b]``).

    Shapes: B = number of turns, T = longest prompt+response.

    - ``input_ids``: (B, T) int64, pads are ``pad_id``
    - ``attention_mask``: (B, T) int64, 1 on prompt and response tokens
    - ``response_mask``: (B, T) float32, 1 only on response tokens
    - ``old_log_prob``: (B, T) float32, engine log-prob of token t (0 off the response)
    - ``advantages``: (B, T) float32, advantage of token t (0 off the response)
    - ``ref_log_prob``: (B, T) float32 or None, reference log-prob of token t
    - ``response_start``: the first column holding any response token (shortest prompt);
      columns before it hold only prompt tokens, so the learner computes logits only from
      ``response_start - 1`` on.
    """

    turn_ids: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    ref_log_prob: torch.Tensor | None
    prompt_lengths: list[int]
    response_lengths: list[int]

    @property
    def response_start(self) -> int:
        return min(self.prompt_lengths)

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens: what a forward+backward pass processes."""
        return int(self.attention_mask.sum())

    @property
    def num_response_tokens(self) -> int:
        return sum(self.response_lengths)

    def to(self, device: Any) -> "PackedTurns":
        """The same batch with every tensor on `device`."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedTurns(
            self.turn_ids, move(self.input_ids), move(self.attention_mask), move(self.response_mask),
            move(self.old_log_prob), move(self.advantages), move(self.ref_log_prob),
            self.prompt_lengths, self.response_lengths,
        )

    def response_values(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a token-aligned (B, T) tensor into each turn's (response_length,) values."""
        return [
            values[b, p : p + r]
            for b, (p, r) in enumerate(zip(self.prompt_lengths, self.response_lengths))
        ]


def pack_turns(turns: Sequence[Turn], *, pad_id: int = 0) -> PackedTurns:
    """Pack turns into a right-padded, token-aligned :class:`PackedTurns`.

    ``ref_log_prob`` is filled only when every turn carries ``ref_logprobs``.
    """
    if not turns:
        raise ValueError("pack_turns needs at least one turn")
    width = max(t.length for t in turns)
    shape = (len(turns), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    response_mask = torch.zeros(shape, dtype=torch.float32)
    old_log_prob = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    with_ref = all(t.ref_logprobs is not None for t in turns)
    ref_log_prob = torch.zeros(shape, dtype=torch.float32) if with_ref else None
    for b, turn in enumerate(turns):
        p, n = len(turn.prompt_ids), turn.length
        input_ids[b, :n] = torch.tensor([*turn.prompt_ids, *turn.response_ids], dtype=torch.long)
        attention_mask[b, :n] = 1
        response_mask[b, p:n] = 1
        old_log_prob[b, p:n] = torch.as_tensor(turn.old_logprobs, dtype=torch.float32)
        advantages[b, p:n] = torch.tensor(turn.advantage_list(), dtype=torch.float32)
        if ref_log_prob is not None:
            ref_log_prob[b, p:n] = torch.as_tensor(turn.ref_logprobs, dtype=torch.float32)
    return PackedTurns(
        turn_ids=[t.id for t in turns],
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        old_log_prob=old_log_prob,
        advantages=advantages,
        ref_log_prob=ref_log_prob,
        prompt_lengths=[len(t.prompt_ids) for t in turns],
        response_lengths=[len(t.response_ids) for t in turns],
    )


def micro_batches(turns: Sequence[Turn], *, max_rows: int, max_tokens: int | None = None) -> list[list[Turn]]:
    """`turns` split for gradient accumulation (learner and critic alike): longest first, so
    each micro-batch pads little, at most `max_rows` turns and, when set, `max_tokens` padded
    tokens (rows x longest row; a single longer turn still gets a micro-batch of its own)."""
    out: list[list[Turn]] = []
    for turn in sorted(turns, key=lambda t: t.length, reverse=True):
        cur = out[-1] if out else None
        if cur is None or len(cur) >= max_rows or (max_tokens is not None and (len(cur) + 1) * cur[0].length > max_tokens):
            out.append([turn])
        else:
            cur.append(turn)
    return out


def mini_batches(turns: Sequence[Turn], size: int, *, shuffle: bool, seed: int) -> list[list[Turn]]:
    """`turns` cut into mini-batches of `size`, in a seeded random order when `shuffle`
    (the seed includes the update count, so a resumed run continues the same sequence)."""
    order = list(range(len(turns)))
    if shuffle:
        order = torch.randperm(len(turns), generator=torch.Generator().manual_seed(seed)).tolist()
    return [[turns[j] for j in order[i : i + size]] for i in range(0, len(order), size)]


def update_mini_batches(turns: Sequence[Turn], size: int, *, epochs: int, shuffle: bool, seed: int,
                        update: int) -> Iterator[list[Turn]]:
    """The mini-batches of one update: `epochs` passes over `turns`, each reshuffled with a
    seed derived from (seed, update count, epoch), so a resumed run draws the same order."""
    for epoch in range(epochs):
        yield from mini_batches(turns, size, shuffle=shuffle, seed=seed * 1_000_003 + update * 1009 + epoch)
