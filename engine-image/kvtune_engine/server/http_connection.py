"""The HTTP/1.1 connection: uvicorn's h11 protocol with the bounds a server on a shared network needs.

Invariant owned here: every connection is bounded in time and in number, and the server never
closes one under a client that may be sending on it without saying so in the log.

- An idle keep-alive connection lives ``keep_alive_s``, longer than the idle timeouts of the common
  client pools (aiohttp 15 s, httpx 5 s, Go's 90 s), so that the client, not the server, closes an idle
  pooled connection. With uvicorn's 5 s the server closed idle pooled connections at the moment a
  client picked them for its next request, which then failed with a reset.
- A request head must be complete within ``header_timeout_s`` of its first byte (slow-loris clients
  hold no connection forever); the client gets a 408 and the close is logged.
- At most ``max_connections`` are open: over the cap the longest-idle keep-alive connection is
  closed to make room, and when none is idle the newcomer's request gets a 503 with its JSON error.

Built on uvicorn's h11 implementation (its ``conn``, ``cycle`` and keep-alive timer); ``check()``
verifies those are there, the tests drive each bound through a real server.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .body_drain import BodyDrainMiddleware

log = logging.getLogger("kvtune.server.http")


@dataclass(frozen=True)
class ConnectionLimits:
    keep_alive_s: float = 120.0
    header_timeout_s: float = 30.0
    max_connections: int = 4096


def error_body(status: int, message: str, code: str) -> bytes:
    kind = "server_overloaded" if status == 503 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def _peer(p: H11Protocol) -> str:
    return "%s:%d" % p.client if p.client else "?"


class BoundedH11Protocol(H11Protocol):
    """One connection. ``limits`` is set on the subclass that ``protocol_class`` makes."""

    limits = ConnectionLimits()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: Any = None
        self._idle_since = self.loop.time()
        self.timeout_keep_alive = self.limits.keep_alive_s
        # a fresh connection that sends nothing is idle: it closes as an idle keep-alive one does
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        if len(self.connections) > self.limits.max_connections and not self._close_an_idle_peer():
            log.warning("connection from %s over --max-connections %d (none idle): its request gets 503",
                        _peer(self), self.limits.max_connections)
            self.app = _over_capacity(self.limits.max_connections)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:  # part of a head: it must complete in time
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
        else:
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            log.info("connection from %s lost with its response pending (%s)", _peer(self),
                     exc or "the client closed it")
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        log.warning("closing connection from %s: its request head was not complete within %gs (--header-timeout)",
                    _peer(self), self.limits.header_timeout_s)
        body = error_body(408, f"the request head was not complete within {self.limits.header_timeout_s:g}s",
                          "header_timeout")
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def _idle(self) -> bool:
        return (self.timeout_keep_alive_task is not None and not self.transport.is_closing()
                and self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete))

    def _close_an_idle_peer(self) -> bool:
        idle = [p for p in self.connections if p is not self and isinstance(p, BoundedH11Protocol) and p._idle()]
        if not idle:
            return False
        oldest = min(idle, key=lambda p: p._idle_since)
        log.info("closing idle connection from %s to admit a new one (--max-connections %d)", _peer(oldest),
                 self.limits.max_connections)
        oldest.timeout_keep_alive_handler()
        return True


def _over_capacity(cap: int) -> Any:
    body = error_body(503, f"the server holds its maximum of {cap} connections, none idle; retry later",
                      "too_many_connections")

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    return BodyDrainMiddleware(app)


def protocol_class(limits: ConnectionLimits) -> type[BoundedH11Protocol]:
    """The protocol class uvicorn runs (``uvicorn.Config(http=...)``), bound to ``limits``."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits})


def check() -> None:
    """uvicorn's h11 protocol still has what this module builds on."""
    for name in ("connection_made", "data_received", "on_response_complete", "connection_lost",
                 "timeout_keep_alive_handler", "_unset_keepalive_if_required"):
        assert callable(getattr(H11Protocol, name, None)), f"uvicorn's H11Protocol lacks {name}"
