"""Prompt-prefix KV cache for the embedded engine.

The n samples of a group send one prompt; a step's nodes share their system prompts; a
multi-turn agent re-sends its growing conversation. The engine prefills each distinct prompt
of one batch once already; this cache keeps the keys and values of prompts it prefilled, so a
later prompt that starts with one of them prefills only the rest.

Prefixes are matched in whole blocks of `block` tokens (a hit covers at most the prompt less
its last token, which is prefilled to get the next token's logits). An entry holds one
prompt's per-layer K/V and is found through the chained hashes of its blocks; a hit is checked
token by token before it is used, so a hash collision costs a miss, never a wrong answer.
Entries are evicted least recently used first once their bytes pass `max_bytes`; the engine
clears the cache whenever its weights may have changed (any `run_exclusive` call).

A `salt` keeps apart prompts whose K/V differ for the same tokens: an engine serving several
LoRA adapters of one base salts each lookup with the row's adapter, whose q/k/v projections
differ from the base's (an entry matches only its own salt).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

__all__ = ["PrefixCache", "BLOCK"]

BLOCK = 16  # tokens a hit is counted in: a shorter shared prefix is not worth a lookup


@dataclass(eq=False)
class _Entry:
    tokens: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (heads, len, dim)
    keys: list[int]  # the chained block hashes that lead here
    nbytes: int
    salt: Hashable = None


class PrefixCache:
    """K/V of prefilled prompts, looked up by the longest block-aligned prefix."""

    def __init__(self, max_bytes: int, block: int = BLOCK) -> None:
        if max_bytes <= 0 or block <= 0:
            raise ValueError("PrefixCache needs max_bytes > 0 and block > 0")
        self.max_bytes, self.block = max_bytes, block
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # id -> entry, LRU first
        self._index: dict[int, int] = {}  # block-chain hash -> entry id
        self._ids = itertools.count()
        self.nbytes = 0
        self.hits = self.lookups = 0

    def _chain(self, tokens: Sequence[int], upto: int, salt: Hashable = None) -> list[int]:
        """The chained hashes of the whole blocks of tokens[:upto], shortest prefix first."""
        out, h = [], hash(salt)
        for end in range(self.block, upto + 1, self.block):
            h = hash((h, tuple(tokens[end - self.block:end])))
            out.append(h)
        return out

    def lookup(self, prompt: Sequence[int], salt: Hashable = None) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(n, per-layer K/V of prompt[:n]) for the longest cached prefix stored with the same
        `salt`, n < len(prompt); (0, []) on a miss."""
        self.lookups += 1
        chain = self._chain(prompt, len(prompt) - 1, salt)
        for i in range(len(chain) - 1, -1, -1):
            eid = self._index.get(chain[i])
            entry = self._entries.get(eid) if eid is not None else None
            n = (i + 1) * self.block
            if entry is None or entry.salt != salt or entry.tokens[:n] != tuple(prompt[:n]):
                continue
            self._entries.move_to_end(eid)  # type: ignore[arg-type]
            self.hits += 1
            return n, [(k[:, :n], v[:, :n]) for k, v in entry.kv]
        return 0, []

    def store(self, prompt: Sequence[int], read_kv: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]],
              salt: Hashable = None) -> None:
        """Keep `prompt`'s K/V (`read_kv()`: per layer, (heads, len(prompt), dim); copied) under
        `salt` unless it is too short, too big or here already (then `read_kv` is not called)."""
        chain = self._chain(prompt, len(prompt), salt)
        if not chain:
            return
        last = self._entries.get(self._index.get(chain[-1], -1))
        if last is not None and last.salt == salt and last.tokens[:len(chain) * self.block] == tuple(prompt[:len(chain) * self.block]):
            self._entries.move_to_end(self._index[chain[-1]])
            return  # its longest block prefix is here already
        n = len(chain) * self.block
        copied = [(k[:, :n].clone(), v[:, :n].clone()) for k, v in read_kv()]
        nbytes = sum(k.nbytes + v.nbytes for k, v in copied)
        if nbytes > self.max_bytes:
            return
        while self._entries and self.nbytes + nbytes > self.max_bytes:
            self._evict()
        entry = _Entry(tuple(prompt[:n]), copied, chain, nbytes, salt)
        eid = next(self._ids)
        self._entries[eid] = entry
        for h in chain:  # a longer prompt takes over its prefixes' hashes: its K/V hold them too
            self._index[h] = eid
        self.nbytes += nbytes

    def _evict(self) -> None:
        eid, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        for h in entry.keys:
            if self._index.get(h) == eid:
                del self._index[h]

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)
