"""`import-traces --listen` under load and attack: one POST's mapping and writing delay no other's
intake; the record folder is read once; idle traces are written on a timer and held spans are
bounded in bytes; connections, idle time and bytes in flight are bounded; a key, 127.0.0.1 by
default, and SIGTERM writes what is held. Every wait here is bounded."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from test_import_traces import T1, T2, openllmetry_trace, request, semconv_trace

import mas_trainer.production.otel_import as oi
from mas_trainer.production.otel_import import ListenLimits, Receiver
from mas_trainer.production.record import read_runs

ROOT = Path(__file__).resolve().parents[2]


def post(url: str, body: bytes, timeout: float = 10, **headers: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json", **headers}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def until(check: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[Callable[..., tuple[Receiver, Any]]]:
    started: list[tuple[Receiver, Any]] = []

    def start(**limits: Any) -> tuple[Receiver, Any]:
        receiver = Receiver(tmp_path / "rec", limits=ListenLimits(**{"close_wait_s": 1.0, **limits}))
        server = receiver.server("127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append((receiver, server))
        return receiver, server

    yield start
    for receiver, server in started:
        server.shutdown()
        server.server_close()
        receiver.close()


def raw(url: str) -> socket.socket:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def closed_by_server(sock: socket.socket, within: float = 10.0) -> bool:
    """True when the server closed it (EOF, or a reset) within the time; False if still open."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_post_being_written_does_not_hold_up_other_posts(listening: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mapping and writing of one POST's traces ran under the lock every POST takes."""
    entered, release = threading.Event(), threading.Event()
    write_runs = oi._write_runs

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(20)
        return write_runs(*args, **kwargs)

    monkeypatch.setattr(oi, "_write_runs", slow_write)
    url = listening()[1].url
    first: list[Any] = []
    writer = threading.Thread(target=lambda: first.append(post(url, json.dumps(request(*semconv_trace())).encode(), 30)))
    writer.start()
    try:
        assert entered.wait(10)
        start = time.monotonic()
        assert post(url, json.dumps(request(*openllmetry_trace()[1:])).encode(), timeout=10) == (200, {})  # no root: held
        assert time.monotonic() - start < 5
    finally:
        release.set()
        writer.join(30)
    assert first == [(200, {})]


def test_the_record_folder_is_read_once(tmp_path: Path, listening: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write built a Recorder, which reads every file of the folder."""
    opened: list[Path] = []

    class Counted(oi.Recorder):
        def __init__(self, folder: Any, **kwargs: Any) -> None:
            opened.append(Path(folder))
            super().__init__(folder, **kwargs)

    monkeypatch.setattr(oi, "Recorder", Counted)
    url = listening()[1].url
    for trace in ("1" * 32, "2" * 32, "3" * 32):
        assert post(url, json.dumps(request(*semconv_trace(trace))).encode())[0] == 200
    assert len(list(read_runs(tmp_path / "rec"))) == 3 and len(opened) == 1


def test_an_idle_trace_is_written_without_another_post(tmp_path: Path, listening: Any) -> None:
    url = listening(idle_s=0.2, flush_every_s=0.05)[1].url
    assert post(url, json.dumps(request(*semconv_trace()[1:])).encode()) == (200, {})  # no root
    assert until(lambda: [t.rollout_id for t, _ in read_runs(tmp_path / "rec")] == [T1])


def test_held_spans_are_bounded_in_bytes(tmp_path: Path) -> None:
    first, second = semconv_trace()[1:], openllmetry_trace()[1:]  # no roots: held
    size = lambda spans: sum(oi._span_bytes(oi._span(s)) for s in spans)  # noqa: E731
    receiver = Receiver(tmp_path / "rec", limits=ListenLimits(max_held_bytes=size(first) + size(second) - 1))
    assert receiver.accept(json.dumps(request(*first)).encode(), "application/json") == (200, {})
    assert list(read_runs(tmp_path / "rec")) == []
    assert receiver.accept(json.dumps(request(*second)).encode(), "application/json") == (200, {})
    assert [t.rollout_id for t, _ in read_runs(tmp_path / "rec")] == [T1]  # the least recently sent went first
    assert receiver.close().runs == 2


def test_connections_are_bounded_and_idle_ones_closed(listening: Any) -> None:
    before = threading.active_count()
    server = listening(max_connections=4, idle_timeout_s=30)[1]
    idle = [raw(server.url) for _ in range(20)]  # each new one closes the oldest idle one: never more than 4 threads
    try:
        assert all(closed_by_server(s) for s in idle[:16])
        assert until(lambda: threading.active_count() <= before + 2 + 4)  # + the accepting thread and the timer
        # four connections in the middle of a request are not closed for a fifth: it gets a 503
        for s in idle[16:]:
            s.sendall(b"POST /v1/traces HTTP/1.1\r\nhost: x\r\n")
        assert until(lambda: sum(server.conns.values()) == 4)
        fifth = raw(server.url)
        assert fifth.recv(200).startswith(b"HTTP/1.1 503")
        fifth.close()
    finally:
        for s in idle:
            s.close()


def test_idle_and_slow_connections_are_closed(listening: Any) -> None:
    server = listening(idle_timeout_s=0.3, read_timeout_s=0.6)[1]
    assert closed_by_server(raw(server.url))
    slow = raw(server.url)
    slow.sendall(b"POST /v1/traces HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
    start, got = time.monotonic(), b""
    slow.settimeout(0.1)
    while time.monotonic() - start < 10:  # a byte every 0.1 s does not keep it open past read_timeout_s
        try:
            chunk = slow.recv(4096)
        except TimeoutError:
            slow.sendall(b" ")
            continue
        if not chunk:
            break
        got += chunk
    assert got.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 5
    # a keep-alive connection serves several requests
    keep = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    body = json.dumps(request(*openllmetry_trace())).encode()
    for _ in range(2):
        keep.request("POST", "/v1/traces", body, {"content-type": "application/json"})
        assert keep.getresponse().read() == b"{}"
    keep.close()


def test_bytes_in_flight_are_bounded(listening: Any) -> None:
    body = json.dumps(request(*openllmetry_trace())).encode()
    receiver, server = listening(max_inflight_bytes=len(body) + 100)
    url = server.url
    stalled = raw(url)  # a body declared, not sent: its bytes are counted until it ends
    stalled.sendall(b"POST /v1/traces HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n{" % len(body))
    assert until(lambda: receiver._inflight == len(body))
    assert post(url, body)[0] == 503
    stalled.close()
    assert until(lambda: post(url, body)[0] == 200)
    bomb = gzip.compress(b" " * (2 * 2**20))  # a gzip body counts unpacked
    status, answer = post(url, bomb, **{"content-encoding": "gzip"})
    assert status == 503 and "retry" in answer["error"]


def test_a_gzip_body_may_not_unpack_past_the_body_bound(listening: Any) -> None:
    url = listening(max_body_bytes=2**20)[1].url
    assert post(url, gzip.compress(b" " * (3 * 2**20)), **{"content-encoding": "gzip"})[0] == 413


def test_listen_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mas_trainer.cli import main

    rec, f = str(tmp_path / "rec"), str(tmp_path / "t.json")
    for argv, words in [(["--listen", "nope"], "give PORT or HOST:PORT"),
                        (["--listen", "10.0.0.1:0", "--host", "127.0.0.1"], "give the host once"),
                        (["--listen", "0", "--strict"], "--strict applies to FILE"),
                        ([f, "--api-key", "k"], "apply to --listen"),
                        (["--listen", "0", "--api-key", "k", "--api-key-file", f], "not both")]:
        assert main(["import-traces", *argv, "--out", rec]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_the_key(tmp_path: Path) -> None:
    receiver = Receiver(tmp_path / "rec", api_key="s3cret")
    server = receiver.server("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    body = json.dumps(request(*semconv_trace())).encode()
    try:
        assert post(server.url, body)[0] == 401
        assert post(server.url, body, authorization="Bearer wrong")[0] == 401
        assert list(read_runs(tmp_path / "rec")) == []
        assert post(server.url, body, authorization="Bearer s3cret") == (200, {})
        assert [t.rollout_id for t, _ in read_runs(tmp_path / "rec")] == [T1]
    finally:
        server.shutdown()
        server.server_close()
        receiver.close()


def test_sigterm_writes_what_is_held_and_the_key_comes_from_the_environment(tmp_path: Path) -> None:
    env = {**os.environ, "MAS_TRAINER_API_KEY": "from-env", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "mas_trainer.cli", "import-traces", "--listen", "0", "--out", str(tmp_path / "rec")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stderr.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(60)
        assert lines and "http://127.0.0.1:" in lines[0] and "API key required" in lines[0], lines
        url = lines[0].split(" at ")[1].split(" ")[0]
        body = json.dumps(request(*openllmetry_trace()[1:])).encode()  # no root: held
        assert post(url, body)[0] == 401
        assert post(url, body, authorization="Bearer from-env") == (200, {})
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0 and "imported 1 runs (1 LLM calls)" in out
    assert [t.rollout_id for t, _ in read_runs(tmp_path / "rec")] == [T2]
