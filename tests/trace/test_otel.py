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


class _Span:
    def __init__(self):
        self.attributes, self.ended, self.status, self.exception = {}, False, None, None

    def set_attribute(self, key, value):
        self.attributes[key] = value

    def set_status(self, code, text):
        self.status = code

    def record_exception(self, exc):
        self.exception = exc

    def end(self):
        self.ended = True


def test_sync_and_async_chat_calls_are_traced_alike(monkeypatch):
    """Both wrappers: trace headers in, the span ended with token counts and the answer handed on;
    a failure ends the span as an error and still raises; outside a rollout, no span at all."""
    import asyncio
    from types import SimpleNamespace

    from opentelemetry.trace import StatusCode

    from mas_trainer.trace import attributes as A
    from mas_trainer.trace import instrument

    spans, answers = [], []
    ctx = instrument.CallContext("r1", "plan", "n1", "planner", on_result=lambda client, result: answers.append(result))
    in_rollout = [True]
    monkeypatch.setattr(instrument, "current_call", lambda: ctx if in_rollout[0] else None)
    monkeypatch.setattr(instrument, "_start_span", lambda call, kwargs: spans.append(_Span()) or spans[-1])
    monkeypatch.setattr(instrument, "_headers_for", lambda call, span: {"traceparent": "00-x"})

    def answer(fail, kwargs):
        if fail:
            raise ValueError("boom")
        return SimpleNamespace(usage=SimpleNamespace(prompt_tokens=3, completion_tokens=2), headers=kwargs.get("extra_headers"))

    class Sync:
        def create(self, fail=False, **kwargs):
            return answer(fail, kwargs)

    class Async:
        async def create(self, fail=False, **kwargs):
            return answer(fail, kwargs)

    sync, async_ = instrument._wrap_sync(Sync.create), instrument._wrap_async(Async.create)
    for call in (lambda **kw: sync(Sync(), **kw), lambda **kw: asyncio.run(async_(Async(), **kw))):
        spans.clear(), answers.clear()
        result = call()
        assert result.headers == {"traceparent": "00-x"} and answers == [result]
        assert spans[0].ended and spans[0].attributes == {A.GEN_AI_INPUT_TOKENS: 3, A.GEN_AI_OUTPUT_TOKENS: 2}
        with pytest.raises(ValueError, match="boom"):
            call(fail=True)
        assert spans[1].ended and spans[1].status == StatusCode.ERROR and str(spans[1].exception) == "boom"
        in_rollout[0] = False
        assert call().headers is None and len(spans) == 2 and len(answers) == 1
        in_rollout[0] = True
