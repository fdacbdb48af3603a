"""`export`: a run's trained policies as Hugging Face folders, plus which role each serves.

A policy trained with LoRA (``learner.lora_rank``) is checkpointed as a peft adapter. By
default it is exported merged into its base (a plain folder that transformers and ``vllm
serve`` load like any model); ``adapter=True`` writes the adapter itself, its base named by
a path that exists on this machine, for ``PeftModel.from_pretrained`` or vLLM's LoRA serving.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mas_trainer.engines.models import ADAPTER_CONFIG, adapter_base, is_adapter, model_dir_for, save_merged
from mas_trainer.errors import UserError
from mas_trainer.run.rundir import RunDir, run_config, trained_policies

__all__ = ["export"]


def export(run_dir: str | Path, out_dir: str | Path, *, adapter: bool = False) -> Path:
    """One Hugging Face folder per trained policy plus `mas-trainer.json` (role -> model)."""
    run = RunDir(run_dir)
    folders = trained_policies(run_dir)
    app = run.app()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapters = {p for p, folder in folders.items() if is_adapter(folder)}
    for policy, folder in folders.items():
        if policy in adapters and not adapter:
            save_merged(folder, out / policy, seed=run_config(run_dir).seed)  # `tiny`'s weights depend on the seed
            continue
        shutil.copytree(folder, out / policy, dirs_exist_ok=True)
        if policy in adapters:
            _locate_base(out / policy / ADAPTER_CONFIG)
    state = run.load_state()
    if state is None:  # trained_policies found one above: deleted since
        raise UserError(f"{run_dir}: its checkpoint is gone")
    mapping = {
        "roles": app.roles,
        "frozen": app.frozen,
        "policies": {p: {"path": p, "base_model": app.policies[p].base_model if p in app.policies else None,
                         "adapter": p in adapters and adapter} for p in folders},
        "step": state["step"],
    }
    (out / "mas-trainer.json").write_text(json.dumps(mapping, indent=1))
    return out


def _locate_base(config_path: Path) -> None:
    """Name the adapter's base by its folder on this machine (`default` means nothing to peft or vLLM)."""
    folder = model_dir_for(adapter_base(config_path.parent))
    if folder is not None:
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = str(folder.resolve())
        config_path.write_text(json.dumps(config, indent=2))
