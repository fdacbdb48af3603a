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

With ``share=True`` (the learner's ``share_prompts``) the turns of a micro-batch that have the very same prompt (a GRPO
group's samples, wherever an app's earlier calls did not differ) are also laid out as one
row of a :class:`SharedPrompts`: the prompt once, then each response, every response placed
at the positions and attention it had alone (it sees the prompt and itself, not its
siblings). The model runs on that layout, and the log-probs are put back into the
token-aligned layout above, so the loss is computed exactly as without sharing; the prompt's
forward and backward are done once per group instead of once per sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Turn", "PackedTurns", "SharedPrompts", "pack_turns", "share_prompts", "micro_batches", "mini_batches", "update_mini_batches", "run_epochs", "clipped_step"]


@dataclass(frozen=True)
class Turn:
    """One trainable LLM call of a policy, as the learner needs it.

    ``advantages`` is one float per response token, or one float broadcast to all of them.
    ``ref_logprobs`` (optional) are the frozen reference model's log-probs of the response
    tokens; the learner fills them itself when it keeps a reference model. ``is_weights``
    (optional) are rollout correction's truncated importance weights, one per response token.
    """

    id: str
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    old_logprobs: Sequence[float]
    advantages: Sequence[float] | float
    ref_logprobs: Sequence[float] | None = None
    is_weights: Sequence[float] | None = None

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
        if self.is_weights is not None and len(self.is_weights) != n:
            raise ValueError(f"turn {self.id}: {len(self.is_weights)} is_weights for {n} response tokens")

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
class SharedPrompts:
    """Turns that share a prompt laid out as one row each: prompt, response 1, response 2, ...

    Shapes: R = distinct prompts, L = longest row, N = response tokens of all turns.

    - ``input_ids``: (R, L) int64, pads are ``pad_id``
    - ``position_ids``: (R, L) int64: each response continues from its prompt's end, as alone
    - ``attention_mask``: (R, 1, L, L) bool, True where a query column may attend a key
      column: causal, and a response's tokens see the prompt and their own response only
    - ``source``: (N, 2) int64, for each response token (turns in batch order, tokens in
      order) the (row, column) whose logits predict it: the prompt's last column for the
      first token, the previous token's column after that
    - ``target``: (N, 2) int64, the (turn, column) of that token in the turn layout
    - ``tokens``: (N,) int64, the token ids
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    source: torch.Tensor
    target: torch.Tensor
    tokens: torch.Tensor
    num_tokens: int

    def to(self, device: Any) -> "SharedPrompts":
        return SharedPrompts(self.input_ids.to(device), self.position_ids.to(device), self.attention_mask.to(device),
                             self.source.to(device), self.target.to(device), self.tokens.to(device), self.num_tokens)


def share_prompts(turns: Sequence[Turn], *, pad_id: int = 0) -> SharedPrompts:
    """The :class:`SharedPrompts` layout of ``turns`` (rows in order of each prompt's first turn)."""
    rows = _by_prompt(range(len(turns)), key=lambda b: turns[b].prompt_ids)
    width = max(len(p) + sum(len(turns[b].response_ids) for b in members) for p, members in rows.items())
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segment = torch.full(shape, -1, dtype=torch.long)  # 0: prompt, k: response k, -1: pad
    where: dict[int, tuple[int, int]] = {}  # turn -> (row, column of its first response token)
    for r, (prompt, members) in enumerate(rows.items()):
        p = len(prompt)
        input_ids[r, :p] = torch.tensor(prompt, dtype=torch.long)
        position_ids[r, :p] = torch.arange(p)
        segment[r, :p] = 0
        col = p
        for k, b in enumerate(members, start=1):
            n = len(turns[b].response_ids)
            input_ids[r, col : col + n] = torch.tensor(list(turns[b].response_ids), dtype=torch.long)
            position_ids[r, col : col + n] = torch.arange(p, p + n)
            segment[r, col : col + n] = k
            where[b] = (r, col)
            col += n
    columns = torch.arange(width)
    causal = columns[:, None] >= columns[None, :]
    own = (segment[:, :, None] == segment[:, None, :]) | (segment[:, None, :] == 0)
    source, target, tokens = [], [], []
    for b, turn in enumerate(turns):
        (r, col), p = where[b], len(turn.prompt_ids)
        for j, token in enumerate(turn.response_ids):
            source.append((r, p - 1 if j == 0 else col + j - 1))
            target.append((b, p + j))
            tokens.append(token)
    return SharedPrompts(
        input_ids=input_ids, position_ids=position_ids, attention_mask=(causal & own)[:, None],
        source=torch.tensor(source, dtype=torch.long), target=torch.tensor(target, dtype=torch.long),
        tokens=torch.tensor(tokens, dtype=torch.long), num_tokens=int((segment >= 0).sum()),
    )


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
    - ``rollout_is_weights``: (B, T) float32 or None, rollout correction's weight of token t
    - ``response_start``: the first column holding any response token (shortest prompt);
      columns before it hold only prompt tokens, so the learner computes logits only from
      ``response_start - 1`` on.
    - ``shared``: the same turns with each prompt once (``pack_turns(share=True)``):
      the model runs on it instead of ``input_ids``.
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
    shared: SharedPrompts | None = None
    rollout_is_weights: torch.Tensor | None = None

    @property
    def response_start(self) -> int:
        return min(self.prompt_lengths)

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens: what a forward+backward pass processes."""
        return self.shared.num_tokens if self.shared is not None else int(self.attention_mask.sum())

    @property
    def num_response_tokens(self) -> int:
        return sum(self.response_lengths)

    def to(self, device: Any) -> "PackedTurns":
        """The same batch with every tensor on `device`."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedTurns(
            self.turn_ids, move(self.input_ids), move(self.attention_mask), move(self.response_mask),
            move(self.old_log_prob), move(self.advantages), move(self.ref_log_prob),
            self.prompt_lengths, self.response_lengths, None if self.shared is None else self.shared.to(device),
            move(self.rollout_is_weights),
        )

    def response_values(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a token-aligned (B, T) tensor into each turn's (response_length,) values."""
        return [
            values[b, p : p + r]
            for b, (p, r) in enumerate(zip(self.prompt_lengths, self.response_lengths, strict=True))
        ]


def pack_turns(turns: Sequence[Turn], *, pad_id: int = 0, share: bool = False) -> PackedTurns:
    """Pack turns into a right-padded, token-aligned :class:`PackedTurns`.

    ``ref_log_prob`` is filled only when every turn carries ``ref_logprobs``; ``share`` adds
    the :class:`SharedPrompts` layout (only where two turns have one prompt).
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
    with_is = all(t.is_weights is not None for t in turns)
    is_weights = torch.zeros(shape, dtype=torch.float32) if with_is else None
    for b, turn in enumerate(turns):
        p, n = len(turn.prompt_ids), turn.length
        input_ids[b, :n] = torch.tensor([*turn.prompt_ids, *turn.response_ids], dtype=torch.long)
        attention_mask[b, :n] = 1
        response_mask[b, p:n] = 1
        old_log_prob[b, p:n] = torch.as_tensor(turn.old_logprobs, dtype=torch.float32)
        advantages[b, p:n] = torch.tensor(turn.advantage_list(), dtype=torch.float32)
        if ref_log_prob is not None:
            ref_log_prob[b, p:n] = torch.as_tensor(turn.ref_logprobs, dtype=torch.float32)
        if is_weights is not None:
            is_weights[b, p:n] = torch.as_tensor(turn.is_weights, dtype=torch.float32)
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
        shared=share_prompts(turns, pad_id=pad_id) if share and len(_by_prompt(turns)) < len(turns)
        else None,
        rollout_is_weights=is_weights,
    )


def micro_batches(turns: Sequence[Turn], *, max_rows: int, max_tokens: int | None = None,
                  share: bool = False) -> list[list[Turn]]:
    """`turns` split for gradient accumulation (learner and critic alike): longest first, so
    each micro-batch pads little, at most `max_rows` turns and, when set, `max_tokens` padded
    tokens (rows x longest row; a single longer turn still gets a micro-batch of its own).

    With `share`, turns with one prompt are kept together (a group larger than `max_rows` is
    cut) and a micro-batch is measured as :func:`share_prompts` lays it out: a row per prompt.
    """
    if not share:
        units = [[t] for t in sorted(turns, key=lambda t: t.length, reverse=True)]
    else:
        groups = _by_prompt(turns)
        units = []
        for group in sorted(groups.values(), key=_row_width, reverse=True):
            group = sorted(group, key=lambda t: len(t.response_ids), reverse=True)
            units.extend(group[i : i + max_rows] for i in range(0, len(group), max_rows))
    out: list[list[Turn]] = []
    for unit in units:
        cur = out[-1] if out else None
        if cur is None or len(cur) + len(unit) > max_rows or (
                max_tokens is not None and _padded_tokens(cur + unit, share) > max_tokens):
            out.append(list(unit))
        else:
            cur.extend(unit)
    return out


def _row_width(group: Sequence[Turn]) -> int:
    return len(group[0].prompt_ids) + sum(len(t.response_ids) for t in group)


def _padded_tokens(turns: Sequence[Turn], share: bool) -> int:
    if not share:
        return len(turns) * max(t.length for t in turns)
    rows = _by_prompt(turns)
    return len(rows) * max(_row_width(g) for g in rows.values())


def _by_prompt(items: Any, key: Any = lambda t: t.prompt_ids) -> dict[tuple[int, ...], list]:
    """`items` grouped by prompt ids, groups in order of first appearance."""
    groups: dict[tuple[int, ...], list] = {}
    for item in items:
        groups.setdefault(tuple(key(item)), []).append(item)
    return groups


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


def clipped_step(params: Sequence[Any], optimizer: Any, max_grad_norm: float | None) -> float | None:
    """One optimizer step on the accumulated gradients, clipped to `max_grad_norm` (None: no
    clipping); the pre-clip norm, or None where it is not finite: then no step (a non-finite
    gradient would poison the moments). The gradients are cleared either way."""
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm is not None else math.inf))
    if math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm if math.isfinite(norm) else None


def run_epochs(turns: Sequence[Turn], config: Any, update: int, step: Callable[[list[Turn]], float | None],
               optimizer: Any) -> tuple[int, int, list[float]]:
    """`step` on every mini-batch of one update (`update_mini_batches` with the learner's or
    critic's `mini_batch_size`, `ppo_epochs`, `shuffle`, `seed`); `step` returns the gradient
    norm, None where a non-finite norm skipped the optimizer step. The gradients are cleared
    however it ends. (mini-batches run, of them skipped, the finite norms)."""
    steps, norms = 0, []
    try:
        for mini in update_mini_batches(turns, config.mini_batch_size, epochs=config.ppo_epochs, shuffle=config.shuffle,
                                        seed=config.seed, update=update):
            norm = step(mini)
            steps += 1
            if norm is not None:
                norms.append(norm)
    finally:
        optimizer.zero_grad(set_to_none=True)
    return steps, steps - len(norms), norms
