"""Refusals the client can read: a response sent before the request's body was read (401 before the
body, 413 on its declared size, 404, 400 on a header) first reads and discards that body.

Invariant owned here: a refused request's client reads its response. A client like urllib sends its
whole body before it reads, and asks for ``Connection: close``; a server that answers and closes with
the body unread makes the kernel reset the connection, and the client sees ``Connection reset by
peer`` instead of the 413 and its message. So the body is discarded up to ``limit`` bytes within
``timeout_s`` (as mature servers' lingering close does), then the response goes out; a body beyond
that is answered with ``Connection: close`` and the log says so. A client that asked
``Expect: 100-continue`` has sent no body: it gets the refusal at once.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("kvtune.server.http")

DRAIN_LIMIT_BYTES = 64 * 2**20
DRAIN_TIMEOUT_S = 10.0


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for k, v in headers:
        if k == b"transfer-encoding" or (k == b"content-length" and v.strip() not in (b"", b"0")):
            return True
    return False


class BodyDrainMiddleware:
    def __init__(self, app: Any, *, limit: int = DRAIN_LIMIT_BYTES, timeout_s: float = DRAIN_TIMEOUT_S):
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        pending = _has_body(headers) and (b"expect", b"100-continue") not in headers
        state = {"pending": pending}

        async def tracked_receive() -> dict[str, Any]:
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                state["pending"] = False
            return msg

        async def drained_send(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start" and state["pending"]:
                state["pending"] = False
                if not await self._discard(receive):
                    client = scope.get("client")
                    log.warning("closing connection from %s: its refused request's body (status %s) was not read "
                                "to its end (over %d bytes or %gs); the client may see a reset",
                                "%s:%d" % tuple(client) if client else "?", msg["status"], self.limit, self.timeout_s)
                    msg = {**msg, "headers": [*msg.get("headers", []), (b"connection", b"close")]}
            await send(msg)

        await self.app(scope, tracked_receive, drained_send)

    async def _discard(self, receive: Any) -> bool:
        """Read the rest of the body; True once its end came within the bounds."""
        async def read() -> bool:
            n = 0
            while True:
                msg = await receive()
                if msg["type"] != "http.request":
                    return False  # the client left
                n += len(msg.get("body", b""))
                if not msg.get("more_body", False):
                    return True
                if n > self.limit:
                    return False
        try:
            return await asyncio.wait_for(read(), self.timeout_s)
        except asyncio.TimeoutError:
            return False
