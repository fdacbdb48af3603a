"""Supervisor routing between a researcher and a writer.

Demonstrates: full separation (3 roles -> 3 policies), ``ChatOpenAI.with_structured_output``
with a pydantic ``Route`` model for the supervisor's decision, plain ``ChatOpenAI.invoke``
in the workers, and ``@trainable`` applied to a function that builds and returns the
compiled graph.

Flow: supervisor -> (researcher | writer) -> supervisor -> ... -> FINISH, at most
``MAX_HOPS`` supervisor decisions. If the supervisor's answer cannot be parsed it falls back
to ``writer`` while there is no draft yet, else to ``FINISH``.

Input: ``{"question": str}``; the answer is ``final_state["draft"]``.
Tasks: ``data/supervisor.jsonl`` (reference field ``answer``).
"""

import operator
from typing import Annotated, Literal, TypedDict

import openai
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel, Field

from mas_trainer import trainable

MAX_HOPS = 4

ROLES = {
    "supervisor": "supervisor_policy",
    "researcher": "researcher_policy",
    "writer": "writer_policy",
}
POLICIES = {
    "supervisor_policy": "default",
    "researcher_policy": "default",
    "writer_policy": "default",
}


class Route(BaseModel):
    """Which worker acts next, or FINISH when the draft answers the question."""

    next: Literal["researcher", "writer", "FINISH"] = Field(
        description="researcher to gather facts, writer to write the answer, FINISH when done"
    )


class State(TypedDict, total=False):
    question: str
    notes: Annotated[list[str], operator.add]
    draft: str
    next: str
    hops: int


SUPERVISOR_PROMPT = (
    "You are a supervisor managing two workers: a researcher, who collects facts, and a "
    "writer, who writes the final answer from the facts. Given the question, the notes and "
    "the current draft, choose who acts next. Choose FINISH once the draft answers the "
    "question."
)
RESEARCHER_PROMPT = (
    "You are a researcher. List the key facts needed to answer the question, "
    "one short fact per line."
)
WRITER_PROMPT = (
    "You are a writer. Answer the question in one or two sentences, using the research notes."
)


def contains_answer(task: dict, final_state: dict, trajectory=None) -> float:
    """1.0 when the reference answer appears in the final draft (case-insensitive)."""
    reference = str(task.get("answer", "")).strip().lower()
    draft = str((final_state or {}).get("draft") or "").lower()
    return 1.0 if reference and reference in draft else 0.0


def _show(notes: list[str] | None, draft: str | None) -> str:
    notes_text = "\n".join(f"- {n}" for n in notes or []) or "(no notes yet)"
    return f"Research notes:\n{notes_text}\n\nCurrent draft:\n{draft or '(no draft yet)'}"


@trainable(roles=ROLES, policies=POLICIES, reward=contains_answer)
def build_graph():
    llm = ChatOpenAI(model="gpt-4o-mini", temperature=0, max_tokens=256)
    router = llm.with_structured_output(Route)

    def supervisor(state: State) -> dict:
        hops = state.get("hops", 0)
        if hops >= MAX_HOPS:
            return {"next": "FINISH", "hops": hops}
        messages = [
            SystemMessage(SUPERVISOR_PROMPT),
            HumanMessage(
                f"Question: {state['question']}\n\n"
                f"{_show(state.get('notes'), state.get('draft'))}\n\nWho acts next?"
            ),
        ]
        try:
            route = router.invoke(messages)
            choice = route.next if isinstance(route, Route) else None
        except (ValueError, OutputParserException, openai.LengthFinishReasonError):
            # ValueError covers invalid JSON and pydantic validation errors.
            choice = None
        if choice is None:
            choice = "FINISH" if state.get("draft") else "writer"
        return {"next": choice, "hops": hops + 1}

    def researcher(state: State) -> dict:
        reply = llm.invoke(
            [
                SystemMessage(RESEARCHER_PROMPT),
                HumanMessage(f"Question: {state['question']}"),
            ]
        )
        return {"notes": [reply.text.strip()]}

    def writer(state: State) -> dict:
        reply = llm.invoke(
            [
                SystemMessage(WRITER_PROMPT),
                HumanMessage(
                    f"Question: {state['question']}\n\n"
                    f"{_show(state.get('notes'), state.get('draft'))}"
                ),
            ]
        )
        return {"draft": reply.text.strip()}

    def route_next(state: State) -> str:
        choice = state.get("next")
        return choice if choice in ("researcher", "writer") else END

    builder = StateGraph(State)
    builder.add_node("supervisor", supervisor)
    builder.add_node("researcher", researcher)
    builder.add_node("writer", writer)
    builder.add_edge(START, "supervisor")
    builder.add_conditional_edges(
        "supervisor", route_next, {"researcher": "researcher", "writer": "writer", END: END}
    )
    builder.add_edge("researcher", "supervisor")
    builder.add_edge("writer", "supervisor")
    return builder.compile()


graph = build_graph


if __name__ == "__main__":
    app = graph if hasattr(graph, "invoke") else graph()  # a decorated factory
    result = app.invoke({"question": "What is the capital of France?"})
    print(result.get("draft"))
