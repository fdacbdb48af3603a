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
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

__all__ = ["configure", "get_tracer", "add_span_processor", "EXPORTERS"]

EXPORTERS = ("none", "console", "otlp")
_lock = threading.Lock()
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None


class _RecordWhileExported(Sampler):
    """Record spans only while something consumes them.

    With no exporter or processor attached, spans are non-recording: they still carry ids
    (node call and LLM call ids, `traceparent`) but skip the SDK's attribute and event
    bookkeeping, which would otherwise be most of the tracing overhead per call.
    """

    def __init__(self) -> None:
        self.recording = False

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):  # type: ignore[no-untyped-def]
        if self.recording:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return SamplingResult(Decision.DROP)

    def get_description(self) -> str:
        return "RecordWhileExported"


def configure(exporter: str | None = None) -> TracerProvider:
    """(Re)build the provider. `exporter`: none | console | otlp (default: $MAS_TRAINER_OTEL_EXPORTER).

    otlp uses the standard OTEL_EXPORTER_OTLP_* variables for its endpoint and headers.
    """
    global _provider, _tracer
    exporter = (exporter or os.environ.get("MAS_TRAINER_OTEL_EXPORTER") or "none").lower()
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown OTel exporter {exporter!r}; choose one of {', '.join(EXPORTERS)}")
    sampler = _RecordWhileExported()
    sampler.recording = exporter != "none"
    provider = TracerProvider(sampler=sampler)
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # optional extra
            raise ValueError("the otlp exporter needs the otlp extra: pip install -c mas-trainer/constraints.txt './mas-trainer[otlp]' (from a checkout, as the README's Install section)") from exc
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
    """Attach any processor/exporter; spans are recorded from then on."""
    provider = _get_provider()
    provider.add_span_processor(processor)
    if isinstance(provider.sampler, _RecordWhileExported):
        provider.sampler.recording = True
