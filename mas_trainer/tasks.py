"""Tasks from where users keep them: a JSONL or JSON file, a Hugging Face dataset
(`hf:NAME[:CONFIG]:SPLIT`), or a list of dicts already in memory. One loader for the CLI
and the Python API, so both read the same things and refuse the same things in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from mas_trainer.errors import UserError

__all__ = ["HF_PREFIX", "load_tasks"]

HF_PREFIX = "hf:"


def load_tasks(data: str | Path | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every task of `data`; a one-line UserError names the file, line or task that is wrong."""
    if not isinstance(data, (str, Path)):
        tasks = list(data)
        bad = [i for i, t in enumerate(tasks, 1) if not isinstance(t, dict)]
        if bad:
            raise UserError(f"data: task {bad[0]} is a {type(tasks[bad[0] - 1]).__name__}, not a dict")
        if not tasks:
            raise UserError("data: no tasks")
        return tasks
    if str(data).startswith(HF_PREFIX):
        return _hf_tasks(str(data))
    path = Path(data)
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON: {exc}") from exc
        tasks = loaded if isinstance(loaded, list) else [loaded]
    else:
        tasks = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                tasks.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from exc
    bad = [i for i, t in enumerate(tasks, 1) if not isinstance(t, dict)]
    if bad:
        raise UserError(f"{path}: task {bad[0]} is not a JSON object")
    if not tasks:
        raise UserError(f"{path}: no tasks")
    return tasks


def _hf_tasks(ref: str) -> list[dict[str, Any]]:
    """`hf:NAME[:CONFIG]:SPLIT` (or `hf:NAME`, split train): one task per row of a Hugging
    Face dataset, from the local cache or a folder when offline (`datasets.load_dataset`)."""
    parts = ref[len(HF_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3 or not all(parts):
        raise UserError(f"data {ref!r}: write hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT (e.g. hf:hotpot_qa:distractor:validation)")
    name, config, split = parts[0], (parts[1] if len(parts) == 3 else None), (parts[-1] if len(parts) > 1 else "train")
    try:
        import datasets
    except ImportError as exc:
        raise UserError(f"data {ref!r} needs the `datasets` package: pip install datasets") from exc
    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; the message says what
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"data {ref!r}: cannot load Hugging Face dataset {name!r} (config {config}, split {split!r}): {first}") from exc
    tasks = [dict(row) for row in rows]
    if not tasks:
        raise UserError(f"data {ref!r}: no rows")
    return tasks
