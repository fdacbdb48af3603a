"""Iterative agentic search: planner -> search -> summariser, looping, then an answerer.

    planner --{"action": "search", "query": ...}--> search (BM25 tool) -> summariser -> planner ...
    planner --{"action": "answer"}, a malformed plan, or MAX_TURNS searches--> answerer -> END

Every LLM reply is JSON decoded under a schema (``response_format``: the gateway constrains
decoding to it), a format the bundled 135M model cannot get wrong; with free text (``SEARCH
<query>`` lines, a line of notes, a free answer) it wrote nothing a reward could credit. The
planner reads the question and the notes so far and writes a plan; its first plan must be a
search (the corpus is fictional: nothing can be answered unread). ``search`` calls a
LangChain ``@tool`` that ranks the RAG QA corpus with BM25 (the retriever of
``rag_qa/app.py``, imported, not copied) on the query alone and returns the two best
passages not fetched yet. The summariser picks the sentence of those passages that helps
(an enum of the fetched sentences) as a line of notes; the answerer replies from the notes
alone, in a few words. One-fact questions ("In which town was Mirela Vostok born?") need one
search, two-fact ones ("In which town was the founder of Brindlecorp born?") two: the
company, then its founder.

Demonstrates: a loop with a conditional edge and a turn limit, structured output, partial
sharing (``graph``: planner on its own policy, summariser and answerer on a shared
``reader`` policy; ``graph_shared``: one policy; ``graph_separate``: a policy each), a trajectory reward (F1 of the answer) and
turn rewards that score every call from the first rollout on, as a running score of how much
of the answer (share of its tokens) the rollout holds after that call:

- a planner call that searched: in the notes so far plus the passages its query fetched (did
  the search bring the answer in?); one that answered: in the notes; a malformed plan: 0;
- a summariser call: in all notes written so far (recall: notes are sentences, F1 would
  punish their length);
- the answerer's call: the F1 of its answer.

With ``reward.allocator=broadcast`` each call gets the final F1 plus its score; with
``turn_delta`` its gain over the previous call's score (R_i - R_{i-1}): the search that first
fetches the answer +1, a summariser that drops it -1, the answerer its F1 minus what the
notes held. The gains of a rollout sum to its final F1.

Input: ``{"question": str}``; the answer is ``final_state["prediction"]``, the searches
``final_state["searches"]`` (query and passages each). Tasks: ``mixed_train.jsonl`` /
``mixed_heldout.jsonl`` next to this file (one- and two-fact questions, reference field
``answer``), made by ``make_data.py``.
"""

from __future__ import annotations

import json
import operator
import re
import sys
from pathlib import Path
from typing import Annotated, Literal, TypedDict

import openai
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable

try:  # imported as examples.langgraph_apps.agentic_search.app
    from ..rag_qa.app import get_retriever
    from ..rag_qa.metrics import f1, recall
except ImportError:  # loaded from its file path (mas-trainer fit path/to/app.py:graph, python app.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rag_qa.app import get_retriever
    from rag_qa.metrics import f1, recall

MAX_TURNS = 2  # searches before the answerer must answer: enough for the two-fact questions
TOP_K = 2
MAX_QUERY_CHARS = 40  # a name or two; the grammar closes the string here, so the plan always ends
MAX_ANSWER_CHARS = 32  # every reference answer is 1-3 words

ROLES = {"planner": "planner", "summariser": "reader", "answerer": "reader"}
POLICIES = {"planner": "default", "reader": "default"}
SHARED_ROLES = {"planner": "agent", "summariser": "agent", "answerer": "agent"}
SHARED_POLICIES = {"agent": "default"}
SEPARATE_ROLES = {"planner": "planner", "summariser": "summariser", "answerer": "answerer"}
SEPARATE_POLICIES = {"planner": "default", "summariser": "default", "answerer": "default"}


def json_format(name: str, properties: dict) -> dict:
    """A ``response_format`` asking for an object with exactly these properties, in this order."""
    schema = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def plan_format(actions: list[str]) -> dict:
    """The planner's format: action first, so the query is written knowing it."""
    return json_format("plan", {"action": {"type": "string", "enum": actions},
                                "query": {"type": "string", "maxLength": MAX_QUERY_CHARS}})


def fact_format(facts: list[str]) -> dict:
    """The summariser's format: one of the fetched sentences, copied exactly (an enum)."""
    return json_format("note", {"fact": {"type": "string", "enum": facts}})


ANSWER_FORMAT = json_format("answer", {"answer": {"type": "string", "maxLength": MAX_ANSWER_CHARS}})

# max_tokens: the JSON around the strings (~12 tokens) plus the longest string a schema allows
# (a token per character at worst), so a reply decoded under its schema always ends in time
_planner = ChatOpenAI(model="gpt-4o-mini", max_tokens=56)
first_planner_llm = _planner.bind(response_format=plan_format(["search"]))
planner_llm = _planner.bind(response_format=plan_format(["search", "answer"]))
summariser_llm = ChatOpenAI(model="gpt-4o-mini", max_tokens=64)  # bound to each search's sentences
answer_llm = ChatOpenAI(model="gpt-4o-mini", max_tokens=48).bind(response_format=ANSWER_FORMAT)

PLANNER_PROMPT = ('Reply {"action": "search", "query": "<name>"} to look up a person, town or company '
                  'named in the question or notes, or {"action": "answer", "query": ""} when the notes '
                  'answer the question.')
SUMMARISER_PROMPT = "Pick the sentence of the passages that helps answer the question."
ANSWER_PROMPT = "Answer with a few words copied from the notes."


class State(TypedDict, total=False):
    question: str
    action: str
    query: str
    searches: Annotated[list[dict], operator.add]  # {"query", "passages": [{"id", "text"}]} per search
    notes: Annotated[list[str], operator.add]
    prediction: str


def parse_json(text: str | None) -> dict | None:
    """The reply's JSON object; None when it is not one (cut off by max_tokens, or free text
    from an endpoint that ignores the schema)."""
    try:
        value = json.loads(text or "")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_plan(text: str | None) -> tuple[str, str] | None:
    """``("search", query)`` or ``("answer", "")`` from the planner's JSON; None when it is not a plan."""
    plan = parse_json(text)
    if plan is None or plan.get("action") not in ("search", "answer"):
        return None
    if plan["action"] == "answer":
        return "answer", ""
    query = plan.get("query")
    return ("search", query.strip()) if isinstance(query, str) else None


def parse_field(text: str | None, key: str) -> str:
    """The string ``key`` of the reply's JSON, stripped; "" when there is none."""
    value = (parse_json(text) or {}).get(key)
    return value.strip() if isinstance(value, str) else ""


def sentences(passages: list[dict]) -> list[str]:
    """The passages' sentences, in order, without repeats: the facts the summariser picks from."""
    out = [s.strip() for p in passages for s in re.split(r"(?<=\.)\s+", p["text"]) if s.strip()]
    return list(dict.fromkeys(out))


def notes_text(state: State) -> str:
    return "\n".join(f"- {n}" for n in state.get("notes", [])) or "(none)"


def planner(state: State) -> dict:
    turns = len(state.get("searches", []))
    if turns >= MAX_TURNS:
        return {"action": "answer"}
    llm = first_planner_llm if turns == 0 else planner_llm
    try:
        reply = llm.invoke([SystemMessage(PLANNER_PROMPT),
                            HumanMessage(f"Question: {state['question']}\nNotes:\n{notes_text(state)}")])
        plan = parse_plan(reply.text)
    except openai.LengthFinishReasonError:  # the client refuses a structured reply cut off by max_tokens
        plan = None
    # a malformed plan ends the search: the answerer replies from the notes there are
    action, query = plan or ("answer", "")
    return {"action": action, "query": query}


@tool
def search_passages(query: str, exclude: list[str]) -> list[dict]:
    """BM25 search of the corpus on the query; the best passages whose id is not in `exclude`."""
    return get_retriever().search(query, TOP_K, exclude=set(exclude))


def search(state: State) -> dict:
    seen = [p["id"] for s in state.get("searches", []) for p in s["passages"]]
    found = search_passages.invoke({"query": state.get("query", ""), "exclude": seen})
    return {"searches": [{"query": state.get("query", ""), "passages": found}]}


def summariser(state: State) -> dict:
    found = state["searches"][-1]["passages"]
    facts = sentences(found)
    if not facts:  # nothing to pick from: no call
        return {"notes": ["(nothing found)"]}
    passages = "\n".join(p["text"] for p in found)
    try:
        reply = summariser_llm.bind(response_format=fact_format(facts)).invoke(
            [SystemMessage(SUMMARISER_PROMPT), HumanMessage(f"Passages:\n{passages}\nQuestion: {state['question']}")])
        note = parse_field(reply.text, "fact")
    except openai.LengthFinishReasonError:
        note = ""
    return {"notes": [note or "(no fact)"]}


def answerer(state: State) -> dict:
    try:
        reply = answer_llm.invoke([SystemMessage(ANSWER_PROMPT),
                                   HumanMessage(f"Notes:\n{notes_text(state)}\nQuestion: {state['question']}")])
        prediction = parse_field(reply.text, "answer")
    except openai.LengthFinishReasonError:
        prediction = ""
    return {"prediction": prediction}


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


def _calls_until(trajectory, call, role: str) -> list:
    """The calls of ``role`` made up to and including ``call``, in order."""
    out = []
    for c in trajectory.llm_calls:
        if c.role == role:
            out.append(c)
        if c.id == call.id:
            break
    return out


def _notes_before(trajectory, call) -> list[str]:
    """The notes the summariser calls made before ``call``."""
    notes = []
    for c in trajectory.llm_calls:
        if c.id == call.id:
            break
        if c.role == "summariser":
            notes.append(parse_field(c.output_text, "fact"))
    return notes


def planner_score(task: dict, call, trajectory) -> float:
    """Running score after a planner call: share of the answer's tokens in what the rollout
    holds once the plan is carried out: the notes so far plus, for a search, the passages its
    query fetched (what the summariser reads next); 0 for a malformed plan.

    Every search follows the planner call before it, so the k-th planner call launched the
    k-th search (a planner call past the last search answered, or was malformed)."""
    plan = parse_plan(call.output_text)
    if plan is None:
        return 0.0
    held = _notes_before(trajectory, call)
    k = len(_calls_until(trajectory, call, "planner"))
    state = trajectory.final_state if isinstance(trajectory.final_state, dict) else {}
    searches = state.get("searches") or []
    if plan[0] == "search" and k <= len(searches):
        held += [p["text"] for p in searches[k - 1]["passages"]]
    return recall(" ".join(held), task.get("answer"))


def notes_score(task: dict, call, trajectory) -> float:
    """Running score after a summariser call: share of the answer's tokens in the notes so far."""
    notes = [parse_field(c.output_text, "fact") for c in _calls_until(trajectory, call, call.role)]
    return recall(" ".join(notes), task.get("answer"))


def answer_score(task: dict, call, trajectory) -> float:
    """Running score after the answerer's call: F1 of its answer."""
    return f1(parse_field(call.output_text, "answer"), task.get("answer"))


TURN_REWARDS = {"planner": planner_score, "summariser": notes_score, "answerer": answer_score}

graph = trainable(build_graph(), roles=ROLES, policies=POLICIES, reward=f1_reward, turn_rewards=TURN_REWARDS)

graph_shared = trainable(build_graph(), roles=SHARED_ROLES, policies=SHARED_POLICIES,
                         reward=f1_reward, turn_rewards=TURN_REWARDS)

graph_separate = trainable(build_graph(), roles=SEPARATE_ROLES, policies=SEPARATE_POLICIES,
                           reward=f1_reward, turn_rewards=TURN_REWARDS)


if __name__ == "__main__":
    question = sys.argv[1] if len(sys.argv) > 1 else "In which town was the founder of Brindlecorp born?"
    result = graph.invoke({"question": question}, {"recursion_limit": 4 * MAX_TURNS + 4})
    print(*[s["query"] for s in result.get("searches", [])], *result.get("notes", []), result["prediction"], sep="\n")
