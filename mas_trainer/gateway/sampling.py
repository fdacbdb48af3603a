"""How the current batch of rollouts samples: owned by whoever drives the rollouts.

The trainer (or `eval`) sets it between batches from its own thread; the gateway reads it on
its event loop for every rollout request. One lock guards the three parts, so a request
never sees the seed of one batch with the temperature or call counts of another.

A rollout request that names no seed gets one derived from what the call *is*, never from
when it arrived (`call_seed`): the step's seed, the rollout, the call's branch (the node
call's identity in its rollout, which the adapter's tracer sends as baggage: `Send` branches
told apart by their index among the step's sends, not by which ran first), the digest of its
prompt, and how many calls of that branch sent the same prompt before it. So two runs with
one seed, and a step re-run on resume, sample the same tokens for the same call, however
parallel branches interleave.
"""

from __future__ import annotations

import hashlib
import threading
from collections import defaultdict
from dataclasses import replace
from typing import Sequence

from mas_trainer.engines.base import SamplingParams

__all__ = ["RolloutSampling", "call_seed", "prompt_digest"]


def prompt_digest(prompt_ids: Sequence[int] | None) -> str:
    """A stable digest of the token ids the engine is given ("" when unknown)."""
    if prompt_ids is None:
        return ""
    return hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=12).hexdigest()


def call_seed(seed: int, rollout_id: str, branch: str, prompt: str = "", occurrence: int = 0) -> int:
    """The sampling seed of one rollout call, the same in every process: a blake2b hash (not
    Python's `hash`, salted per process) of the step's `seed`, the rollout, the call's
    `branch` (its node call's identity; the node name where the client sent none), its
    `prompt` digest and its `occurrence` among the calls of that branch with that prompt."""
    key = "\x1f".join((str(seed), rollout_id, branch, prompt, str(occurrence)))
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class RolloutSampling:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The step's seed: requests that name no seed get one from `call_seed`.
        self._seed: int | None = None
        # Validation may sample differently from training (verl's val_kwargs): when set,
        # rollout requests use this temperature whatever the app asked for.
        self._temperature: float | None = None
        # (rollout, branch, prompt digest) -> calls seeded so far: a node that sends one prompt
        # twice in a row gets two samples. Only calls with the same prompt in the same branch
        # count each other, and such calls made one after the other arrive in their order.
        self._calls: dict[tuple[str, str, str], int] = defaultdict(int)
        # call id -> its seed: the client's retry of a dropped request is the same call
        self._seeds: dict[str, int] = {}

    def reseed(self, seed: int | None, *, temperature: float | None = None) -> None:
        """Seed the requests of the next batch of rollouts (None: leave them unseeded) and
        set their temperature (None: the one each request asks for)."""
        with self._lock:
            self._seed = seed
            self._temperature = temperature
            self._calls.clear()
            self._seeds.clear()

    def apply(self, params: SamplingParams, rollout_id: str | None, node: str, *, branch: str | None = None,
              prompt_ids: Sequence[int] | None = None, call_id: str | None = None) -> SamplingParams:
        """`params` of one request as the batch samples them; requests outside any rollout
        (a user poking the endpoint) keep their own. `branch` identifies the call's node call
        in its rollout (`node` stands in without one), `prompt_ids` are what the engine is
        given, `call_id` the call's own id (its chat span's)."""
        if not rollout_id:
            return params
        with self._lock:
            if params.seed is None and self._seed is not None:
                seed = self._seeds.get(call_id) if call_id else None
                if seed is None:
                    identity = branch or node
                    digest = prompt_digest(prompt_ids)
                    k = self._calls[(rollout_id, identity, digest)]
                    self._calls[(rollout_id, identity, digest)] = k + 1
                    seed = call_seed(self._seed, rollout_id, identity, digest, k)
                    if call_id:
                        self._seeds[call_id] = seed
                params = replace(params, seed=seed)
            if self._temperature is not None:
                params = replace(params, temperature=self._temperature)
        return params
