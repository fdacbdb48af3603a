import pytest

from mas_trainer.trace import otel


def test_console_exporter_prints_spans(capsys):
    otel.configure("console")
    try:
        span = otel.get_tracer().start_span("node planner", attributes={"mas.kind": "node"})
        span.end()
        assert '"name": "node planner"' in capsys.readouterr().out
    finally:
        otel.configure("none")


def test_unknown_exporter_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown OTel exporter 'zipkin'; choose one of none, console, otlp"):
        otel.configure("zipkin")


def test_otlp_exporter_can_be_configured(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    provider = otel.configure("otlp")
    try:
        assert provider is not None
    finally:
        otel.configure("none")
