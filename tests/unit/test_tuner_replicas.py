"""Replica prediction: a workload that saturates one engine (ComputeBound), split across N replicas
by a round-robin or a least-loaded router, against direct simulations of the N replicas."""
from __future__ import annotations

import math

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profile import SpeedTimeline
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS
from kvtune_engine.sim.simulator import SLO, percentile, simulate
from kvtune_engine.sim.trace import TraceRequest
from kvtune_operator.tuner.diagnose import diagnose
from kvtune_operator.tuner.observation import Observation
from kvtune_operator.tuner.replicas import ROUTERS, Replica, predict_replicas, route, simulate_fleet

SC = SCENARIOS["seq-cap"]
PROFILE = load_profile(SC.profile)
SLO_ = SLO(SC.slo_ttft_s, SC.slo_tpot_s)
CONFIG = EngineConfig(max_num_seqs=1024)   # generous: the sequence cap never binds
# a machine that ran 2.5x slower for 5 s of the window, then faster (a fitted profile's speed)
SLOW = PROFILE.model_copy(update={"speed": SpeedTimeline(start_s=5.0, window_s=5.0, factors=(2.5, 0.7, 1.8))})


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    # the seq-cap scenario at 3x its rate: more than one A100 can decode
    return [TraceRequest(round(r.arrival_s / 3, 6), r.prompt_tokens, r.output_tokens) for r in SC.trace(0)[:600]]


@pytest.fixture(scope="module")
def fleets(trace):
    return {(router, n): simulate_fleet(trace, CONFIG, PROFILE, SLO_, n, router) for router in ROUTERS for n in (1, 2, 3)}


def _finish_times(share: list[TraceRequest], summary: dict) -> list[float]:
    """Each request's finish time in a direct simulation of its replica (rejected: at arrival)."""
    fin = [r.arrival_s for r in share]
    for row in summary["per_request"]:
        fin[int(row["id"][1:])] = row["arrival_s"] + row["e2e_s"]
    return fin


def test_one_engine_is_saturated(trace):
    s = simulate(trace, CONFIG, PROFILE, SLO_)
    assert diagnose(Observation.from_sim_summary(s, trace=trace)).cause == "ComputeBound"
    assert s["requests"]["meeting_slo"] / s["requests"]["total"] < 0.6


@pytest.mark.parametrize("profile", [PROFILE, SLOW], ids=["named", "machine-speed"])
def test_replica_steps_exactly_as_simulate(trace, profile):
    """Machine speed included: a replica on a slow stretch of the machine drains as slowly as the
    simulator says (the replica loop once charged the bare cost model)."""
    rep = Replica(CONFIG, profile)
    for r in trace:
        rep.advance(r.arrival_s)
        rep.add(r)
    rep.advance(math.inf)
    direct = _finish_times(trace, simulate(trace, CONFIG, profile, SLO_, per_request=True))
    assert [rep.finish_s[j] for j in range(len(trace))] == pytest.approx(direct, rel=1e-12, abs=1e-9)


@pytest.mark.parametrize("n", [2, 3])
def test_round_robin_prediction_matches_direct_simulation(trace, fleets, n):
    shares = [trace[k::n] for k in range(n)]           # request i to replica i mod n
    sims = [simulate(s, CONFIG, PROFILE, SLO_, per_request=True) for s in shares]
    f = fleets[("round-robin", n)]
    assert f.per_replica_requests == tuple(len(s) for s in shares)
    good = sum(s["requests"]["meeting_slo"] for s in sims)
    assert f.meeting_slo == good and f.goodput_share == pytest.approx(good / len(trace))
    end = max(sh[0].arrival_s + s["duration_s"] for sh, s in zip(shares, sims))
    assert f.duration_s == pytest.approx(end - trace[0].arrival_s)
    assert f.goodput_requests_per_s == pytest.approx(good / f.duration_s)
    assert f.output_tokens_per_s == pytest.approx(sum(s["output_tokens"] for s in sims) / f.duration_s)
    ttft = sorted(row["ttft_s"] for s in sims for row in s["per_request"])
    queue = sorted(row["queue_s"] for s in sims for row in s["per_request"])
    assert f.ttft_p95_s == pytest.approx(percentile(ttft, 0.95))
    assert f.queue_time_p95_s == pytest.approx(percentile(queue, 0.95))
    # the pooled p95 lies between the replicas' own p95s
    assert min(s["ttft_p95_s"] for s in sims) <= f.ttft_p95_s <= max(s["ttft_p95_s"] for s in sims)
    assert min(s["tpot_p95_s"] for s in sims) <= f.tpot_p95_s <= max(s["tpot_p95_s"] for s in sims)


@pytest.mark.parametrize("profile", [PROFILE, SLOW], ids=["named", "machine-speed"])
def test_least_loaded_sends_each_request_where_fewest_are_in_flight(trace, fleets, profile):
    n = 3
    shares = route(trace, n, "least-loaded", CONFIG, profile)
    assert sum(map(len, shares)) == len(trace) and all(shares)
    sims = [simulate(s, CONFIG, profile, SLO_, per_request=True) for s in shares]
    finish = [_finish_times(s, sm) for s, sm in zip(shares, sims)]
    pos = [0] * n        # requests routed to each replica so far
    for r in trace:
        t = r.arrival_s
        load = [sum(1 for j in range(pos[k]) if finish[k][j] > t) for k in range(n)]
        k = next(k for k in range(n) if pos[k] < len(shares[k]) and shares[k][pos[k]] is r)
        assert load[k] == min(load), (t, load, k)
        pos[k] += 1
    assert pos == [len(s) for s in shares]
    f = fleets[("least-loaded", n)] if profile is PROFILE else simulate_fleet(trace, CONFIG, profile, SLO_, n)
    assert f.meeting_slo == sum(s["requests"]["meeting_slo"] for s in sims)
    assert f.per_replica_requests == tuple(len(s) for s in shares)


@pytest.mark.parametrize("router", ROUTERS)
def test_more_replicas_never_predict_lower_goodput(fleets, router):
    figs = [fleets[(router, n)] for n in (1, 2, 3)]
    for a, b in zip(figs, figs[1:]):
        assert b.goodput_share >= a.goodput_share
        assert b.goodput_requests_per_s >= a.goodput_requests_per_s
        assert b.ttft_p95_s <= a.ttft_p95_s
    assert figs[0].goodput_share < 0.6 and figs[1].goodput_share >= 0.95


def test_predict_replicas_names_the_least_count(trace):
    p = predict_replicas(trace, CONFIG, PROFILE, SLO_, target_share=0.95, max_replicas=4)
    assert p.replicas == 2
    assert [f.replicas for f in p.figures] == [1, 2]
    assert p.figures[0].goodput_share < 0.95 <= p.figures[1].goodput_share
    assert p.message.startswith("2 replicas (least-loaded routing) meet the objectives for 100% of requests")
    none = predict_replicas(trace, CONFIG, PROFILE, SLO_, target_share=0.95, max_replicas=1, router="round-robin")
    assert none.replicas is None
    assert none.message == (f"1 replica meets the objectives for only {none.figures[0].goodput_share:.0%} of "
                            "requests (target 95%); no count up to 1 predicted to reach it")
