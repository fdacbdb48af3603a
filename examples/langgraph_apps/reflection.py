"""Generate -> reflect loop.

Demonstrates: full sharing (2 roles -> 1 policy), token streaming with
``ChatOpenAI.stream`` (chunks accumulated into one message) in the sync ``generate`` node,
and ``await ChatOpenAI.ainvoke`` in the async ``reflect`` node. Because one node is async,
run the graph with ``ainvoke`` / ``astream``. ``trainable`` wraps the compiled graph.

Flow: generate -> reflect -> generate -> END. At most ``MAX_DRAFTS`` drafts; the loop ends
early when the reflector replies APPROVED.

Input: ``{"task": str}``; the result is ``final_state["draft"]``.
Tasks: ``data/reflection.jsonl`` (reference field ``keywords``).
"""

import asyncio
from typing import TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable

MAX_DRAFTS = 2

ROLES = {"generate": "shared", "reflect": "shared"}
POLICIES = {"shared": "default"}

llm = ChatOpenAI(model="gpt-4o-mini", temperature=0.7, max_tokens=256)


class State(TypedDict, total=False):
    task: str
    draft: str
    critique: str
    drafts: int


GENERATE_PROMPT = "You are a careful writer. Complete the user's writing task concisely."
REFLECT_PROMPT = (
    "You are a strict editor. Give two or three concrete suggestions to improve the draft. "
    "If the draft needs no changes, reply with exactly: APPROVED"
)


def keyword_reward(task: dict, final_state: dict, trajectory=None) -> float:
    """Fraction of the task's reference keywords that appear in the final draft."""
    keywords = [str(k).lower() for k in task.get("keywords") or []]
    draft = str((final_state or {}).get("draft") or "").lower()
    if not keywords:
        return 0.0
    return sum(k in draft for k in keywords) / len(keywords)


def generate(state: State) -> dict:
    messages = [SystemMessage(GENERATE_PROMPT), HumanMessage(state["task"])]
    if state.get("critique"):
        messages += [
            AIMessage(state.get("draft", "")),
            HumanMessage(f"Revise your text using this feedback:\n{state['critique']}"),
        ]
    full = None
    for chunk in llm.stream(messages):
        full = chunk if full is None else full + chunk
    draft = full.text.strip() if full is not None else ""
    return {"draft": draft, "drafts": state.get("drafts", 0) + 1}


async def reflect(state: State) -> dict:
    reply = await llm.ainvoke(
        [
            SystemMessage(REFLECT_PROMPT),
            HumanMessage(f"Task: {state['task']}\n\nDraft:\n{state.get('draft', '')}"),
        ]
    )
    return {"critique": reply.text.strip()}


def after_generate(state: State) -> str:
    return END if state.get("drafts", 0) >= MAX_DRAFTS else "reflect"


def after_reflect(state: State) -> str:
    critique = state.get("critique", "")
    return END if critique.strip().upper().startswith("APPROVED") else "generate"


builder = StateGraph(State)
builder.add_node("generate", generate)
builder.add_node("reflect", reflect)
builder.add_edge(START, "generate")
builder.add_conditional_edges("generate", after_generate, ["reflect", END])
builder.add_conditional_edges("reflect", after_reflect, ["generate", END])

graph = trainable(builder.compile(), roles=ROLES, policies=POLICIES, reward=keyword_reward)


if __name__ == "__main__":
    result = asyncio.run(graph.ainvoke({"task": "Write a haiku about autumn leaves."}))
    print(result.get("draft"))
