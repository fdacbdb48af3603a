"""Span attribute and baggage names.

GenAI semantic-convention names where one exists; the project's own under ``mas.``.
Kept in one module so exporters, the gateway and the assembler agree.
"""

__all__ = [
    "GEN_AI_OPERATION", "GEN_AI_PROVIDER", "GEN_AI_REQUEST_MODEL", "GEN_AI_AGENT_NAME", "GEN_AI_TOOL_NAME",
    "GEN_AI_TOOL_CALL_ID", "GEN_AI_INPUT_TOKENS", "GEN_AI_OUTPUT_TOKENS",
    "ROLLOUT_ID", "NODE", "NODE_CALL_ID", "STEP", "PARENT_NODE_CALL_ID", "ROLE", "POLICY",
    "ATTEMPT", "CHECKPOINT_NS", "BRANCH", "KIND",
    "BAGGAGE_ROLLOUT", "BAGGAGE_NODE", "BAGGAGE_NODE_CALL", "BAGGAGE_ROLE", "BAGGAGE_BRANCH",
]

GEN_AI_OPERATION = "gen_ai.operation.name"  # "chat", "execute_tool", "invoke_agent"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

KIND = "mas.kind"  # "rollout" | "node" | "llm" | "tool"
ROLLOUT_ID = "mas.rollout_id"
NODE = "mas.node"
NODE_CALL_ID = "mas.node_call_id"
PARENT_NODE_CALL_ID = "mas.parent_node_call_id"
STEP = "mas.step"
ATTEMPT = "mas.attempt"
CHECKPOINT_NS = "mas.checkpoint_ns"
BRANCH = "mas.branch"  # what the node call is in its rollout, the same in every run of it (see BAGGAGE_BRANCH)
ROLE = "mas.role"
POLICY = "mas.policy"

# W3C baggage keys the OpenAI instrumentation sets and the gateway routes on.
BAGGAGE_ROLLOUT = "mas.rollout"
BAGGAGE_NODE = "mas.node"
BAGGAGE_NODE_CALL = "mas.node_call"
BAGGAGE_ROLE = "mas.role"
# The node call's identity in its rollout, from what the graph decided rather than when it ran
# (LangGraph: superstep and task path, a `Send`'s index among the step's sends, the retry
# attempt, the enclosing node call's for subgraphs): the gateway derives sampling seeds from it.
BAGGAGE_BRANCH = "mas.branch"
