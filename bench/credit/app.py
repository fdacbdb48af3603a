"""A relay where the upstream role gates the outcome, for `bench/bench_credit.py`.

The planner (policy ``lead``) writes a plan; the writer (policy ``crew``) answers with the plan
in its prompt. The trajectory reward is the product of the two outputs' shares of plain
lowercase words: a bad plan scores 0 whatever the writer does, and a good plan is worth only
what the writer makes of it. There is no role reward, so each role's credit has to come from
the one trajectory number: broadcast gives both turns the same, turn_delta splits it by rule,
counterfactual forks the graph before and after each turn and credits the change in mean return.
The tiny model learns it within minutes on a CPU.
"""

import re
from typing import TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable

WORD = re.compile(r"[a-z]+")


def word_fraction(text: str | None) -> float:
    pieces = (text or "").split()
    return sum(bool(WORD.fullmatch(p)) for p in pieces) / len(pieces) if pieces else 0.0


class State(TypedDict, total=False):
    question: str
    plan: str
    answer: str


def _graph():
    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)

    def planner(s: State) -> State:
        return {"plan": llm.invoke(f"Plan: {s['question']}").content}

    def writer(s: State) -> State:
        return {"answer": llm.invoke(f"{s['plan']}\nAnswer: {s['question']}").content}

    g = StateGraph(State)
    g.add_node("planner", planner)
    g.add_node("writer", writer)
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    return trainable(g.compile(), roles={"planner": "lead", "writer": "crew"}, policies={"lead": "tiny", "crew": "tiny"},
                     reward=lambda task, state, traj: word_fraction(state.get("plan")) * word_fraction(state.get("answer")))


graph = _graph
