"""The project's OpenTelemetry tracer provider.

A private provider (not the global one) so tracing a rollout never changes what the
user's own OTel set-up exports; any exporter can still be attached to it.
"""

from __future__ import annotations

import os
import sys
import threading

from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

__all__ = ["configure", "get_tracer", "add_span_processor", "EXPORTERS"]

EXPORTERS = ("none", "console", "otlp")
_lock = threading.Lock()
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None


def configure(exporter: str | None = None) -> TracerProvider:
    """(Re)build the provider. `exporter`: none | console | otlp (default: $MAS_TRAINER_OTEL_EXPORTER).

    otlp uses the standard OTEL_EXPORTER_OTLP_* variables for its endpoint and headers.
    """
    global _provider, _tracer
    exporter = (exporter or os.environ.get("MAS_TRAINER_OTEL_EXPORTER") or "none").lower()
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown OTel exporter {exporter!r}; choose one of {', '.join(EXPORTERS)}")
    provider = TracerProvider()
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # optional extra
            raise ValueError("the otlp exporter needs `pip install mas-trainer[otlp]`") from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    with _lock:
        old, _provider = _provider, provider
        _tracer = provider.get_tracer("mas_trainer")
    if old is not None:
        old.shutdown()
    return provider


def _get_provider() -> TracerProvider:
    with _lock:
        provider = _provider
    return provider if provider is not None else configure()


def get_tracer() -> trace.Tracer:
    """The project's tracer (cached: it is asked for on every node and LLM call)."""
    tracer = _tracer
    if tracer is None:
        configure()
        tracer = _tracer
    return tracer  # type: ignore[return-value]


def add_span_processor(processor: SpanProcessor) -> None:
    _get_provider().add_span_processor(processor)
