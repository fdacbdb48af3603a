"""The gateway's HTTP server: uvicorn on h11, with the bounds uvicorn does not set itself.

uvicorn closes idle keep-alive connections, but it waits forever for the headers of a
request and for its body (a client that sends a byte a minute holds a connection, and with
enough of them every file descriptor), and it accepts any number of connections. The
protocol below adds a read deadline (a whole request must arrive within `read_timeout_s`
of the server starting to wait for it) and a cap on open connections. Header size is
bounded by h11 (`max_header_bytes`).

Who the cap protects. A connection is *anonymous* until one of its requests is admitted by
the gateway (a valid key or rollout token, or any request where no key is set); the gateway
then says so (`Connections.admitted`). Anonymous connections never take capacity from
admitted ones: when the server is full, or one client address holds more than
`max_anonymous_per_client` anonymous connections, the oldest anonymous connection (one
with no request under way, if there is such) is closed to make room. Only when every open
connection is admitted does a new one get a 503. So a thousand idle sockets without a key
cost the key holder nothing: on the loopback, where every client has the same address, the
per-client bound is what keeps them from filling the server first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ServerLimits", "GatewayServer", "Connections"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    max_connections: int = 1024
    # An OpenAI client opens at most its pool size (httpx: 100) at once; a fit with 64
    # concurrent rollouts opens its connections in a burst before the first is admitted.
    max_anonymous_per_client: int = 256
    read_timeout_s: float = 30.0  # headers + body of one request
    keep_alive_s: float = 30.0  # an idle connection is closed after this
    max_header_bytes: int = 32 * 1024


_BUSY_BODY = json.dumps({"error": {"message": "too many connections; retry later", "type": "server_busy",
                                   "param": None, "code": "too_many_connections"}}).encode()
_BUSY = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(_BUSY_BODY)}\r\n"
         "connection: close\r\nretry-after: 1\r\n\r\n").encode() + _BUSY_BODY


class Connections:
    """The anonymous connections of one server, oldest first (used on its event loop only)."""

    def __init__(self, limits: "ServerLimits") -> None:
        self.limits = limits
        self._anonymous: dict[_GuardedH11, None] = {}  # insertion order = age
        self._by_host: dict[str, dict[_GuardedH11, None]] = {}
        self._by_client: dict[tuple[str, int], _GuardedH11] = {}

    def opened(self, conn: "_GuardedH11", total: int) -> bool:
        """Register a new connection; False if it must be refused (the server is full of admitted ones)."""
        host = conn.client[0] if conn.client else ""
        if conn.client:
            self._by_client[conn.client] = conn
        self._anonymous[conn] = None
        same = self._by_host.setdefault(host, {})
        same[conn] = None
        if len(same) > self.limits.max_anonymous_per_client:
            self._evict(same, conn, f"client {host} holds over {self.limits.max_anonymous_per_client} connections without a request admitted")
        if total > self.limits.max_connections and not self._evict(self._anonymous, conn, "the server is full"):
            self.closed(conn)
            return False
        return True

    def admitted(self, client: tuple[str, int] | None) -> None:
        """A request on this connection was admitted: from now on it is never evicted."""
        conn = self._by_client.get(client) if client else None
        if conn is not None:
            self._forget_anonymous(conn)

    def closed(self, conn: "_GuardedH11") -> None:
        self._forget_anonymous(conn)
        if conn.client and self._by_client.get(conn.client) is conn:
            del self._by_client[conn.client]

    def _forget_anonymous(self, conn: "_GuardedH11") -> None:
        if conn in self._anonymous:
            del self._anonymous[conn]
            host = conn.client[0] if conn.client else ""
            same = self._by_host.get(host, {})
            same.pop(conn, None)
            if not same:
                self._by_host.pop(host, None)

    def _evict(self, pool: dict["_GuardedH11", None], keep: "_GuardedH11", why: str) -> bool:
        # the oldest with no request under way; failing that the oldest of all
        idle = next((c for c in pool if c is not keep and c.cycle is None), None)
        victim = idle or next((c for c in pool if c is not keep), None)
        if victim is None:
            return False
        log.info("closed an anonymous connection from %s: %s", victim.client, why)
        self.closed(victim)
        victim.transport.close()
        return True


class _GuardedH11(H11Protocol):
    """h11 protocol with a per-request read deadline and the connection bounds above (class
    attributes set per server by `_protocol_for`)."""

    pool: Connections = Connections(ServerLimits())
    read_timeout_s = ServerLimits.read_timeout_s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if not self.pool.opened(self, len(self.connections)):
            transport.write(_BUSY)
            transport.close()
            return
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.closed(self)
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._deadline, self.cycle)

    def _deadline(self, cycle_when_armed: Any) -> None:
        self._read_timer = None
        cycle = self.cycle
        no_request_yet = cycle is cycle_when_armed  # headers still incomplete (or never sent)
        body_unfinished = cycle is not None and cycle.more_body and not cycle.response_started
        if (no_request_yet or body_unfinished) and not self.transport.is_closing():
            self.transport.close()  # the handler, if any, sees a disconnect


def _protocol_for(limits: ServerLimits, pool: Connections) -> type[H11Protocol]:
    return type("GuardedH11", (_GuardedH11,), {"pool": pool, "read_timeout_s": limits.read_timeout_s})


class GatewayServer:
    """Runs a gateway with uvicorn on a background thread (127.0.0.1 unless told otherwise)."""

    def __init__(self, gateway: Any, host: str = "127.0.0.1", port: int = 0, *, limits: ServerLimits | None = None) -> None:
        import uvicorn

        self.gateway = gateway
        self.limits = limits or ServerLimits()
        self.connections = Connections(self.limits)
        # the gateway says which connections carried an admitted request (see the module doc)
        if hasattr(gateway, "on_admitted"):
            gateway.on_admitted = self.connections.admitted
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit this; without it a keep-alive response written in two
        # parts waits for the client's delayed ACK (~40 ms a call).
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(
            gateway.app, log_level="warning", lifespan="off", access_log=False, http=_protocol_for(self.limits, self.connections),
            # uvicorn annotates int but schedules it with call_later: fractions of a second work
            timeout_keep_alive=self.limits.keep_alive_s,  # type: ignore[arg-type]
            h11_max_incomplete_event_size=self.limits.max_header_bytes,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, name="mas-gateway", daemon=True)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout_s: float = 10.0) -> "GatewayServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"gateway did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        # Stop accepting calls and answer those in flight (503) first: uvicorn would wait for
        # them, and the caller may close their engines next.
        close = getattr(self.gateway, "close", None)
        if callable(close) and self._thread.is_alive():
            close()
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> "GatewayServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
