"""Rows of many LoRA adapters of one base in one batch, each row's low-rank update in two
matmuls a layer, whatever the number of adapters.

peft's own mixed-batch forward (`adapter_names=`) loops over the batch's adapters in every
adapted layer, gathering each adapter's rows, and registers a hook on every layer for each
forward: on the 2-core reference CPU three adapters mixed decoded at about half the base's
speed (SmolLM2-135M, all-linear rank 16). Here every adapter's A matrices are stacked into
one (S*r, in) matrix and their B matrices into one (out, S*r), once per weight version, and a
forward hook on each adapted layer's base Linear adds

    ((x @ A_all^T) * mask) @ B_all^T,   mask[row, column] = scaling of the column's adapter
                                        if it is the row's adapter, else 0

so a row gets exactly its own adapter's ``scaling * B (A x)`` (the other adapters' columns are
multiplied by zero), and a base row (no adapter) nothing. The extra work is a (B, S*r)
product per layer, small beside the base's (in x out) matmul for ranks far below the hidden
size; rows of the same adapter need no gathering. Meanwhile peft's own LoRA path is switched
off (its layers' disabled flag), so the base Linear runs once per layer for the whole batch.

`tests/engines/test_adapter_batch.py` checks it against peft's mixed-batch forward (the
reference) and against each adapter merged into its own model.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Iterator, Sequence

import torch

__all__ = ["BatchedLora"]


class BatchedLora:
    """The adapters `names` of a peft model, applied per row by `rows(...)`."""

    def __init__(self, peft_model: Any, names: Sequence[str]) -> None:
        from peft.tuners.lora import LoraLayer

        self.names = list(names)
        self.slot = {name: i for i, name in enumerate(self.names)}
        self.layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer) and any(n in m.lora_A for n in self.names)]
        for m in self.layers:
            if not isinstance(m.base_layer, torch.nn.Linear):
                raise ValueError(f"batched adapters support LoRA on Linear layers only, not on {type(m.base_layer).__name__}")
        self._stacks: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None  # per layer: A_all, B_all, layout
        self._layouts: list[tuple[torch.Tensor, torch.Tensor]] = []  # column -> adapter slot, column -> scaling
        self._rows: torch.Tensor | None = None  # a forward's row -> adapter slot (-1: the base)
        self._masks: dict[int, torch.Tensor] = {}
        self._hooks = [m.base_layer.register_forward_hook(partial(self._add, i)) for i, m in enumerate(self.layers)]

    def refresh(self) -> None:
        """The adapters' weights may have changed (an update): stack them again before the next forward."""
        self._stacks = None

    def _build(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        layouts: dict[tuple, int] = {}
        self._layouts = []
        stacks = []
        for m in self.layers:
            a, b, slots, scales = [], [], [], []
            for name in self.names:
                if name in m.lora_A:
                    weight = m.lora_A[name].weight
                    a.append(weight.detach())
                    b.append(m.lora_B[name].weight.detach())
                    slots += [self.slot[name]] * weight.shape[0]
                    scales += [float(m.scaling[name])] * weight.shape[0]
            key = (tuple(slots), tuple(scales))
            if key not in layouts:  # layers adapted alike share one mask per forward
                layouts[key] = len(self._layouts)
                device = a[0].device
                self._layouts.append((torch.tensor(slots, device=device), torch.tensor(scales, device=device)))
            stacks.append((torch.cat(a), torch.cat(b, dim=1), layouts[key]))
        return stacks

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within: a forward of the base model gives row i adapter `adapters[i]`'s output (None: the base's)."""
        if self._stacks is None:
            self._stacks = self._build()
        first = self._layouts[0][0] if self._layouts else None
        slots = torch.tensor([-1 if a is None else self.slot[a] for a in adapters],
                             device=first.device if first is not None else "cpu")
        before = [m._disable_adapters for m in self.layers]
        for m in self.layers:  # peft's own LoRA path off: the hooks add every row's update
            m._disable_adapters = True
        self._rows = slots if bool((slots >= 0).any()) else None
        try:
            yield
        finally:
            for m, was in zip(self.layers, before):
                m._disable_adapters = was
            self._rows = None
            self._masks.clear()

    def _add(self, i: int, _module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        rows, stacks = self._rows, self._stacks
        if rows is None or stacks is None:  # outside `rows`: a learner's forward, peft's own path
            return None
        a, b, layout = stacks[i]
        mask = self._masks.get(layout)
        if mask is None:
            col_slot, col_scale = self._layouts[layout]
            mask = self._masks[layout] = (rows[:, None] == col_slot[None, :]) * col_scale[None, :]  # (B, C)
        x = args[0]
        low = torch.matmul(x, a.t())  # (B, T, C): every adapter's A at once
        low = low * mask.to(low.dtype)[:, None, :]
        return output + torch.matmul(low, b.t()).to(output.dtype)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
