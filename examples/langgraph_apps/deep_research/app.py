"""A deep agent (deepagents) that answers questions about invented observatories by delegating.

    lead --task--> researcher (its `lookup` tool reads records.jsonl)
         --task--> critic     (checks the draft answer against what the researcher found)

The main agent, "lead", has no tool that knows the facts: only the researcher's `lookup` does,
so the lead answers right only when it hands the question to the researcher and uses what
comes back. deepagents adds a third sub-agent, "general-purpose", with the lead's tools.
Every agent is `model="openai:gpt-4o-mini"`, as a user writes it: deepagents builds it with
`init_chat_model`, and its OpenAI profile turns the Responses API on, so in a rollout the
calls go to the gateway's `/v1/responses` (it reads `OPENAI_BASE_URL`).

Roles are the agents' names (docs/agents.md): the lead, the researcher and the critic each on
a policy of its own; general-purpose shares the lead's.

Rewards, all computed from the task's `answer` and `entity` (the data file's, which no agent
can write):
- trajectory: 1.0 when the lead's final reply contains the answer;
- lead: 1.0 when it sent the researcher a task naming the observatory asked about;
- researcher: 1.0 when it called `lookup` with a name that finds that observatory's record;
- critic: 1.0 when its reply states the answer (it confirmed or corrected the draft).
With the default `broadcast` allocator each agent's calls get the trajectory reward plus its own.

Input: `{"messages": [{"role": "user", "content": question}]}`; tasks in `train.jsonl` and
`heldout.jsonl` next to this file, written with the records by `make_data.py`.
"""

from __future__ import annotations

import difflib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from deepagents import create_deep_agent
from langchain_core.tools import tool

from mas_trainer import trainable

HERE = Path(__file__).resolve().parent
MODEL = "openai:gpt-4o-mini"

ROLES = {"lead": "lead", "researcher": "research", "critic": "critic", "general-purpose": "lead"}
POLICIES = {"lead": "default", "research": "default", "critic": "default"}


@lru_cache(maxsize=1)
def _records() -> dict[str, dict]:
    rows = (json.loads(line) for line in (HERE / "records.jsonl").read_text().splitlines() if line.strip())
    return {_stem(r["name"]): r for r in rows}


def _stem(name: str) -> str:
    return normalise(name).removesuffix("observatory").strip()


def find_record(name: str) -> dict | None:
    """The record whose name is closest to `name` ("Observatory" optional; case and small misspellings
    forgiven), else None."""
    match = difflib.get_close_matches(_stem(name), list(_records()), n=1, cutoff=0.8)
    return _records()[match[0]] if match else None


@tool
def lookup(name: str) -> str:
    """Look up an observatory by its name: the town it is in, the year it was founded, who directs it."""
    rec = find_record(name)
    if rec is None:
        return f"No observatory named {name!r} is on record."
    return f"{rec['name']}: in the town of {rec['town']}, founded in {rec['founded']}, directed by {rec['director']}."


SUBAGENTS: list[Any] = [
    {"name": "researcher", "model": MODEL, "tools": [lookup],
     "description": "Finds facts about an observatory in the records. Give it the observatory's name.",
     "system_prompt": "You research observatories. Call `lookup` with the observatory's name, then reply with "
                      "the facts it returned, word for word."},
    {"name": "critic", "model": MODEL, "tools": [],
     "description": "Checks a draft answer against the facts found. Give it the question, the facts and the draft.",
     "system_prompt": "You check answers. Given a question, the facts found and a draft answer, reply with the "
                      "correct answer in a few words, taken from the facts."},
]

LEAD_PROMPT = ("You answer questions about observatories. You do not know them: ask the researcher for the "
               "observatory's facts, have the critic check your draft, then reply with the answer in a few words.")


def build(middleware: Sequence[Any] = (), subagent_middleware: Mapping[str, Sequence[Any]] | None = None) -> Any:
    """The app, decorated. `middleware` goes to the main agent (the tests force its delegation with one),
    `subagent_middleware` to the sub-agents by name (the scripted teacher of demos.py answers for all three)."""
    extra = dict(subagent_middleware or {})
    if unknown := set(extra) - {s["name"] for s in SUBAGENTS}:
        raise ValueError(f"subagent_middleware: no sub-agent named {sorted(unknown)}; they are {[s['name'] for s in SUBAGENTS]}")
    subagents = [{**s, "middleware": list(extra[s["name"]])} if s["name"] in extra else s for s in SUBAGENTS]
    agent = create_deep_agent(model=MODEL, tools=[], system_prompt=LEAD_PROMPT, subagents=subagents,
                              middleware=list(middleware), name="lead")
    return trainable(agent, roles=ROLES, policies=POLICIES, reward=answered_right,
                     role_rewards={"lead": asked_the_researcher, "researcher": looked_it_up, "critic": confirmed})


# ----- rewards -------------------------------------------------------------------------------


def normalise(text: Any) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", str(text or "")).lower().split())


def _states(text: Any, answer: str) -> bool:
    return f" {normalise(answer)} " in f" {normalise(text)} "


def _tool_calls(calls: Sequence[Any], name: str) -> list[dict]:
    """The arguments of the `name` tool calls the model itself wrote in `calls` (unparseable ones: {})."""
    out = []
    for call in calls:
        for tc in call.tool_calls:
            fn = tc.get("function") or {}
            if fn.get("name") == name:
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except json.JSONDecodeError:
                    args = {}
                out.append(args if isinstance(args, dict) else {})
    return out


def _text(message: Any) -> str:
    """A message's text, whether a LangChain message or its dict, its content a string or Responses API blocks."""
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", "")
    if isinstance(content, list):
        return " ".join(b if isinstance(b, str) else str(b.get("text", "")) for b in content)
    return str(content or "")


def answered_right(task: dict, state: dict, trajectory: Any = None) -> float:
    messages = (state or {}).get("messages") or []
    return float(bool(messages) and _states(_text(messages[-1]), task["answer"]))


def asked_the_researcher(task: dict, calls: Sequence[Any], trajectory: Any = None) -> float:
    stem = task["entity"].removesuffix(" Observatory")
    return float(any(args.get("subagent_type") == "researcher" and _states(args.get("description"), stem)
                     for args in _tool_calls(calls, "task")))


def looked_it_up(task: dict, calls: Sequence[Any], trajectory: Any = None) -> float:
    found = (find_record(str(args.get("name", ""))) for args in _tool_calls(calls, "lookup"))
    return float(any(rec is not None and rec["name"] == task["entity"] for rec in found))


def confirmed(task: dict, calls: Sequence[Any], trajectory: Any = None) -> float:
    return float(bool(calls) and _states(calls[-1].output_text, task["answer"]))


graph = build()
