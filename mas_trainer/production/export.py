"""`export`: a run's trained policies as Hugging Face folders, plus which role each serves.

A policy trained with LoRA (``learner.lora_rank``) is checkpointed as a peft adapter. By
default it is exported merged into its base (a plain folder that transformers and ``vllm
serve`` load like any model); ``adapter=True`` writes the adapter itself, its base named by
a path that exists on this machine, for ``PeftModel.from_pretrained`` or vLLM's LoRA serving.

Policies trained as adapters of one shared base (``learner.shared_base``) are exported as they
were trained, unless ``adapter=False``: the base once, as a plain Hugging Face folder (``base``),
and each policy's adapter in a folder of its own whose ``base_model_name_or_path`` is that
folder, which is what ``vllm serve OUT/base --enable-lora --lora-modules a=OUT/a b=OUT/b`` loads.
``mas-trainer.json`` says which folder is a base, which policies are its adapters and which
frozen policies it answers as the bare base. ``adapter=False`` writes each merged instead.

The weights are the run's best checkpoint where it kept one, else its last (``checkpoint``
"best" or "last" asks for one: run/rundir.py, `trained_checkpoint`); ``mas-trainer.json``
says which, and its step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mas_trainer.engines.models import (ADAPTER_CONFIG, adapter_base, is_adapter, load_model, materialize, model_dir_for,
                                        save_merged, save_pretrained)
from mas_trainer.errors import UserError
from mas_trainer.run.rundir import RunDir, run_config, trained_checkpoint

__all__ = ["export"]


def export(run_dir: str | Path, out_dir: str | Path, *, adapter: bool | None = None, checkpoint: str | None = None) -> Path:
    """One Hugging Face folder per trained policy plus `mas-trainer.json` (role -> model), into
    `out_dir` (new or empty). `adapter`: None, a shared base's policies as the base once plus their
    adapters and other LoRA policies merged; True, every LoRA policy as its adapter; False, every
    LoRA policy merged into its base. `checkpoint`: "best" or "last" (default: the best where kept)."""
    run = RunDir(run_dir)
    trained = trained_checkpoint(run_dir, checkpoint)
    folders = trained.policies
    app = run.app()
    cfg = run_config(run_dir)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # an older export's files would mix with these (a merged model's weights beside an adapter's)
        raise UserError(f"export folder {out} is not empty: export into a new or empty folder")
    adapters = {p for p, folder in folders.items() if is_adapter(folder)}
    shared = {p for p in adapters if cfg.learner_for(p).shared_base} if adapter is not False else set()
    groups: dict[str, list[str]] = {}
    for p in sorted(shared):
        groups.setdefault(adapter_base(folders[p]), []).append(p)
    bases = _base_folders(groups, taken=set(folders))
    out.mkdir(parents=True, exist_ok=True)
    for ref, name in bases.items():
        _write_base(ref, out / name, seed=cfg.seed)  # `tiny`'s weights depend on the seed
    base_of = {p: bases[ref] for ref, names in groups.items() for p in names}
    for policy, folder in folders.items():
        if policy in adapters and policy not in shared and not adapter:
            save_merged(folder, out / policy, seed=cfg.seed)
            continue
        shutil.copytree(folder, out / policy, dirs_exist_ok=True)
        if policy in shared:
            _name_base(out / policy / ADAPTER_CONFIG, out / base_of[policy])
        elif policy in adapters:
            _locate_base(out / policy / ADAPTER_CONFIG)
    mapping = {
        "roles": app.roles,
        "frozen": app.frozen,
        "policies": {p: {"path": p, "base_model": app.policies[p].base_model if p in app.policies else None,
                         "adapter": p in adapters and (bool(adapter) or p in shared),
                         **({"adapter_of": base_of[p]} if p in shared else {})} for p in folders},
        "step": trained.step,
        "checkpoint": trained.which,
    }
    if bases:  # which folder is a base, and whom it answers: its adapters, and frozen policies as the bare base
        frozen = {ref: sorted(p for p, pol in app.policies.items() if not pol.trainable and pol.base_model == ref) for ref in bases}
        mapping["bases"] = {name: {"path": name, "base_model": ref, "adapters": groups[ref], "frozen": frozen[ref]}
                            for ref, name in bases.items()}
    (out / "mas-trainer.json").write_text(json.dumps(mapping, indent=1))
    return out


def _base_folders(groups: dict[str, list[str]], taken: set[str]) -> dict[str, str]:
    """Each shared base's folder name: `base`, then `base_1`, ... (never a policy's own folder)."""
    names: dict[str, str] = {}
    candidates = (f"base_{i}" if i else "base" for i in range(len(groups) + len(taken) + 1))
    for ref in groups:
        names[ref] = next(c for c in candidates if c not in taken)
    return names


def _write_base(ref: str, target: Path, *, seed: int) -> None:
    """The base model `ref` (`tiny`, `default`, a folder or hub id) as a plain Hugging Face folder."""
    folder = materialize(ref, seed=seed)
    if (folder / "config.json").is_file():
        shutil.copytree(folder, target)  # a hub snapshot's files are links into its blobs: copied as files
        return
    model, tokenizer = load_model(ref, seed=seed)  # a GGUF: dequantised, as training loaded it
    save_pretrained(model, tokenizer, target)


def _name_base(config_path: Path, base: Path) -> None:
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = str(base.resolve())
    config_path.write_text(json.dumps(config, indent=2))


def _locate_base(config_path: Path) -> None:
    """Name the adapter's base by its folder on this machine (`default` means nothing to peft or vLLM)."""
    folder = model_dir_for(adapter_base(config_path.parent))
    if folder is not None:
        _name_base(config_path, folder)
