"""`export`: a run's trained policies as Hugging Face folders, plus which role each serves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mas_trainer.runtime.backends import trained_policies
from mas_trainer.runtime.rundir import RunDir

__all__ = ["export"]


def export(run_dir: str | Path, out_dir: str | Path) -> Path:
    """One Hugging Face folder per trained policy plus `mas-trainer.json` (role -> model)."""
    run = RunDir(run_dir)
    folders = trained_policies(run_dir)
    app = run.app()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for policy, folder in folders.items():
        shutil.copytree(folder, out / policy, dirs_exist_ok=True)
    mapping = {
        "roles": app.roles,
        "frozen": app.frozen,
        "policies": {p: {"path": p, "base_model": app.policies[p].base_model if p in app.policies else None} for p in folders},
        "step": run.load_state()["step"],
    }
    (out / "mas-trainer.json").write_text(json.dumps(mapping, indent=1))
    return out
