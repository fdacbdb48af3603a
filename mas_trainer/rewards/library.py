"""Ready-made rewards: exact match, token F1, valid JSON, code tests.

Each function here *makes* a reward: ``reward=exact_match()`` in ``@trainable``. The reward
it returns works at every level, because it reads a text out of whatever that level judges:

=========== ================================================ ===============================
level       text judged                                      typical use
=========== ================================================ ===============================
trajectory  ``final_state[answer]`` (a key, or a callable)   the answer is right
role        each of the role's calls' ``output_text``,       the planner always answers in
            averaged                                         JSON
turn        the call's ``output_text``                       this edit's code passes tests
=========== ================================================ ===============================

A state value that is a message (``{"content": ...}``) or a list of messages (LangGraph's
``messages``) gives its last message's text; ``None`` or a missing key gives ``""`` (an app
that stopped without answering scores 0, it is not an error). A reference missing from the
task is an error: the task file, not the policy, is wrong, and training on it would only
teach noise. The reward's name in errors (see :class:`~mas_trainer.rewards.RewardError`)
carries its arguments, e.g. ``exact_match(answer='answer', reference='answer')``.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from mas_trainer.errors import UserError
from mas_trainer.trace.schema import LLMCall, Trajectory

__all__ = ["normalize_answer", "exact_match", "f1", "json_valid", "code_tests"]

Picker = str | Callable[[Any], Any]
Reward = Callable[[dict[str, Any], Any, Trajectory], float]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_FENCE = re.compile(r"```[\w+-]*[ \t]*\n(.*?)```", re.S)


def normalize_answer(text: str | None) -> str:
    """SQuAD v1.1's normalisation: lower case, no punctuation, no articles a/an/the, single spaces."""
    text = (text or "").lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _as_text(value: Any) -> str:
    """A state value as text: messages give their (last) content, numbers their str()."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return _as_text(value[-1]) if value else ""
    if isinstance(value, dict) and "content" in value:
        content = value["content"]
        if isinstance(content, list):  # OpenAI content parts
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return _as_text(content)
    content = getattr(value, "content", None)  # a LangChain message object left in the state
    return _as_text(content) if content is not None else str(value)


def _is_message(value: Any) -> bool:
    """A message, or a list ending in one: text to parse, not JSON data already."""
    last = value[-1] if isinstance(value, (list, tuple)) and value else value
    return (isinstance(last, dict) and "content" in last) or hasattr(last, "content")


def _pick(state: Any, answer: Picker) -> Any:
    if callable(answer):
        return answer(state)
    return state.get(answer) if isinstance(state, dict) else getattr(state, answer, None)


def _reference(task: dict[str, Any], reference: Picker) -> list[str]:
    if callable(reference):
        value = reference(task)
    elif reference in task:
        value = task[reference]
    else:
        raise KeyError(f"the task has no {reference!r} to compare with (its keys: {', '.join(map(str, task)) or 'none'})")
    refs = value if isinstance(value, (list, tuple)) else [value]
    return [_as_text(r) for r in refs]


def _level_agnostic(score: Callable[[dict[str, Any], Any], float], answer: Picker, label: str) -> Reward:
    """A reward for any level from ``score(task, value)``: the value is the call's text at the
    turn level, each call's text (averaged) at the role level, the state's answer otherwise."""

    def reward(task: dict[str, Any], subject: Any, trajectory: Trajectory) -> float:
        if isinstance(subject, LLMCall):
            return score(task, subject.output_text)
        if isinstance(subject, Sequence) and subject and all(isinstance(c, LLMCall) for c in subject):
            return sum(score(task, c.output_text) for c in subject) / len(subject)
        return score(task, _pick(subject, answer))

    reward.__name__ = reward.__qualname__ = label  # what RewardError names
    return reward


def _label(fn: str, **args: Any) -> str:
    shown = (f"{k}={getattr(v, '__name__', None) or v!r}" if callable(v) else f"{k}={v!r}" for k, v in args.items())
    return f"{fn}({', '.join(shown)})"


def _tokens_f1(pred: list[str], ref: list[str]) -> float:
    if not pred or not ref:
        return float(pred == ref)  # SQuAD: both empty is a match, one empty is not
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(*, answer: Picker = "answer", reference: Picker = "answer") -> Reward:
    """1.0 when the normalised answer equals a normalised reference (a task value may be a list
    of acceptable answers), else 0.0. ``answer`` is a state key or ``state -> value``;
    ``reference`` a task key or ``task -> str | list[str]``."""

    def score(task: dict[str, Any], value: Any) -> float:
        pred = normalize_answer(_as_text(value))
        return float(any(pred == normalize_answer(r) for r in _reference(task, reference)))

    return _level_agnostic(score, answer, _label("exact_match", answer=answer, reference=reference))


def f1(*, answer: Picker = "answer", reference: Picker = "answer") -> Reward:
    """SQuAD token F1 of the normalised answer against the best reference (partial credit)."""

    def score(task: dict[str, Any], value: Any) -> float:
        pred = normalize_answer(_as_text(value)).split()
        return max((_tokens_f1(pred, normalize_answer(r).split()) for r in _reference(task, reference)), default=0.0)

    return _level_agnostic(score, answer, _label("f1", answer=answer, reference=reference))


def _strip_fence(text: str) -> str:
    """The first fenced block of a model's text (```json ... ```), else the text itself."""
    found = _FENCE.search(text)
    return found.group(1) if found else text


def _validator(schema: Any) -> Callable[[Any], bool]:
    """``data -> valid?`` for a JSON Schema dict (jsonschema), a pydantic model or any type
    pydantic validates, or None (any JSON). Built once, so a bad schema fails at start-up."""
    if schema is None:
        return lambda data: True
    if isinstance(schema, dict):
        try:
            import jsonschema
        except ImportError:
            raise UserError("json_valid: a JSON Schema dict needs the jsonschema package (pip install jsonschema); "
                            "or give a pydantic model instead") from None
        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise UserError(f"json_valid: the schema is not a valid JSON Schema: {exc.message}") from None
        checker = cls(schema)
        return lambda data: bool(checker.is_valid(data))
    from pydantic import TypeAdapter, ValidationError

    adapter = TypeAdapter(schema)

    def valid(data: Any) -> bool:
        try:
            adapter.validate_python(data)
        except ValidationError:
            return False
        return True

    return valid


def json_valid(schema: Any = None, *, answer: Picker = "answer") -> Reward:
    """1.0 when the answer is JSON (a fenced ```json block counts) that fits ``schema``, else 0.0.

    ``schema``: a JSON Schema dict (checked with the ``jsonschema`` package), a pydantic model
    (or any type pydantic validates), or None for "any JSON". A state value that is already a
    dict or list is validated as it is."""
    valid = _validator(schema)

    def score(task: dict[str, Any], value: Any) -> float:
        if isinstance(value, (dict, list)) and not _is_message(value):
            return float(valid(value))
        try:
            data = json.loads(_strip_fence(_as_text(value)))
        except ValueError:
            return 0.0
        return float(valid(data))

    name = getattr(schema, "__name__", None) or ("JSON Schema" if isinstance(schema, dict) else None)
    return _level_agnostic(score, answer, _label("json_valid", schema=name, answer=answer))


def code_tests(run: Callable[[str, dict[str, Any]], Any], *, answer: Picker = "code", all_or_nothing: bool = False) -> Reward:
    """The fraction of tests the answer's code passes, as your ``run(code, task)`` reports it.

    The library runs no code itself: untrusted code needs a sandbox you chose (the code-gen
    example's ``sandbox.run_tests`` is one). ``run`` returns a number in [0, 1], a bool, or an
    object with ``passed`` and ``total`` (that sandbox's ``SandboxResult``). The code is the
    first fenced block of the text if it has one. ``all_or_nothing``: 1.0 only if all pass."""

    def score(task: dict[str, Any], value: Any) -> float:
        result = run(_strip_fence(_as_text(value)), task)
        if hasattr(result, "passed") and hasattr(result, "total"):
            fraction = result.passed / result.total if result.total else 0.0
        else:
            fraction = float(result)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"the test runner reported {fraction}, not a fraction of tests passed in [0, 1]")
        return float(fraction == 1.0) if all_or_nothing else fraction

    return _level_agnostic(score, answer, _label("code_tests", run=run, answer=answer))
