"""`mas-trainer view` on a run directory that was handed over and cannot be trusted: links out of
the run, lines nested deep enough to break a recursive parser, and clients that connect and
never speak. Small hand-written runs, so these run in seconds.
"""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mas_trainer.engines.models import load_tokenizer
from mas_trainer.errors import UserError
from mas_trainer.view import ViewServer, ViewSource, write_html
from mas_trainer.view.server import select_steps

SECRET = "OUTSIDE-THE-RUN-1f6e"
DEEP = "[" * 100_000


def _traj(rid: str, text: str = "inside", **extra) -> dict:
    return {"rollout_id": rid, "task": {"q": text}, "status": "ok", "rewards": {"trajectory": 1.0}, **extra}


def _lines(*rows: dict | str) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def _run(base: Path) -> Path:
    run = base / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(_lines({"kind": "train", "step": 1, "reward/mean": 0.5}))
    (run / "trajectories" / "step_000001.jsonl").write_text(_lines(_traj("s000001-t00000-r0")))
    return run


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path, headers={"Host": f"127.0.0.1:{port}"})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


@pytest.fixture
def serve():
    servers: list[ViewServer] = []

    def start(source: ViewSource, **kw) -> ViewServer:
        servers.append(ViewServer(source, 0, **kw).start())
        return servers[-1]

    yield start
    for srv in servers:
        srv.stop()


# --- links out of the run ------------------------------------------------------------------------------
@pytest.fixture
def linked_run(tmp_path):
    """A run whose step_000002, metrics.jsonl and app.json are links to files outside it, and whose
    step_000003 is a link to step_000001 (inside: still shown)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jsonl").write_text(_lines(_traj("s000002-t00000-r0", SECRET)))
    (outside / "metrics.jsonl").write_text(_lines({"kind": "train", "step": 1, f"{SECRET}/metric": 1.0}))
    (outside / "app.json").write_text(json.dumps({"roles": {SECRET: "p"}}))
    run = _run(tmp_path)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(outside / "metrics.jsonl")
    (run / "app.json").symlink_to(Path("..") / "outside" / "app.json")
    (run / "trajectories" / "step_000002.jsonl").symlink_to(Path("..") / ".." / "outside" / "secret.jsonl")
    (run / "trajectories" / "step_000003.jsonl").symlink_to("step_000001.jsonl")
    return run


def test_links_out_of_the_run_are_not_served_by_the_api(linked_run, serve):
    srv = serve(ViewSource(linked_run))
    status, body = _get(srv.port, "/api/index")
    index = json.loads(body)
    assert status == 200 and SECRET not in body.decode()
    assert [s["name"] for s in index["steps"]] == ["step_000001", "step_000003"]
    assert index["app"] is None and index["charts"] == []
    for rel in ("trajectories/step_000002.jsonl", "metrics.jsonl", "app.json"):
        assert f"{rel}: leads out of the run directory; skipped" in index["warnings"]
    assert index["raw_files"] == ["trajectories/step_000001.jsonl", "trajectories/step_000003.jsonl"]
    status, body = _get(srv.port, "/api/step?name=step_000002")
    assert status == 404 and SECRET not in body.decode()
    for path in ("/raw/trajectories/step_000002.jsonl", "/raw/metrics.jsonl", "/raw/app.json"):
        assert _get(srv.port, path)[0] == 404, path
    status, body = _get(srv.port, "/")
    assert status == 200 and SECRET not in body.decode()
    status, body = _get(srv.port, "/api/step?name=step_000003")  # a link that stays inside the run
    assert status == 200 and json.loads(body)["rollouts"][0]["task"] == {"q": "inside"}


def test_links_out_of_the_run_are_not_embedded_by_html(linked_run, tmp_path):
    source = ViewSource(linked_run)
    page = write_html(source, tmp_path / "shared.html").read_text()
    assert SECRET not in page
    assert "trajectories/step_000002.jsonl: leads out of the run directory; skipped" in page
    with pytest.raises(UserError, match="no trajectory file for 'step_000002'"):
        select_steps(source, "step_000002")


def test_a_policy_name_cannot_climb_out_of_the_checkpoint_folder(tmp_path):
    """The tokenizer folder is named by the trajectory's `policy`: `..` in it must not reach outside."""
    load_tokenizer("tiny").save_pretrained(tmp_path / "outside" / "tok")
    run = _run(tmp_path)
    (run / "checkpoint" / "policies").mkdir(parents=True)
    call = {"id": "c0", "policy": "../../../outside/tok", "response_ids": [72, 105], "response_logprobs": [-0.1, -0.2]}
    (run / "trajectories" / "step_000001.jsonl").write_text(_lines(_traj("s000001-t00000-r0", llm_calls=[call])))
    step = ViewSource(run).step("step_000001")
    assert step["rollouts"][0]["llm_calls"][0]["pieces"] is None
    assert step["tokenizers"] == {"../../../outside/tok": "no tokenizer found (pass --tokenizer): token ids shown"}


@pytest.mark.parametrize("linked", ["tokenizer.json", "chat_template.jinja", "extra"])
def test_a_policy_folder_with_any_file_linked_out_is_not_used_for_its_tokenizer(tmp_path, caplog, linked):
    """The tokenizer loader reads files of its own choosing in the folder: each must be inside
    the run (was: only one of tokenizer_config.json / tokenizer.json was checked)."""
    folder = tmp_path / "run" / "checkpoint" / "policies" / "p"
    load_tokenizer("tiny").save_pretrained(folder)
    run = _run(tmp_path)
    call = {"id": "c0", "policy": "p", "response_ids": [72, 105], "response_logprobs": [-0.1, -0.2]}
    (run / "trajectories" / "step_000001.jsonl").write_text(_lines(_traj("s000001-t00000-r0", llm_calls=[call])))
    assert ViewSource(run).step("step_000001")["tokenizers"] == {"p": "checkpoint/policies/p"}  # all inside: used
    outside = tmp_path / "outside"
    outside.mkdir()
    if linked == "extra":  # a folder of the policy's that links out
        (folder / "extra").symlink_to(outside, target_is_directory=True)
    else:
        (folder / linked).rename(outside / linked)
        (folder / linked).symlink_to(outside / linked)
    with caplog.at_level(logging.WARNING, logger="mas_trainer.view"):
        step = ViewSource(run).step("step_000001")
    assert step["tokenizers"] == {"p": "no tokenizer found (pass --tokenizer): token ids shown"}
    assert step["rollouts"][0]["llm_calls"][0]["pieces"] is None
    assert f"{linked}: leads out of the run directory; skipped" in caplog.text


# --- lines nobody can read ----------------------------------------------------------------------------
@pytest.fixture
def deep_run(tmp_path):
    run = _run(tmp_path)
    (run / "metrics.jsonl").write_text(_lines({"kind": "train", "step": 1, "reward/mean": 0.5}, DEEP,
                                              {"kind": "train", "step": 2, "reward/mean": 0.7}))
    (run / "trajectories" / "step_000001.jsonl").write_text(_lines(
        _traj("s000001-t00000-r0"), DEEP, '{"x": ' * 150 + "1" + "}" * 150, "[1, 2]", '{"cut by a kill',
        '{"n": ' + "7" * 5000 + "}", _traj("s000001-t00000-r1")))
    (run / "app.json").write_text(DEEP)
    (run / "config.yaml").write_text("reward: " + DEEP)
    return run


def test_unreadable_lines_are_skipped_and_named(deep_run, caplog):
    src = ViewSource(deep_run)
    with caplog.at_level(logging.WARNING, logger="mas_trainer.view"):
        index = src.index()
        src.index()
    traj = "trajectories/step_000001.jsonl"
    expected = [f"{traj} line 2: nested deeper than 100 levels; skipped",
                f"{traj} line 3: nested deeper than 100 levels; skipped",
                f"{traj} line 4: a JSON list, not an object; skipped"]
    assert index["warnings"][:2] == ["metrics.jsonl line 2: nested deeper than 100 levels; skipped",
                                     "app.json: nested deeper than 100 levels; ignored"]
    assert index["warnings"][2].startswith("config.yaml: nested deeper than 100 levels")
    assert index["warnings"][3:6] == expected
    assert index["warnings"][6].startswith(f"{traj} line 5: not valid JSON (")
    assert index["warnings"][7].startswith(f"{traj} line 6: not valid JSON (Exceeds the limit")
    assert [p[1] for p in index["charts"][0]["series"][0]["points"]] == [0.5, 0.7]  # the lines around it still count
    assert index["steps"][0]["rollouts"] == 2
    logged = [r.getMessage() for r in caplog.records]
    assert logged.count(expected[0]) == 1  # once, not on every reload
    step = src.step("step_000001")
    assert len(step["rollouts"]) == 2 and step["warnings"][:3] == expected


def test_a_deeply_nested_line_does_not_break_the_server_or_html(deep_run, serve, tmp_path, caplog):
    from mas_trainer.cli import main

    srv = serve(ViewSource(deep_run))
    warning = "metrics.jsonl line 2: nested deeper than 100 levels; skipped"
    status, body = _get(srv.port, "/api/index")
    assert status == 200 and warning in json.loads(body)["warnings"]
    status, body = _get(srv.port, "/api/step?name=step_000001")
    assert status == 200 and "trajectories/step_000001.jsonl line 2: nested deeper than 100 levels; skipped" in json.loads(body)["warnings"]
    status, body = _get(srv.port, "/")
    assert status == 200 and warning in body.decode()
    out = tmp_path / "deep.html"
    with caplog.at_level(logging.WARNING, logger="mas_trainer.view"):
        assert main(["view", str(deep_run), "--html", str(out)]) == 0
    page = out.read_text()
    assert warning in page and "trajectories/step_000001.jsonl line 2: nested deeper" in page
    assert warning in caplog.messages  # and on the terminal, where --html has no page to show it


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium not installed")
def test_the_page_shows_what_was_skipped(deep_run, tmp_path):
    page = write_html(ViewSource(deep_run), tmp_path / "deep.html")
    proc = subprocess.run(["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=8000", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '<div class="note warn">metrics.jsonl line 2: nested deeper than 100 levels; skipped</div>' in proc.stdout
    # the file's own lines: in the overview and again above the step's rollouts
    assert proc.stdout.count(">trajectories/step_000001.jsonl line 4: a JSON list, not an object; skipped<") == 2


# --- idle and piled-up connections --------------------------------------------------------------------
def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes `sock` within the hang guard (it must; the guard only stops a hang)."""
    sock.settimeout(30)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_idle_and_stalled_connections_are_closed(linked_run, serve):
    srv = serve(ViewSource(linked_run), idle_timeout=0.5)
    with socket.create_connection(("127.0.0.1", srv.port)) as idle:
        assert _closed_by_server(idle)  # sent nothing
    with socket.create_connection(("127.0.0.1", srv.port)) as stalled:
        stalled.sendall(f"GET /api/index HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n".encode())  # no blank line: unfinished
        assert _closed_by_server(stalled)
    assert _get(srv.port, "/api/index")[0] == 200


def test_idle_connections_cannot_keep_a_new_client_out(linked_run, serve):
    """More idle sockets than the cap (the defaults: 32, 30 s idle timeout), some of them halfway
    through a request: a new client is still answered at once (the bound is a hang guard), the
    ones idle the longest are closed to make room, and the threads stay within the cap."""
    srv = serve(ViewSource(linked_run))
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(40)]
    for s in idle[::4]:  # a request that never ends its headers: no request under way yet
        s.sendall(f"GET /api/index HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n".encode())
    try:
        t0 = time.monotonic()
        assert _get(srv.port, "/api/index")[0] == 200
        assert time.monotonic() - t0 < 60  # a hang guard: the idle timeout alone would take 30 s and renew
        assert _closed_by_server(idle[0]) and _closed_by_server(idle[8])  # the oldest went first
        assert threading.active_count() - before <= 32
    finally:
        for s in idle:
            s.close()


def test_a_new_connection_is_refused_only_when_every_open_one_is_being_answered(linked_run, serve, monkeypatch):
    """The 503 is kept for a server whose every connection has a request being answered: a
    request under way is never cut to make room."""
    source = ViewSource(linked_run)
    release, entered = threading.Event(), threading.Semaphore(0)
    index = source.index

    def slow_index():
        entered.release()
        release.wait(120)  # a hang guard
        return index()

    monkeypatch.setattr(source, "index", slow_index)
    srv = serve(source, idle_timeout=30, max_connections=2)
    got: list[int] = []
    busy = [threading.Thread(target=lambda: got.append(_get(srv.port, "/api/index")[0])) for _ in range(2)]
    for t in busy:
        t.start()
    try:
        for _ in busy:
            assert entered.acquire(timeout=120)  # both requests are being answered
        with socket.create_connection(("127.0.0.1", srv.port)) as extra:
            extra.settimeout(120)
            assert extra.recv(100).startswith(b"HTTP/1.0 503")
    finally:
        release.set()
        for t in busy:
            t.join(120)
    assert got == [200, 200]
    assert _get(srv.port, "/api/index")[0] == 200


def test_server_settings_are_checked(tmp_path):
    source = ViewSource(_run(tmp_path))
    with pytest.raises(UserError, match="idle_timeout must be > 0"):
        ViewServer(source, 0, idle_timeout=0)
    with pytest.raises(UserError, match="max_connections >= 1"):
        ViewServer(source, 0, max_connections=0)
