"""Tracing: trajectory schema, span attribute names, the OTel provider, OpenAI instrumentation.

Importing this package is cheap: the schema's names load ``trace.schema`` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_trainer._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.trace.schema import SCHEMA_VERSION, LLMCall, NodeCall, Rewards, ToolCall, Trajectory

__all__ = ["SCHEMA_VERSION", "Trajectory", "NodeCall", "LLMCall", "ToolCall", "Rewards"]

__getattr__ = lazy_exports(__name__, {"mas_trainer.trace.schema": ["SCHEMA_VERSION", "Trajectory", "NodeCall", "LLMCall", "ToolCall", "Rewards"]})
