"""How the current batch of rollouts samples: owned by whoever drives the rollouts.

The trainer (or `eval`) sets it between batches from its own thread; the gateway reads it on
its event loop for every rollout request. One lock guards the three parts, so a request
never sees the seed of one batch with the temperature or call counts of another.
"""

from __future__ import annotations

import hashlib
import threading
from collections import defaultdict
from dataclasses import replace

from mas_trainer.engines.base import SamplingParams

__all__ = ["RolloutSampling"]


class RolloutSampling:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The step's seed: requests that name no seed get one derived from (seed, rollout,
        # node, k-th call of that node), so a rollout whose calls come in a fixed order
        # samples the same tokens when the step is re-run (resume).
        self._seed: int | None = None
        # Validation may sample differently from training (verl's val_kwargs): when set,
        # rollout requests use this temperature whatever the app asked for.
        self._temperature: float | None = None
        self._calls: dict[tuple[str, str], int] = defaultdict(int)

    def reseed(self, seed: int | None, *, temperature: float | None = None) -> None:
        """Seed the requests of the next batch of rollouts (None: leave them unseeded) and
        set their temperature (None: the one each request asks for)."""
        with self._lock:
            self._seed = seed
            self._temperature = temperature
            self._calls.clear()

    def apply(self, params: SamplingParams, rollout_id: str | None, node: str) -> SamplingParams:
        """`params` of one request as the batch samples them; requests outside any rollout
        (a user poking the endpoint) keep their own."""
        if not rollout_id:
            return params
        with self._lock:
            if params.seed is None and self._seed is not None:
                k = self._calls[(rollout_id, node)]
                self._calls[(rollout_id, node)] = k + 1
                digest = hashlib.blake2b(f"{self._seed}|{rollout_id}|{node}|{k}".encode(), digest_size=8).digest()
                params = replace(params, seed=int.from_bytes(digest, "little") & 0x7FFFFFFF)
            if self._temperature is not None:
                params = replace(params, temperature=self._temperature)
        return params
