"""Several operator replicas (issue 22): the shard Leases' rules against a fake clock and an in-memory
Lease store that answers like the apiserver (conditional create and update, resourceVersion bumps).

What a user relies on: every object is worked on by exactly one replica at any moment, replicas share
the shards fairly, a dead replica's shards move to the living after the Lease duration and never
before its own deadline has stopped it, and a stale write is refused."""
from __future__ import annotations

import copy
import itertools

import pytest

from kvtune_operator.kube import KubeError
from kvtune_operator.leases import LeaseConflict, LeaseUnavailable, ShardKeeper, keeper_for, record_of
from kvtune_operator.reconcile import Reconciler
from kvtune_operator.settings import Settings
from kvtune_operator.shards import ShardTable, fair_share, shard_of

from test_operator_reconcile import SPEC, FakeKube

SHARDS, DURATION, DEADLINE, PERIOD = 16, 15.0, 10.0, 3.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class LeaseStore:
    """Leases of one namespace as the apiserver keeps them: create fails when the name exists,
    update unless the resourceVersion is the current one; every write bumps the resourceVersion."""

    def __init__(self) -> None:
        self.leases: dict[str, dict] = {}
        self.rv = itertools.count(1)
        self.down = False
        self.writes: list[tuple[str, str, str | None]] = []  # (kind, lease, holder)

    def client(self) -> "StoreClient":
        return StoreClient(self)


class StoreClient:
    timeout_s = 1.0

    def __init__(self, store: LeaseStore):
        self.store = store

    def list(self) -> list[dict]:
        if self.store.down:
            raise LeaseUnavailable("cannot reach the Kubernetes API")
        return copy.deepcopy(list(self.store.leases.values()))

    def write(self, action, identity, duration_s, now_wall):
        s = self.store
        if s.down:
            raise LeaseUnavailable("cannot reach the Kubernetes API")
        holder = identity if action.kind != "release" else None
        if action.kind == "create":
            if action.name in s.leases:
                raise LeaseConflict("exists")
        elif s.leases[action.name]["metadata"]["resourceVersion"] != action.resource_version:
            raise LeaseConflict("resourceVersion")
        s.leases[action.name] = {"metadata": {"name": action.name, "resourceVersion": str(next(s.rv))},
                                 "spec": {"holderIdentity": holder, "leaseDurationSeconds": int(duration_s),
                                          "leaseTransitions": action.transitions}}
        s.writes.append((action.kind, action.name, holder))
        return copy.deepcopy(s.leases[action.name])


def replica(name: str, store: LeaseStore, clock: Clock) -> ShardKeeper:
    table = ShardTable(name, SHARDS, duration_s=DURATION, renew_deadline_s=DEADLINE)
    return ShardKeeper(store.client(), table, period_s=PERIOD, clock=clock, wall=clock)


def held(k: ShardKeeper) -> set[int]:
    return set(k.held())


def assert_disjoint(*keepers: ShardKeeper) -> None:
    for a, b in itertools.combinations(keepers, 2):
        both = held(a) & held(b)
        assert not both, f"shards {sorted(both)} counted as their own by {a.table.identity} and {b.table.identity}"


def run(clock: Clock, keepers: list[ShardKeeper], seconds: float, *, dead: tuple[ShardKeeper, ...] = ()) -> None:
    """Advance time in steps of a tenth of a second, each live keeper syncing every PERIOD; the
    invariant is checked at every step, the dead keepers' own view included (they no longer sync)."""
    next_sync = {id(k): clock.t for k in keepers}
    end = clock.t + seconds
    while clock.t < end:
        for k in keepers:
            if k not in dead and clock.t >= next_sync[id(k)]:
                k.sync()
                next_sync[id(k)] = clock.t + PERIOD
            assert_disjoint(*keepers)
        clock.t = round(clock.t + 0.1, 3)


def test_shard_of_is_stable_in_range_and_spreads():
    assert shard_of("llm", "qwen", 16) == shard_of("llm", "qwen", 16)
    got = {shard_of(f"ns{i % 10}", f"d{i}", 16) for i in range(200)}
    assert got == set(range(16))  # 200 objects reach every shard
    assert shard_of("a", "bc", 16) != shard_of("ab", "c", 16) or shard_of("a", "bc", 7) != shard_of("ab", "c", 7)
    with pytest.raises(ValueError, match="at least 1"):
        shard_of("a", "b", 0)


def test_fair_share_is_the_ceiling():
    assert [fair_share(16, n) for n in (0, 1, 2, 3, 16, 17)] == [16, 16, 8, 6, 1, 1]


def test_one_replica_takes_every_shard_at_once():
    store, clock = LeaseStore(), Clock()
    a = replica("a", store, clock)
    a.sync()
    assert held(a) == set(range(SHARDS))
    assert all(a.owns("llm", f"d{i}") for i in range(50))
    holders = {n: o["spec"]["holderIdentity"] for n, o in store.leases.items()}
    assert holders == {**{f"kvtune-shard-{i}": "a" for i in range(SHARDS)}, "kvtune-member-0": "a"}


def test_a_second_replica_gets_half_and_no_shard_is_ever_held_twice():
    store, clock = LeaseStore(), Clock()
    a, b = replica("a", store, clock), replica("b", store, clock)
    a.sync()
    run(clock, [a, b], 3 * PERIOD)
    assert len(held(a)) == len(held(b)) == SHARDS // 2 and held(a) | held(b) == set(range(SHARDS))
    # a handed back the shards it gave up (no waiting for them to expire): b took them right away
    assert [w for w in store.writes if w[0] == "release"] and not [w for w in store.writes if w[2] is None
                                                                    and store.leases[w[1]]["spec"]["holderIdentity"] is None]
    c = replica("c", store, clock)
    run(clock, [a, b, c], 4 * PERIOD)
    sizes = sorted(len(held(k)) for k in (a, b, c))
    assert sum(sizes) == SHARDS and max(sizes) <= fair_share(SHARDS, 3), sizes


def test_a_dead_replica_stops_before_its_shards_move_and_they_move_within_the_lease_duration():
    store, clock = LeaseStore(), Clock()
    a, b = replica("a", store, clock), replica("b", store, clock)
    a.sync()
    run(clock, [a, b], 3 * PERIOD)
    a_shards = held(a)
    died = clock.t
    run(clock, [a, b], DURATION + 2 * PERIOD, dead=(a,))  # a's own view checked too: it lapses first
    assert held(a) == set() and held(b) == set(range(SHARDS))
    # b took a's shards only after a whole Lease duration on its clock since a last renewed
    taken = [w for w in store.writes if w[0] == "acquire" and w[2] == "b" and int(w[1].rsplit("-", 1)[1]) in a_shards]
    assert taken
    assert clock.t - died <= DURATION + 3 * PERIOD


def test_a_replica_that_cannot_renew_stops_at_its_deadline():
    store, clock = LeaseStore(), Clock()
    a = replica("a", store, clock)
    a.sync()
    renewed = clock.t
    store.down = True
    while clock.t < renewed + DEADLINE - 0.1:
        clock.t += 0.5
        a.sync()
        assert held(a) == set(range(SHARDS)) or clock.t >= renewed + DEADLINE
    clock.t = renewed + DEADLINE
    a.sync()
    assert held(a) == set() and not a.owns("llm", "qwen")
    store.down = False  # nobody else took them: renewing with the same resourceVersion works
    a.sync()
    assert held(a) == set(range(SHARDS))


def test_a_conflicting_write_is_never_ownership():
    """b plans from an old list (a's Leases look expired to it) while a has renewed since: every
    write of b carries a stale resourceVersion, the store refuses it, and b owns nothing."""
    store, clock = LeaseStore(), Clock()
    a, b = replica("a", store, clock), replica("b", store, clock)
    a.sync()
    b.table.observe([record_of(o, DURATION) for o in b.client.list()], clock.t)
    clock.t += DURATION + 1
    a.sync()
    actions = b.table.plan(clock.t)
    # to b, a looks dead: b plans to take every shard and a member Lease
    assert {x.kind for x in actions} == {"acquire"} and len(actions) == SHARDS + 1
    for action in actions:
        with pytest.raises(LeaseConflict):
            b.client.write(action, "b", DURATION, clock.t)
        b.table.failed(action, conflict=True)
    assert held(b) == set() and held(a) == set(range(SHARDS))


def test_stopping_hands_every_lease_back():
    store, clock = LeaseStore(), Clock()
    a, b = replica("a", store, clock), replica("b", store, clock)
    a.sync()
    a.stop()
    assert held(a) == set()
    assert {o["spec"]["holderIdentity"] for o in store.leases.values()} == {None}
    b.sync()  # b need not wait for a Lease duration
    assert held(b) == set(range(SHARDS))


def test_table_refuses_unsafe_settings():
    with pytest.raises(ValueError, match="shorter than the Lease duration"):
        ShardTable("a", 16, duration_s=10, renew_deadline_s=10)
    with pytest.raises(ValueError, match="identity"):
        ShardTable("", 16, duration_s=15, renew_deadline_s=10)


def test_settings_and_keeper_for():
    assert keeper_for(Settings(), api_client=None) is None  # the default: one replica, no Lease
    with pytest.raises(ValueError, match="KVTUNE_LEASE_NAMESPACE"):
        keeper_for(Settings(shards=16), api_client=None, environ={})
    k = keeper_for(Settings(shards=8, lease_duration=30), api_client=None,
                   environ={"POD_NAME": "kvtune-7f9-abc", "POD_NAMESPACE": "kvtune-system"})
    assert (k.table.identity, k.table.shards, k.client.namespace) == ("kvtune-7f9-abc", 8, "kvtune-system")
    assert k.table.renew_deadline_s < k.table.duration_s == 30
    with pytest.raises(ValueError, match="shards"):
        Settings(shards=-1)
    assert Settings.from_env({"KVTUNE_SHARDS": "16", "KVTUNE_IDENTITY": "p-1"}).shards == 16


# -- the last check before a write (Reconciler) ------------------------------------------------------

class PreconditionKube(FakeKube):
    """FakeKube whose status patch honours a resourceVersion precondition, as the apiserver does."""

    def __init__(self) -> None:
        super().__init__()
        self.preconditions: list[str] = []

    def patch_infd_status(self, namespace, name, status, resource_version=None):
        if resource_version is not None:
            self.preconditions.append(resource_version)
            if self.infd(name, namespace)["metadata"]["resourceVersion"] != resource_version:
                raise KubeError("the object has been modified", 409)
        out = super().patch_infd_status(namespace, name, status)
        out["metadata"]["resourceVersion"] = self._bump()
        return out


def _reconciler() -> tuple[PreconditionKube, Reconciler]:
    kube = PreconditionKube()
    kube.add_infd(copy.deepcopy(SPEC))
    return kube, Reconciler(kube, Settings())


def test_a_replica_without_the_shard_writes_nothing():
    kube, rec = _reconciler()
    rec.owns = lambda namespace, name: False
    out = rec.reconcile("llm", "qwen", status_update={"tuning": {"phase": "Verifying"}}, basis={})
    assert out.refused and "another replica" in out.refused
    assert not [c for c in kube.calls if c[1] in ("patch", "create")] and kube.infd()["status"] == {}
    assert not kube.events


def test_a_round_from_a_stale_tuner_state_is_refused_and_a_current_one_written_conditionally():
    kube, rec = _reconciler()
    rec.owns = lambda namespace, name: True
    rec.reconcile("llm", "qwen")
    basis = copy.deepcopy(kube.infd()["status"].get("tuning") or {})
    kube.infd()["status"]["tuning"] = {**basis, "phase": "Verifying", "message": "another replica's round"}
    out = rec.reconcile("llm", "qwen", status_update={"tuning": {**basis, "phase": "Observing"}}, basis=basis)
    assert out.refused and "changed since" in out.refused
    assert kube.infd()["status"]["tuning"]["message"] == "another replica's round"
    kube.infd()["status"]["tuning"] = basis
    out = rec.reconcile("llm", "qwen", status_update={"tuning": {**basis, "phase": "Observing"}}, basis=basis)
    assert out.refused is None and out.retry is None
    assert kube.infd()["status"]["tuning"]["phase"] == "Observing" and kube.preconditions


def test_one_replica_writes_as_before():
    """No shards: no ownership check, no precondition, whatever the tuner passes."""
    kube, rec = _reconciler()
    out = rec.reconcile("llm", "qwen", status_update={"tuning": {"phase": "Observing"}}, basis={"phase": "X"})
    assert out.refused is None and not kube.preconditions
    assert kube.infd()["status"]["tuning"]["phase"] == "Observing"


def test_handlers_leave_other_replicas_objects_alone():
    """With a keeper the registry keeps the Leases from startup to cleanup, and the reconcile, refresh
    and tune handlers return at once for an object whose shard the replica does not hold (the
    Reconciler has no cluster here: any call would fail)."""
    from kvtune_operator.handlers import build_registry

    store, clock = LeaseStore(), Clock()
    other = replica("other", store, clock)
    other.sync()  # holds every shard
    me = replica("me", store, clock)
    me.sync()
    settings = Settings(shards=SHARDS)
    rec = Reconciler(kube=None, settings=settings)
    registry = build_registry(settings, rec, me)
    assert rec.owns == me.owns and not me.owns("llm", "qwen")
    activities = {h.id.rsplit(".", 1)[-1] for h in registry._activities.get_all_handlers()}
    assert {"take_shards", "hand_back_shards"} <= activities
    calls: list = []
    rec.reconcile = lambda *a, **k: calls.append(a)  # type: ignore[method-assign]
    handlers = [*registry._changing.get_all_handlers(), *registry._spawning.get_all_handlers()]
    ran = set()
    for h in handlers:
        if h.id in ("reconcile", "refresh", "tune"):
            assert h.fn(namespace="llm", name="qwen", retry=0, body={}, memo={}) is None, h.id
            ran.add(h.id)
    assert ran == {"reconcile", "refresh", "tune"} and calls == []
    one = Reconciler(kube=None, settings=Settings())
    build_registry(Settings(), one)
    assert one.owns is None  # one replica: no check at all
