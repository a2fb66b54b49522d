"""What a kubelet reports about a container, for the pod node (node.py) to write into pod status.

Pure pieces, no processes and no API calls: the restart back-off (the kubelet's
``flowcontrol.Backoff`` rules), probes (readiness from ``httpGet``/``tcpSocket``), the termination
message (``FallbackToLogsOnError``: the log's last 80 lines, at most 2048 bytes, when the exit code
is not 0), and the ``containerStatuses[]`` entry and ``Ready``/``ContainersReady`` conditions, as a
strategic-merge patch of the pods/status subresource (keys that must go are sent as null).
"""

from __future__ import annotations

import datetime as dt
import http.client
import socket
from dataclasses import dataclass, field
from pathlib import Path

#: The kubelet's limits for a termination message taken from the log.
MESSAGE_MAX_LINES = 80
MESSAGE_MAX_BYTES = 2048
#: The kubelet's back-off: 10 s, doubling, at most 5 min. The pod node scales it down (node.py).
KUBELET_BACKOFF = (10.0, 300.0)


def rfc3339(t: float | None = None) -> str:
    """A timestamp as the apiserver stores it (seconds, UTC, ``Z``)."""
    when = dt.datetime.fromtimestamp(t, dt.timezone.utc) if t is not None else dt.datetime.now(dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def go_duration(seconds: float) -> str:
    """Go's ``time.Duration.String()`` for the back-off in the kubelet's message: 10s, 1m20s, 5m0s, 500ms."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, secs = divmod(seconds, 60)
    s = f"{secs:.0f}s" if float(secs).is_integer() else f"{secs:g}s"
    return f"{int(minutes)}m{s}" if minutes else s


def termination_message(log_path: Path, offset: int, exit_code: int, policy: str | None) -> str:
    """The message of a run that wrote its log from `offset`: with ``FallbackToLogsOnError`` and a
    non-zero exit, the last lines of its log (80 lines, then the last 2048 bytes), as the kubelet
    does; otherwise empty (the termination-message file itself is not simulated)."""
    if policy != "FallbackToLogsOnError" or exit_code == 0:
        return ""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return ""
    lines = data.splitlines(keepends=True)[-MESSAGE_MAX_LINES:]
    return b"".join(lines)[-MESSAGE_MAX_BYTES:].decode(errors="replace")


@dataclass
class BackOff:
    """The kubelet's per-container back-off: the first restart is at once; a container that exits
    again waits `initial`, then twice as long each time up to `maximum`; an exit more than
    2 x `maximum` after the previous one starts over."""

    initial: float
    maximum: float
    current: float | None = None       # None: no back-off yet
    last_update: float | None = None   # the exit time that set `current`

    def _expired(self, event: float) -> bool:
        return self.last_update is None or event - self.last_update > 2 * self.maximum

    def in_backoff_since(self, event: float, now: float) -> bool:
        """Is a container that exited at `event` still waiting at `now`?"""
        if self.current is None or self._expired(event):
            return False
        return now - event < self.current

    def next(self, event: float) -> None:
        """Called when the container is restarted after exiting at `event`."""
        if self.current is None or self._expired(event):
            self.current = self.initial
        else:
            self.current = min(self.current * 2, self.maximum)
        self.last_update = event


@dataclass
class Probe:
    """An ``httpGet`` or ``tcpSocket`` probe, run against the container's local port. Success:
    HTTP status 200-399 (as the kubelet's prober), or a TCP connection."""

    kind: str                  # "http" or "tcp"
    path: str = "/"
    period: float = 10.0
    timeout: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1

    @classmethod
    def from_spec(cls, spec: dict | None) -> "Probe | None":
        """None for no probe, or for an ``exec``/``grpc`` probe (not simulated: the container
        counts as passing it)."""
        if not spec:
            return None
        common = dict(period=float(spec.get("periodSeconds") or 10), timeout=float(spec.get("timeoutSeconds") or 1),
                      failure_threshold=int(spec.get("failureThreshold") or 3),
                      success_threshold=int(spec.get("successThreshold") or 1))
        if "httpGet" in spec:
            return cls("http", path=spec["httpGet"].get("path") or "/", **common)
        if "tcpSocket" in spec:
            return cls("tcp", **common)
        return None

    def check(self, port: int) -> bool:
        try:
            if self.kind == "tcp":
                with socket.create_connection(("127.0.0.1", port), timeout=self.timeout):
                    return True
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=self.timeout)
            try:
                conn.request("GET", self.path, headers={"User-Agent": "kube-probe/1.36"})
                return 200 <= conn.getresponse().status < 400
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):
            return False


@dataclass
class ContainerStatus:
    """One container as the kubelet reports it. The pod node updates the fields; `patch()` turns
    them into the pods/status patch."""

    name: str
    image: str
    restart_count: int = 0
    container_id: str = ""
    running_since: str | None = None        # state.running.startedAt
    terminated: dict | None = None          # state.terminated (exited, not restarted yet)
    waiting: dict | None = None             # state.waiting (CrashLoopBackOff)
    last_terminated: dict | None = None     # lastState.terminated
    started: bool = False                   # the startup probe passed (or there is none)
    ready: bool = False                     # the readiness probe passed (or there is none)
    ever_started: bool = False              # phase Running from the first start on
    ready_since: str = field(default_factory=rfc3339)  # Ready/ContainersReady lastTransitionTime
    _ready_reported: bool | None = None

    def state(self) -> dict:
        keys = {"running": None, "waiting": None, "terminated": None}
        if self.running_since is not None:
            keys["running"] = {"startedAt": self.running_since}
        elif self.terminated is not None:
            keys["terminated"] = self.terminated
        else:
            keys["waiting"] = self.waiting or {"reason": "ContainerCreating"}
        return keys

    def patch(self) -> dict:
        """The strategic-merge patch of pods/status: this container's entry (merged by name) and the
        Ready and ContainersReady conditions (merged by type)."""
        ready = self.ready and self.running_since is not None
        if ready != self._ready_reported:
            if self._ready_reported is not None:
                self.ready_since = rfc3339()
            self._ready_reported = ready
        conditions = [{
            "type": kind, "status": "True" if ready else "False", "lastProbeTime": None,
            "lastTransitionTime": self.ready_since,
            "reason": None if ready else "ContainersNotReady",
            "message": None if ready else f"containers with unready status: [{self.name}]",
        } for kind in ("ContainersReady", "Ready")]
        entry = {
            "name": self.name, "image": self.image, "containerID": self.container_id or None,
            "restartCount": self.restart_count, "ready": ready,
            "started": self.started and self.running_since is not None,
            "state": self.state(),
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {"terminated": None},
        }
        status: dict = {"conditions": conditions, "containerStatuses": [entry]}
        if self.ever_started:
            status["phase"] = "Running"
        return {"status": status}


def terminated_state(exit_code: int, message: str, started_at: str, finished_at: str, container_id: str) -> dict:
    """``state.terminated`` / ``lastState.terminated`` of a run (``reason`` Completed or Error; a
    signal's exit code is 128 + its number, as a container runtime reports it)."""
    return {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
            "message": message or None, "startedAt": started_at, "finishedAt": finished_at,
            "containerID": container_id}
