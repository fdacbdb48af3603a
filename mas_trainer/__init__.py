"""mas-trainer: train LangGraph multi-agent apps as multi-agent RL systems.

`import mas_trainer` stays light: the LangGraph adapter (and with it `trainable`) and the
torch engine are imported when first used.
"""

import os
import sys
from typing import Any

# torch's OpenMP (libgomp) reads this once, when torch is imported: waiting pool threads then sleep instead of
# spinning for a thread another process (or the gateway) holds, which made engines on a loaded CPU 10x slower
# (docs/engine.md, "Threads"). Too late once torch is in; a value set beforehand is kept.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
