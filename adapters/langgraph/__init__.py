"""LangGraph adapter: the `@trainable` decorator, the tracer and the app runner."""

from .runner import LangGraphApp
from .tracer import GraphTracer
from .trainable import as_graph, node_names, spec_of, trainable

__all__ = ["trainable", "spec_of", "as_graph", "node_names", "GraphTracer", "LangGraphApp"]
