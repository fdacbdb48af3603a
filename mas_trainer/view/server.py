"""`mas-trainer view`: a local web page over a run directory, or one static HTML file.

The server binds 127.0.0.1 only and answers GET/HEAD on:

- ``/`` (``?step=NAME`` optional): the page, with the index and one step inline;
- ``/api/index``: curves, policy map, list of trajectory files (re-read on every request, so a
  running ``fit``'s new steps appear on reload);
- ``/api/step?name=NAME``: one trajectory file, assembled (:mod:`mas_trainer.view.data`);
- ``/raw/REL``: a file of the run as it is, only those :meth:`ViewSource.raw_files` lists
  (metrics, app.json, config.yaml, rewards.png, trajectory files), never anything else.

Query parameters are validated (a step name must name a listed file), paths with ``..``,
absolute paths, encoded separators or links that leave the run directory are refused (every
file goes through :meth:`ViewSource.inside`, for the API and the static file alike), and a
``Host`` header other than the server's own address is refused (DNS rebinding).

A connection that sends nothing, or stops mid-request, is dropped after `idle_timeout`
seconds; at most `max_connections` are open at once (a thread each). When a new connection
finds them all open, the one idle the longest with no request under way (waiting for its next
request, or still sending one) is closed to make room, so idle or slow clients cannot keep a
new one out; only when every open connection has a request being answered is the new one
refused with a 503. (The gateway's `transport.Connections` does the same on an event loop, for
uvicorn's protocols, and tells keyed clients from anonymous ones; the viewer has no keys and a
thread per connection, so it keeps its own table here.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs, unquote, urlsplit

from mas_trainer.errors import UserError
from mas_trainer.view.data import STEP_NAME, ViewSource
from mas_trainer.view.page import content_security_policy, render_page

__all__ = ["ViewServer", "serve_view", "serve_until_interrupted", "write_html", "page_data", "select_steps"]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
IDLE_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 32
_EVICT_WAIT_S = 5.0  # how long a new connection waits for the closed one's thread to end (it takes milliseconds)
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
         b"Content-Length: 35\r\n\r\ntoo many open connections, retry.\r\n")


def _initial_step(index: dict[str, Any]) -> str | None:
    steps = index["steps"]
    train = [s for s in steps if s["kind"] == "train"]
    return (train or steps)[-1]["name"] if steps else None


def page_data(source: ViewSource, step: str | None = None, *, all_steps: Iterable[str] | None = None) -> dict[str, Any]:
    """What the page embeds: the index, plus `step` (server) or every step in `all_steps` (static file)."""
    index = source.index()
    if all_steps is not None:
        names = list(all_steps)
        return {"index": index, "steps_data": source.all_steps(names), "initial_step": names[-1] if names else None}
    name = step or _initial_step(index)
    steps_data = {name: source.step(name)} if name else {}
    return {"index": index, "steps_data": {k: v for k, v in steps_data.items() if v is not None}, "initial_step": name}


def select_steps(source: ViewSource, steps: str | None) -> list[str]:
    """`--steps`: all (default), last, or a comma list of step numbers and/or file names."""
    files = source.step_files()
    if not steps or steps == "all":
        return [s.name for s in files]
    if steps == "last":
        train = [s for s in files if s.kind == "train"]
        return [(train or files)[-1].name] if files else []
    out: list[str] = []
    for part in (p.strip() for p in steps.split(",")):
        if not part:
            continue
        if part.isdigit():
            hits = [s.name for s in files if s.step == int(part)]
        else:
            hits = [s.name for s in files if s.name == part]
        if not hits:
            raise UserError(f"--steps {steps}: no trajectory file for {part!r}; have {', '.join(s.name for s in files) or 'none'}")
        out += [h for h in hits if h not in out]
    return out


def write_html(source: ViewSource, out: str | Path, *, steps: str | None = None) -> Path:
    """One self-contained HTML file (no network, no other files) with the chosen steps."""
    names = select_steps(source, steps)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_page(page_data(source, all_steps=names), api=False), encoding="utf-8")
    return path


class _Handler(BaseHTTPRequestHandler):
    server: "ViewServer"
    server_version = "mas-trainer-view"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        # every read and write on the socket then gives up after this long, and
        # BaseHTTPRequestHandler drops the connection on that TimeoutError
        self.connection.settimeout(self.server.idle_timeout)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    # --- replies ------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        self.send_header("X-Frame-Options", "DENY")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data: Any, status: int = 200) -> None:
        self._send(status, json.dumps(data, allow_nan=False).encode(), "application/json; charset=utf-8")

    def _error(self, status: int, message: str) -> None:
        self._json({"error": message}, status)

    # --- routing ------------------------------------------------------------------------------
    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        self._answer(self._route)

    def _bad_method(self) -> None:
        self._answer(lambda: self._error(HTTPStatus.METHOD_NOT_ALLOWED, "only GET and HEAD"))

    def _answer(self, respond: Callable[[], None]) -> None:
        if not self.server.request_begins(self.connection):  # closed to make room for a new connection
            self.close_connection = True
            return
        try:
            respond()
        except (BrokenPipeError, ConnectionResetError):
            pass
        except TimeoutError:
            raise  # the client stopped reading: the base class drops the connection
        except Exception as exc:  # noqa: BLE001 - one bad file must not take the server down
            log.exception("view: %s failed", self.path)
            self._error(500, f"{type(exc).__name__}: {str(exc)[:300]}")
        finally:
            self.server.request_ends(self.connection)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _bad_method  # type: ignore[assignment]

    def _route(self) -> None:
        if not self.server.host_ok(self.headers.get("Host")):
            return self._error(HTTPStatus.FORBIDDEN, "unexpected Host header")
        parts = urlsplit(self.path)
        path = parts.path
        try:
            query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False, max_num_fields=8)
        except ValueError:
            return self._error(HTTPStatus.BAD_REQUEST, "bad query string")
        if any(len(v) > 1 for v in query.values()):
            return self._error(HTTPStatus.BAD_REQUEST, "a query parameter is repeated")
        q = {k: v[0] for k, v in query.items()}
        source = self.server.source
        if path == "/":
            if set(q) - {"step"}:
                return self._error(HTTPStatus.BAD_REQUEST, f"unknown query parameter(s): {', '.join(sorted(set(q) - {'step'}))}")
            step = q.get("step")
            if step is not None and source.find_step(step) is None:
                return self._error(HTTPStatus.NOT_FOUND if STEP_NAME.match(step) else HTTPStatus.BAD_REQUEST, "no such step")
            page = render_page(page_data(source, step), api=True)
            return self._send(200, page.encode(), "text/html; charset=utf-8",
                              {"Content-Security-Policy": content_security_policy(api=True) + "; frame-ancestors 'none'"})
        if path == "/api/index":
            if q:
                return self._error(HTTPStatus.BAD_REQUEST, "no query parameters here")
            return self._json(source.index())
        if path == "/api/step":
            name = q.get("name")
            if set(q) != {"name"} or not name or not STEP_NAME.match(name):
                return self._error(HTTPStatus.BAD_REQUEST, "want ?name=STEP (a trajectory file's name, e.g. step_000001)")
            data = source.step(name)
            if data is None:
                return self._error(HTTPStatus.NOT_FOUND, "no such step")
            return self._json(data)
        if path.startswith("/raw/"):
            return self._raw(path[len("/raw/"):])
        if path == "/favicon.ico":
            return self._send(204, b"", "text/plain")
        return self._error(HTTPStatus.NOT_FOUND, "not found")

    def _raw(self, encoded: str) -> None:
        rel = unquote(encoded, errors="strict") if "%" in encoded else encoded
        if (not rel or "\\" in rel or "\x00" in rel or rel.startswith("/")
                or any(part in ("", ".", "..") for part in rel.split("/"))):
            return self._error(HTTPStatus.BAD_REQUEST, "bad path")
        real = self.server.source.raw_files().get(rel)  # links already followed, and kept only inside the run
        if real is None:
            return self._error(HTTPStatus.NOT_FOUND, "not a file of this run")
        ctype = "image/png" if real.suffix == ".png" else "text/plain; charset=utf-8"
        return self._send(200, real.read_bytes(), ctype, {"Content-Security-Policy": "default-src 'none'; sandbox"})


class _Conn:
    """An open connection: `busy` while a request of it is being answered; `evicted` once closed
    to make room; `done` when its thread has ended."""

    __slots__ = ("sock", "busy", "evicted", "done")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.busy, self.evicted, self.done = sock, False, False, threading.Event()


class ViewServer(ThreadingHTTPServer):
    """The view's HTTP server on 127.0.0.1:`port` (0: any free port); `url` once bound.

    `idle_timeout`: seconds a connection may wait on its client; `max_connections`: open at once
    (the one idle the longest makes room for a new one, see the module's doc).
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, source: ViewSource, port: int = 0, *, idle_timeout: float = IDLE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        if not idle_timeout > 0 or max_connections < 1:
            raise UserError(f"view server: idle_timeout must be > 0 and max_connections >= 1 "
                            f"(got {idle_timeout}, {max_connections})")
        self.source = source
        self.idle_timeout = float(idle_timeout)
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._conns: dict[Any, _Conn] = {}  # by socket, the least recently active first
        try:
            super().__init__((HOST, port), _Handler)
        except OSError as exc:
            raise UserError(f"cannot listen on {HOST}:{port} ({exc.strerror or exc}); choose another --port") from None
        self.port = self.server_address[1]
        self.url = f"http://{HOST}:{self.port}/"
        self._thread: threading.Thread | None = None

    def process_request(self, request: Any, client_address: Any) -> None:
        # a thread per connection, but never more than max_connections of them
        if not self._make_room(client_address):
            log.info("view: %s refused: every open connection has a request under way", client_address)
            self._refuse(request)
            return
        with self._lock:
            self._conns[request] = _Conn(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._lock:
            conn = self._conns.pop(request, None)
        if conn is not None:
            conn.done.set()

    def _make_room(self, client_address: Any) -> bool:
        """True when a new connection may open: below the cap, or once the connection idle the
        longest with no request under way has been closed and its thread has ended."""
        with self._lock:
            if len(self._conns) < self.max_connections:
                return True
            victim = next((c for c in self._conns.values() if not c.busy and not c.evicted), None)
            if victim is None:
                return False
            victim.evicted = True
        log.info("view: closed the connection idle the longest to make room for %s", client_address)
        with contextlib.suppress(OSError):
            victim.sock.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once, and the thread ends
        return victim.done.wait(_EVICT_WAIT_S)

    def request_begins(self, sock: Any) -> bool:
        """A request of this connection is to be answered: False if it was closed to make room."""
        with self._lock:
            conn = self._conns.get(sock)
            if conn is None or conn.evicted:
                return False
            conn.busy = True
            return True

    def request_ends(self, sock: Any) -> None:
        with self._lock:
            conn = self._conns.pop(sock, None)
            if conn is not None:  # the most recently active now: the last to be closed
                conn.busy = False
                self._conns[sock] = conn

    def _refuse(self, request: socket.socket) -> None:
        with contextlib.suppress(OSError):
            request.settimeout(1.0)
            request.sendall(_BUSY)
        self.shutdown_request(request)

    def host_ok(self, host: str | None) -> bool:
        return host in (f"{HOST}:{self.port}", f"localhost:{self.port}") or (self.port == 80 and host in (HOST, "localhost"))

    def start(self) -> "ViewServer":
        """Serve in a background thread (tests, notebooks)."""
        self._thread = threading.Thread(target=self.serve_forever, name="mas-trainer-view", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def serve_view(source: ViewSource, port: int = 8765, *, announce: Any = print, idle_timeout: float = IDLE_TIMEOUT_S,
               max_connections: int = MAX_CONNECTIONS) -> None:
    """Serve until Ctrl-C."""
    server = ViewServer(source, port, idle_timeout=idle_timeout, max_connections=max_connections)
    announce(f"viewing {source.path} at {server.url} (127.0.0.1 only; Ctrl-C to stop)")
    serve_until_interrupted(server)


def serve_until_interrupted(server: Any) -> None:
    """`server.serve_forever()` until Ctrl-C; its socket closed however it ends."""
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
    finally:
        server.server_close()

