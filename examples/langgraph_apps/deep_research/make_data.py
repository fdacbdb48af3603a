"""Writes the deep research example's data, deterministically: `records.jsonl` (one record per
invented observatory: the town it is in, the year it was founded, who directs it) and the
questions about them, `train.jsonl` and `heldout.jsonl`.

The observatories are invented so that no model knows them: only the researcher's `lookup`
tool, which reads `records.jsonl`, can answer. Each observatory has three questions; one of
them, drawn at random, is held out, so the held-out questions ask new things about the same
observatories.

    python examples/langgraph_apps/deep_research/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
N_RECORDS = 20
SEED = 0

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "r", "s", "t", "v", "z", "br", "gr", "kl", "st", "tr"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
CODAS = ["", "", "n", "r", "l", "s", "th", "m"]
FIRST = ["Ilsa", "Toma", "Renata", "Oskar", "Mireille", "Anselm", "Yara", "Casimir", "Liesel", "Dorian",
         "Elva", "Teodor", "Sunniva", "Bastian", "Noor", "Fenna", "Aurel", "Greta", "Ivo", "Maren"]

QUESTIONS = {
    "town": ("In which town is {name}?", "town"),
    "founded": ("In which year was {name} founded?", "founded"),
    "director": ("Who directs {name}?", "director"),
}


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables)).capitalize()


def records(rng: random.Random) -> list[dict]:
    out: list[dict] = []
    seen: set[str] = set()
    while len(out) < N_RECORDS:
        stem, town, surname = _word(rng, 2), _word(rng, 2), _word(rng, 2)
        if stem in seen or town in seen:
            continue
        seen |= {stem, town}
        out.append({"name": f"{stem} Observatory", "town": town, "founded": str(rng.randint(1700, 1990)),
                    "director": f"{FIRST[len(out)]} {surname}"})
    return out


def tasks(recs: list[dict], rng: random.Random) -> tuple[list[dict], list[dict]]:
    train: list[dict] = []
    heldout: list[dict] = []
    for i, rec in enumerate(recs):
        held = rng.choice(sorted(QUESTIONS))
        for kind, (template, field) in QUESTIONS.items():
            task = {"id": f"{i:02d}-{kind}", "messages": [{"role": "user", "content": template.format(name=rec["name"])}],
                    "answer": rec[field], "entity": rec["name"], "kind": kind}
            (heldout if kind == held else train).append(task)
    return train, heldout


def write(out_dir: Path = HERE) -> None:
    rng = random.Random(SEED)
    recs = records(rng)
    train, heldout = tasks(recs, rng)
    for name, rows in (("records", recs), ("train", train), ("heldout", heldout)):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    write()
