"""A plain two-node graph with no ``@trainable``: a check that undecorated apps trace too.

Demonstrates: an ordinary compiled ``StateGraph`` (``graph`` is exactly what
``builder.compile()`` returns), with ``ChatOpenAI.invoke`` in both nodes. Nothing in this
file mentions mas-trainer: roles and policies come from the trainer's defaults (or its
command line), not from the app.

Flow: draft -> polish -> END.

Input: ``{"topic": str}``; the result is ``final_state["text"]``.
Tasks: ``data/untraced_plain.jsonl`` (reference field ``answer``).
"""

from typing import TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

llm = ChatOpenAI(model="gpt-4o-mini", temperature=0.5, max_tokens=200)


class State(TypedDict, total=False):
    topic: str
    draft: str
    text: str


def draft(state: State) -> dict:
    reply = llm.invoke(
        [
            SystemMessage("Write two sentences explaining the topic to a child."),
            HumanMessage(state["topic"]),
        ]
    )
    return {"draft": reply.text.strip()}


def polish(state: State) -> dict:
    reply = llm.invoke(
        [
            SystemMessage("Fix grammar and make the text clearer. Reply with the text only."),
            HumanMessage(state.get("draft", "")),
        ]
    )
    return {"text": reply.text.strip()}


builder = StateGraph(State)
builder.add_node("draft", draft)
builder.add_node("polish", polish)
builder.add_edge(START, "draft")
builder.add_edge("draft", "polish")
builder.add_edge("polish", END)

graph = builder.compile()


if __name__ == "__main__":
    print(graph.invoke({"topic": "why the sky is blue"}).get("text"))
