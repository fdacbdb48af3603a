"""Retrieval-augmented QA: a query rewriter, a BM25 retriever tool, an answerer.

    rewrite (LLM) -> retrieve (BM25 tool over corpus.jsonl) -> answer (LLM)

The rewriter turns the question into a short keyword search query; the retriever ranks the
local corpus with BM25 (``rank-bm25``) on the question plus the rewritten query (the rewrite
expands the question, it never loses it) and keeps the top 2 passages; the answerer replies
with a short answer from those passages.

Demonstrates: a LangChain ``@tool`` called inside a node (the trajectory records it as a tool
call), separate policies (``graph``: rewriter and answerer are two models) and one shared
policy (``graph_shared``), a trajectory reward (token F1 against the task's ``answer``) and
a role reward for the rewriter (did the retrieved passages contain the answer).

Input: ``{"question": str}``; the answer is ``final_state["prediction"]``.
Tasks: ``train.jsonl`` / ``heldout.jsonl`` next to this file (reference field ``answer``),
made with the corpus by ``make_data.py``. ``RAG_QA_CORPUS`` points the retriever at another
corpus (JSON lines with ``id`` and ``text``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from rank_bm25 import BM25Okapi

from mas_trainer import trainable

try:  # imported as a package module (examples.langgraph_apps.rag_qa.app, rag_qa.app)
    from .metrics import exact_match, f1, recall
except ImportError:  # loaded from its file path (mas-trainer fit path/to/app.py:graph, python app.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rag_qa.metrics import exact_match, f1, recall

HERE = Path(__file__).resolve().parent
CORPUS_PATH = Path(os.environ.get("RAG_QA_CORPUS") or HERE / "corpus.jsonl")
TOP_K = 2

SEPARATE_ROLES = {"rewrite": "rewriter", "answer": "answerer"}
SEPARATE_POLICIES = {"rewriter": "default", "answerer": "default"}
SHARED_ROLES = {"rewrite": "qa", "answer": "qa"}
SHARED_POLICIES = {"qa": "default"}
ANSWERER_ROLES = {"answer": "answerer"}
ANSWERER_POLICIES = {"answerer": "default"}

rewriter_llm = ChatOpenAI(model="gpt-4o-mini", max_tokens=24)
answer_llm = ChatOpenAI(model="gpt-4o-mini", max_tokens=16)


# ----- the retriever: BM25 over the local corpus ---------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(
    "a an the of in on at to for by and or is was are were be been it its this that which what who "
    "whom whose where when how does do did".split()
)


def bm25_tokens(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOPWORDS]


def load_corpus(path: str | Path = CORPUS_PATH) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


class Retriever:
    """BM25 (Okapi) over passages ``{"id", "text"}``; ``search`` returns the best ``k``."""

    def __init__(self, passages: list[dict]) -> None:
        self.passages = passages
        self.bm25 = BM25Okapi([bm25_tokens(p.get("title", "") + " " + p["text"]) for p in passages])

    def search(self, query: str, k: int = TOP_K, exclude: set[str] | frozenset[str] = frozenset()) -> list[dict]:
        words = bm25_tokens(query)
        if not words:
            return []
        scores = self.bm25.get_scores(words)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        hits = [self.passages[i] for i in order if scores[i] > 0 and self.passages[i]["id"] not in exclude]
        return [{"id": p["id"], "text": p["text"]} for p in hits[:k]]


@lru_cache(maxsize=1)
def get_retriever() -> Retriever:
    return Retriever(load_corpus())


@tool
def search_corpus(query: str) -> list[dict]:
    """Search the corpus with BM25; returns the top passages as {"id", "text"}."""
    return get_retriever().search(query, TOP_K)


# ----- the graph -----------------------------------------------------------------------------


class State(TypedDict, total=False):
    question: str
    query: str
    passages: list[dict]
    prediction: str


def first_line(text: str) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def rewrite(state: State) -> dict:
    reply = rewriter_llm.invoke(
        [
            SystemMessage("Rewrite the question as a short search query: key words only."),
            HumanMessage(state["question"]),
        ]
    )
    return {"query": first_line(reply.text)}


def retrieve(state: State) -> dict:
    return {"passages": search_corpus.invoke({"query": f"{state['question']} {state.get('query', '')}"})}


def answer(state: State) -> dict:
    context = "\n".join(p["text"] for p in state.get("passages", []))
    reply = answer_llm.invoke(
        [
            SystemMessage("Answer with a few words copied from the passages."),
            HumanMessage(f"{context}\nQuestion: {state['question']}"),
        ]
    )
    return {"prediction": first_line(reply.text)}


def build_graph():
    builder = StateGraph(State)
    builder.add_node("rewrite", rewrite)
    builder.add_node("retrieve", retrieve)
    builder.add_node("answer", answer)
    builder.add_edge(START, "rewrite")
    builder.add_edge("rewrite", "retrieve")
    builder.add_edge("retrieve", "answer")
    builder.add_edge("answer", END)
    return builder.compile()


# ----- rewards -------------------------------------------------------------------------------


def f1_reward(task: dict, final_state: dict, trajectory=None) -> float:
    """Token F1 (SQuAD normalisation) of the prediction against the task's ``answer``."""
    return f1((final_state or {}).get("prediction"), task.get("answer"))


def exact_match_reward(task: dict, final_state: dict, trajectory=None) -> float:
    """1.0 when the normalised prediction equals the task's ``answer``."""
    return exact_match((final_state or {}).get("prediction"), task.get("answer"))


def retrieval_hit(task: dict, calls, trajectory) -> float | None:
    """Rewriter's role reward: 1.0 when the retrieved passages contain the whole answer."""
    state = getattr(trajectory, "final_state", None) or {}
    passages = state.get("passages") if isinstance(state, dict) else None
    if passages is None:
        return None
    return float(recall(" ".join(p["text"] for p in passages), task.get("answer")) == 1.0)


# separate policies: the rewriter and the answerer are two models
graph = trainable(build_graph(), roles=SEPARATE_ROLES, policies=SEPARATE_POLICIES,
                  reward=f1_reward, role_rewards={"rewrite": retrieval_hit})

# one shared policy serves both nodes
graph_shared = trainable(build_graph(), roles=SHARED_ROLES, policies=SHARED_POLICIES,
                         reward=f1_reward, role_rewards={"rewrite": retrieval_hit})

# only the answerer is trained; the rewriter stays the base model (the README's demo: the
# retriever already finds the passage from the question, so the answer is what there is to learn)
graph_answerer = trainable(build_graph(), roles=ANSWERER_ROLES, policies=ANSWERER_POLICIES,
                           frozen=["rewrite"], reward=f1_reward)


if __name__ == "__main__":
    question = sys.argv[1] if len(sys.argv) > 1 else "In which town was Mirela Vostok born?"
    result = graph.invoke({"question": question})
    print(result["query"], [p["id"] for p in result["passages"]], result["prediction"], sep="\n")
