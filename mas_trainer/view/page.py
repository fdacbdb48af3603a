"""The one HTML document of `mas-trainer view`: template, CSS and JS inlined, data as inert JSON.

The same document is served by the local server (`api: true`: other steps are fetched from
it) and written by ``--html`` (every step embedded). Its Content-Security-Policy allows only
this script and this style (by hash): even a string that escaped the page's text rendering
could not run code or load anything from the network.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from importlib import resources
from typing import Any

__all__ = ["render_page", "embed_json", "content_security_policy"]

_PLACEHOLDER = re.compile(r"__(CSP|STYLE|SCRIPT|DATA)__")


def _static(name: str) -> str:
    return resources.files("mas_trainer.view").joinpath(name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"


def embed_json(data: Any) -> str:
    """JSON that is inert inside `<script type="application/json">`: no `<`, `>`, `&` can close it."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def content_security_policy(*, api: bool) -> str:
    script, style = _static("view.js"), _static("view.css")
    return "; ".join([
        "default-src 'none'",
        f"script-src {_sha256(script)}",
        f"style-src {_sha256(style)}",
        "img-src 'self' data:" if api else "img-src data:",
        "connect-src 'self'" if api else "connect-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
    ])


def render_page(data: dict[str, Any], *, api: bool) -> str:
    """The whole page; `data` = {"index": ..., "steps_data": {name: step}, "initial_step": name|None}."""
    script, style = _static("view.js"), _static("view.css")
    if "</script" in script.lower() or "</style" in style.lower():
        raise RuntimeError("the viewer's script or style would close its own element")
    values = {
        "CSP": content_security_policy(api=api).replace('"', "&quot;"),
        "STYLE": style,
        "SCRIPT": script,
        "DATA": embed_json({**data, "api": api}),
    }
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], _static("page.html"))
