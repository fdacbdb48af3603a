"""Learners: update one policy's weights from its turns and advantages.

The embedded learner (:class:`TorchLearner`) runs verl's policy losses on torch in the
policy engine's own process and thread. Importing this package is cheap: torch and verl
load only when the learner or the batch helpers are first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_trainer._lazy import lazy_exports
from mas_trainer.learners.config import LearnerConfig

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.learners.batch import PackedTurns, Turn, pack_turns
    from mas_trainer.learners.torch_learner import TorchLearner

__all__ = ["LearnerConfig", "PackedTurns", "TorchLearner", "Turn", "pack_turns"]

__getattr__ = lazy_exports(__name__, {
    "mas_trainer.learners.batch": ["PackedTurns", "Turn", "pack_turns"],
    "mas_trainer.learners.torch_learner": ["TorchLearner"],
})
