"""`mas-trainer view`: a run's curves and trajectories in the browser (local server or one HTML file).

`ViewSource` reads a run directory or a trajectories file and assembles what the page shows
(:mod:`mas_trainer.view.data`); `serve_view` serves it on 127.0.0.1, `write_html` writes the
same page as one self-contained file (:mod:`mas_trainer.view.server`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.view.data import ViewSource, build_charts, token_pieces
    from mas_trainer.view.server import ViewServer, serve_view, write_html

__all__ = ["ViewSource", "build_charts", "token_pieces", "ViewServer", "serve_view", "write_html"]

# imported on first use: `import mas_trainer.config` (every CLI command) must not pay for
# FastAPI, OpenTelemetry or Ray through a package's __init__
_LAZY = {
    "ViewSource": "mas_trainer.view.data",
    "build_charts": "mas_trainer.view.data",
    "token_pieces": "mas_trainer.view.data",
    "ViewServer": "mas_trainer.view.server",
    "serve_view": "mas_trainer.view.server",
    "write_html": "mas_trainer.view.server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
