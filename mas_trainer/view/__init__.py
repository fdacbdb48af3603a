"""`mas-trainer view`: a run's curves and trajectories in the browser (local server or one HTML file).

`ViewSource` reads a run directory or a trajectories file and assembles what the page shows
(:mod:`mas_trainer.view.data`); `serve_view` serves it on 127.0.0.1, `write_html` writes the
same page as one self-contained file (:mod:`mas_trainer.view.server`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_trainer._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.view.data import ViewSource, build_charts, token_pieces
    from mas_trainer.view.server import ViewServer, serve_view, write_html

__all__ = ["ViewSource", "build_charts", "token_pieces", "ViewServer", "serve_view", "write_html"]

__getattr__ = lazy_exports(__name__, {
    "mas_trainer.view.data": ["ViewSource", "build_charts", "token_pieces"],
    "mas_trainer.view.server": ["ViewServer", "serve_view", "write_html"],
})
