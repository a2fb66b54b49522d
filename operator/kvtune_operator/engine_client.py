"""The one client of an engine's admin API (``/kvtune/v1/state``, ``/trace``, ``/steps``, ``/config``)
and its ``/metrics``: what the tuning loop, ``kvtune demo`` and ``kvtune diagnose --url`` read.

One set of limits for every request: a total wall-clock deadline (connect, headers, body: not per
read) and a byte cap on the answer, no redirect followed (`prometheus.bounded_fetch`). One error type,
`EngineError`, whose message is a short fixed reason (the path and an HTTP status or what went
wrong), never any part of a response body: the messages reach conditions, events and terminals.

The admin key is a bearer token that can retune the engine and read its trace (other users'
request shapes): ``key_only_to`` (the IPs of the resource's own pods, in the operator) makes the
client refuse, before any connection, to send it to any other host.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .prometheus import MAX_RESPONSE_BYTES, QueryFailed, bounded_fetch, pod_host
from .tuner.backlog import WindowTrace

#: every request's total deadline and the cap on its answer (the trace of 10000 requests is ~2 MiB)
DEADLINE_S = 10.0
MAX_BYTES = MAX_RESPONSE_BYTES
#: sent with every request: an engine's log (and a test's loopback server) can tell the client's requests
USER_AGENT = "kvtune-engine-client/1"

ADMIN = "/kvtune/v1"


class EngineError(QueryFailed):
    """A read of the engine failed. ``str()``: the path and a short fixed reason, never a response
    body; ``status``: the HTTP status when the engine answered one, else None (unreachable, timed
    out, too large, not an engine's answer)."""

    def __init__(self, path: str, reason: str, *, status: int | None = None):
        super().__init__(f"{path}: {reason}", status=status)
        self.path, self.reason = path, reason


_HINTS = {401: "the admin API wants the engine's admin key (--admin-key)",
          403: "the admin API refused the admin key",
          404: "no such endpoint here: is this the engine's admin port?"}


def _int(x: Any, default: int = 0) -> int:
    try:
        return int(x) if x is not None else default
    except (TypeError, ValueError):
        return default


def _float(x: Any, default: float = 0.0) -> float:
    try:
        v = float(x) if x is not None else default
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default


@dataclass(frozen=True)
class EngineState:
    """``GET /kvtune/v1/state``: the fields the callers read, and the whole snapshot (``raw``), which
    `Observation.from_metrics` reads as its ``state``."""
    uptime_s: float
    config: dict[str, Any]
    num_blocks: int
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def of(cls, answer: Any) -> "EngineState":
        if not isinstance(answer, dict) or not isinstance(answer.get("config", {}), dict):
            raise EngineError(f"{ADMIN}/state", "not an engine's state")
        blocks = answer.get("blocks") if isinstance(answer.get("blocks"), dict) else {}
        return cls(uptime_s=_float(answer.get("uptime_s")), config=dict(answer.get("config") or {}),
                   num_blocks=_int(blocks.get("total")), raw=answer)


def _records(answer: Mapping[str, Any], key: str, path: str) -> list[dict[str, Any]]:
    got = answer.get(key) or []
    if not isinstance(got, list) or not all(isinstance(r, dict) for r in got):
        raise EngineError(path, f"not an engine's {key}")
    return got


@dataclass(frozen=True)
class EngineTrace:
    """``GET /kvtune/v1/trace``: the finished requests' shapes and (asked for) those still in the engine."""
    requests: list[dict[str, Any]]
    unfinished: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, answer: Any) -> "EngineTrace":
        path = f"{ADMIN}/trace"
        if not isinstance(answer, dict):
            raise EngineError(path, "not an engine's trace")
        return cls(_records(answer, "requests", path), _records(answer, "unfinished", path))

    def split(self, start: float) -> WindowTrace:
        """The window from ``start`` (the trace's clock) and the requests that arrived before it."""
        try:
            return WindowTrace.split({"requests": self.requests, "unfinished": self.unfinished}, start)
        except (TypeError, ValueError, KeyError, AttributeError):
            raise EngineError(f"{ADMIN}/trace", "not an engine's trace") from None


@dataclass(frozen=True)
class EngineSteps:
    """``GET /kvtune/v1/steps``: the engine's recent step log (the cost fit's samples)."""
    steps: list[dict[str, Any]]

    @classmethod
    def of(cls, answer: Any) -> "EngineSteps":
        path = f"{ADMIN}/steps"
        if not isinstance(answer, dict):
            raise EngineError(path, "not an engine's step log")
        return cls(_records(answer, "steps", path))


@dataclass(frozen=True)
class EngineLiveConfig:
    """``GET`` / ``PATCH /kvtune/v1/config``: the config the engine runs, and what a change changed."""
    config: dict[str, Any]
    changed: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, answer: Any) -> "EngineLiveConfig":
        if not isinstance(answer, dict) or not isinstance(answer.get("config"), dict):
            raise EngineError(f"{ADMIN}/config", "not an engine's config")
        changed = answer.get("changed")
        return cls(dict(answer["config"]), dict(changed) if isinstance(changed, dict) else {})


class EngineClient:
    """One engine, at ``url`` (``http://host:port``: its admin port where it has one). Every request
    has the total deadline ``deadline_s`` and the byte cap ``max_bytes``; any failure is an EngineError.

    ``admin_key``: sent as a bearer token. ``key_only_to``: the hosts (IPs) the key may go to; a
    client for any other host refuses every request unsent (None: the caller vouches for ``url``,
    as a user who types it does)."""

    def __init__(self, url: str, *, admin_key: str | None = None, key_only_to: Iterable[str] | None = None,
                 deadline_s: float = DEADLINE_S, max_bytes: int = MAX_BYTES):
        self.url = url.rstrip("/")
        self.deadline_s, self.max_bytes = deadline_s, max_bytes
        self._headers = {"User-Agent": USER_AGENT}
        self._refused: str | None = None
        if admin_key:
            self._headers["Authorization"] = f"Bearer {admin_key}"
            if key_only_to is not None and pod_host(self.url) not in set(key_only_to):
                self._refused = "not a host the admin key may go to; not contacted"

    def __repr__(self) -> str:  # never the key
        return f"EngineClient({self.url!r})"

    # ---- the transport: limits and errors in one place
    def fetch(self, path: str, params: Mapping[str, Any] | None = None, *, method: str = "GET",
              json_body: Any = None) -> bytes:
        """The body of one answer (HTTP 200 only)."""
        if self._refused:
            raise EngineError(path, self._refused)
        query = {k: ("true" if v is True else "false" if v is False else v)
                 for k, v in (params or {}).items() if v is not None}
        try:
            return bounded_fetch(f"{self.url}{path}", query or None, headers=self._headers, method=method,
                                 json_body=json_body, deadline_s=self.deadline_s, max_bytes=self.max_bytes)
        except EngineError:
            raise
        except QueryFailed as e:
            hint = _HINTS.get(e.status or 0) if path.startswith(ADMIN) else None
            raise EngineError(path, f"{e} ({hint})" if hint else str(e), status=e.status) from None

    def fetch_json(self, path: str, params: Mapping[str, Any] | None = None, **kw: Any) -> Any:
        body = self.fetch(path, params, **kw)
        try:
            return json.loads(body)
        except ValueError:
            raise EngineError(path, "the answer is not JSON") from None

    # ---- the endpoints, as typed records
    def state(self) -> EngineState:
        return EngineState.of(self.fetch_json(f"{ADMIN}/state"))

    def trace(self, *, since_s: float | None = None, limit: int | None = None,
              unfinished: bool = False) -> EngineTrace:
        return EngineTrace.of(self.fetch_json(f"{ADMIN}/trace", {"since_s": since_s, "limit": limit,
                                                                  "unfinished": unfinished or None}))

    def steps(self, *, limit: int | None = None) -> EngineSteps:
        return EngineSteps.of(self.fetch_json(f"{ADMIN}/steps", {"limit": limit}))

    def config(self) -> EngineLiveConfig:
        return EngineLiveConfig.of(self.fetch_json(f"{ADMIN}/config"))

    def set_config(self, changes: Mapping[str, Any]) -> EngineLiveConfig:
        """Change live knobs (all or nothing); a restart knob the engine cannot change live is an
        EngineError with status 409."""
        return EngineLiveConfig.of(self.fetch_json(f"{ADMIN}/config", method="PATCH", json_body=dict(changes)))

    def metrics_text(self) -> str:
        """One scrape of ``/metrics`` (Prometheus text)."""
        return self.fetch("/metrics").decode("utf-8", "replace")
