"""Which operator replica owns which InferenceDeployment: shards held through Leases (pure logic).

Invariant owned here: an object is worked on (reconciled, tuned) only by the replica that holds its
shard's Lease, and a holder stops working on a shard *before* any other replica may regard that Lease
as expired. The rules are Kubernetes' usual Lease rules, no consensus of our own:

* ``shard_of`` puts an object in one of ``shards`` shards by a stable hash of namespace/name, so every
  replica computes the same shard without talking to the others.
* A Lease is expired for an observer when ``leaseDurationSeconds`` have passed on the *observer's own
  clock* since it first saw the Lease's current resourceVersion (as client-go's leader election does):
  no replica compares its clock with another's wall clock, only durations.
* The holder counts a shard as its own only until ``renew_deadline`` after the moment it *sent* its
  last successful renewal (taken before the request, so before the apiserver recorded it); the
  deadline is shorter than the Lease duration, so a replica that cannot renew stops first.
* Each replica aims at a fair share, ceil(shards / live replicas); live replicas are the holders of
  unexpired Leases: the shard Leases and one member Lease per replica (``kvtune-member-<j>``), which a
  replica holding no shard yet uses to be counted. It takes free or expired shards up to its share and
  hands back (clears the holder of) the shards above it, after it has stopped working on them.

`ShardTable` is the state machine; `leases.ShardKeeper` does the I/O against the apiserver.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Iterable

SHARD_PREFIX = "kvtune-shard-"
MEMBER_PREFIX = "kvtune-member-"


def shard_of(namespace: str, name: str, shards: int) -> int:
    """The shard of an object: a stable hash of namespace/name (the same in every replica and release)."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % shards


def shard_lease(i: int) -> str:
    return f"{SHARD_PREFIX}{i}"


def member_lease(j: int) -> str:
    return f"{MEMBER_PREFIX}{j}"


def fair_share(shards: int, live: int) -> int:
    """How many shards one of ``live`` replicas holds at most: ceil(shards / live)."""
    return math.ceil(shards / max(1, live))


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    """What the apiserver holds for one Lease (the fields the rules read)."""

    name: str
    holder: str | None
    duration_s: float
    resource_version: str
    transitions: int = 0


@dataclasses.dataclass(frozen=True)
class Action:
    """One write to make: ``kind`` acquire | renew | release | create, on Lease ``name``.
    ``resource_version``: the precondition (None for create)."""

    kind: str
    name: str
    resource_version: str | None = None
    transitions: int = 0


class ShardTable:
    """One replica's view of the Leases and of what it may work on, driven by an explicit clock."""

    def __init__(self, identity: str, shards: int, *, duration_s: float, renew_deadline_s: float):
        if not identity:
            raise ValueError("a replica identity is needed (the pod name: POD_NAME from the downward API)")
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards}")
        if not 0 < renew_deadline_s < duration_s:
            raise ValueError(f"the renew deadline ({renew_deadline_s}s) must be shorter than the Lease duration "
                             f"({duration_s}s): a replica must stop before others may take its shards")
        self.identity, self.shards = identity, shards
        self.duration_s, self.renew_deadline_s = duration_s, renew_deadline_s
        #: Lease name -> (resourceVersion first seen, local time first seen)
        self._observed: dict[str, tuple[str, float]] = {}
        #: Lease name -> local time until which this replica may work on it (held shards and member)
        self._valid_until: dict[str, float] = {}
        self._leases: dict[str, LeaseRecord] = {}

    # -- what may be worked on -------------------------------------------------------------------

    def owns_shard(self, i: int, now: float) -> bool:
        return self._valid_until.get(shard_lease(i), -math.inf) > now

    def owns(self, namespace: str, name: str, now: float) -> bool:
        return self.owns_shard(shard_of(namespace, name, self.shards), now)

    def held(self, now: float) -> list[int]:
        return [i for i in range(self.shards) if self.owns_shard(i, now)]

    # -- reading the Leases ------------------------------------------------------------------------

    def observe(self, leases: Iterable[LeaseRecord], now: float) -> None:
        """A fresh list of the Leases: note when each resourceVersion was first seen."""
        self._leases = {}
        for lease in leases:
            if not (lease.name.startswith(SHARD_PREFIX) or lease.name.startswith(MEMBER_PREFIX)):
                continue
            self._leases[lease.name] = lease
            seen = self._observed.get(lease.name)
            if seen is None or seen[0] != lease.resource_version:
                self._observed[lease.name] = (lease.resource_version, now)
            if lease.holder != self.identity:  # somebody else holds it (or nobody): not ours, whatever we thought
                self._valid_until.pop(lease.name, None)

    def expired(self, name: str, now: float) -> bool:
        """Free, or not renewed for a whole Lease duration on this replica's clock."""
        lease = self._leases.get(name)
        if lease is None or not lease.holder:
            return True
        _, seen = self._observed[name]
        return now >= seen + lease.duration_s

    def live_replicas(self, now: float) -> set[str]:
        """Holders of unexpired Leases (shards and members), this replica included."""
        return {lease.holder for lease in self._leases.values()
                if lease.holder and not self.expired(lease.name, now)} | {self.identity}

    # -- deciding -------------------------------------------------------------------------------

    def plan(self, now: float) -> list[Action]:
        """The writes of one round: create missing Leases (as their holder), keep one member Lease,
        renew the shards held up to the fair share, release those above it, take free or expired
        ones below it (lowest shard first). Releases are planned only for shards this replica has
        already stopped working on (`stop_excess` runs first)."""
        actions: list[Action] = []
        mine = lambda n: (lease := self._leases.get(n)) is not None and lease.holder == self.identity  # noqa: E731

        members = [member_lease(j) for j in range(self.shards)]
        member = next((n for n in members if mine(n)), None)
        if member is not None:
            actions.append(self._write("renew", member))
        else:
            free = next((n for n in members if self.expired(n, now)), None)
            if free is not None:
                actions.append(self._write("acquire", free))

        share = fair_share(self.shards, len(self.live_replicas(now)))
        held = [i for i in range(self.shards) if mine(shard_lease(i))]
        keep, excess = held[:share], held[share:]
        actions += [self._write("renew", shard_lease(i)) for i in keep]
        actions += [self._write("release", shard_lease(i)) for i in excess]
        room = share - len(keep)
        for i in range(self.shards):
            if room <= 0:
                break
            name = shard_lease(i)
            if not mine(name) and self.expired(name, now):
                actions.append(self._write("acquire", name))
                room -= 1
        return actions

    def stop_excess(self, actions: Iterable[Action]) -> None:
        """Stop working on the shards about to be released (before the release is written)."""
        for a in actions:
            if a.kind == "release":
                self._valid_until.pop(a.name, None)

    def _write(self, kind: str, name: str) -> Action:
        lease = self._leases.get(name)
        if lease is None:
            return Action("create", name)
        transitions = lease.transitions + (1 if kind == "acquire" else 0)
        return Action(kind, name, lease.resource_version, transitions)

    # -- the apiserver's answers ------------------------------------------------------------------

    def succeeded(self, action: Action, sent_at: float, record: LeaseRecord) -> None:
        """A write went through; ``sent_at``: the local time taken before it was sent."""
        self._leases[action.name] = record
        self._observed[action.name] = (record.resource_version, sent_at)
        if action.kind == "release":
            self._valid_until.pop(action.name, None)
        else:
            self._valid_until[action.name] = sent_at + self.renew_deadline_s

    def failed(self, action: Action, *, conflict: bool) -> None:
        """A write did not go through. ``conflict``: the apiserver refused its resourceVersion (or the
        Lease exists already): somebody else wrote it, so it is not ours from now on. Otherwise (no
        answer) a held shard stays ours only until the deadline of the last renewal that went through."""
        if conflict or action.kind != "renew":
            self._valid_until.pop(action.name, None)

    def release_all(self) -> list[Action]:
        """On shutdown: stop everything, then hand every held Lease back."""
        actions = [self._write("release", n) for n, lease in sorted(self._leases.items())
                   if lease.holder == self.identity]
        self._valid_until.clear()
        return actions
