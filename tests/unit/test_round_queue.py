"""The tuning rounds' queue (round_queue.py) and the RoundsLate condition, on a clock of the test's own.

A fleet of N deployments polls the real RoundQueue as their kopf timers do (each at its own poll
offset), every round taking longer than the fleet's intervals allow with k rounds at once: no
deployment starves, rounds start in the order they fell due, never more than k run at once; and the
tuning loop says so in RoundsLate while its rounds start more than one interval late, and clears it
when they catch up.
"""
from __future__ import annotations

import json

import httpx
import pytest

from kvtune_operator import operator_metrics
from kvtune_operator.conditions import get_condition
from kvtune_operator.demo.engine import free_port
from kvtune_operator.reconcile import Reconciler
from kvtune_operator.round_queue import RoundQueue
from kvtune_operator.settings import Settings
from kvtune_operator.tuning import TuningLoop

from test_operator_reconcile import SPEC, FakeKube

POLL = 1.0


def run_fleet(n: int, capacity: int, *, interval, duration, horizon: float, step: float = 0.25):
    """Deployment i (interval(i), duration(i) seconds) polls every POLL s at its own offset; due at its last
    start + its interval (the first round when first polled). Returns each round's (i, due, start)
    and the most rounds seen running at once."""
    q = RoundQueue(capacity, stale_after_s=3 * POLL)
    tuned_at: dict[int, float] = {}
    first_due: dict[int, float] = {}
    ends: dict[int, float] = {}
    rounds: list[tuple[int, float, float]] = []
    most = 0
    t = 0.0
    slots = round(POLL / step)  # deployment i polls in slot i % slots of each poll period
    while t < horizon:
        for i, end in list(ends.items()):
            if end <= t:
                q.done(i)
                del ends[i]
        for i in range(n):
            if i in ends or round(t / step) % slots != i % slots:
                continue  # running, or not this deployment's poll
            due = tuned_at[i] + interval(i) if i in tuned_at else first_due.setdefault(i, t)
            if t < due:
                continue
            a = q.offer(i, due, t)
            if a is not None:
                tuned_at[i] = t
                ends[i] = t + duration(i)
                rounds.append((i, a.due_at, a.started_at))
        most = max(most, q.running)
        t = round(t + step, 6)
    return rounds, most


@pytest.mark.parametrize("n,k", [(30, 4), (100, 8), (12, 1)])
def test_no_deployment_starves_when_rounds_take_longer_than_their_intervals(n, k):
    # demand: n rounds of 3-6 s every 10-30 s, far more than k at once can carry
    interval = lambda i: 10.0 + 20.0 * (i % 3) / 2  # noqa: E731
    duration = lambda i: 3.0 + (i % 4)  # noqa: E731
    horizon = 2400.0
    rounds, most = run_fleet(n, k, interval=interval, duration=duration, horizon=horizon)
    assert most <= k
    assert sum(interval(i) for i in range(n)) and len(rounds) > 2 * n
    # overloaded: rounds do run late (the queue is needed) ...
    lags = [start - due for _, due, start in rounds]
    assert max(lags) > min(interval(i) for i in range(n))
    # ... but every deployment keeps getting its rounds, and none waits more than one turn of the
    # whole fleet (every other deployment's round once, k at a time, plus a poll)
    turn = sum(duration(i) for i in range(n)) / k + max(duration(i) for i in range(n)) + 2 * POLL
    per = {i: [s for j, _, s in rounds if j == i] for i in range(n)}
    for i, starts in per.items():
        assert len(starts) >= horizon / (interval(i) + turn) - 2, (i, len(starts))
    assert max(lags) <= turn, (max(lags), turn)
    # fair: the capacity goes to rounds by due time. Shares per deployment differ only by interval
    # (a long-interval deployment is never behind a short-interval one that was due after it)
    counts = sorted(len(s) for s in per.values())
    assert counts[0] >= counts[-1] / 3


def test_rounds_start_in_the_order_they_fell_due():
    q = RoundQueue(1, stale_after_s=10)
    assert q.offer("a", 0.0, 0.0) is not None            # a runs; b, c, d fall due while it runs
    assert q.offer("d", 3.0, 3.0) is None and q.offer("b", 1.0, 3.0) is None and q.offer("c", 2.0, 3.0) is None
    q.done("a")
    order = []
    for t in (4.0, 5.0, 6.0):
        for key, due in (("d", 3.0), ("c", 2.0), ("b", 1.0)):  # polled in the "wrong" order every time
            if key not in order and (a := q.offer(key, due, t)) is not None:
                order.append(key)
                assert a.lag_s == t - due
                q.done(key)
                break
    assert order == ["b", "c", "d"]


def test_a_deployment_that_stops_asking_leaves_the_queue():
    q = RoundQueue(1, stale_after_s=3)
    assert q.offer("busy", 0.0, 0.0) is not None
    assert q.offer("gone", 0.0, 0.0) is None                # due first, then deleted: never asks again
    assert q.offer("next", 1.0, 1.0) is None
    q.done("busy")
    assert q.offer("next", 1.0, 2.0) is None                # "gone" still holds its place ...
    assert q.offer("next", 1.0, 4.0) is not None            # ... until it is stale
    q.done("next")
    q.offer("off", 5.0, 5.0)
    q.withdraw("off")                                        # autotune Off: leaves at once
    assert q.waiting == 0


def test_bad_capacity_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        RoundQueue(0, stale_after_s=1)


def _fleet_kube(names):
    kube = FakeKube()
    for n in names:
        kube.add_infd(json.loads(json.dumps({**SPEC, "autotune": {"mode": "Apply", "interval": "10s",
                                                                    "window": "20s"}})), name=n)
    return kube


def test_rounds_late_is_set_while_rounds_run_late_and_cleared_when_they_catch_up():
    """Capacity 1 and three deployments due at once: the third waits; once it starts more than one
    interval late its status says RoundsLate True (and the operator metric counts it), and its next
    round, on time, clears it."""
    names = ["a", "b", "c"]
    kube = _fleet_kube(names)
    settings = Settings.from_env({"KVTUNE_PROMETHEUS_URL": "http://127.0.0.1:9"})  # rounds end at once
    now = [1_000_000.0]
    loop = TuningLoop(Reconciler(kube, settings), settings, clock=lambda: now[0])
    q = RoundQueue(1, stale_after_s=30)
    memos: dict[str, dict] = {n: {} for n in names}
    lag_before = operator_metrics.ROUND_LAG._sum.get()
    q.offer("elsewhere", now[0], now[0])                      # a long round holds the only slot
    for _ in range(12):                                       # 12 s of polls: every deployment waits
        for n in names:
            assert loop.maybe_tick("llm", n, kube.get_infd("llm", n), memos[n], q) is None
        now[0] += 1.0
    q.done("elsewhere")
    for n in names:                                           # they run one per poll, in due order
        assert loop.maybe_tick("llm", n, kube.get_infd("llm", n), memos[n], q) is not None
    late = get_condition(kube.infd("a")["status"]["conditions"], "RoundsLate")
    assert late["status"] == "True" and late["reason"] == "BehindSchedule"
    assert "12s after it was due (interval 10s)" in late["message"] and "1 rounds at once" in late["message"]
    assert "started at 1970-01-12T13:46:52Z" in late["message"]  # when the last round ran: 1_000_012
    assert q.late == 3 and operator_metrics.ROUND_LAG._sum.get() - lag_before >= 36
    now[0] += 10.0                                            # the next rounds are on time
    for n in names:
        assert loop.maybe_tick("llm", n, kube.get_infd("llm", n), memos[n], q) is not None
        cond = get_condition(kube.infd(n)["status"]["conditions"], "RoundsLate")
        assert cond["status"] == "False" and cond["reason"] == "OnSchedule", cond
    assert q.late == 0


def test_the_operator_serves_its_round_metrics():
    port = free_port()
    operator_metrics.serve(port, address="127.0.0.1")
    operator_metrics.ROUND_LAG.observe(42.0)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for name in ("kvtune_operator_tuning_round_lag_seconds_bucket", "kvtune_operator_tuning_round_lag_seconds_count",
                 "kvtune_operator_tuning_rounds_running", "kvtune_operator_tuning_rounds_waiting",
                 "kvtune_operator_tuning_rounds_late", "kvtune_operator_tuning_round_duration_seconds_count"):
        assert name in text, name
    assert 'kvtune_operator_tuning_round_lag_seconds_bucket{le="30.0"}' in text


def test_a_deleted_deployment_leaves_no_prediction_error_series():
    port = free_port()
    operator_metrics.serve(port, address="127.0.0.1")
    operator_metrics.PREDICTION_ERROR.labels("team-a", "chat").set(0.12)
    operator_metrics.PREDICTION_ERROR.labels("team-a", "other").set(0.3)
    series = 'kvtune_operator_prediction_error_ratio{name="chat",namespace="team-a"}'
    assert series in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    operator_metrics.forget("team-a", "chat")
    operator_metrics.forget("team-a", "never-tuned")  # no verdict yet: nothing to drop, no error
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert series not in text and 'name="other"' in text
