"""Checkpoint files read from a run directory, vetted before a library unpickles them.

Run directories get copied and shared, so nothing in one may run code when it is loaded.
This project's own files are read with `torch.load(weights_only=True)`; verl's checkpoint
manager reads its shards, optimizer state and RNG state with `weights_only=False`, which
runs whatever a crafted pickle names. So before verl loads a folder, every `.pt` file in it
is scanned with torch's own `get_unsafe_globals_in_checkpoint` (the globals the restricted
unpickler would refuse), and a file that names anything but the numpy array types verl's
RNG state needs is refused. DTensor and its placements are torch's own safe globals once
`torch.distributed.tensor` is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mas_trainer.errors import UserError

__all__ = ["refuse_code_in_checkpoints", "load_tensors"]

# What `np.random.get_state()` pickles to (verl's BaseCheckpointManager.get_rng_state), under
# numpy 1.x and 2.x names; dtype classes are numpy's own (`numpy.dtypes.UInt32DType`).
_NUMPY = frozenset({"numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
                    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar"})


def _allowed(name: str) -> bool:
    return name in _NUMPY or (name.startswith("numpy.dtypes.") and name.endswith("DType"))


def refuse_code_in_checkpoints(folder: str | Path) -> None:
    """Raise a one-line UserError if a `.pt` file under `folder` could run code when unpickled."""
    import torch.distributed.tensor  # noqa: F401 - registers DTensor and its placements as safe globals
    from torch.serialization import get_unsafe_globals_in_checkpoint

    for path in sorted(Path(folder).rglob("*.pt")):
        try:
            names = get_unsafe_globals_in_checkpoint(path)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds on a damaged file
            raise UserError(f"{path}: not a readable torch checkpoint ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                            "restore the run's checkpoint folder from a backup, or train into a new --output") from None
        bad = sorted(n for n in names if not _allowed(n))
        if bad:
            raise UserError(f"{path} names {', '.join(bad[:3])} (a pickle that could run code when loaded); refused: "
                            "resume only run directories this project wrote")


def load_tensors(path: str | Path) -> Any:
    """This project's own `.pt` file: tensors, numbers and containers only (`weights_only`);
    a pickle that names anything else is refused in one line."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{path} holds more than tensors and numbers (a pickle that could run code); refused: "
                        "resume only run directories this project wrote") from None
