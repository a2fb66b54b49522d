"""Who may call what: the /v1 API key, the admin API's own key and the admin port, as a plain ASGI
middleware.

Invariant owned here: the admin API (``/kvtune/v1/*``: state, trace, steps, config) answers only
a bearer token equal to ``--admin-key``, or, when no admin key is set, only clients on the
loopback interface; the ``/v1`` API key never opens it. ``/health`` and ``/metrics`` stay open
(probes, Prometheus) and carry no request content. With ``--admin-port`` the admin API and
``/metrics`` answer on that port only and the API on the other port only (``/health`` on both), so
that a NetworkPolicy, which sees ports and not paths, can admit API clients to one and only the
operator and Prometheus to the other. A plain ASGI middleware (not Starlette's
BaseHTTPMiddleware) so that a client hanging up is no error.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any

ADMIN_PREFIX = "/kvtune/"
METRICS_PATH = "/metrics"
HEALTH_PATH = "/health"


def _bearer(scope: dict[str, Any]) -> str:
    for k, v in scope.get("headers") or []:
        if k == b"authorization":
            got = v.decode("latin-1")
            return got[7:].strip() if got.lower().startswith("bearer ") else ""
    return ""


def _same(token: str, key: str) -> bool:
    return bool(token) and hmac.compare_digest(token.encode("utf-8", "surrogatepass"), key.encode())


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class AuthMiddleware:
    def __init__(self, app: Any, *, api_key: str | None, admin_key: str | None, admin_port: int | None = None):
        self.app = app
        self.api_key = api_key or None
        self.admin_key = admin_key or None
        self.admin_port = admin_port or None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            denied = self.check(scope)
            if denied is not None:
                status, message, code = denied
                kind = "not_found_error" if status == 404 else "authentication_error"
                body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    def check(self, scope: dict[str, Any]) -> tuple[int, str, str] | None:
        path: str = scope.get("path", "")
        wrong_port = self._wrong_port(scope, path)
        if wrong_port is not None:
            return 404, wrong_port, "wrong_port"
        if path.startswith(ADMIN_PREFIX):
            if self.admin_key:
                if not _same(_bearer(scope), self.admin_key):
                    return 401, "the admin API needs the admin key (Authorization: Bearer <admin key>)", \
                        "invalid_admin_key"
                return None
            client = scope.get("client")
            if not is_loopback(client[0] if client else None):
                return 403, ("the admin API answers only on loopback when the server has no admin key; start it "
                             "with --admin-key (or $KVTUNE_ADMIN_KEY) to reach it from elsewhere"), "admin_loopback_only"
            return None
        if self.api_key and path.startswith("/v1") and not _same(_bearer(scope), self.api_key):
            return 401, "invalid or missing API key", "invalid_api_key"
        return None

    def _wrong_port(self, scope: dict[str, Any], path: str) -> str | None:
        """With an admin port: why ``path`` is not served on the port the request came in on."""
        if self.admin_port is None or path == HEALTH_PATH:
            return None
        server = scope.get("server")
        on_admin = bool(server) and server[1] == self.admin_port
        admin_path = path.startswith(ADMIN_PREFIX) or path == METRICS_PATH
        if admin_path and not on_admin:
            return f"{path} is served on the admin port {self.admin_port}, not on the API port"
        if on_admin and not admin_path:
            return (f"the admin port {self.admin_port} serves {METRICS_PATH}, {HEALTH_PATH} and {ADMIN_PREFIX}v1/* "
                    f"only; {path} is on the API port")
        return None
