"""A small client for a `mas-trainer serve --record` endpoint: feedback on a recorded run.

The standard library only (urllib): an app that reports feedback needs nothing installed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from mas_trainer.errors import UserError
from mas_trainer.production.record import read_runs

__all__ = ["feedback", "read_runs"]


def feedback(base_url: str, run_id: str, *, score: float | None = None, label: str | None = None,
             turn: str | None = None, comment: str | None = None, api_key: str | None = None,
             timeout_s: float = 30.0) -> dict[str, Any]:
    """POST a score and/or a label for `run_id` (the `x-mas-run-id` of a served answer), or for
    one of its turns (a completion's id). `base_url` as the OpenAI client's, ending in /v1.
    Raises UserError with the server's one-line reason when it refuses."""
    body = {k: v for k, v in {"run_id": run_id, "score": score, "label": label, "turn": turn,
                              "comment": comment}.items() if v is not None}
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(base_url.rstrip("/") + "/feedback", data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = exc.reason
        raise UserError(f"feedback refused ({exc.code}): {reason}") from None
