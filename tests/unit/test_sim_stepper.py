"""The stepped simulated engine: one source of a trace's requests and of a step's cost, no clock.

A caller that owns its clock (as the real-time simulated engine does, sleeping each step's cost)
gets the very steps ``simulate`` replays, through the public API alone."""
from __future__ import annotations

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.request import Request, SamplingParams
from kvtune_engine.sim.profile import SpeedTimeline
from kvtune_engine.sim.profiles import PROFILES
from kvtune_engine.sim.scenarios import mix
from kvtune_engine.sim.simulator import simulate
from kvtune_engine.sim.stepper import SimEngine

BASE = PROFILES["a100-llama3-8b"]
SLOW = BASE.model_copy(update={"speed": SpeedTimeline(start_s=0.0, window_s=1.0, factors=(1.0, 2.0, 0.5, 1.5))})
CFG = EngineConfig(max_num_seqs=8)


def _own_clock(trace, profile):
    """A driver with its own clock: arrivals queued when the clock has passed them, one step at a time."""
    eng, now, finish, i = SimEngine(CFG, profile), trace[0].arrival_s, {}, 0
    while i < len(trace) or eng.busy():
        while i < len(trace) and trace[i].arrival_s <= now:
            assert eng.add(eng.request(i, trace[i]))
            i += 1
        if not eng.busy():
            now = trace[i].arrival_s
            continue
        dt, done = eng.step(now)
        now += dt   # a real-time engine sleeps dt here
        finish.update({d.request_id: now for d in done})
    return finish


@pytest.mark.parametrize("profile", [BASE, SLOW], ids=["named", "machine-speed"])
def test_a_caller_with_its_own_clock_steps_what_simulate_replays(profile):
    trace = mix(requests=120, rate=30.0, prompt_mean=256, output_mean=48, prefix_groups=3, prefix_tokens=64, seed=1)
    rows = simulate(trace, CFG, profile, per_request=True)["per_request"]
    finish = _own_clock(trace, profile)
    assert len(finish) == len(rows) == len(trace)
    for r in rows:
        assert finish[r["id"]] == pytest.approx(r["arrival_s"] + r["e2e_s"], rel=1e-12, abs=1e-9)


def test_a_step_costs_the_profile_time_the_machine_speed_and_nothing_else():
    eng, slow = SimEngine(CFG, BASE), SimEngine(CFG, SLOW)
    for e in (eng, slow):    # a request built outside (as the server builds one): no trace needed
        assert e.add(Request(list(range(100)), SamplingParams(max_tokens=2, ignore_eos=True), arrival_s=0.0))
    seen = []
    dt, done = eng.step(1.5, lambda batch, d: seen.append((batch.num_batched_tokens, d)))
    assert dt == pytest.approx(BASE.step_time(100, 0, 100 * 101 / 2)) and not done
    assert seen == [(100, dt)]
    assert slow.step(1.5)[0] == pytest.approx(2.0 * dt)          # started in the 2x window
    assert slow.step(2.5)[0] == pytest.approx(0.5 * eng.step(2.5)[0])  # the decode, in the 0.5x window


def test_requests_of_one_prefix_group_share_exactly_its_prefix():
    from kvtune_engine.sim.trace import TraceRequest
    eng = SimEngine(CFG, BASE)
    a, b, c = (eng.request(i, TraceRequest(0.0, 100, 4, prefix_group=g, prefix_tokens=40))
               for i, g in enumerate(("g", "g", "h")))
    assert a.prompt_token_ids[:40] == b.prompt_token_ids[:40] != c.prompt_token_ids[:40]
    assert a.prompt_token_ids[40] != b.prompt_token_ids[40]
    assert (a.request_id, len(a.prompt_token_ids)) == ("r0", 100)
