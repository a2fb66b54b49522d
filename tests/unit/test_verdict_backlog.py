"""The verdict's replay of the old config includes the backlog the window inherited.

After a change that makes an overloaded engine faster, the window that verifies it is spent draining
the queue built under the old config: every request finishing in it has waited, so its goodput is 0
under any config. A replay of the old config that starts the window with an empty engine serves the
window's first arrivals at once and looks better, and a good change was rolled back (seen in the demo
and the e2e test on a loaded machine). Replayed with the requests of the window before it, the old
config shows the same backlog, and the change is kept.
"""
from __future__ import annotations

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS
from kvtune_engine.sim.simulator import SLO
from kvtune_operator.tuner.decide import judge, window_figures
from kvtune_operator.tuner.predict import Predictor

SC = SCENARIOS["seq-cap"]
PROFILE = load_profile(SC.profile)
SLO_ = SLO(SC.slo_ttft_s, SC.slo_tpot_s)


def _records(trace):
    return [{"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}
            for r in trace]


def test_the_old_config_replayed_with_its_backlog():
    trace = SC.trace(0)
    cut = trace[len(trace) // 2].arrival_s
    lead, window = _records([r for r in trace if r.arrival_s < cut]), _records([r for r in trace if r.arrival_s >= cut])
    old = EngineConfig(max_num_seqs=64)         # the scenario's cap: a queue builds
    pred = Predictor(PROFILE, SLO_)
    empty = window_figures(pred.predict_window([], window, old, cut))
    inherited = window_figures(pred.predict_window(lead, window, old, cut))
    assert inherited["goodput_share"] < 0.5 * empty["goodput_share"]
    assert inherited["queue_time_p95_s"] > 1.5 * empty["queue_time_p95_s"]

    # the window after raising the cap: it drains the backlog (no request within the objectives) at a
    # much higher throughput; the window before it had a few lucky requests
    measured = {**inherited, "goodput_requests_per_s": 0.0, "goodput_share": 0.0,
                "output_tokens_per_s": 5 * inherited["output_tokens_per_s"]}
    before = {**inherited, "goodput_share": max(0.05, inherited["goodput_share"] * 2)}
    assert not judge(before, measured, None, 0.10, empty).keep          # an empty-engine replay: rolled back
    v = judge(before, measured, None, 0.10, inherited)
    assert v.keep, v.reason                                              # with the backlog: kept
    assert "does no better" in v.reason


def test_a_window_before_without_goodput_is_no_reference_the_replay_judges():
    """Seen in the faults e2e test: a backlog drained by 32 sequences left the window before with no
    goodput; max_num_seqs 1 then let a short request through in time (0.1 req/s), which read as +100%
    against 0 and was kept. The old config replayed on the window after is the reference then."""
    before = {"goodput_requests_per_s": 0.0, "goodput_share": 0.0, "output_tokens_per_s": 900.0,
              "offered_requests_per_s": 5.0}
    measured = {"goodput_requests_per_s": 0.1, "goodput_share": 0.02, "output_tokens_per_s": 60.0,
                "offered_requests_per_s": 5.0}
    old_replayed = {"goodput_requests_per_s": 2.5, "goodput_share": 0.5, "output_tokens_per_s": 850.0,
                    "offered_requests_per_s": 5.0}
    assert judge(before, measured, None, 0.10).keep            # without a replay: +100% vs 0, kept as before
    v = judge(before, measured, None, 0.10, old_replayed)
    assert not v.keep and "old config replayed" in v.reason and "almost no goodput" in v.reason, v.reason
    # a change that really helped an engine with no goodput: the replay of the old config shows none either
    helped = {**measured, "goodput_requests_per_s": 2.0, "goodput_share": 0.4, "output_tokens_per_s": 900.0}
    starved = {**old_replayed, "goodput_requests_per_s": 0.05, "goodput_share": 0.01}
    v = judge(before, helped, None, 0.10, starved)
    assert v.keep and v.change > 1.0, v.reason
