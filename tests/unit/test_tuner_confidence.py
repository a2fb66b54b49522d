"""Predictions that know when they are unreliable (issue 24): near saturation a change is taken only
when it wins across the range the cost model's speed error spans; every verdict records its
prediction error; a running error above its bound makes the loop recommend only, and says why."""
from __future__ import annotations

import math

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS, mix
from kvtune_operator.tuner.decide import Decision, Objectives, TunerState, prediction_error_ratio
from kvtune_operator.tuner.loop import Tuner, TunerSettings, measure
from kvtune_operator.tuner.thresholds import Thresholds

SC = SCENARIOS["seq-cap"]
PROFILE = load_profile(SC.profile)
OBJECTIVES = Objectives(slo_ttft_s=SC.slo_ttft_s, slo_tpot_s=SC.slo_tpot_s, cooldown_s=600, bad_memory_s=3600)
SETTINGS = TunerSettings(objectives=OBJECTIVES)


def chat(rate: float, n: int = 400, seed: int = 1):
    """seq-cap's chat traffic (300-token prompts, 400-token answers) at ``rate`` requests/s."""
    return mix(requests=n, rate=rate, prompt_mean=300, prompt_sigma=0.6, output_mean=400, output_sigma=0.5,
               max_tokens=4096, seed=seed)


@pytest.fixture(scope="module")
def saturated():
    """96 sequences at 11.5 requests/s: the sequence cap binds (87% of requests meet the SLOs) and the
    best candidate, a higher cap, would run at about the engine's capacity."""
    tr, cfg = chat(11.5), EngineConfig(max_num_seqs=96)
    return tr, measure(tr, cfg, PROFILE, SETTINGS.slo)


def test_a_saturated_prediction_that_does_not_win_across_its_range_is_not_applied(saturated):
    tr, obs = saturated
    tuner = Tuner(SETTINGS, base_profile=PROFILE)
    rnd = tuner.round(obs, tr, 0.0)
    d = rnd.decision
    assert d is not None and d.action == "none" and not rnd.changed
    assert tuner.state.phase == "Idle" and tuner.state.pending is None
    assert 0.9 <= d.confidence["utilization"] <= 1.1                   # the trace runs the candidate at ~1
    assert d.reason.startswith("declined") and "utilization" in d.reason and "faster" in d.reason
    lo, hi = d.confidence["goodput_low_requests_per_s"], d.confidence["goodput_high_requests_per_s"]
    assert lo < hi
    # the same window with the check off: the point prediction alone would have applied it
    off = TunerSettings(objectives=OBJECTIVES, thresholds=Thresholds(saturated_utilization=math.inf))
    assert Tuner(off, base_profile=PROFILE).round(obs, tr, 0.0).changed


def test_a_clear_win_near_saturation_is_still_taken_with_its_range():
    tr, cfg = chat(12.0), EngineConfig(max_num_seqs=64)
    rnd = Tuner(SETTINGS, base_profile=PROFILE).round(measure(tr, cfg, PROFILE, SETTINGS.slo), tr, 0.0)
    assert rnd.changed and rnd.decision.changes["max_num_seqs"] > 64
    c = rnd.decision.confidence
    assert c["utilization"] >= 0.9 and c["current_utilization"] > c["utilization"]
    assert c["goodput_low_requests_per_s"] > 2 * c["current_goodput_high_requests_per_s"]
    assert "predicted utilization" in rnd.decision.reason and "goodput range" in rnd.decision.reason
    st = Tuner(SETTINGS, base_profile=PROFILE).state
    st.begin(rnd.decision, {"offered_requests_per_s": 12.0}, 0.0)
    assert st.pending.predicted_figures["utilization"] == c["utilization"]   # kept for the verdict


def test_the_prediction_error_ratio_of_a_verdict():
    assert prediction_error_ratio({"goodput_requests_per_s": 9.0, "goodput_share": 0.9}, {"goodput_share": 0.6}) \
        == pytest.approx(0.5)
    assert prediction_error_ratio({"goodput_requests_per_s": 9.0, "goodput_share": 0.9}, {"goodput_share": 0.0}) == 10.0
    assert prediction_error_ratio({}, {"goodput_share": 0.6}) is None            # a kvtune.io/try: nothing predicted


def test_the_running_prediction_error_and_its_streak():
    th, st = Thresholds(), TunerState()
    st.track_prediction(0.1, 0.0, th, 100.0)
    assert st.prediction_error == pytest.approx(0.1) and st.prediction_errors_high == 0
    for t in (1.0, 2.0):
        st.track_prediction(1.0, t, th, 100.0)
    assert st.prediction_error == pytest.approx(0.775) and st.prediction_errors_high == 2
    assert not st.predictions_unreliable(2.0)
    st.track_prediction(None, 3.0, th, 100.0)                     # no prediction: nothing counts
    assert st.prediction_errors_high == 2
    st.track_prediction(1.0, 4.0, th, 100.0)
    assert st.prediction_errors_high == 3 and st.unreliable_until == 104.0
    assert st.predictions_unreliable(50.0) and not st.predictions_unreliable(104.0)
    msg = st.unreliable_message(th)
    assert "89%" in msg and "30%" in msg and "3 verdicts" in msg
    st.track_prediction(0.0, 200.0, th, 100.0)                    # after the hold: the streak starts again
    assert st.unreliable_until is None and st.prediction_errors_high == 1
    st.track_prediction(0.0, 201.0, th, 100.0)
    assert st.prediction_error < th.prediction_error_bound and st.prediction_errors_high == 0


def test_a_verdict_records_prediction_against_outcome():
    cur, new = EngineConfig(max_num_seqs=64), EngineConfig(max_num_seqs=128)
    st = TunerState()
    d = Decision("change", "test", cur, new, changes={"max_num_seqs": 128},
                 predicted={"goodput_requests_per_s": 9.0, "requests_per_s": 10.0})
    st.begin(d, {"goodput_requests_per_s": 5.0, "requests_per_s": 10.0, "offered_requests_per_s": 10.0,
                 "goodput_share": 0.5}, 0.0)
    v, _ = st.verify({"goodput_requests_per_s": 6.0, "requests_per_s": 10.0, "offered_requests_per_s": 10.0,
                      "goodput_share": 0.6}, 60.0, OBJECTIVES)
    assert v.prediction_error_ratio == pytest.approx(0.5)         # predicted 0.9 of the load, measured 0.6
    entry = st.history[-1]
    assert entry["event"] == "kept" and entry["prediction_error_ratio"] == pytest.approx(0.5)
    assert entry["predicted"]["goodput_share"] == pytest.approx(0.9) and entry["measured"]["goodput_share"] == 0.6


def test_unreliable_predictions_make_the_loop_recommend_only():
    tr, cfg = chat(12.0), EngineConfig(max_num_seqs=64)
    state = TunerState(prediction_error=0.8, prediction_errors_high=3, unreliable_until=1000.0)
    tuner = Tuner(SETTINGS, base_profile=PROFILE, state=state)
    rnd = tuner.round(measure(tr, cfg, PROFILE, SETTINGS.slo), tr, 10.0)
    assert rnd.decision.action == "change" and rnd.config == cfg      # decided, not applied
    assert tuner.state.phase == "Idle" and tuner.state.pending is None
    assert "unreliable" in rnd.unreliable and "80%" in rnd.unreliable
