"""A swarm made by the ``langgraph-swarm`` package: two agents that hand the user to each other.

Demonstrates: ``create_swarm`` over two ``create_agent`` agents (langchain v1), compiled
with an ``InMemorySaver`` checkpointer, as the package's README builds it. There is no
central router: the active agent answers, and hands the conversation over with a tool call
made by ``create_handoff_tool`` (``transfer_to_math_expert`` / ``transfer_to_concierge``);
the swarm remembers the active agent in its state (``active_agent``).

Roles -> policies: concierge -> ``concierge``, math_expert -> ``math``. Both agents are
compiled subgraphs (``concierge:model``, ``concierge:tools``, ...): naming the agent routes
every LLM call inside it to its policy.

During a rollout each run gets its own checkpointer thread, so every rollout starts with
the default active agent (``concierge``) and an empty history.

Input: ``{"messages": [{"role": "user", "content": str}]}``; the answer is the last message.
Tasks: ``data/swarm_pkg.jsonl`` (reference field ``answer``).
"""

from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph_swarm import create_handoff_tool, create_swarm

from mas_trainer import trainable

ROLES = {"concierge": "concierge", "math_expert": "math"}
POLICIES = {"concierge": "default", "math": "default"}

UNITS = {"km": 1000.0, "m": 1.0, "cm": 0.01, "mile": 1609.344, "ft": 0.3048}


@tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


@tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@tool
def convert_length(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length between units: km, m, cm, mile, ft."""
    if from_unit not in UNITS or to_unit not in UNITS:
        return f"Error: units must be among {', '.join(UNITS)}"
    result = value * UNITS[from_unit] / UNITS[to_unit]
    return f"{round(result, 3):g} {to_unit}"


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

concierge = create_agent(
    model,
    tools=[
        convert_length,
        create_handoff_tool(agent_name="math_expert", description="Transfer to math_expert for arithmetic."),
    ],
    name="concierge",
    system_prompt="You are a concierge. Convert units yourself; transfer arithmetic to math_expert.",
)
math_expert = create_agent(
    model,
    tools=[
        add,
        multiply,
        create_handoff_tool(agent_name="concierge", description="Transfer to concierge for anything but arithmetic."),
    ],
    name="math_expert",
    system_prompt="You are a math expert. Use add and multiply, then state the number.",
)

swarm = create_swarm([concierge, math_expert], default_active_agent="concierge").compile(checkpointer=InMemorySaver())

graph = trainable(swarm, roles=ROLES, policies=POLICIES, reward=contains_answer)


if __name__ == "__main__":
    result = graph.invoke(
        {"messages": [{"role": "user", "content": "What is 12 times 7?"}]},
        {"configurable": {"thread_id": "demo"}},
    )
    print(result["messages"][-1].content)
