"""mas-trainer: train LangGraph multi-agent apps as multi-agent RL systems.

`import mas_trainer` stays light: the LangGraph adapter (and with it `trainable`) and the
torch engine are imported when first used.
"""

from typing import Any

__all__ = ["trainable", "fit", "evaluate", "export", "fit_config", "FitResult", "__version__"]
__version__ = "0.1.0"

_API = ("fit", "evaluate", "export", "fit_config", "FitResult")  # mas_trainer.api: what the CLI verbs call


def __getattr__(name: str) -> Any:
    if name == "trainable":
        from mas_trainer.adapters.langgraph import trainable

        return trainable
    if name in _API:
        from mas_trainer import api

        return getattr(api, name)
    raise AttributeError(f"module 'mas_trainer' has no attribute {name!r}")
