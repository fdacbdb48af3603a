"""Map-reduce: a planner fans out to one worker per subtopic with ``Send``, a reducer combines.

Demonstrates: partial sharing (3 roles -> 2 policies: planner -> ``planner``; worker and
reducer -> ``worker``), parallel ``Send`` branches (each worker call is its own node call),
plain ``ChatOpenAI.invoke``, and ``trainable`` applied to the ``StateGraph`` builder.

The planner asks for ``num_subtopics`` subtopics, one per line. Lines are cleaned of bullets
and numbering; if the model gives fewer usable lines, generic subtopics fill up to the count
the task asks for, so every run fans out to exactly ``num_subtopics`` workers (1 to
``MAX_SUBTOPICS``, default 3).

Input: ``{"topic": str, "num_subtopics": int}``; the result is ``final_state["summary"]``.
Tasks: ``data/map_reduce.jsonl`` (reference field ``keywords``).
"""

import operator
import re
from typing import Annotated, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from mas_trainer import trainable

DEFAULT_SUBTOPICS = 3
MAX_SUBTOPICS = 5
MAX_SUBTOPIC_CHARS = 80

ROLES = {"planner": "planner", "worker": "worker", "reducer": "worker"}
POLICIES = {"planner": "default", "worker": "default"}

llm = ChatOpenAI(model="gpt-4o-mini", temperature=0.3, max_tokens=200)


class OverallState(TypedDict, total=False):
    topic: str
    num_subtopics: int
    subtopics: list[str]
    sections: Annotated[list[str], operator.add]
    summary: str


class WorkerState(TypedDict):
    topic: str
    subtopic: str


_BULLET = re.compile(r"^\s*(?:[-*\u2022]+|\d+[.):]|[a-zA-Z][.)])\s*")


def parse_subtopics(text: str, count: int) -> list[str]:
    """One subtopic per non-empty line, without bullets or numbering, at most ``count``."""
    subtopics = []
    for line in text.splitlines():
        item = _BULLET.sub("", line).strip().strip("*_#").strip()
        if item and item not in subtopics:
            subtopics.append(item[:MAX_SUBTOPIC_CHARS])
        if len(subtopics) == count:
            break
    return subtopics


def requested_count(state: OverallState) -> int:
    try:
        count = int(state.get("num_subtopics", DEFAULT_SUBTOPICS))
    except (TypeError, ValueError):
        count = DEFAULT_SUBTOPICS
    return max(1, min(count, MAX_SUBTOPICS))


def keyword_reward(task: dict, final_state: dict, trajectory=None) -> float:
    """Fraction of the task's reference keywords that appear in the summary."""
    keywords = [str(k).lower() for k in task.get("keywords") or []]
    summary = str((final_state or {}).get("summary") or "").lower()
    if not keywords:
        return 0.0
    return sum(k in summary for k in keywords) / len(keywords)


def planner(state: OverallState) -> dict:
    count = requested_count(state)
    reply = llm.invoke(
        [
            SystemMessage(
                "You plan short reports. Reply with subtopics only, one per line, "
                "no numbering and no other text."
            ),
            HumanMessage(f"List {count} subtopics for a short report on: {state['topic']}"),
        ]
    )
    subtopics = parse_subtopics(reply.text, count)
    for i in range(len(subtopics), count):
        subtopics.append(f"{state['topic']}: aspect {i + 1}")
    return {"subtopics": subtopics}


def fan_out(state: OverallState) -> list[Send]:
    return [
        Send("worker", {"topic": state["topic"], "subtopic": subtopic})
        for subtopic in state["subtopics"]
    ]


def worker(state: WorkerState) -> dict:
    reply = llm.invoke(
        [
            SystemMessage("You write one concise paragraph (at most three sentences)."),
            HumanMessage(
                f"Report topic: {state['topic']}\nWrite the paragraph on: {state['subtopic']}"
            ),
        ]
    )
    return {"sections": [f"{state['subtopic']}: {reply.text.strip()}"]}


def reducer(state: OverallState) -> dict:
    sections = "\n\n".join(state.get("sections", []))
    reply = llm.invoke(
        [
            SystemMessage("You combine report sections into one short, coherent summary."),
            HumanMessage(f"Topic: {state['topic']}\n\nSections:\n{sections}"),
        ]
    )
    return {"summary": reply.text.strip()}


builder = StateGraph(OverallState)
builder.add_node("planner", planner)
builder.add_node("worker", worker)
builder.add_node("reducer", reducer)
builder.add_edge(START, "planner")
builder.add_conditional_edges("planner", fan_out, ["worker"])
builder.add_edge("worker", "reducer")
builder.add_edge("reducer", END)

graph = trainable(builder, roles=ROLES, policies=POLICIES, reward=keyword_reward)


if __name__ == "__main__":
    app = graph if hasattr(graph, "invoke") else graph.compile()
    result = app.invoke({"topic": "renewable energy", "num_subtopics": 3})
    print(result.get("summary"))
