"""The training loop (`trainer.py`), the rollouts it runs (`session.py`: gateway and engines;
`controller.py`: the app on each task), counterfactual forks (`forking.py`), evaluation
(`evaluate.py`) and the engine answering each policy in every verb (`backends.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_trainer._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.apps import AppRunner, RunResult
    from mas_trainer.loop.controller import Controller

__all__ = ["AppRunner", "Controller", "RunResult"]

__getattr__ = lazy_exports(__name__, {
    "mas_trainer.apps": ["AppRunner", "RunResult"],
    "mas_trainer.loop.controller": ["Controller"],
})
