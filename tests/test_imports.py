"""The package's import graph: no circles between modules or packages, and a light config.

Every `import` counts, also the ones inside functions: a circle hidden in a function body
still ties two parts together (and breaks the day someone hoists the import).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ((ROOT / "mas_trainer", "mas_trainer"), (ROOT / "adapters", "mas_trainer.adapters"))


def _modules() -> dict[str, Path]:
    found = {}
    for base, prefix in PACKAGES:
        for f in base.rglob("*.py"):
            parts = [p for p in f.relative_to(base).with_suffix("").parts if p != "__init__"]
            found[".".join([prefix, *parts])] = f
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = owner(name) if name.startswith("mas_trainer") else ""
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def _package(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:3] if len(parts) > 2 and parts[1] == "adapters" else parts[:2])


def test_no_module_imports_itself_in_a_circle():
    assert _cycles(_graph()) == []


def test_no_two_packages_import_each_other():
    packages: dict[str, set[str]] = {}
    for mod, targets in _graph().items():
        for t in targets:
            if _package(mod) != _package(t):
                packages.setdefault(_package(mod), set()).add(_package(t))
    assert _cycles(packages) == []


def test_config_is_a_leaf():
    """config.py imports other packages' config modules only, never the runtime above it."""
    targets = _graph()["mas_trainer.config"]
    assert all(t.endswith(".config") or t in ("mas_trainer.errors", "mas_trainer.rewards.allocators") for t in targets), targets


def test_loading_the_config_imports_no_server_tracing_or_training_stack():
    code = ("import sys, mas_trainer.config, mas_trainer.cli; "
            "print(sorted(m for m in ('fastapi', 'opentelemetry', 'torch', 'ray', 'verl', 'langgraph') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# What `import mas_trainer.config` (every CLI command) loads of the package: the config modules,
# the reward allocators the config checks names against (with the counterfactual one they
# register) and the trajectory schema they read. A module added here is paid by `--help`.
CONFIG_IMPORTS = {
    "mas_trainer", "mas_trainer._lazy", "mas_trainer.config", "mas_trainer.errors",
    "mas_trainer.algo", "mas_trainer.algo.config", "mas_trainer.engines", "mas_trainer.engines.config",
    "mas_trainer.learners", "mas_trainer.learners.config",
    "mas_trainer.rewards", "mas_trainer.rewards.allocators", "mas_trainer.rewards.config",
    "mas_trainer.rewards.counterfactual", "mas_trainer.rewards.levels",
    "mas_trainer.replicas", "mas_trainer.replicas.config",
    "mas_trainer.trace", "mas_trainer.trace.schema",
}


def test_loading_the_config_imports_only_its_light_modules():
    code = "import sys, mas_trainer.config; print(' '.join(sorted(m for m in sys.modules if m.startswith('mas_trainer'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert set(out.stdout.split()) == CONFIG_IMPORTS


def test_lazy_packages_export_every_name_in_all():
    import importlib

    for package in ("mas_trainer.rewards", "mas_trainer.engines", "mas_trainer.algo", "mas_trainer.trace"):
        mod = importlib.import_module(package)
        missing = [name for name in mod.__all__ if not hasattr(mod, name)]
        assert missing == [], (package, missing)


def test_only_apps_imports_the_adapter():
    """The core reaches the LangGraph adapter through `mas_trainer.apps` only (`app_runner`,
    `forks_of`); the package's lazy `mas_trainer.trainable` is the public re-export of the decorator."""
    importers = {mod for mod, targets in _graph().items() if not mod.startswith("mas_trainer.adapters")
                 and any(t.startswith("mas_trainer.adapters") for t in targets)}
    assert importers == {"mas_trainer", "mas_trainer.apps"}
