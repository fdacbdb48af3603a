"""The embedded engine's decode-step K/V: a cache that grows in place, attention that reads it as it is.

Two copies per layer per decode step dominate a batched decode on a CPU once prompts are a few
hundred tokens long (an agent's growing conversation), more than the weights themselves:

- Hugging Face's `DynamicLayer` appends a step's key and value with `torch.cat`, which copies
  the layer's whole cache every step. `GrowingLayer` keeps them in buffers with spare columns
  (`SPARE`), so a step writes one column and a copy happens once every `SPARE` steps.
- Hugging Face's sdpa attention repeats the K/V heads of grouped-query attention for every
  query head (`repeat_kv`) whenever a mask is given, and the engine's padded batch always gives
  one. `decode_attention` instead folds the query heads of one K/V head into that head's query
  rows (a decode step has one query position, so they share its mask) and attends to the
  cache unrepeated. Anything but a no-grad single-token step goes to Hugging Face's own
  function unchanged, so a learner sharing the model trains exactly as before.

Both give the same numbers as the plain path (tests/engines/test_fast_decode.py compares them);
`TorchEngine(..., fast_decode=False)` keeps the plain path, the reference the benches compare with.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["GrowingLayer", "SPARE", "ATTENTION", "new_cache", "use_decode_attention"]

SPARE = 128  # columns allocated ahead: one cache copy per SPARE decode steps instead of one per step
ATTENTION = "mas_trainer_sdpa"  # the name decode_attention is registered under


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with room to grow.

    Reading `keys` / `values` gives the filled columns; assigning them (the engine's batch
    edits do) replaces the buffer with the tensor given, which has no spare room, so the next
    update copies it into a new buffer, as `DynamicLayer` would.
    """

    def __init__(self, config: Any = None) -> None:
        self._buf: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self._len = {"keys": 0, "values": 0}
        super().__init__(config)

    def _get(self, name: str) -> torch.Tensor | None:
        buf = self._buf[name]
        if buf is None or buf.dim() != 4 or buf.shape[-2] == self._len[name]:
            return buf
        return buf[:, :, :self._len[name]]

    def _set(self, name: str, value: torch.Tensor | None) -> None:
        self._buf[name] = value
        self._len[name] = value.shape[-2] if value is not None and value.dim() == 4 else 0

    keys = property(lambda self: self._get("keys"), lambda self, v: self._set("keys", v))  # type: ignore[assignment]
    values = property(lambda self: self._get("values"), lambda self, v: self._set("values", v))  # type: ignore[assignment]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append("keys", key_states)
        self._append("values", value_states)
        return self.keys, self.values  # type: ignore[return-value]

    def _append(self, name: str, new: torch.Tensor) -> None:
        buf, n, add = self._buf[name], self._len[name], new.shape[-2]
        if buf is None or buf.dim() != 4 or n == 0:
            buf, n = new.new_empty((*new.shape[:2], add + SPARE, new.shape[-1])), 0
        elif buf.shape[-2] < n + add:
            grown = buf.new_empty((*buf.shape[:2], n + add + SPARE, buf.shape[-1]))
            grown[:, :, :n] = buf[:, :, :n]
            buf = grown
        buf[:, :, n:n + add] = new  # columns past every view handed out so far: nobody else reads them
        self._buf[name], self._len[name] = buf, n + add


def new_cache(config: Any, prefixes: list[tuple[torch.Tensor, torch.Tensor]] | None = None, *, grow: bool = True) -> Any:
    """A `DynamicCache` for `config` (full-attention layers only), of `GrowingLayer`s when
    `grow`, holding `prefixes` (per layer, keys and values (batch, heads, len, dim)) if given."""
    cache = DynamicCache(config=config)
    if grow:
        cache.layers = [GrowingLayer() for _ in cache.layers]
    for layer, (keys, values) in zip(cache.layers, prefixes or ()):
        layer.update(keys, values)
    return cache


def decode_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Hugging Face's sdpa attention, with grouped K/V heads read unrepeated on a decode step.

    query (batch, heads, 1, dim); key, value (batch, kv_heads, len, dim); mask (batch, 1, 1, len)
    or None. Returns (batch, 1, heads, dim), as `sdpa_attention_forward` does.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    if (q_len != 1 or groups == 1 or torch.is_grad_enabled() or dropout
            or (attention_mask is not None and attention_mask.shape[1] != 1)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # query head h reads K/V head h // groups (repeat_kv's order): the group's heads become query rows
    folded = query.reshape(batch, key.shape[1], groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_decode_attention(model: Any) -> bool:
    """Route `model`'s attention through `decode_attention` if it uses Hugging Face's sdpa
    (registered once under `ATTENTION`; not saved with the model's config). True if it now does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = model.config
    if getattr(config, "_attn_implementation", None) == ATTENTION:
        return True
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(ATTENTION, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    config._attn_implementation = ATTENTION
    return True
