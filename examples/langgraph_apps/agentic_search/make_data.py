"""Write the agentic search task sets: one-fact questions to learn on, two-fact ones to grow into.

    python examples/langgraph_apps/agentic_search/make_data.py

A 135M model rarely completes a two-search chain at first, so every reward of a two-fact-only
set starts at 0 and GRPO has nothing to compare. The train set is therefore mostly one-fact
questions (one search with the name in the question fetches the answer) with the two-fact
ones mixed in; fit shuffles tasks, so the mix, not the file order, is the curriculum. The
held-out set has as many of each, so its score shows both.

Reads the question files ``../rag_qa/make_data.py`` writes (``rag_qa/train.jsonl`` and
``heldout.jsonl``: one fact; ``train.jsonl`` and ``heldout.jsonl`` here: two facts) and
writes, next to this file, ``mixed_train.jsonl`` (every train question of both) and
``mixed_heldout.jsonl`` (HELDOUT_PER_KIND of each, drawn with a fixed seed from the held-out
files), rows ``{"id", "question", "answer", "passage_ids", "hops", "kind"}``. Deterministic:
running it again rewrites the same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
RAG_DIR = HERE.parent / "rag_qa"
SEED = 20261201
HELDOUT_PER_KIND = 24  # per number of hops: all the two-fact held-out questions


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def one_hop(row: dict) -> dict:
    return {"id": row["id"], "question": row["question"], "answer": row["answer"],
            "passage_ids": [row["passage_id"]], "hops": 1, "kind": row["kind"]}


def two_hop(row: dict) -> dict:
    return {"id": row["id"], "question": row["question"], "answer": row["answer"],
            "passage_ids": row["passage_ids"], "hops": 2, "kind": row["kind"]}


def main(here: Path = HERE, rag_dir: Path = RAG_DIR) -> None:
    rng = random.Random(SEED)
    train = [one_hop(r) for r in read_jsonl(rag_dir / "train.jsonl")]
    train += [two_hop(r) for r in read_jsonl(here / "train.jsonl")]
    heldout = []
    for rows in ([one_hop(r) for r in read_jsonl(rag_dir / "heldout.jsonl")],
                 [two_hop(r) for r in read_jsonl(here / "heldout.jsonl")]):
        heldout += sorted(rng.sample(rows, min(HELDOUT_PER_KIND, len(rows))), key=lambda r: r["id"])
    assert not {r["question"] for r in train} & {r["question"] for r in heldout}
    write_jsonl(here / "mixed_train.jsonl", train)
    write_jsonl(here / "mixed_heldout.jsonl", heldout)
    print(f"mixed_train {len(train)} ({sum(r['hops'] == 1 for r in train)} one-fact), "
          f"mixed_heldout {len(heldout)} ({sum(r['hops'] == 1 for r in heldout)} one-fact)")


if __name__ == "__main__":
    main()
