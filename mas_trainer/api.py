"""The Python API: what `mas-trainer fit`, `eval` and `export` do, from a script or a notebook.

```python
import mas_trainer
from app import graph                       # an @trainable StateGraph (or "app.py:graph")

run = mas_trainer.fit(graph, "tasks.jsonl", output="runs/mine", overrides={"steps": 20, "learner.lr": 1e-5})
run.held_out[-1]["reward/mean"]             # every metrics row is there; run.output holds the run directory
mas_trainer.evaluate(graph, "held_out.jsonl", run=run.output)
mas_trainer.export(run.output, "exported/")
```

The CLI's verbs call these functions with what they parsed, so the two cannot drift apart:
data is a path (JSONL or JSON), `hf:NAME[:CONFIG]:SPLIT` or a list of dicts; configuration
is a YAML file, a mapping, or `key=value` strings, checked as `fit --help` documents them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from mas_trainer.data import load_tasks

if TYPE_CHECKING:
    from rich.console import Console

    from mas_trainer.config import FitConfig

__all__ = ["FitResult", "evaluate", "export", "fit", "fit_config"]


@dataclass
class FitResult:
    """A finished (or resumed and finished) run: its directory and every metrics row."""

    output: Path
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def train(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("kind") == "train"]

    @property
    def held_out(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("kind") == "val"]

    @property
    def policies(self) -> dict[str, Path]:
        """policy -> its trained Hugging Face folder (what `export` and `serve` load)."""
        folder = self.output / "checkpoint" / "policies"
        return {p.name: p for p in sorted(folder.iterdir()) if p.is_dir()} if folder.is_dir() else {}


def fit_config(config: str | Path | Mapping[str, Any] | FitConfig | None = None,
               overrides: Mapping[str, Any] | Iterable[str] = (), *, model: str | None = None) -> FitConfig:
    """The checked configuration from a YAML file or a mapping, then `overrides`
    (`{"learner.lr": 1e-5}` or `["learner.lr=1e-5"]`); `model` as `fit --model`."""
    from mas_trainer.config import FitConfig, load_config

    # a mapping's values are Python values, applied after the file (dotted keys, in order)
    items = [] if isinstance(overrides, Mapping) else list(overrides)
    base = {**(dict(overrides) if isinstance(overrides, Mapping) else {}), **({"model": model} if model else {})}
    if isinstance(config, FitConfig):
        if not items and not base:
            return config
        return load_config(None, items, base={**config.model_dump(mode="json"), **base})
    if isinstance(config, Mapping):
        return load_config(None, items, base={**config, **base})
    return load_config(config, items, base=base)


def fit(app: Any, data: str | Path | Iterable[dict[str, Any]], *, output: str | Path = "runs/fit",
        config: str | Path | Mapping[str, Any] | FitConfig | None = None, overrides: Mapping[str, Any] | Iterable[str] = (),
        model: str | None = None, val_data: str | Path | Iterable[dict[str, Any]] | None = None, resume: bool = False,
        console: Console | None = None, started_at: float | None = None) -> FitResult:
    """Train `app` (an @trainable graph, or `"file.py:attr"` / `"pkg.mod:attr"`) on `data`;
    progress goes to `console` (default: the terminal). Raises UserError (one line) on bad
    input, before anything starts where it can be known then. `started_at` (a
    `time.perf_counter()` reading, default: now) is where the run's clock starts: the CLI
    passes its launch, so start-up counts."""
    import time

    from mas_trainer.runtime.trainer import fit as run_fit

    started_at = time.perf_counter() if started_at is None else started_at
    cfg = fit_config(config, overrides, model=model)
    tasks = load_tasks(data)
    val = load_tasks(val_data) if val_data is not None else None
    rows = run_fit(app, tasks, cfg, output, val_tasks=val, resume=resume, console=console, started_at=started_at)
    return FitResult(Path(output), rows)


def evaluate(app: Any, data: str | Path | Iterable[dict[str, Any]], *, run: str | Path | None = None,
             **options: Any) -> dict[str, Any]:
    """Mean reward of `app` on `data`, overall and per role, with the trained policies of `run`
    (else the base models); `options` as `mas-trainer eval`'s (n, seed, max_tokens, temperature,
    max_in_flight, timeout_s, model)."""
    from mas_trainer.runtime.evaluate import evaluate as run_evaluate

    return run_evaluate(app, load_tasks(data), run_dir=run, **options)


def export(run: str | Path, out_dir: str | Path, *, adapter: bool = False) -> Path:
    """One Hugging Face folder per trained policy of `run`, plus `mas-trainer.json`."""
    from mas_trainer.runtime.export import export as run_export

    return run_export(run, out_dir, adapter=adapter)
