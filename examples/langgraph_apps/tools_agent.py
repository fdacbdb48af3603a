"""A tool-calling agent: ``ChatOpenAI(...).bind_tools([calculator])`` and ``ToolNode``.

Demonstrates: tool calls (the ``tools`` node runs the tool and makes no LLM call, so only
``agent`` is a role), a ``MessagesState`` graph whose input is chat messages, and a loop
agent -> tools -> agent bounded to ``MAX_TURNS`` agent turns (it also stops when a reply has
malformed tool-call arguments, which the ``ToolNode`` would leave unanswered). ``trainable`` wraps the
compiled graph.

The calculator evaluates arithmetic safely (an AST walk over numbers and + - * / // % **,
with bounds on size), and returns an error string instead of raising on bad input; the
``ToolNode`` turns bad arguments or an unknown tool name into an error ``ToolMessage``.

Input: ``{"messages": [{"role": "user", "content": str}]}``; the result is the last message.
Tasks: ``data/tools_agent.jsonl`` (reference field ``answer``).
"""

import ast
import operator

from langchain_core.messages import SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from mas_trainer import trainable

MAX_TURNS = 3
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100

ROLES = {"agent": "agent"}
POLICIES = {"agent": "default"}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError("exponent too large")
        result = _BINARY[type(node.op)](left, right)
        if abs(result) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return result
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, parentheses and + - * / // % **, e.g. "(3 + 4) * 2"."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return "Error: expression too long"
    try:
        result = _evaluate(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
        return f"Error: {e}"
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


SYSTEM_PROMPT = (
    "You are a helpful assistant. Use the calculator tool for any arithmetic, "
    "then state the final numeric answer."
)

llm = ChatOpenAI(model="gpt-4o-mini", temperature=0, max_tokens=256).bind_tools([calculator])


class State(MessagesState):
    turns: int


def _text(message) -> str:
    if isinstance(message, dict):
        content = message.get("content", "")
    else:
        content = getattr(message, "content", "")
    if isinstance(content, list):
        content = " ".join(
            part.get("text", "") if isinstance(part, dict) else str(part) for part in content
        )
    return str(content or "")


def contains_answer(task: dict, final_state: dict, trajectory=None) -> float:
    """1.0 when the reference answer appears in the last message (case-insensitive)."""
    reference = str(task.get("answer", "")).strip().lower()
    messages = (final_state or {}).get("messages") or []
    last = _text(messages[-1]).lower() if messages else ""
    return 1.0 if reference and reference in last else 0.0


def agent(state: State) -> dict:
    reply = llm.invoke([SystemMessage(SYSTEM_PROMPT), *state["messages"]])
    return {"messages": [reply], "turns": state.get("turns", 0) + 1}


def route_after_agent(state: State) -> str:
    if state.get("turns", 0) >= MAX_TURNS:
        return END
    last = state["messages"][-1]
    if getattr(last, "invalid_tool_calls", None):
        # Malformed tool-call arguments: stop rather than send calls nobody answered.
        return END
    return "tools" if getattr(last, "tool_calls", None) else END


builder = StateGraph(State)
builder.add_node("agent", agent)
builder.add_node("tools", ToolNode([calculator]))
builder.add_edge(START, "agent")
builder.add_conditional_edges("agent", route_after_agent, ["tools", END])
builder.add_edge("tools", "agent")

graph = trainable(builder.compile(), roles=ROLES, policies=POLICIES, reward=contains_answer)


if __name__ == "__main__":
    result = graph.invoke({"messages": [{"role": "user", "content": "What is 17 * 23?"}]})
    print(result["messages"][-1].content)
