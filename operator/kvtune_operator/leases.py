"""The shard Leases on the apiserver: list, create, update with a resourceVersion precondition.

Invariant owned here: every Lease write is conditional (create fails if the Lease exists, update
carries the resourceVersion it was planned from), so two replicas can never both believe a write of
theirs made them the holder; `ShardKeeper` feeds the answers to `shards.ShardTable`, which decides.
The calls are exactly `LEASE_API_CALLS`, which the chart grants in the operator's namespace only.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Mapping

from kvtune_operator.shards import Action, LeaseRecord, ShardTable

log = logging.getLogger("kvtune_operator.shards")

#: (apiGroup, resource) -> verbs: the Lease calls below; the chart's lease Role grants exactly these
#: (files/rbac-lease-rules.yaml, tests/unit/test_chart.py), in the release namespace only.
LEASE_API_CALLS: dict[tuple[str, str], set[str]] = {
    ("coordination.k8s.io", "leases"): {"list", "create", "update"},
}
#: a holder stops working on a shard this share of the Lease duration after its last renewal was sent
#: (client-go's renewDeadline 10 s of leaseDuration 15 s), and tries to renew every PERIOD_SHARE of it
RENEW_DEADLINE_SHARE = 2 / 3
PERIOD_SHARE = 1 / 5
LABEL = {"app.kubernetes.io/managed-by": "kvtune-operator", "kvtune.io/lease": "shard"}


class LeaseConflict(RuntimeError):
    """The apiserver refused a conditional write: somebody else wrote the Lease first."""


class LeaseUnavailable(RuntimeError):
    """The apiserver did not answer, or answered an error other than a conflict."""


def _micro_time(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record_of(obj: dict[str, Any], default_duration_s: float) -> LeaseRecord:
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    return LeaseRecord(name=meta.get("name", ""), holder=spec.get("holderIdentity") or None,
                       duration_s=float(spec.get("leaseDurationSeconds") or default_duration_s),
                       resource_version=str(meta.get("resourceVersion", "")),
                       transitions=int(spec.get("leaseTransitions") or 0))


class LeaseClient:
    """coordination.k8s.io/v1 Leases of one namespace, as plain dicts."""

    def __init__(self, api_client: Any, namespace: str, *, timeout_s: float = 5.0):
        from kubernetes import client

        self.api = client.CoordinationV1Api(api_client)
        self.namespace, self.timeout_s = namespace, timeout_s

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError as TransportError

        try:
            resp = fn(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
        except ApiException as e:
            if e.status == 409:
                raise LeaseConflict(f"Lease write refused: {e.reason}") from None
            raise LeaseUnavailable(f"Lease call failed ({e.status} {e.reason})") from None
        except (TransportError, OSError) as e:
            raise LeaseUnavailable(f"cannot reach the Kubernetes API: {e}") from None
        return json.loads(resp.data) if resp.data else {}

    def list(self) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in LABEL.items())
        return list(self._call(self.api.list_namespaced_lease, self.namespace, label_selector=selector)
                    .get("items") or [])

    def write(self, action: Action, identity: str, duration_s: float, now_wall: float) -> dict[str, Any]:
        """Create, take, renew or hand back one Lease, conditional on ``action.resource_version``."""
        holding = action.kind != "release"
        spec: dict[str, Any] = {"holderIdentity": identity if holding else None,
                                "leaseDurationSeconds": int(round(duration_s)),
                                "renewTime": _micro_time(now_wall), "leaseTransitions": action.transitions}
        if action.kind in ("acquire", "create"):
            spec["acquireTime"] = _micro_time(now_wall)
        meta: dict[str, Any] = {"name": action.name, "namespace": self.namespace, "labels": dict(LABEL)}
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}
        if action.kind == "create":
            return self._call(self.api.create_namespaced_lease, self.namespace, body)
        meta["resourceVersion"] = action.resource_version
        if action.kind == "renew":  # keep the acquire time of the holding
            spec.pop("acquireTime", None)
        return self._call(self.api.replace_namespaced_lease, action.name, self.namespace, body)


class ShardKeeper:
    """Keeps this replica's shards: every ``period_s`` lists the Leases, plans (`ShardTable.plan`) and
    writes. ``owns(namespace, name)`` is what the handlers ask before any work. Runs in a thread."""

    def __init__(self, client: LeaseClient, table: ShardTable, *, period_s: float,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.client, self.table, self.period_s = client, table, period_s
        self.clock, self.wall = clock, wall
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._held: list[int] = []

    def owns(self, namespace: str, name: str) -> bool:
        with self._lock:
            return self.table.owns(namespace, name, self.clock())

    def held(self) -> list[int]:
        with self._lock:
            return self.table.held(self.clock())

    def sync(self) -> None:
        """One round: list, plan, write. Failures leave the table to let held shards lapse in time.
        The lock guards the table, never a network call: `owns` answers at once."""
        try:
            leases = self.client.list()
        except (LeaseUnavailable, LeaseConflict) as e:
            log.warning("cannot list the shard Leases (%s); held shards lapse unless renewed in time", e)
            with self._lock:
                self._report()
            return
        with self._lock:
            self.table.observe([record_of(o, self.table.duration_s) for o in leases], self.clock())
            actions = self.table.plan(self.clock())
            self.table.stop_excess(actions)
        for action in actions:
            sent = self.clock()
            try:
                obj = self.client.write(action, self.table.identity, self.table.duration_s, self.wall())
            except LeaseConflict:
                with self._lock:
                    self.table.failed(action, conflict=True)
                continue
            except LeaseUnavailable as e:
                log.warning("Lease %s: %s failed: %s", action.name, action.kind, e)
                with self._lock:
                    self.table.failed(action, conflict=False)
                continue
            with self._lock:
                self.table.succeeded(action, sent, record_of(obj, self.table.duration_s))
        with self._lock:
            self._report()

    def _report(self) -> None:
        held = self.table.held(self.clock())
        gained, lost = sorted(set(held) - set(self._held)), sorted(set(self._held) - set(held))
        if gained:
            log.info("replica %s now holds shards %s (of %d): reconciling and tuning their objects",
                     self.table.identity, gained, self.table.shards)
        if lost:
            log.info("replica %s no longer holds shards %s: stopped reconciling and tuning their objects",
                     self.table.identity, lost)
        self._held = held

    def start(self) -> None:
        self.sync()
        self._thread = threading.Thread(target=self._run, name="kvtune-shards", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - the keeper must keep running; held shards lapse meanwhile
                log.exception("shard Lease round failed")

    def stop(self) -> None:
        """Stop working on every shard, then hand the Leases back (so another replica need not wait
        for them to expire)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.period_s + self.client.timeout_s + 1)
        with self._lock:
            for action in self.table.release_all():
                try:
                    self.client.write(action, self.table.identity, self.table.duration_s, self.wall())
                except (LeaseConflict, LeaseUnavailable) as e:
                    log.warning("Lease %s not handed back (%s): it expires by itself", action.name, e)
            self._report()


def keeper_for(settings: Any, api_client: Any, environ: Mapping[str, str] | None = None) -> ShardKeeper | None:
    """The shard keeper the settings ask for (``shards`` > 0), else None: one replica, no Lease.
    Raises ValueError, saying what is missing, when the Leases' namespace is unknown."""
    if not settings.shards:
        return None
    environ = os.environ if environ is None else environ
    identity = settings.identity or environ.get("POD_NAME") or socket.gethostname()
    namespace = settings.lease_namespace or environ.get("POD_NAMESPACE")
    if not namespace:
        raise ValueError(f"shards is {settings.shards} but the shard Leases have no namespace: set "
                         "KVTUNE_LEASE_NAMESPACE (or POD_NAMESPACE) to the operator's own namespace")
    table = ShardTable(identity, settings.shards, duration_s=settings.lease_duration,
                       renew_deadline_s=settings.lease_duration * RENEW_DEADLINE_SHARE)
    return ShardKeeper(LeaseClient(api_client, namespace), table, period_s=settings.lease_duration * PERIOD_SHARE)
