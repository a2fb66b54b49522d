"""The tuning rounds' queue: at most ``capacity`` rounds at once, the one due longest first.

Invariant owned here: a due deployment waits only for rounds that were due before it (or at the same
time, by name), so none starves however long rounds take: while it waits its due time is fixed, and
a deployment that runs again has a new due time (its start plus its interval) later than its last,
so only finitely many rounds can pass it. At most ``capacity`` rounds run at once, whatever the
number of deployments.

Each deployment's kopf timer offers its round every poll (``offer``); it starts only if it is among
the ``capacity - running`` longest-due waiting ones, and otherwise keeps its place and asks again at
its next poll (never blocking a thread of kopf's executor, which the reconcile handlers share). A
deployment that stops asking (deleted, autotune Off, another replica's now) leaves the queue after
``stale_after_s``, so it never holds a place it no longer uses. Pure and thread-safe; the clock is the
caller's (``now``), so tests drive it by hand.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True)
class Admission:
    """A round allowed to start: how late it starts (its due time to now, seconds)."""

    key: Hashable
    due_at: float
    started_at: float

    @property
    def lag_s(self) -> float:
        return max(0.0, self.started_at - self.due_at)


@dataclass
class _Waiting:
    due_at: float
    last_offer: float


class RoundQueue:
    """Fair admission of tuning rounds (see the module docstring)."""

    def __init__(self, capacity: int, *, stale_after_s: float) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 round at once, not {capacity}")
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be positive, not {stale_after_s}")
        self.capacity, self.stale_after_s = capacity, stale_after_s
        self._waiting: dict[Hashable, _Waiting] = {}
        self._running: set[Hashable] = set()
        self._late: set[Hashable] = set()
        self._lock = threading.Lock()

    def offer(self, key: Hashable, due_at: float, now: float) -> Admission | None:
        """``key``'s round is due at ``due_at``: an Admission if it may start now (the caller then
        runs it and calls ``done``), else None: it keeps its place (its first due time) until its
        next offer."""
        with self._lock:
            if key in self._running:
                return None
            self._drop_stale(now)
            entry = self._waiting.get(key)
            if entry is None:
                entry = self._waiting[key] = _Waiting(due_at, now)
            else:
                entry.due_at, entry.last_offer = min(entry.due_at, due_at), now
            free = self.capacity - len(self._running)
            if free <= 0:
                return None
            ahead = sorted(self._waiting, key=lambda k: (self._waiting[k].due_at, str(k)))[:free]
            if key not in ahead:
                return None
            del self._waiting[key]
            self._running.add(key)
            return Admission(key, entry.due_at, now)

    def done(self, key: Hashable, *, late: bool = False) -> None:
        """The round of ``key`` ended (however it ended): its slot is free. ``late``: it started more
        than one interval after it was due (counted in ``late`` until its next round is on time)."""
        with self._lock:
            self._running.discard(key)
            (self._late.add if late else self._late.discard)(key)

    def withdraw(self, key: Hashable) -> None:
        """``key`` no longer wants a round (autotune Off): it leaves the queue now."""
        with self._lock:
            self._waiting.pop(key, None)
            self._late.discard(key)

    def _drop_stale(self, now: float) -> None:
        for k in [k for k, w in self._waiting.items() if now - w.last_offer > self.stale_after_s]:
            del self._waiting[k]

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._running)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def late(self) -> int:
        with self._lock:
            return len(self._late)
