"""Iterative agentic search: planner -> search -> summariser, looping, then an answerer.

    planner --SEARCH <query>--> search (BM25) -> summariser -> planner ...
    planner --ANSWER (or MAX_TURNS searches done)--> answerer -> END

The planner reads the question and the notes so far and replies ``SEARCH <query>`` or
``ANSWER``; the search node ranks the RAG QA corpus with BM25 (the retriever of
``rag_qa/app.py``, imported, not copied) and returns the two best passages not seen yet;
the summariser condenses them into a line of notes; after ``ANSWER`` or ``MAX_TURNS``
searches the answerer replies from the notes alone. Two-fact questions ("In which town was
the founder of X born?") need two searches: one for X, one for its founder.

Demonstrates: a loop with a conditional edge and a turn limit, partial sharing (``graph``:
planner on its own policy, summariser and answerer on a shared ``reader`` policy;
``graph_shared``: one policy), a trajectory reward (F1 of the answer) and turn rewards that
form a running score for ``reward.allocator=turn_delta``:

- a summariser call scores the share of the answer's tokens present in all notes written so
  far (recall: notes are sentences, F1 would punish their length);
- an answerer call scores the F1 of its answer;
- planner calls score nothing (no turn part).

With ``reward.allocator=turn_delta`` each scored call gets its gain over the previous
scored call (R_i - R_{i-1}) on top of the final F1 every call gets: a summariser that brings
the answer into the notes is credited for it, the answerer gets F1 minus what the notes
already held. The gains of a rollout sum to its final F1; ``reward.weights.trajectory=0``
would keep only the gains, but then the planner (no turn score) gets no signal at all.

Input: ``{"question": str}``; the answer is ``final_state["prediction"]``.
Tasks: ``train.jsonl`` / ``heldout.jsonl`` next to this file (reference field ``answer``,
and ``passage_ids``, the two passages needed), made by ``../rag_qa/make_data.py``.
"""

from __future__ import annotations

import operator
import re
import sys
from pathlib import Path
from typing import Annotated, Literal, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable

try:  # imported as examples.langgraph_apps.agentic_search.app
    from ..rag_qa.app import first_line, get_retriever
    from ..rag_qa.metrics import f1, recall
except ImportError:  # loaded from its file path (mas-trainer fit path/to/app.py:graph, python app.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rag_qa.app import first_line, get_retriever
    from rag_qa.metrics import f1, recall

MAX_TURNS = 3  # searches before the answerer must answer
TOP_K = 2

ROLES = {"planner": "planner", "summariser": "reader", "answerer": "reader"}
POLICIES = {"planner": "default", "reader": "default"}
SHARED_ROLES = {"planner": "agent", "summariser": "agent", "answerer": "agent"}
SHARED_POLICIES = {"agent": "default"}

planner_llm = ChatOpenAI(model="gpt-4o-mini", max_tokens=24)
summariser_llm = ChatOpenAI(model="gpt-4o-mini", max_tokens=48)
answer_llm = ChatOpenAI(model="gpt-4o-mini", max_tokens=16)


class State(TypedDict, total=False):
    question: str
    action: str
    query: str
    turn: int
    seen: Annotated[list[str], operator.add]
    found: list[dict]
    notes: Annotated[list[str], operator.add]
    prediction: str


_SEARCH = re.compile(r"^\W*search\W*(.*)$", re.IGNORECASE | re.DOTALL)
_ANSWER = re.compile(r"^\W*answer\b", re.IGNORECASE)


def parse_plan(text: str, question: str) -> tuple[str, str]:
    """``("answer", "")`` or ``("search", query)``; a reply that is neither is read as a query
    (the question itself when the reply is empty)."""
    line = first_line(text)
    if _ANSWER.match(line):
        return "answer", ""
    match = _SEARCH.match(line)
    query = (match.group(1) if match else line).strip()
    return "search", query or question


def notes_text(state: State) -> str:
    return "\n".join(f"- {n}" for n in state.get("notes", [])) or "(none)"


def planner(state: State) -> dict:
    turn = state.get("turn", 0)
    if turn >= MAX_TURNS:
        return {"action": "answer"}
    reply = planner_llm.invoke(
        [
            SystemMessage("Reply SEARCH <query> to look up a fact, or ANSWER when the notes answer the question."),
            HumanMessage(f"Question: {state['question']}\nNotes:\n{notes_text(state)}"),
        ]
    )
    action, query = parse_plan(reply.text, state["question"])
    return {"action": action, "query": query}


def search(state: State) -> dict:
    found = get_retriever().search(state["query"], TOP_K, exclude=set(state.get("seen", [])))
    return {"found": found, "seen": [p["id"] for p in found], "turn": state.get("turn", 0) + 1}


def summariser(state: State) -> dict:
    passages = "\n".join(p["text"] for p in state.get("found", [])) or "(nothing found)"
    reply = summariser_llm.invoke(
        [
            SystemMessage("Write one short line of notes with the facts that help answer the question."),
            HumanMessage(f"Question: {state['question']}\nPassages:\n{passages}"),
        ]
    )
    return {"notes": [first_line(reply.text)]}


def answerer(state: State) -> dict:
    reply = answer_llm.invoke(
        [
            SystemMessage("Answer with a few words copied from the notes."),
            HumanMessage(f"Notes:\n{notes_text(state)}\nQuestion: {state['question']}"),
        ]
    )
    return {"prediction": first_line(reply.text)}


def after_planner(state: State) -> Literal["search", "answerer"]:
    return "search" if state.get("action") == "search" else "answerer"


def build_graph():
    builder = StateGraph(State)
    builder.add_node("planner", planner)
    builder.add_node("search", search)
    builder.add_node("summariser", summariser)
    builder.add_node("answerer", answerer)
    builder.add_edge(START, "planner")
    builder.add_conditional_edges("planner", after_planner, ["search", "answerer"])
    builder.add_edge("search", "summariser")
    builder.add_edge("summariser", "planner")
    builder.add_edge("answerer", END)
    return builder.compile()


# ----- rewards -------------------------------------------------------------------------------


def f1_reward(task: dict, final_state: dict, trajectory=None) -> float:
    """Token F1 (SQuAD normalisation) of the final answer against the task's ``answer``."""
    return f1((final_state or {}).get("prediction"), task.get("answer"))


def notes_score(task: dict, call, trajectory) -> float:
    """Running score after a summariser call: share of the answer's tokens in the notes so far."""
    notes = []
    for c in trajectory.llm_calls:
        if c.role == call.role:
            notes.append(first_line(c.output_text or ""))
        if c.id == call.id:
            break
    return recall(" ".join(notes), task.get("answer"))


def answer_score(task: dict, call, trajectory) -> float:
    """Running score after the answerer's call: F1 of its answer."""
    return f1(first_line(call.output_text or ""), task.get("answer"))


TURN_REWARDS = {"summariser": notes_score, "answerer": answer_score}

graph = trainable(build_graph(), roles=ROLES, policies=POLICIES, reward=f1_reward, turn_rewards=TURN_REWARDS)

graph_shared = trainable(build_graph(), roles=SHARED_ROLES, policies=SHARED_POLICIES,
                         reward=f1_reward, turn_rewards=TURN_REWARDS)


if __name__ == "__main__":
    question = sys.argv[1] if len(sys.argv) > 1 else "In which town was the founder of Brindlecorp born?"
    result = graph.invoke({"question": question}, {"recursion_limit": 4 * MAX_TURNS + 4})
    print(*result.get("notes", []), result["prediction"], sep="\n")
