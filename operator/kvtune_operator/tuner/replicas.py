"""How many replicas meet the objectives, when one engine is saturated and no knob helps.

The trace is split across N replicas the way a router would split it, each replica's share is
replayed through the simulator (``simulate``: the engine's own scheduler and block pool), and the
per-request figures of all replicas are pooled into one summary of the fleet (goodput, throughput,
p95 TTFT / TPOT / queue time over every request, not an average of per-replica percentiles).

Routers:

- ``round-robin``: request i goes to replica i mod N (arrival order).
- ``least-loaded``: each request goes to the replica with the fewest requests in flight (arrived and
  not finished) at its arrival, ties to the next replica in round-robin order. In-flight counts come
  from the simulator itself: the N engines are stepped side by side in virtual time (``Replica``:
  the simulator's ``SimEngine`` and ``Replay``, the very loop and step costs of ``simulate``), so a
  replica that is slow to drain, or on a slow stretch of the machine, gets fewer new requests.

Pure: no clock, no I/O. About as fast as simulating the trace once per N tried.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from kvtune_engine.config import EngineConfig
from kvtune_engine.quantile import percentile
from kvtune_engine.request import Request
from kvtune_engine.sim.profile import Profile
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_engine.sim.stepper import Replay, SimEngine
from kvtune_engine.sim.trace import TraceRequest

ROUTERS = ("round-robin", "least-loaded")


class Replica:
    """One engine stepped in virtual time by the simulator's own ``Replay`` of a ``SimEngine`` (the
    requests, steps and step costs of ``simulate``, machine speed included), fed one arrival at a
    time, so a router can ask how many requests it has in flight at each arrival. Request j of a
    replica is request j of its share in ``simulate``, so every step is the same."""

    def __init__(self, config: EngineConfig, profile: Profile) -> None:
        self.replay = Replay(SimEngine(config, profile), on_done=self._finished,
                             on_reject=lambda j, r: self._done(j, r.arrival_s))
        self.assigned = self.finished = 0
        self.finish_s: dict[int, float] = {}     # local index -> finish (or rejection) time
        self._last = (float("-inf"), 0)          # (end, finishers) of the last step that finished any

    def add(self, r: TraceRequest) -> None:
        """Assign a request (arrivals in order, each at or after the previous one)."""
        self.replay.feed(self.assigned, r)
        self.assigned += 1

    def in_flight(self, t: float) -> int:
        """Requests assigned, arrived by ``t`` and not finished at ``t`` (call ``advance(t)`` first).
        Only the last step run can end after ``t``: its finishers still count."""
        end, n = self._last
        return self.assigned - self.finished + (n if end > t else 0)

    def advance(self, t: float) -> None:
        """Run every step that starts before ``t`` (a step starting at ``t`` may admit an arrival at ``t``)."""
        self.replay.advance(t)

    def _finished(self, done: list[Request], end: float) -> None:
        for d in done:
            self._done(int(d.request_id[1:]), end)
        self._last = (end, len(done))

    def _done(self, j: int, at: float) -> None:
        self.finish_s[j] = at
        self.finished += 1


def route(trace: Sequence[TraceRequest], n: int, router: str, config: EngineConfig | None = None,
          profile: Profile | None = None) -> list[list[TraceRequest]]:
    """The trace's share of each of ``n`` replicas (each in arrival order). ``least-loaded`` needs
    the config and profile the replicas run (it simulates them to know what is in flight)."""
    if n < 1:
        raise ValueError(f"replicas must be >= 1 (got {n})")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)} (got {router!r})")
    order = sorted(trace, key=lambda r: r.arrival_s)
    parts: list[list[TraceRequest]] = [[] for _ in range(n)]
    if router == "round-robin" or n == 1:
        for i, r in enumerate(order):
            parts[i % n].append(r)
        return parts
    if config is None or profile is None:
        raise ValueError("least-loaded routing needs the engine config and profile")
    fleet = [Replica(config, profile) for _ in range(n)]
    last = n - 1
    for r in order:
        best, best_load = -1, 0
        for step in range(1, n + 1):
            k = (last + step) % n
            rep = fleet[k]
            rep.advance(r.arrival_s)
            load = rep.in_flight(r.arrival_s)
            if best < 0 or load < best_load:
                best, best_load = k, load
        fleet[best].add(r)
        parts[best].append(r)
        last = best
    return parts


@dataclass(frozen=True)
class FleetFigures:
    """The pooled prediction for N replicas."""
    replicas: int
    router: str
    requests: int
    meeting_slo: int
    goodput_share: float             # requests meeting the SLO / all requests of the trace
    goodput_requests_per_s: float    # over the fleet's span: first arrival to last finish
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    queue_time_p95_s: float | None
    duration_s: float
    rejected: int
    preemptions: int
    per_replica_requests: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_replica_requests"] = list(self.per_replica_requests)
        return d


def combine(summaries: Sequence[dict], slo: SLO, replicas: int, router: str,
            shares: Sequence[Sequence[TraceRequest]]) -> FleetFigures:
    """Pool the ``simulate(..., per_request=True)`` summaries of the replicas into fleet figures."""
    ttft, tpot, queue = [], [], []
    good = finished = out_tokens = rejected = pre = total = 0
    start, end = float("inf"), float("-inf")
    for s, share in zip(summaries, shares):
        if not share:
            continue
        total += len(share)
        first = min(r.arrival_s for r in share)
        start = min(start, first)
        end = max(end, first + s["duration_s"])
        finished += s["requests"]["finished"]
        rejected += s["requests"]["rejected"]
        out_tokens += s["output_tokens"]
        pre += s["preemptions"]["swap"] + s["preemptions"]["recompute"]
        for row in s["per_request"]:
            t1 = row["ttft_s"]
            n_out = row["output_tokens"]
            t2 = (row["e2e_s"] - t1) / (n_out - 1) if n_out > 1 else None
            ttft.append(t1)
            queue.append(row["queue_s"])
            if t2 is not None:
                tpot.append(t2)
            good += slo.met(t1, t2)
    dur = max(end - start, 1e-12)
    for v in (ttft, tpot, queue):
        v.sort()
    return FleetFigures(replicas, router, total, good, good / total if total else 0.0, good / dur, finished / dur,
                        out_tokens / dur, percentile(ttft, 0.95), percentile(tpot, 0.95), percentile(queue, 0.95),
                        dur, rejected, pre, tuple(len(p) for p in shares))


def simulate_fleet(trace: Sequence[TraceRequest], config: EngineConfig, profile: Profile, slo: SLO,
                   replicas: int, router: str = "least-loaded") -> FleetFigures:
    """N replicas of ``config`` behind ``router``: each share simulated, the figures pooled."""
    shares = route(trace, replicas, router, config, profile)
    summaries = [simulate(list(p), config, profile, slo, per_request=True) if p else {} for p in shares]
    return combine(summaries, slo, replicas, router, shares)


@dataclass
class ReplicaPrediction:
    """The least number of replicas whose pooled goodput share meets ``target_share`` (None: not
    within ``max_replicas``), with the figures of every N tried (1 up to the answer)."""
    replicas: int | None
    target_share: float
    router: str
    max_replicas: int
    figures: list[FleetFigures] = field(default_factory=list)

    @property
    def message(self) -> str:
        one = self.figures[0]
        if self.replicas is None:
            last = self.figures[-1]
            many = f"{last.replicas} replicas ({self.router} routing)" if last.replicas > 1 else "1 replica"
            return (f"{many} meet{'s' if last.replicas == 1 else ''} the objectives for only "
                    f"{last.goodput_share:.0%} of requests (target {self.target_share:.0%}); no count up to "
                    f"{self.max_replicas} predicted to reach it")
        got = self.figures[self.replicas - 1]
        if self.replicas == 1:
            return f"1 replica meets the objectives for {got.goodput_share:.0%} of requests"
        return (f"{self.replicas} replicas ({self.router} routing) meet the objectives for {got.goodput_share:.0%} "
                f"of requests (target {self.target_share:.0%}); 1 replica: {one.goodput_share:.0%}")

    def to_dict(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "target_share": self.target_share, "router": self.router,
                "max_replicas": self.max_replicas, "message": self.message,
                "figures": [f.to_dict() for f in self.figures]}


def predict_replicas(trace: Sequence[TraceRequest], config: EngineConfig, profile: Profile, slo: SLO, *,
                     target_share: float = 0.95, max_replicas: int = 8, router: str = "least-loaded"
                     ) -> ReplicaPrediction:
    """Try N = 1, 2, ... ``max_replicas`` and stop at the first whose goodput share meets the target."""
    if not 0.0 < target_share <= 1.0:
        raise ValueError(f"target_share must be in (0, 1] (got {target_share})")
    if max_replicas < 1:
        raise ValueError(f"max_replicas must be >= 1 (got {max_replicas})")
    if not trace:
        raise ValueError("empty trace")
    pred = ReplicaPrediction(None, target_share, router, max_replicas)
    for n in range(1, max_replicas + 1):
        f = simulate_fleet(trace, config, profile, slo, n, router)
        pred.figures.append(f)
        if f.goodput_share >= target_share:
            pred.replicas = n
            break
    return pred


__all__ = ["FleetFigures", "ROUTERS", "Replica", "ReplicaPrediction", "combine", "predict_replicas", "route",
           "simulate_fleet"]
