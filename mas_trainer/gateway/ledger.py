"""Token records of LLM calls, filed by rollout until the controller collects them."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

from mas_trainer.trace.schema import LLMCall

__all__ = ["Ledger"]

log = logging.getLogger(__name__)


class Ledger:
    """Thread-safe: the gateway files from its event loop, the controller takes from its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_rollout: dict[str, list[LLMCall]] = defaultdict(list)
        self._closed: set[str] = set()

    def file(self, rollout_id: str, call: LLMCall) -> None:
        with self._lock:
            if rollout_id not in self._closed:
                self._by_rollout[rollout_id].append(call)
                return
        # A call still running when its rollout ended (timeout, error): its trajectory is
        # already written without it, and nobody trains on it.
        log.info("llm call %s of rollout %s finished after the rollout was collected; dropped", call.id, rollout_id)

    def take(self, rollout_id: str) -> list[LLMCall]:
        """All calls of a finished rollout, in arrival order; later arrivals are dropped."""
        with self._lock:
            self._closed.add(rollout_id)
            return self._by_rollout.pop(rollout_id, [])
