"""No third-party setup chatter: what every CLI verb and every API call does first."""

from __future__ import annotations

import importlib
import logging
import os
import sys

__all__ = ["quiet_libraries"]


def quiet_libraries() -> None:
    """Keep libraries' setup chatter out of mas-trainer's output, where it can: Hugging Face
    progress bars ("Loading weights", "Writing model shards", downloads; worker processes
    inherit the variable) unless HF_HUB_DISABLE_PROGRESS_BARS is set otherwise, and Ray's
    notice that it turned token authentication on (a local instance `fit` starts for itself).
    Libraries imported already are told directly; those imported later read the variable."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"].strip().lower() in ("1", "true", "yes", "on"):
        if "huggingface_hub" in sys.modules:
            importlib.import_module("huggingface_hub.utils").disable_progress_bars()
        if "transformers" in sys.modules:
            importlib.import_module("transformers.utils.logging").disable_progress_bar()
    ray_auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if ray_auth.getEffectiveLevel() < logging.ERROR:
        ray_auth.setLevel(logging.ERROR)
