"""An outer graph whose ``research`` node is a compiled subgraph.

Demonstrates: roles named by subgraph node (``"research:search_query"``, as in
``graph.get_graph(xray=True)``), partial sharing (both subgraph nodes -> ``research``
policy, ``final`` -> ``writer`` policy), ``ChatOpenAI`` inside the subgraph and
``init_chat_model("openai:gpt-4o-mini")`` in the outer ``final`` node. ``trainable`` wraps
the compiled outer graph.

Flow: research[search_query -> summarize] -> final. ``search_query`` asks the model for a
search query and looks it up in a small in-memory corpus (no network); ``summarize`` turns
the hits into notes; ``final`` answers from the notes.

Input: ``{"question": str}``; the result is ``final_state["response"]``.
Tasks: ``data/subgraph_app.jsonl`` (reference field ``answer``).
"""

import re
from typing import TypedDict

from langchain.chat_models import init_chat_model
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable

ROLES = {
    "research:search_query": "research",
    "research:summarize": "research",
    "final": "writer",
}
POLICIES = {"research": "default", "writer": "default"}

CORPUS = [
    "Mars is called the Red Planet because iron oxide on its surface gives it a reddish look.",
    "Jupiter is the largest planet in the Solar System.",
    "Water boils at 100 degrees Celsius at sea level.",
    "The Pacific Ocean is the largest and deepest ocean on Earth.",
    "Paris is the capital and largest city of France.",
    "Photosynthesis in plants turns light, water and carbon dioxide into sugar and oxygen.",
    "Mount Everest, at 8,849 metres, is the highest mountain above sea level.",
    "The human heart has four chambers: two atria and two ventricles.",
]
MAX_HITS = 3

research_llm = ChatOpenAI(model="gpt-4o-mini", temperature=0, max_tokens=128)
final_model = init_chat_model("openai:gpt-4o-mini", temperature=0, max_tokens=128)


def search(query: str, k: int = MAX_HITS) -> list[str]:
    """Rank corpus passages by word overlap with the query (a stand-in for a search API)."""
    words = set(re.findall(r"[a-z0-9]+", query.lower()))
    scored = [(len(words & set(re.findall(r"[a-z0-9]+", p.lower()))), p) for p in CORPUS]
    return [p for score, p in sorted(scored, key=lambda sp: -sp[0]) if score > 0][:k]


def contains_answer(task: dict, final_state: dict, trajectory=None) -> float:
    """1.0 when the reference answer appears in the response (case-insensitive)."""
    reference = str(task.get("answer", "")).strip().lower()
    response = str((final_state or {}).get("response") or "").lower()
    return 1.0 if reference and reference in response else 0.0


# --- the research subgraph ------------------------------------------------------------


class ResearchState(TypedDict, total=False):
    question: str
    query: str
    hits: list[str]
    notes: str


def search_query(state: ResearchState) -> dict:
    reply = research_llm.invoke(
        [
            SystemMessage("Write one short web search query for the question. Reply with the query only."),
            HumanMessage(state["question"]),
        ]
    )
    lines = [line.strip() for line in reply.text.splitlines() if line.strip()]
    query = lines[0][:200] if lines else state["question"]
    hits = search(query) or search(state["question"])
    return {"query": query, "hits": hits}


def summarize(state: ResearchState) -> dict:
    hits = "\n".join(f"- {h}" for h in state.get("hits", [])) or "(no results)"
    reply = research_llm.invoke(
        [
            SystemMessage("Summarise the search results that are relevant to the question as short notes."),
            HumanMessage(f"Question: {state['question']}\n\nSearch results:\n{hits}"),
        ]
    )
    return {"notes": reply.text.strip()}


research_builder = StateGraph(ResearchState)
research_builder.add_node("search_query", search_query)
research_builder.add_node("summarize", summarize)
research_builder.add_edge(START, "search_query")
research_builder.add_edge("search_query", "summarize")
research_builder.add_edge("summarize", END)
research = research_builder.compile()


# --- the outer graph --------------------------------------------------------------------


class State(TypedDict, total=False):
    question: str
    query: str
    hits: list[str]
    notes: str
    response: str


def final(state: State) -> dict:
    reply = final_model.invoke(
        [
            SystemMessage("Answer the question in one sentence using the research notes."),
            HumanMessage(
                f"Question: {state['question']}\n\nNotes:\n{state.get('notes') or '(none)'}"
            ),
        ]
    )
    return {"response": reply.text.strip()}


builder = StateGraph(State)
builder.add_node("research", research)
builder.add_node("final", final)
builder.add_edge(START, "research")
builder.add_edge("research", "final")
builder.add_edge("final", END)

graph = trainable(builder.compile(), roles=ROLES, policies=POLICIES, reward=contains_answer)


if __name__ == "__main__":
    result = graph.invoke({"question": "Which planet is known as the Red Planet?"})
    print(result.get("response"))
