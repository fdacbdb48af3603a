"""LoRA adapters through `peft` (``learner.lora_rank``): one policy = a frozen base + an adapter.

Why: the update then computes no weight gradients and keeps no AdamW state for the base,
only for the adapter's small matrices; RL updates are low-rank enough for an adapter to
learn them (see docs/training.md for what was measured here).

The adapter is injected into the very model object the engine generates with (peft wraps
its linear layers in place), so, as with full fine-tuning, there is no copy to keep in
step. Between updates the adapter is *merged* into the base weights (``W + B A`` written
into ``W``), so generation runs the plain linear layers at full speed; the learner unmerges
it before it trains. In float32 a merge/unmerge round trip changes a weight by rounding
only (~1e-7 relative), far below what the update moves.

On disk a policy trained with LoRA is a peft adapter folder (``adapter_config.json``,
``adapter_model.safetensors``, the tokenizer), whose ``base_model_name_or_path`` is the
mas-trainer model reference it was trained on (``default``, ``tiny`` or a folder):
`engines.models.load_model` turns such a folder into the merged model (eval, serve; the
folder format is read there), `open_adapter` into a trainable one (``fit --resume``), and ``export`` writes it merged (a plain Hugging Face
folder) or, with ``--adapter``, as the adapter itself.

With ``learner.shared_base`` several policies are adapters of one base in one peft model
(`add_named_adapter`, `policy/shared_base.py`), never merged: each is saved as a plain adapter
folder of its own (`save_adapter`), and ``export`` writes the base once plus those folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mas_trainer.errors import UserError

__all__ = ["add_adapter", "add_named_adapter", "adapter_params", "open_adapter", "save_adapter"]

def add_adapter(model: Any, *, rank: int, alpha: float, target_modules: str | list[str], base_model: str,
                layers: int | None = None) -> Any:
    """Inject a fresh, trainable LoRA adapter into `model` (in place); returns the `PeftModel`.

    Only the adapter requires grad afterwards. peft initialises B = 0, so the policy's
    function is the base model's until the first update. `layers`: adapt only the top that
    many transformer layers (``learner.lora_layers``)."""
    from peft import get_peft_model

    config = _lora_config(model, rank=rank, alpha=alpha, target_modules=target_modules, layers=layers)
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as exc:  # e.g. a target module name the model does not have
        raise UserError(f"learner.target_modules={target_modules!r}: {str(exc).splitlines()[0]}") from None
    # peft records the model's own name_or_path (none for `tiny`); the model reference is what loads the base again
    peft_model.peft_config["default"].base_model_name_or_path = base_model
    return peft_model


def add_named_adapter(model: Any, name: str, *, rank: int, alpha: float, target_modules: str | list[str], base_model: str,
                      layers: int | None = None, folder: str | Path | None = None) -> Any:
    """One more adapter, `name`, on a shared base (``learner.shared_base``, `policy/shared_base.py`):
    `model` is the plain base (the first adapter wraps it) or the `PeftModel` of the adapters
    before; `folder`: a saved adapter that trains on (resume), else a fresh one (B = 0).
    Returns the `PeftModel`, which holds every adapter, unmerged."""
    from peft import PeftModel, get_peft_model

    if folder is not None:
        if isinstance(model, PeftModel):
            model.load_adapter(str(folder), adapter_name=name, is_trainable=True)
            return model
        return PeftModel.from_pretrained(model, str(folder), adapter_name=name, is_trainable=True)
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    config = _lora_config(base, rank=rank, alpha=alpha, target_modules=target_modules, layers=layers)
    try:
        if isinstance(model, PeftModel):
            model.add_adapter(name, config)
        else:
            model = get_peft_model(model, config, adapter_name=name)
    except ValueError as exc:
        raise UserError(f"learner.target_modules={target_modules!r}: {str(exc).splitlines()[0]}") from None
    model.peft_config[name].base_model_name_or_path = base_model  # peft records the model's own name_or_path instead
    return model


def adapter_params(peft_model: Any, name: str) -> list[Any]:
    """The parameters of adapter `name` alone (its A and B matrices in every adapted layer)."""
    return [p for key, p in peft_model.named_parameters() if "lora_" in key and f".{name}." in key]


def save_adapter(peft_model: Any, name: str, folder: str | Path) -> Path:
    """Adapter `name` of a shared base as a plain peft adapter folder (its tensors named as a
    single adapter's, so `PeftModel.from_pretrained`, `load_model` and vLLM's LoRA load it)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(peft_model, adapter_name=name, save_embedding_layers=False)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(folder / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    peft_model.peft_config[name].save_pretrained(str(folder))
    return folder


def _lora_config(model: Any, *, rank: int, alpha: float, target_modules: str | list[str], layers: int | None) -> Any:
    from peft import LoraConfig

    where: dict[str, Any] = {}
    if layers is not None:
        total = getattr(model.config, "num_hidden_layers", None)
        if not total:
            raise UserError("learner.lora_layers needs a model whose config gives num_hidden_layers; set lora_layers=null")
        if layers > total:
            raise UserError(f"learner.lora_layers={layers} but the model has {total} layers; set at most {total}, or null for all")
        where["layers_to_transform"] = list(range(total - layers, total))
        if target_modules == "all-linear":  # peft takes layers_to_transform with a list of names only
            target_modules = _linear_names(model)
        elif isinstance(target_modules, str):
            raise UserError(f"learner.lora_layers needs learner.target_modules as a list of module names or 'all-linear', "
                            f"not the pattern {target_modules!r}; list the names (e.g. [q_proj, v_proj]) or set lora_layers=null")
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM", **where)


def _linear_names(model: Any) -> list[str]:
    """What peft's "all-linear" means, as module names: every linear layer's name but the output head's."""
    import torch

    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head})


def open_adapter(model: Any, folder: str | Path) -> Any:
    """Load the adapter saved in `folder` into `model` (in place), trainable; returns the `PeftModel`."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(folder), is_trainable=True)
