"""`serve --record`'s endpoints for what the app sends about a recorded run (its calls are
recorded as the gateway answers them): POST /v1/feedback, a score or label for a run or one of
its turns, and POST /v1/runs, a run's graph input and output (once per run).

An `Endpoint` bounds its body (bigger ones are refused, not truncated) and handles it: the
gateway checks the key, answers 404 when it records nothing, reads the body, and answers with
what `handle` returns or the `Refused` it raises. Runs the recorder does not hold are refused,
and so is feedback past the recorder's bounds (409 per run, 507 in all), with the bound said.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from mas_trainer.gateway.protocol import Refused
from mas_trainer.production.record import Feedback, GraphRun, Recorder

__all__ = ["Endpoint", "FEEDBACK", "GRAPH_RUN"]

M = TypeVar("M", bound=BaseModel)
# why the recorder refuses a graph run or feedback -> (status, code)
_REFUSED = {"unknown": (404, "run_not_found"), "duplicate": (409, "run_already_recorded"),
            "redaction": (422, "redaction_failed"), "run_limit": (409, "feedback_limit"),
            "full": (507, "feedback_full")}


class Endpoint(NamedTuple):
    max_bytes: int
    what: str  # the body, as a refusal names it
    handle: Callable[[Recorder, bytes], Awaitable[dict[str, Any]]]


async def _feedback(recorder: Recorder, body: bytes) -> dict[str, Any]:
    got = _parse(Feedback, body)
    _refuse(await asyncio.to_thread(recorder.feedback, got))  # fsync'ed: off the event loop
    return {"status": "recorded", "run_id": got.run_id}


async def _graph_run(recorder: Recorder, body: bytes) -> dict[str, Any]:
    got = _parse(GraphRun, body)
    _refuse(await asyncio.to_thread(recorder.record_graph, got))
    return {"status": "recorded", "run_id": got.run_id}


def _refuse(refused: tuple[str, str] | None) -> None:
    if refused is not None:
        status, code = _REFUSED[refused[0]]
        raise Refused(status, refused[1], code=code, retry=False)


def _parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise Refused.invalid(exc, 422, retry=False) from None


FEEDBACK = Endpoint(8 * 1024, "feedback", _feedback)  # a few fields: anything bigger is not feedback
GRAPH_RUN = Endpoint(1024 * 1024, "a graph run", _graph_run)  # a graph's input and output
