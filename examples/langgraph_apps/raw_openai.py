"""Nodes that call the OpenAI SDK directly, no LangChain chat model.

Demonstrates: ``openai.OpenAI().chat.completions.create(...)`` in a sync node (``answer``,
module-level client) and ``openai.AsyncOpenAI()`` with ``stream=True`` in an async node
(``review``, client opened per call, chunks accumulated, usage chunk ignored). These calls
produce no LangChain LLM runs, so they are seen only through the OpenAI SDK. Full
separation (2 roles -> 2 policies). Because one node is async, run the graph with
``ainvoke`` / ``astream``. ``trainable`` wraps the compiled graph.

Flow: answer -> review -> END.

Input: ``{"question": str}``; the result is ``final_state["response"]``.
Tasks: ``data/raw_openai.jsonl`` (reference field ``answer``).
"""

import asyncio
from typing import TypedDict

from langgraph.graph import END, START, StateGraph
from openai import AsyncOpenAI, OpenAI

from mas_trainer import trainable

MODEL = "gpt-4o-mini"

ROLES = {"answer": "answerer", "review": "reviewer"}
POLICIES = {"answerer": "default", "reviewer": "default"}

client = OpenAI()


class State(TypedDict, total=False):
    question: str
    draft: str
    response: str


def contains_answer(task: dict, final_state: dict, trajectory=None) -> float:
    """1.0 when the reference answer appears in the reviewed response (case-insensitive)."""
    reference = str(task.get("answer", "")).strip().lower()
    response = str((final_state or {}).get("response") or "").lower()
    return 1.0 if reference and reference in response else 0.0


def answer(state: State) -> dict:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer the question briefly."},
            {"role": "user", "content": state["question"]},
        ],
        temperature=0.2,
        max_tokens=128,
    )
    content = completion.choices[0].message.content if completion.choices else None
    return {"draft": (content or "").strip()}


async def review(state: State) -> dict:
    parts: list[str] = []
    async with AsyncOpenAI() as aclient:
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "system",
                    "content": "Check the draft answer. Reply with the corrected final answer only.",
                },
                {
                    "role": "user",
                    "content": f"Question: {state['question']}\nDraft answer: {state.get('draft', '')}",
                },
            ],
            temperature=0.2,
            max_tokens=128,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
    return {"response": "".join(parts).strip()}


builder = StateGraph(State)
builder.add_node("answer", answer)
builder.add_node("review", review)
builder.add_edge(START, "answer")
builder.add_edge("answer", "review")
builder.add_edge("review", END)

graph = trainable(builder.compile(), roles=ROLES, policies=POLICIES, reward=contains_answer)


if __name__ == "__main__":
    result = asyncio.run(graph.ainvoke({"question": "What is the boiling point of water in Celsius?"}))
    print(result.get("response"))
