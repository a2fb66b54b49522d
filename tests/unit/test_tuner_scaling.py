"""Scaling out when tuning cannot help (issue 11): a compute-bound window gets a replica prediction in
its diagnosis; in Apply mode with autotune.bounds.replicas the operator scales through the scale
subresource, never past the bounds, never against an HPA or a KEDA ScaledObject, not twice in a
cooldown."""
from __future__ import annotations

import copy
import json

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_engine.sim.trace import TraceRequest
from kvtune_operator.model import InferenceDeployment
from kvtune_operator.effective import resolve_autotune
from kvtune_operator.scaling import autoscaler_of, replica_target, replicas_needed
from kvtune_operator.settings import Settings
from kvtune_operator.tuner.observation import Observation
from kvtune_operator.tuner.replicas import simulate_fleet
from tests.infd import infd_body
from kvtune_operator.tuning import Gathered, tick

from test_operator_reconcile import merge_patch

SC = SCENARIOS["seq-cap"]
PROFILE = load_profile(SC.profile)


def obj(bounds: dict | None, mode: str = "Apply", replicas: int = 1, status: dict | None = None) -> InferenceDeployment:
    return InferenceDeployment.from_body(infd_body(
        "chat", namespace="llm", generation=1, status=status or {}, model_path="/models/m", replicas=replicas,
        engine={"maxNumSeqs": 1024, "gpuMemoryUtilization": 0.9, "maxModelLen": 8192},
        autotune={"mode": mode, "interval": "30s", "window": "2m", "cooldown": "10m",
                  "objectives": {"ttftP95": f"{SC.slo_ttft_s}s", "tpotP95": f"{SC.slo_tpot_s * 1000:g}ms"},
                  "bounds": bounds or {}}))


@pytest.fixture(scope="module")
def saturated() -> Gathered:
    """The seq-cap scenario at 3x its rate with a generous cap: more than one engine can decode."""
    trace = [TraceRequest(round(r.arrival_s / 3, 6), r.prompt_tokens, r.output_tokens) for r in SC.trace(0)[:600]]
    cfg = EngineConfig(max_num_seqs=1024)
    summary = simulate(trace, cfg, PROFILE, SLO(SC.slo_ttft_s, SC.slo_tpot_s))
    return Gathered(Observation.from_sim_summary(summary, trace=trace, config=cfg), trace, summary["duration_s"])


def test_a_compute_bound_window_predicts_replicas_and_scales_within_bounds(saturated):
    o = obj({"replicas": {"min": 1, "max": 4}})
    res = tick(o.spec, o.status, resolve_autotune(o.spec, Settings()), saturated, 1_000_000.0, base_profile=PROFILE)
    d = res.status_update["diagnosis"]
    assert d["cause"] == "ComputeBound"
    n = d["figures"]["replicasNeeded"]
    assert 2 <= n <= 4 and f"{n} replicas" in d["message"]
    # the prediction holds against a direct simulation of n engines (and n - 1 do not suffice)
    slo = SLO(SC.slo_ttft_s, SC.slo_tpot_s)
    assert simulate_fleet(saturated.trace, EngineConfig(max_num_seqs=1024), PROFILE, slo, n).goodput_share >= 0.95
    assert simulate_fleet(saturated.trace, EngineConfig(max_num_seqs=1024), PROFILE, slo, n - 1).goodput_share < 0.95
    assert res.scale == n
    last = res.status_update["tuning"]["lastChange"]
    assert last["action"] == "Scale" and f"1 -> {n} replicas" in last["message"]
    assert [e.reason for e in res.events] == ["TuningScale"]
    assert "engine" not in res.status_update            # no knob changed: replicas only

    # the next round, within the cooldown: no second scale
    status = json.loads(json.dumps(merge_patch({}, res.status_update)))
    again = obj({"replicas": {"min": 1, "max": 4}}, replicas=n, status=status)
    res2 = tick(again.spec, again.status, resolve_autotune(again.spec, Settings()), saturated, 1_000_060.0,
                base_profile=PROFILE)
    assert res2.scale is None


def test_no_scaling_without_bounds_in_recommend_mode_or_against_an_autoscaler(saturated):
    for o, autoscaler in ((obj(None), None), (obj({"replicas": {"max": 4}}, mode="Recommend"), None),
                          (obj({"replicas": {"max": 4}}), "HorizontalPodAutoscaler/chat")):
        res = tick(o.spec, o.status, resolve_autotune(o.spec, Settings()), saturated, 1_000_000.0,
                   base_profile=PROFILE, autoscaler=autoscaler)
        assert res.scale is None and not [e for e in res.events if e.reason == "TuningScale"]
        assert res.status_update["diagnosis"]["figures"]["replicasNeeded"] >= 2   # still predicted: a recommendation
    # the bounds cap the count
    o = obj({"replicas": {"min": 1, "max": 1}})
    assert tick(o.spec, o.status, resolve_autotune(o.spec, Settings()), saturated, 1_000_000.0,
                base_profile=PROFILE).scale is None


def test_autoscalers_that_target_the_deployment_are_found():
    hpa = {"kind": "HorizontalPodAutoscaler", "metadata": {"name": "h"},
           "spec": {"scaleTargetRef": {"apiVersion": "kvtune.io/v1alpha1", "kind": "InferenceDeployment", "name": "chat"}}}
    keda = {"kind": "ScaledObject", "metadata": {"name": "k"}, "spec": {"scaleTargetRef": {"name": "chat"}}}
    other = copy.deepcopy(hpa)
    other["spec"]["scaleTargetRef"]["name"] = "other"
    assert autoscaler_of([other, hpa], "chat") == "HorizontalPodAutoscaler/h"
    assert autoscaler_of([keda], "chat") == "ScaledObject/k"       # KEDA's default kind: the Deployment
    assert autoscaler_of([other], "chat") is None
    assert replicas_needed(2, 3) == 6 and replicas_needed(1, 0) == 1
    assert replica_target(6, 3, 1, 4) == 4 and replica_target(3, 3, 1, 4) is None
    assert replica_target(None, 2, 1, 5) == 5          # not reachable in the prediction: the most allowed


def test_the_loop_scales_through_the_scale_subresource_unless_an_hpa_owns_the_count(saturated, monkeypatch):
    from kvtune_operator import tuning
    from kvtune_operator.kube import API_CALLS
    from kvtune_operator.reconcile import Reconciler
    from kvtune_operator.tuning import TuningLoop

    from test_operator_reconcile import FakeKube

    monkeypatch.setattr(tuning, "gather", lambda *a, **k: saturated)   # the window, without Prometheus
    real_tick = tuning.tick
    monkeypatch.setattr(tuning, "tick", lambda *a, **k: real_tick(*a, **k, base_profile=PROFILE))
    for hpas, want in (([], True), ([{"kind": "HorizontalPodAutoscaler", "metadata": {"name": "h"},
                                      "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "chat"}}}], False)):
        kube = FakeKube()
        kube.add_infd(obj({"replicas": {"min": 1, "max": 4}}).model_dump(by_alias=True, exclude_none=True,
                                                                         mode="json")["spec"], name="chat")
        kube.hpas = hpas
        settings = Settings.from_env({})
        loop = TuningLoop(Reconciler(kube, settings), settings, clock=lambda: 1_000_000.0)
        loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), {})
        st = kube.infd("chat")
        if want:
            assert kube.scaled and st["spec"]["replicas"] == kube.scaled[0] >= 2
            assert st["status"]["tuning"]["lastChange"]["action"] == "Scale"
            assert ("Normal", "TuningScale") in [(t, r) for t, r, _ in kube.events]
        else:
            assert not kube.scaled and st["spec"]["replicas"] == 1
            assert "HorizontalPodAutoscaler" not in str(st["status"]["tuning"].get("lastChange"))
        granted = {(res, verb) for (_, res), verbs in API_CALLS.items() for verb in verbs}
        for what, verb in set(kube.calls):
            if what in ("inferencedeployments/scale", "horizontalpodautoscalers"):
                assert (what, verb) in granted
