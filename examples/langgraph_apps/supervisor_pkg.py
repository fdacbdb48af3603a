"""A supervisor made by the ``langgraph-supervisor`` package over two LangChain agents.

Demonstrates: an app built only with LangChain's own constructors, left as its authors
would write it: two ``create_agent`` agents (langchain v1; ``create_react_agent`` from
``langgraph.prebuilt`` works the same) managed by ``create_supervisor``, compiled with an
``InMemorySaver`` checkpointer. Each agent is a compiled subgraph (``math_expert:model``,
``math_expert:tools``, ...), and the supervisor itself is one (``supervisor:agent``,
``supervisor:tools``). The policy map names the *agents*: every LLM call inside an agent
plays that agent's role and is served by its policy. Hand-offs are tool calls
(``transfer_to_math_expert``, ``transfer_to_research_expert``; an agent hands back with
``transfer_back_to_supervisor``, added by the package).

Roles -> policies: supervisor -> ``supervisor``, math_expert -> ``math``, research_expert
-> ``research`` (full separation).

During a rollout each run gets its own checkpointer thread, so rollouts never see each
other's messages.

Input: ``{"messages": [{"role": "user", "content": str}]}``; the answer is the last message.
Tasks: ``data/supervisor_pkg.jsonl`` (reference field ``answer``).
"""

import ast
import operator
import re

from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph_supervisor import create_supervisor

from mas_trainer import trainable

ROLES = {"supervisor": "supervisor", "math_expert": "math", "research_expert": "research"}
POLICIES = {"supervisor": "default", "math": "default", "research": "default"}

FACTS = [
    "Paris is the capital of France.",
    "Jupiter is the largest planet in the Solar System.",
    "Water boils at 100 degrees Celsius at sea level.",
    "The human heart has four chambers.",
    "Mount Everest is 8849 metres high.",
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


@tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with numbers, parentheses and + - * /, e.g. "(3 + 4) * 2"."""
    if len(expression) > 200:
        return "Error: expression too long"
    try:
        result = _evaluate(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"Error: {e}"
    return str(int(result)) if float(result).is_integer() else str(round(result, 6))


@tool
def lookup(query: str) -> str:
    """Look up facts about a topic in a small encyclopedia; returns the matching facts."""
    words = set(re.findall(r"[a-z0-9]+", query.lower()))
    hits = [f for f in FACTS if words & set(re.findall(r"[a-z0-9]+", f.lower()))]
    return "\n".join(hits[:2]) or "No facts found."


def _text(message) -> str:
    content = message.get("content", "") if isinstance(message, dict) else getattr(message, "content", "")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content or "")


def contains_answer(task: dict, final_state: dict, trajectory=None) -> float:
    """1.0 when the reference answer appears in the last message (case-insensitive)."""
    reference = str(task.get("answer", "")).strip().lower()
    messages = (final_state or {}).get("messages") or []
    return 1.0 if reference and messages and reference in _text(messages[-1]).lower() else 0.0


model = ChatOpenAI(model="gpt-4o-mini", temperature=0, max_tokens=128)

math_expert = create_agent(
    model,
    tools=[calculate],
    name="math_expert",
    system_prompt="You are a math expert. Use the calculate tool for arithmetic, then give the number.",
)
research_expert = create_agent(
    model,
    tools=[lookup],
    name="research_expert",
    system_prompt="You are a researcher. Use the lookup tool to find facts, then answer in one sentence.",
)

supervisor = create_supervisor(
    [math_expert, research_expert],
    model=model,
    prompt=(
        "You manage a math expert and a research expert. Hand arithmetic to math_expert and "
        "questions about facts to research_expert, then give the user the final answer."
    ),
).compile(checkpointer=InMemorySaver())

graph = trainable(supervisor, roles=ROLES, policies=POLICIES, reward=contains_answer)


if __name__ == "__main__":
    result = graph.invoke(
        {"messages": [{"role": "user", "content": "What is 17 * 23?"}]},
        {"configurable": {"thread_id": "demo"}},
    )
    print(result["messages"][-1].content)
