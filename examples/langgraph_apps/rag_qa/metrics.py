"""SQuAD-style answer metrics: normalise, exact match, token F1 (and answer recall).

``normalise`` lower-cases, drops punctuation and the articles a / an / the, and collapses
whitespace, as the SQuAD v1.1 evaluation script does. A reference may be one string or a
list of acceptable strings; the best match counts.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

__all__ = ["normalise", "tokens", "exact_match", "f1", "recall"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalise(text: str | None) -> str:
    text = (text or "").lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def tokens(text: str | None) -> list[str]:
    return normalise(text).split()


def _references(reference: str | Iterable[str] | None) -> list[str]:
    if reference is None:
        return []
    if isinstance(reference, str):
        return [reference]
    return [str(r) for r in reference]


def exact_match(prediction: str | None, reference: str | Iterable[str] | None) -> float:
    """1.0 when the normalised prediction equals a normalised reference, else 0.0."""
    pred = normalise(prediction)
    return float(any(pred == normalise(r) for r in _references(reference)))


def _f1(pred: list[str], ref: list[str]) -> float:
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, rec = common / len(pred), common / len(ref)
    return 2 * precision * rec / (precision + rec)


def f1(prediction: str | None, reference: str | Iterable[str] | None) -> float:
    """Token F1 of the normalised prediction against the best reference (0.0 without one)."""
    refs = _references(reference)
    return max((_f1(tokens(prediction), tokens(r)) for r in refs), default=0.0)


def recall(text: str | None, reference: str | Iterable[str] | None) -> float:
    """Share of the reference's tokens found in ``text`` (how much of the answer a longer
    text, e.g. retrieved passages or notes, contains), best reference."""
    have = Counter(tokens(text))
    best = 0.0
    for r in _references(reference):
        ref = tokens(r)
        if ref:
            best = max(best, sum((Counter(ref) & have).values()) / len(ref))
    return best
