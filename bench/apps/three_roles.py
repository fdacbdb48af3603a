"""Three roles, three trainable policies (full separation), for `bench/bench_shared_base.py`.

A planner (policy ``plan``) writes a plan for the question, a writer (policy ``write``) answers
with the plan in its prompt, and an editor (policy ``edit``) rewrites the answer. All three run
the bundled model (``default``, SmolLM2-135M-Instruct). Each role is scored on its own output by
the share of plain lowercase words in it (no capitals, markdown, digits or punctuation stuck to
words: what the instruct model's chatty replies lack at first), and the trajectory reward,
which the held-out evaluations report, is the mean of the three. A reward the model can move
in a few steps on a CPU, and one per policy, so each of the three learns from its own turns.

`TASKS` and `VAL` are the training and held-out questions (the bench writes them to jsonl).
"""

import re
from typing import TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable

WORD = re.compile(r"[a-z]+")

TASKS = ["Name a fruit.", "Name a color.", "Say hello.", "Name an animal.", "Describe the sea.", "Name a tool.",
         "Say yes.", "Name a city.", "Describe a tree.", "Name a sport.", "Describe the rain.", "Name a drink."]
VAL = ["Name a river.", "Describe the sky.", "Name a bird.", "Say goodbye.", "Name a flower.", "Describe the wind."]


def word_fraction(text: str | None) -> float:
    """Share of whitespace-separated pieces that are plain lowercase words (0 for no text)."""
    pieces = (text or "").split()
    return sum(bool(WORD.fullmatch(p)) for p in pieces) / len(pieces) if pieces else 0.0


class State(TypedDict, total=False):
    question: str
    plan: str
    draft: str
    answer: str


def _graph():
    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0)

    def planner(s: State) -> State:
        return {"plan": llm.invoke(f"Plan an answer: {s['question']}").content}

    def writer(s: State) -> State:
        return {"draft": llm.invoke(f"{s['plan']}\nAnswer: {s['question']}").content}

    def editor(s: State) -> State:
        return {"answer": llm.invoke(f"Improve this answer: {s['draft']}").content}

    g = StateGraph(State)
    for name, node in (("planner", planner), ("writer", writer), ("editor", editor)):
        g.add_node(name, node)
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", "editor")
    g.add_edge("editor", END)
    own = lambda task, calls, traj: word_fraction(calls[-1].output_text)  # noqa: E731  a role's own output
    return trainable(
        g.compile(), roles={"planner": "plan", "writer": "write", "editor": "edit"},
        policies={"plan": "default", "write": "default", "edit": "default"},
        reward=lambda task, state, traj: sum(word_fraction(state.get(k)) for k in ("plan", "draft", "answer")) / 3,
        role_rewards={"planner": own, "writer": own, "editor": own},
    )


graph = _graph
