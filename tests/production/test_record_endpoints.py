"""serve --record over HTTP: a redaction hook that exits fails one request, not the server;
feedback past its bounds or with a score that is not a number gets a 4xx saying why."""

import logging

import httpx
import pytest

from mas_trainer.engines.fake import FakeChatFormat, FakeEngine
from mas_trainer.gateway import Gateway, GatewayServer, PolicyBackend, Router
from mas_trainer.production.record import FEEDBACK_PER_RUN, Recorder, read_runs

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def recording(tmp_path):
    gw = Gateway(Router(model_routes={"m": "p"}))
    gw.add_policy("p", PolicyBackend(FakeEngine(model_name="fake", latency_s=0.0, reply="hello"), FakeChatFormat()))
    gw.recorder = Recorder(tmp_path, file_mb=4 / 1024, max_mb=16 / 1024, redact=lambda s: s)
    with GatewayServer(gw) as server:
        yield server, gw


def chat(server):
    r = httpx.post(f"{server.base_url}/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 200, r.text
    return r.headers["x-mas-run-id"]


def test_a_hook_that_exits_fails_its_request_and_the_server_goes_on(recording, caplog):
    server, gw = recording
    recorder = gw.recorder
    kept = chat(server)

    def hook(s):
        raise SystemExit(3)

    recorder.redact = hook
    with caplog.at_level(logging.ERROR):
        lost = chat(server)  # answered, not recorded
        r = httpx.post(f"{server.base_url}/runs", json={"run_id": kept, "input": "x"}, timeout=10)
        assert r.status_code == 422 and r.json()["error"]["code"] == "redaction_failed"
        assert "\n" not in r.json()["error"]["message"]
        r = httpx.post(f"{server.base_url}/feedback", json={"run_id": kept, "label": "x"}, timeout=10)
        assert r.status_code == 422 and r.json()["error"]["code"] == "redaction_failed"
        chat(server)
    assert "redaction hook failed (SystemExit: 3)" in caplog.text
    recorder.redact = None
    assert httpx.post(f"{server.base_url}/runs", json={"run_id": kept, "input": "x"}, timeout=10).status_code == 200
    assert [t.rollout_id for t, _ in read_runs(recorder.folder)] == [kept] and lost != kept


def test_feedback_bounds_and_scores_over_http(recording, tmp_path):
    server, gw = recording
    runs = [chat(server) for _ in range(10)]

    def post(run_id, **fb):
        return httpx.post(f"{server.base_url}/feedback", json={"run_id": run_id, **fb}, timeout=10)

    for score in ("1", True, "NaN"):
        r = post(runs[0], score=score)
        assert r.status_code == 422 and r.json()["error"]["message"].startswith("score: Input should be a"), r.text
    flood = [post(runs[0], score=1) for _ in range(120)]  # 4 KiB of feedback in all (16 KiB of runs)
    assert sorted(t.rollout_id for t, _ in read_runs(gw.recorder.folder)) == sorted(runs)  # no run evicted
    assert {r.status_code for r in flood} == {200, 507}
    assert flood[-1].json()["error"]["code"] == "feedback_full" and "1/4 of --record-max-mb" in flood[-1].json()["error"]["message"]
    gw.recorder = Recorder(tmp_path / "big", file_mb=1, max_mb=1)
    run_id = chat(server)
    answers = [post(run_id, score=1).status_code for _ in range(FEEDBACK_PER_RUN + 1)]
    assert answers == [200] * FEEDBACK_PER_RUN + [409]
    r = post(run_id, label="more")
    assert r.json()["error"]["code"] == "feedback_limit"
    assert f"at most {FEEDBACK_PER_RUN} feedback entries and 64 KiB of them are kept per run" in r.json()["error"]["message"]
