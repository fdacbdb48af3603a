"""Demonstrations for a warm start: the deep research app run by a scripted teacher that delegates well.

    python examples/langgraph_apps/deep_research/demos.py [--data train.jsonl] [--out sft.jsonl]

The bundled SmolLM2-135M never delegates (docs/agents.md), so every rollout scores 0 and GRPO has
nothing to learn from. Here the app itself runs (deepagents' real prompts, tools and sub-agent
plumbing), but each agent's model call is answered by `Teacher`, a middleware that writes what a
good agent would and never calls the model: the lead hands the question to the researcher, the
researcher calls `lookup` and reports its facts word for word, the lead drafts the answer from
them and has the critic check it, the critic states the answer, the lead replies with it. The
teacher reads only what each agent was given, never the task's answer. Every call the teacher answers
becomes one line of the warm start's format (docs/training.md, "Warm start";
`mas_trainer.production.curate.SFTLine`): the messages and tools as the model was asked, the
teacher's reply as the completion, the policy the app maps the agent to. A task whose run does
not earn the app's trajectory reward is refused: the demos teach only what the reward pays for.

Messages are written in the chat-completions form (`convert_to_openai_messages`): the gateway turns
a Responses API request into the same chat messages before its chat template renders them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage, convert_to_openai_messages
from langchain_core.utils.function_calling import convert_to_openai_tool

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


NAME = re.compile(r"[A-Z]\w+ Observatory")
FACTS = re.compile(r"in the town of (?P<town>[^,]+), founded in (?P<founded>\d+), directed by (?P<director>[^.]+)\.")
ASKED = {"In which town": "town", "In which year": "founded", "Who directs": "director"}  # make_data.py's questions


def _call(ids: Iterator[int], tool: str, **args: str) -> dict[str, Any]:
    return {"name": tool, "args": args, "id": f"call_{next(ids):024d}", "type": "tool_call"}


class Teacher(AgentMiddleware):
    """Answers every model call of one agent with what a good agent writes, and files the call.

    It reads only the conversation the model was given, as the model would: never the task's
    answer (the run is scored against that afterwards)."""

    def __init__(self, agent: str, filed: list[dict], ids: Iterator[int]) -> None:
        super().__init__()
        self.agent, self.filed, self.ids = agent, filed, ids

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> ModelResponse:
        reply = {"lead": self._lead, "researcher": self._researcher, "critic": self._critic}[self.agent](request.messages)
        asked = [request.system_message, *request.messages] if request.system_message is not None else request.messages
        self.filed.append({"agent": self.agent, "messages": convert_to_openai_messages(asked),
                           "tools": [convert_to_openai_tool(t) for t in request.tools] or None,
                           "completion": convert_to_openai_messages(reply)})
        return ModelResponse(result=[reply])  # the model is never called

    def _lead(self, messages: list) -> AIMessage:
        question = next(m.text for m in messages if isinstance(m, HumanMessage))
        results = [m.text for m in messages if isinstance(m, ToolMessage)]
        if not results:
            entity = _found(NAME, question, "an observatory's name in the question")
            return AIMessage(content="", tool_calls=[_call(self.ids, "task", description=f"Find the facts about {entity[0]}.",
                                                           subagent_type="researcher")])
        if len(results) == 1:
            kind = next((k for prefix, k in ASKED.items() if question.startswith(prefix)), None)
            if kind is None:
                raise ValueError(f"the teacher does not know how to answer {question!r}")
            draft = _found(FACTS, results[0], "the researcher's facts")[kind]
            return AIMessage(content="", tool_calls=[_call(
                self.ids, "task", subagent_type="critic", description=f"Question: {question}\nFacts: {results[0]}\nDraft answer: {draft}")])
        return AIMessage(content=results[-1])  # the critic's checked answer

    def _researcher(self, messages: list) -> AIMessage:
        found = [m.text for m in messages if isinstance(m, ToolMessage)]
        if found:
            return AIMessage(content=found[-1])
        name = _found(NAME, messages[0].text, "an observatory's name in the lead's task")
        return AIMessage(content="", tool_calls=[_call(self.ids, "lookup", name=name[0])])

    def _critic(self, messages: list) -> AIMessage:
        asked = messages[0].text
        draft = asked.rsplit("Draft answer:", 1)[1].strip() if "Draft answer:" in asked else ""
        facts = FACTS.search(asked)
        return AIMessage(content=draft if facts is not None and draft in facts.groupdict().values() else "I cannot confirm it.")


def _found(pattern: re.Pattern[str], text: str, what: str) -> re.Match[str]:
    match = pattern.search(text)
    if match is None:
        raise ValueError(f"the teacher found no {what} in {text[:120]!r}")
    return match


def demos(tasks: list[dict], *, log: Callable[[str], None] = print) -> list[dict]:
    """The warm start's lines for `tasks` (the app's task format with `answer`), in order. Raises
    RuntimeError for a task whose teacher-run does not earn the app's trajectory reward."""
    os.environ.setdefault("OPENAI_API_KEY", "unused")  # init_chat_model wants one; the teacher never calls the model
    from deep_research import app
    from mas_trainer.production.curate import SFTLine

    lines: list[dict] = []
    for task in tasks:
        filed: list[dict] = []
        ids = itertools.count(1)  # tool-call ids as deterministic as the rest of a demo
        teacher = {a: Teacher(a, filed, ids) for a in ("lead", "researcher", "critic")}
        graph = app.build([teacher["lead"]], {"researcher": [teacher["researcher"]], "critic": [teacher["critic"]]})
        state = graph.invoke({"messages": task["messages"]}, config={"recursion_limit": 50})
        if app.answered_right(task, state) != 1.0:
            raise RuntimeError(f"task {task.get('id')}: the teacher's run did not earn the trajectory reward")
        run_id = uuid.uuid5(uuid.NAMESPACE_URL, f"deep_research/{task.get('id')}").hex
        for call in filed:
            lines.append(SFTLine(policy=app.ROLES[call["agent"]], role=call["agent"], node="model", run_id=run_id,
                                 score=1.0, messages=call["messages"], tools=call["tools"],
                                 completion=call["completion"]).model_dump(exclude_none=True))
        log(f"{task.get('id')}: {len(filed)} turns ({', '.join(c['agent'] for c in filed)})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE / "train.jsonl", help="tasks (default: train.jsonl)")
    parser.add_argument("--out", type=Path, default=Path("sft.jsonl"), help="the warm start's JSON lines (--warm-start FILE)")
    args = parser.parse_args(argv)
    tasks = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    lines = demos(tasks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{len(lines)} turns of {len(tasks)} tasks -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
