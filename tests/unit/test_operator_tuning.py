"""One tuning tick in the cluster's shape (tuning.tick), without a cluster: an observed seq-cap window
leads to a live maxNumSeqs change in status.engine (Apply), a recommendation only (Recommend), no
decision while a change is still rolling out, and a rollback when the window after the change is worse."""
from __future__ import annotations

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_operator.effective import effective_engine, resolve_autotune
from kvtune_operator.model import AutotuneMode, InferenceDeployment
from kvtune_operator.settings import Settings
from kvtune_operator.tuner.observation import Observation
from kvtune_operator.tuning import Gathered, tick
from kvtune_operator.tuning_state import state_from_status
from tests.infd import infd_body

SC = SCENARIOS["seq-cap"]
PROFILE = load_profile(SC.profile)


def infd(mode: str, status: dict | None = None) -> InferenceDeployment:
    return InferenceDeployment.from_body(infd_body(
        "chat", namespace="llm", generation=1, status=status or {},
        model={"path": "/models/m", "volume": {"hostPath": {"path": "/m"}, "mountPath": "/models"}},
        engine={"maxNumSeqs": 64, "gpuMemoryUtilization": 0.9, "maxModelLen": 8192},
        autotune={"mode": mode, "interval": "30s", "window": "2m", "cooldown": "10m",
                  "objectives": {"ttftP95": "2s", "tpotP95": "100ms"},
                  "bounds": {"maxNumSeqs": {"min": 32, "max": 192}}}))


def window(cfg: EngineConfig, n: int = 500) -> Gathered:
    trace = SC.trace(0)[:n]
    summary = simulate(trace, cfg, PROFILE, SLO(SC.slo_ttft_s, SC.slo_tpot_s))
    obs = Observation.from_sim_summary(summary, trace=trace, config=cfg)
    return Gathered(obs, trace, summary.get("duration_s", 60.0))


def plan_of(obj: InferenceDeployment):
    return resolve_autotune(obj.spec, Settings())


@pytest.fixture(scope="module")
def seq_cap_window():
    return window(effective_engine(infd("Apply").spec, None, AutotuneMode.APPLY).config)


def test_apply_raises_the_sequence_cap_live_within_bounds(seq_cap_window):
    obj = infd("Apply")
    plan = plan_of(obj)
    res = tick(obj.spec, obj.status, plan, seq_cap_window, now=1_000_000.0,
               base_profile=PROFILE)
    assert res.status_update["diagnosis"]["cause"] == "SequenceCap"
    assert "sequence cap" in res.status_update["diagnosis"]["message"].lower()
    new = res.status_update["engine"]["maxNumSeqs"]
    assert 64 < new <= 192                                   # raised, and never past the user's bound
    assert res.status_update["baseline"]["maxNumSeqs"] == 64  # the spec's value, never rewritten
    assert res.applied == {"max_num_seqs": new}               # a live knob only: no rollout
    t = res.status_update["tuning"]
    assert t["phase"] == "Verifying" and t["lastChange"]["action"] == "Apply"
    assert t["lastChange"]["restart"] is False and t["lastChange"]["predicted"]["goodputRequestsPerSecond"] > 0
    assert [e.reason for e in res.events] == ["TuningApply"]
    assert {c.type: c.status for c in res.conditions}["MetricsAvailable"] == "True"


def test_recommend_decides_but_writes_no_knob(seq_cap_window):
    obj = infd("Recommend")
    plan = plan_of(obj)
    res = tick(obj.spec, obj.status, plan, seq_cap_window, now=1_000_000.0,
               base_profile=PROFILE)
    assert "engine" not in res.status_update and res.applied == {}
    t = res.status_update["tuning"]
    assert t["phase"] == "Recommended" and t["lastChange"]["action"] == "Recommend"
    assert t["lastChange"]["after"]["maxNumSeqs"] > 64


def test_no_decision_while_the_engines_still_run_the_old_knobs(seq_cap_window):
    obj = infd("Apply", status={"engine": {"maxNumSeqs": 128}, "baseline": {"maxNumSeqs": 64}})
    plan = plan_of(obj)
    res = tick(obj.spec, obj.status, plan, seq_cap_window, now=1_000_000.0,
               base_profile=PROFILE)  # engines report 64
    t = res.status_update["tuning"]
    assert t["phase"] == "Applying" and "maxNumSeqs" in t["message"]
    assert res.applied == {} and not res.events and "diagnosis" not in res.status_update


def test_a_regression_after_the_change_is_rolled_back_and_remembered(seq_cap_window):
    obj = infd("Apply")
    plan = plan_of(obj)
    first = tick(obj.spec, obj.status, plan, seq_cap_window, now=1_000_000.0, base_profile=PROFILE)
    new = first.status_update["engine"]["maxNumSeqs"]
    status = {"engine": first.status_update["engine"], "baseline": first.status_update["baseline"],
              "tuning": first.status_update["tuning"]}
    after = infd("Apply", status)
    cfg = effective_engine(after.spec, after.status, AutotuneMode.APPLY).config
    assert cfg.max_num_seqs == new
    # Force a bad outcome: the window measured after the change has a fraction of the goodput.
    good = window(cfg)
    bad_obs = good.observation.with_(goodput_requests_per_s=good.observation.goodput_requests_per_s * 0.1,
                                     output_tokens_per_s=good.observation.output_tokens_per_s * 0.1,
                                     summary=None)
    res = tick(after.spec, after.status, plan, Gathered(bad_obs, [], good.window_s), now=1_000_200.0,
               base_profile=PROFILE)
    actions = [h["action"] for h in res.status_update["tuning"]["history"]]
    assert actions == ["Apply", "RollBack"]
    assert res.status_update["engine"]["maxNumSeqs"] == 64          # back to what ran before
    assert res.status_update["tuning"]["phase"] == "RolledBack"
    assert any(e.reason == "TuningRollBack" and e.type == "Warning" for e in res.events)
    # remembered in status (not in the operator's memory): not tried again for a while
    later = infd("Apply", {k: res.status_update[k] for k in ("engine", "baseline", "tuning")})
    assert state_from_status(later.status.tuning).is_bad(cfg, 1_000_300.0)
    assert "pending" not in later.status.tuning.dump()


def test_a_tried_candidate_is_applied_verified_and_rolled_back_when_worse(seq_cap_window):
    from kvtune_operator.tuning import TRY_ANNOTATION, parse_trial

    trial = parse_trial({TRY_ANNOTATION: '{"maxNumSeqs": 32}'})
    assert trial == {"max_num_seqs": 32}
    obj = infd("Apply")
    plan = plan_of(obj)
    first = tick(obj.spec, obj.status, plan, seq_cap_window, now=2_000_000.0, trial=trial, base_profile=PROFILE)
    assert first.applied == {"max_num_seqs": 32} and first.status_update["tuning"]["phase"] == "Verifying"
    after = infd("Apply", {k: first.status_update[k] for k in ("engine", "baseline", "tuning")})
    cfg = effective_engine(after.spec, after.status, AutotuneMode.APPLY).config
    worse = window(cfg)  # the real simulated window under the halved cap
    res = tick(after.spec, after.status, plan, worse, now=2_000_200.0, base_profile=PROFILE)
    assert [h["action"] for h in res.status_update["tuning"]["history"]] == ["Apply", "RollBack"]
    assert res.status_update["engine"]["maxNumSeqs"] == 64


def test_a_malformed_trial_names_the_annotation_and_the_knobs():
    from kvtune_operator.tuning import TRY_ANNOTATION, parse_trial

    with pytest.raises(ValueError, match="kvtune.io/try.*maxNumSeqs"):
        parse_trial({TRY_ANNOTATION: '{"maxSeqs": 3}'})
    with pytest.raises(ValueError, match="JSON object"):
        parse_trial({TRY_ANNOTATION: "[1]"})


def test_a_verdict_records_prediction_against_outcome_in_the_fields_vocabulary(seq_cap_window):
    obj = infd("Apply")
    plan = plan_of(obj)
    first = tick(obj.spec, obj.status, plan, seq_cap_window, now=3_000_000.0, base_profile=PROFILE)
    predicted = first.status_update["tuning"]["lastChange"]["predicted"]
    # a prediction carries the utilization it implies and its range; figures by the field's names
    assert predicted["utilization"] > 0 and len(predicted["goodputRangeRequestsPerSecond"]) == 2
    assert 0 < predicted["sloAttainment"] <= 1 and predicted["ttftP95Ms"] > 0 and predicted["tpotP95Ms"] > 0
    after = infd("Apply", {k: first.status_update[k] for k in ("engine", "baseline", "tuning")})
    res = tick(after.spec, after.status, plan, window(effective_engine(after.spec, after.status,
                                                                       AutotuneMode.APPLY).config),
               now=3_000_200.0, base_profile=PROFILE)
    t = res.status_update["tuning"]
    keep = t["history"][-1]
    assert keep["action"] == "Keep" and keep["predictionErrorRatio"] >= 0
    assert keep["measured"]["sloAttainment"] > 0 and keep["measured"]["tpotP95Ms"] > 0
    assert t["predictionError"] == pytest.approx(keep["predictionErrorRatio"], abs=1e-3)
    cond = {c.type: c for c in res.conditions}["PredictionsUnreliable"]
    assert cond.status == "False" and "running prediction error" in cond.message


def test_unreliable_predictions_fall_back_to_recommend_with_a_condition(seq_cap_window):
    obj = infd("Apply", status={"tuning": {"predictionError": 0.8, "predictionErrorsHigh": 3,
                                           "predictionsUnreliableUntil": "2100-01-01T00:00:00Z"}})
    res = tick(obj.spec, obj.status, plan_of(obj), seq_cap_window, now=1_000_000.0, base_profile=PROFILE)
    assert res.applied == {} and "engine" not in res.status_update      # Apply mode, yet nothing written
    t = res.status_update["tuning"]
    assert t["phase"] == "Recommended" and t["lastChange"]["action"] == "Recommend"
    assert "predictions are unreliable" in t["message"] and t["predictionError"] == 0.8
    cond = {c.type: c for c in res.conditions}["PredictionsUnreliable"]
    assert cond.status == "True" and cond.reason == "PredictionErrorHigh"
    assert "80%" in cond.message and "30%" in cond.message and "3 verdicts" in cond.message
