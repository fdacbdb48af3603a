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

Checked here, before the run directory is written (the learner would otherwise fail on them
with a traceback, or run for hours): ids are ints (not bools, not strings) from 0 to the model's
vocabulary size - 1 (`vocab_size` of its config.json, else `len(tokenizer)`); a turn's prompt +
completion fits the model's context (`max_position_embeddings` of its config.json, else the
tokenizer's `model_max_length`, else `DEFAULT_CONTEXT`). The model's config.json is the one next
to the policy's tokenizer (a local folder, a hub snapshot). The file is streamed, a line read by
a bounded `readline`, and bounded: `MAX_LINE_BYTES` a line, `MAX_FILE_BYTES`, `MAX_LINES` and
`MAX_TOKENS` (the ids kept for training, ~36 bytes each in memory until the workers have them).
"""

from __future__ import annotations

import collections
import difflib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from mas_trainer.config import ConfigError, FitConfig

__all__ = ["SupervisedTurn", "iter_turns", "warm_start_examples", "MAX_LINE_BYTES", "MAX_FILE_BYTES", "MAX_LINES",
           "MAX_TOKENS", "DEFAULT_CONTEXT"]

log = logging.getLogger(__name__)

# Bounds of the file (docs/training.md, "Warm start"): the warm start trains on steps x batch_size
# turns a policy (160 by default), so these leave room for far more than it uses.
MAX_LINE_BYTES = 8 * 2**20  # twice the gateway's 4 MiB request body: the messages it took, plus the engine's ids
MAX_FILE_BYTES = 2**30  # read and parsed in seconds
MAX_LINES = 100_000  # each checked and tokenized, ~0.7 ms a short turn: about a minute at the bound
MAX_TOKENS = 20_000_000  # the ids kept (prompt + completion, all policies): ~36 bytes each, ~0.7 GB at the bound
DEFAULT_CONTEXT = 32_768  # a model whose config.json and tokenizer state no context length

_TokenId = Annotated[StrictInt, Field(ge=0)]  # not a bool, a float or "1": the learner indexes its embedding by it


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
    prompt_ids: list[_TokenId] | None = None
    response_ids: list[_TokenId] | None = None

    @model_validator(mode="after")
    def _ids(self) -> "SupervisedTurn":
        if (self.prompt_ids is None) != (self.response_ids is None):
            raise ValueError("prompt_ids and response_ids come together (exact tokens) or not at all (messages rendered)")
        if self.prompt_ids is not None and (not self.prompt_ids or not self.response_ids):
            raise ValueError("prompt_ids and response_ids must not be empty")
        return self


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 2**20 and n % 2**20 == 0 else f"{n} bytes"


def _count_lines(path: Path) -> int:
    """Lines of the file, counted in bounded chunks: too many is refused at once, not after a
    minute of tokenizing."""
    lines, last = 0, b"\n"
    with path.open("rb") as f:
        while chunk := f.read(2**20):
            lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    return lines + (last != b"\n")


def _too_many_lines(path: Path) -> ConfigError:
    return ConfigError(f"{path}: more than {MAX_LINES} lines, the limit of a warm-start file (each is checked and "
                       "tokenized before the run starts, and the warm start trains on steps x batch_size turns a "
                       "policy): keep fewer, e.g. the best-scored (`mas-trainer data --min-score`)")


def iter_turns(path: str | Path, policies: Mapping[str, bool]) -> Iterator[tuple[int, SupervisedTurn]]:
    """The file's turns with their line numbers, streamed; `policies`: the app's, name -> trainable.
    A missing or oversized file, a bad line or a policy the app lacks is a `ConfigError` of one line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"warm_start.data: {p} not found (the supervised turns, one JSON object a line)")
    if (size := p.stat().st_size) > MAX_FILE_BYTES:
        raise ConfigError(f"{p}: {size} bytes, over the limit of {_size(MAX_FILE_BYTES)} for a warm-start file: keep "
                          "fewer lines (the warm start trains on steps x batch_size turns a policy)")
    if _count_lines(p) > MAX_LINES:
        raise _too_many_lines(p)
    read = 0
    with p.open("rb") as f:
        lineno = 0
        while raw := f.readline(MAX_LINE_BYTES + 2):  # the bound, its newline and one byte more: never a whole huge line
            lineno += 1
            where = f"{p}:{lineno}"
            read += len(raw)
            if len(raw) - raw.endswith(b"\n") > MAX_LINE_BYTES:
                raise ConfigError(f"{where}: the line is over the limit of {_size(MAX_LINE_BYTES)} a line; leave it out "
                                  "(or drop its prompt_ids and response_ids: the messages are then rendered)")
            if read > MAX_FILE_BYTES:  # it grew while read
                raise ConfigError(f"{p}: over the limit of {_size(MAX_FILE_BYTES)} for a warm-start file: keep fewer lines")
            if lineno > MAX_LINES:
                raise _too_many_lines(p)
            if not raw.strip():
                continue
            try:
                turn = SupervisedTurn.model_validate(json.loads(raw.decode("utf-8")))
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}); write the file as UTF-8") from None
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
            yield lineno, turn


@dataclass(frozen=True)
class _Model:
    """What a policy's examples are checked against: its chat format, vocabulary and context."""

    chat: Any
    vocab: int | None  # ids are 0 .. vocab - 1 (None: no tokenizer to tell)
    context: int  # prompt + completion tokens
    source: str  # where the context was found, for the error


def _model_of(chat: Any) -> _Model:
    """The vocabulary and context of the model behind `chat`: its config.json (next to the
    tokenizer: `load_tokenizer` loads a local folder or a hub snapshot by its path), as the
    learner's embedding and the engine's `max_context` have them."""
    tok = getattr(chat, "tokenizer", None)
    folder = getattr(tok, "name_or_path", None)
    config: Any = {}
    path = Path(folder) / "config.json" if isinstance(folder, str) and folder else None
    if path is not None and path.is_file() and path.stat().st_size <= 2**20:
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            config = {}
    sections = [c for c in (config, config.get("text_config") if isinstance(config, dict) else None) if isinstance(c, dict)]

    def stated(key: str) -> int | None:  # multimodal configs keep the language model's in text_config
        return next((v for c in sections if isinstance(v := c.get(key), int) and not isinstance(v, bool) and v > 0), None)

    vocab = stated("vocab_size") or (len(tok) if tok is not None else None)
    if (context := stated("max_position_embeddings")) is not None:
        return _Model(chat, vocab, context, f"max_position_embeddings in {path}")
    stated_max = getattr(tok, "model_max_length", None)
    if isinstance(stated_max, int) and 0 < stated_max < 10**9:  # transformers' "unknown" is 1e30
        return _Model(chat, vocab, stated_max, "its tokenizer's model_max_length")
    return _Model(chat, vocab, DEFAULT_CONTEXT, "the bound for a model that states none")


def _check_ids(where: str, policy: str, model: _Model, field: str, ids: list[int]) -> None:
    """Ids past the vocabulary would index past the learner's embedding: an IndexError from a worker."""
    if model.vocab is None or not ids or max(ids) < model.vocab:
        return
    i, bad = next((i, t) for i, t in enumerate(ids) if t >= model.vocab)
    raise ConfigError(f"{where}: {field}[{i}]: {bad} is not a token of policy {policy!r}'s model, whose vocabulary has "
                      f"{model.vocab} ids (0 to {model.vocab - 1}); the ids come from another model: drop prompt_ids and "
                      "response_ids from its lines (the messages are then rendered)")


def warm_start_examples(cfg: FitConfig, policies: Mapping[str, bool], chat_for: Any) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Each trainable policy's (prompt ids, completion ids) examples for its warm start (none: no
    warm start configured). `chat_for(policy)`: the policy's `HFChatFormat`. A trainable policy
    left with no line (or with `steps=0`) gets no warm start; a warning says so. Only the ids of
    the lines trained on are kept, as the file is read."""
    if cfg.warm_start.data is None:
        return {}
    path = cfg.warm_start.data
    trained = {p: ws for p, trainable in policies.items() if trainable and (ws := cfg.warm_start_for(p)).steps > 0}
    lines: collections.Counter[str] = collections.Counter()
    models: dict[str, _Model] = {}
    out: dict[str, list[tuple[list[int], list[int]]]] = {}
    tokens = 0
    for lineno, turn in iter_turns(path, policies):
        policy, where = turn.policy, f"{path}:{lineno}"
        lines[policy] += 1
        kept = trained.get(policy)
        if kept is None or (kept.min_score is not None and (turn.score is None or turn.score < kept.min_score)):
            continue
        if policy not in models:  # its tokenizer loaded once, and only for a policy with lines trained on
            models[policy] = _model_of(chat_for(policy))
        model = models[policy]
        if turn.prompt_ids is not None and turn.response_ids is not None:  # the engine's own tokens
            _check_ids(where, policy, model, "prompt_ids", turn.prompt_ids)
            _check_ids(where, policy, model, "response_ids", turn.response_ids)
            prompt, completion, fields = turn.prompt_ids, turn.response_ids, "prompt_ids + response_ids"
        else:
            try:
                prompt, completion = model.chat.render_turn([m.model_dump(exclude_none=True) for m in turn.messages],
                                                            turn.completion.model_dump(exclude_none=True), turn.tools)
            except Exception as exc:  # the template's own errors (jinja, a role it refuses): one line
                raise ConfigError(f"{where}: messages: the chat template of policy {policy!r} cannot render "
                                  f"them ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
            if not completion:
                raise ConfigError(f"{where}: completion: renders to no tokens")
            fields = "messages + completion"
        n = len(prompt) + len(completion)
        if n > model.context:
            raise ConfigError(f"{where}: {fields}: {n} tokens, past the {model.context}-token context of policy "
                              f"{policy!r}'s model ({model.source}); leave the line out or shorten its messages")
        tokens += n
        if tokens > MAX_TOKENS:
            raise ConfigError(f"{where}: the turns of the policies trained come to more than {MAX_TOKENS} tokens, the "
                              "limit of a warm start (their ids are held in memory until the workers have them): keep "
                              "fewer lines (the warm start trains on steps x batch_size turns a policy)")
        out.setdefault(policy, []).append((prompt, completion))
    frozen = sorted(p for p in lines if not policies[p])
    if frozen:
        log.warning("%s: lines of policies that are not trained (%s) are left out", path, ", ".join(frozen))
    for policy, config in sorted(trained.items()):
        if policy not in out:
            cut = f" with score >= {config.min_score:g}" if config.min_score is not None and lines[policy] else ""
            log.warning("%s has no line%s for policy %r: it gets no warm start", path, cut, policy)
    return {p: out[p] for p in sorted(out)}
