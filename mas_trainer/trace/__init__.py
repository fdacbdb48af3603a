"""Tracing: trajectory schema, span attribute names, the OTel provider, OpenAI instrumentation."""

from .schema import SCHEMA_VERSION, LLMCall, NodeCall, Rewards, ToolCall, Trajectory

__all__ = ["SCHEMA_VERSION", "Trajectory", "NodeCall", "LLMCall", "ToolCall", "Rewards"]
