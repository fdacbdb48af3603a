"""Learners: update one policy's weights from its turns and advantages.

The embedded learner (:class:`TorchLearner`) runs verl's policy losses on torch in the
policy engine's own process and thread. Importing this package is cheap: torch and verl
load only when the learner or the batch helpers are first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mas_trainer.learners.config import LearnerConfig

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.learners.batch import PackedTurns, Turn, pack_turns
    from mas_trainer.learners.torch_learner import TorchLearner, build_actor_config

__all__ = ["LearnerConfig", "PackedTurns", "TorchLearner", "Turn", "build_actor_config", "pack_turns"]

_LAZY = {
    "PackedTurns": "mas_trainer.learners.batch",
    "Turn": "mas_trainer.learners.batch",
    "pack_turns": "mas_trainer.learners.batch",
    "TorchLearner": "mas_trainer.learners.torch_learner",
    "build_actor_config": "mas_trainer.learners.torch_learner",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
