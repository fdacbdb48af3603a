"""The supervised warm start's data: the JSONL of good turns read, checked and tokenized per
policy, before any worker group or Ray starts (docs/training.md, "Warm start").

One line per turn, as `mas-trainer data` writes it from well-scored recorded runs:
`{"policy", "role", "node", "run_id", "score", "messages", "completion", "tools"?,
"prompt_ids"?, "response_ids"?}`. Fields beyond these are ignored (a newer writer may add some).

Tokens: a line's `prompt_ids`/`response_ids` (this project's engine produced them) are trained
on as they are, whatever the policy's tokenizer: such a file is meant for the base model that
produced it, which this code cannot check (a file from another tokenizer would teach noise:
drop those fields, then the messages are rendered). Without them the policy's chat template
renders `messages` (+ `tools`) as the gateway does (`HFChatFormat.render`) and the completion as
the template's assistant turn up to its end-of-turn token (`HFChatFormat.render_turn`).
"""

from __future__ import annotations

import difflib
import json
import logging
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mas_trainer.config import ConfigError, FitConfig

__all__ = ["SupervisedTurn", "read_turns", "warm_start_examples"]

log = logging.getLogger(__name__)


class _Message(BaseModel):
    """An OpenAI chat message as it was sent (tool_calls, tool_call_id, name kept as they are)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Any = None  # text, or a list of parts: the chat format says which it cannot render


class _Completion(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _something(self) -> "_Completion":
        if not self.content and not self.tool_calls:
            raise ValueError("the completion says nothing: neither content nor tool_calls")
        return self


class SupervisedTurn(BaseModel):
    """One line of the warm-start file."""

    model_config = ConfigDict(extra="ignore")

    policy: str = Field(min_length=1)
    role: str | None = None
    node: str | None = None
    run_id: str | None = None
    score: float | None = None
    messages: list[_Message] = Field(min_length=1)
    completion: _Completion
    tools: list[dict[str, Any]] | None = None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None

    @model_validator(mode="after")
    def _ids(self) -> "SupervisedTurn":
        if (self.prompt_ids is None) != (self.response_ids is None):
            raise ValueError("prompt_ids and response_ids come together (exact tokens) or not at all (messages rendered)")
        if self.prompt_ids is not None and (not self.prompt_ids or not self.response_ids):
            raise ValueError("prompt_ids and response_ids must not be empty")
        return self


def read_turns(path: str | Path, policies: Mapping[str, bool]) -> dict[str, list[tuple[int, SupervisedTurn]]]:
    """The file's lines by policy, with their line numbers; `policies`: the app's, name -> trainable.
    A missing file, a bad line or a policy the app lacks is a `ConfigError` of one line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"warm_start.data: {p} not found (the supervised turns, one JSON object a line)")
    out: dict[str, list[tuple[int, SupervisedTurn]]] = {}
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                turn = SupervisedTurn.model_validate(json.loads(line))
            except (ValueError, RecursionError) as exc:
                if isinstance(exc, ValidationError):
                    err = exc.errors()[0]
                    field = "".join(f"{'.' if isinstance(part, str) else ''}{part if isinstance(part, str) else [part]}"
                                    for part in err["loc"]).lstrip(".")
                    why = err["msg"].removeprefix("Value error, ")
                    raise ConfigError(f"{where}: {field + ': ' if field else ''}{why}") from None
                raise ConfigError(f"{where}: not a JSON object ({str(exc).splitlines()[0]})") from None
            if turn.policy not in policies:
                close = difflib.get_close_matches(turn.policy, list(policies), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(f"{where}: policy: the app has no policy {turn.policy!r}; {hint}"
                                  f"its policies: {', '.join(sorted(policies)) or 'none'}")
            out.setdefault(turn.policy, []).append((lineno, turn))
    return out


def warm_start_examples(cfg: FitConfig, policies: Mapping[str, bool], chat_for: Any) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Each trainable policy's (prompt ids, completion ids) examples for its warm start (none: no
    warm start configured). `chat_for(policy)`: the policy's `HFChatFormat`. A trainable policy
    left with no line (or with `steps=0`) gets no warm start; a warning says so."""
    if cfg.warm_start.data is None:
        return {}
    path = cfg.warm_start.data
    by_policy = read_turns(path, policies)
    frozen = sorted(p for p in by_policy if not policies[p])
    if frozen:
        log.warning("%s: lines of policies that are not trained (%s) are left out", path, ", ".join(frozen))
    out: dict[str, list[tuple[list[int], list[int]]]] = {}
    for policy in sorted(p for p, trainable in policies.items() if trainable):
        ws = cfg.warm_start_for(policy)
        if ws.steps == 0:
            continue
        lines = [(n, t) for n, t in by_policy.get(policy, []) if ws.min_score is None or (t.score is not None and t.score >= ws.min_score)]
        if not lines:
            cut = f" with score >= {ws.min_score:g}" if ws.min_score is not None and by_policy.get(policy) else ""
            log.warning("%s has no line%s for policy %r: it gets no warm start", path, cut, policy)
            continue
        chat = chat_for(policy)
        examples = []
        for lineno, turn in lines:
            if turn.prompt_ids is not None and turn.response_ids is not None:  # the engine's own tokens
                examples.append((turn.prompt_ids, turn.response_ids))
                continue
            try:
                prompt, completion = chat.render_turn([m.model_dump(exclude_none=True) for m in turn.messages], turn.completion.model_dump(exclude_none=True), turn.tools)
            except Exception as exc:  # the template's own errors (jinja, a role it refuses): one line
                raise ConfigError(f"{path}:{lineno}: messages: the chat template of policy {policy!r} cannot render "
                                  f"them ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
            if not completion:
                raise ConfigError(f"{path}:{lineno}: completion: renders to no tokens")
            examples.append((prompt, completion))
        out[policy] = examples
    return out
