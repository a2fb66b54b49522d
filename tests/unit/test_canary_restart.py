"""A restart change on a canary Deployment (issue 24): with siblings, a change that needs new pods
first runs on one extra pod, the canary Deployment's, while every pod of the deployment keeps
status.engine; the reconcile gives that Deployment one pod exactly while the change is pending and
sets it to zero after the verdict (never deletes: the operator has no delete verb); a canary whose
engine cannot start on the new knobs is rolled back with the engine's words and the candidate
barred, no other pod having run it; a canary name that is somebody else's object is never written,
and the change then rolls every pod as before. The I/O half runs against real engines in
tests/integration/test_canary_replicas.py."""
from __future__ import annotations

import dataclasses
import json

from kvtune_engine.config import EngineConfig

import pytest

from kvtune_operator.canary_children import canary_free
from kvtune_operator.effective import effective_engine
from kvtune_operator.model import AutotuneMode, InferenceDeployment
from kvtune_operator.reconcile import Reconciler
from kvtune_operator.render import LABEL_CANARY
from kvtune_operator.settings import Settings
from kvtune_operator.tuner.canary import PodFigures, judge_canary
from kvtune_operator.tuning import TuningLoop, tick
from kvtune_operator.tuning_canary import CanaryTarget, judged, pod_figures
from tests.infd import infd_body
from kvtune_operator.tuning_state import state_from_status

from test_operator_reconcile import FakeKube
from test_operator_tuning import PROFILE, infd, plan_of, window
from test_tuner_state import stored

TARGET = CanaryTarget("chat-a", "http://10.0.0.1:8001", ("chat-b", "chat-c"), deployment="chat-canary")
NOW = 1_000_000.0
SETTINGS = Settings.from_env({"KVTUNE_PROMETHEUS_URL": "http://127.0.0.1:9", "KVTUNE_ALLOW_HOST_PATH": "1",
                              "KVTUNE_ALLOW_LOOPBACK_ENGINES": "1"})


@pytest.fixture(scope="module")
def started():
    obj = infd("Apply")
    gathered = window(effective_engine(obj.spec, None, AutotuneMode.APPLY).config)
    return obj, tick(obj.spec, obj.status, plan_of(obj), gathered, now=NOW, base_profile=PROFILE, canary=TARGET,
                     trial={"block_size": 32})


def _cluster(obj, status: dict) -> FakeKube:
    kube = FakeKube()
    kube.add_infd({}, name="chat")
    raw = kube.infd("chat")
    raw["spec"] = json.loads(obj.spec.model_dump_json(by_alias=True, exclude_none=True))
    raw["status"] = status
    return kube


def _deployment(kube: FakeKube, name: str) -> dict | None:
    return kube.objects.get(("apps/v1", "Deployment", "llm", name))


def _configmap(kube: FakeKube, name: str) -> str:
    return kube.objects[("v1", "ConfigMap", "llm", name)]["data"]["engine.yaml"]


def test_a_restart_change_starts_on_a_canary_deployment_and_status_engine_stays(started):
    _, res = started
    t = res.status_update["tuning"]
    assert res.applied == {} and "engine" not in res.status_update and res.canary_call is None
    assert t["phase"] == "Canary" and t["pending"]["restart"] is True
    run = t["pending"]["canary"]
    assert run["deployment"] == "chat-canary" and "pod" not in run
    assert run["controls"] == ["chat-a", "chat-b", "chat-c"]               # every pod is a control
    assert "canary Deployment chat-canary" in t["lastChange"]["message"] and t["lastChange"]["restart"] is True


def test_the_reconcile_runs_one_canary_pod_while_pending_and_none_after_the_verdict(started):
    obj, res = started
    kube = _cluster(obj, stored({}, res.status_update))
    Reconciler(kube, SETTINGS).reconcile("llm", "chat")
    main, canary = _deployment(kube, "chat"), _deployment(kube, "chat-canary")
    assert main["spec"]["replicas"] == obj.spec.replicas and canary["spec"]["replicas"] == 1
    assert "block_size: 32\n" in _configmap(kube, "chat-canary-engine")
    assert "block_size: 32\n" not in _configmap(kube, "chat-engine")      # the deployment's pods never move
    pod_labels = canary["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[LABEL_CANARY] == "true" and canary["spec"]["selector"]["matchLabels"][LABEL_CANARY] == "true"
    assert all(pod_labels[k] == v for k, v in main["spec"]["selector"]["matchLabels"].items())  # the Service's share
    assert canary["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    hashes = [d["spec"]["template"]["metadata"]["annotations"]["kvtune.io/restart-hash"] for d in (main, canary)]
    assert hashes[1] == res.status_update["tuning"]["pending"]["restartHash"] and hashes[0] != hashes[1]

    rec = Reconciler(kube, SETTINGS)  # a refresh while the canary runs: nothing changed, nothing sent
    rec.reconcile("llm", "chat")
    kube.calls.clear()
    rec.reconcile("llm", "chat")
    assert [call for call in kube.calls if call[1] == "patch"] == []
    assert _deployment(kube, "chat-canary")["spec"]["replicas"] == 1

    # reverted against its siblings: the candidate barred, the canary Deployment at zero, nothing rolled
    after = infd("Apply", kube.infd("chat")["status"])
    j = judge_canary(PodFigures("chat-canary-x", 100, 20, 5000), [PodFigures("chat-a", 100, 60, 5000)], window_s=120)
    out = judged(after.spec, after.status, plan_of(after), j, {"goodput_share": 0.2}, NOW + 150)
    t = out.status_update["tuning"]
    assert t["lastChange"]["action"] == "RollBack" and "engine" not in out.status_update
    assert t.get("restarts") == 1                                              # the canary's start only
    Reconciler(kube, SETTINGS).reconcile("llm", "chat", status_update=out.status_update)
    assert _deployment(kube, "chat-canary")["spec"]["replicas"] == 0
    assert "pending" not in kube.infd("chat")["status"]["tuning"]
    assert ("Deployment", "delete") not in kube.calls
    assert _deployment(kube, "chat")["spec"]["template"] == main["spec"]["template"]


def test_a_canary_pod_that_cannot_start_is_rolled_back_and_its_candidate_barred(started):
    obj, res = started
    kube = _cluster(obj, stored({}, res.status_update))
    Reconciler(kube, SETTINGS).reconcile("llm", "chat")  # the canary Deployment, as the decision's reconcile made it
    loop = TuningLoop(Reconciler(kube, SETTINGS), SETTINGS, clock=lambda: NOW + 40)
    hash_ = _deployment(kube, "chat-canary")["spec"]["template"]["metadata"]["annotations"]["kvtune.io/restart-hash"]
    sibling = {"metadata": {"name": "chat-a", "labels": {}},
               "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
    crashed = {"metadata": {"name": "chat-canary-1", "labels": {LABEL_CANARY: "true"},
                            "annotations": {"kvtune.io/restart-hash": hash_}},
               "status": {"podIP": "127.0.0.2", "containerStatuses": [{
                   "restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                   "lastState": {"terminated": {"exitCode": 1, "message": "no room for one KV block of 32 tokens"}}}]}}
    kube.pods = [sibling, crashed]
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), {"tuned_at": NOW})
    t = kube.infd("chat")["status"]["tuning"]
    last = t["lastChange"]
    assert last["action"] == "RollBack" and "canary Deployment chat-canary did not start" in last["message"]
    assert "no room for one KV block" in last["message"] and "no other pod ever ran it" in last["message"]
    assert "pending" not in t and t["rejected"][0]["knobs"]["blockSize"] == 32 and t.get("restarts") == 1
    assert _deployment(kube, "chat-canary")["spec"]["replicas"] == 0                # its pod goes
    assert "engine" not in kube.infd("chat")["status"] or kube.infd("chat")["status"]["engine"].get("blockSize") != 32


def test_a_ready_canary_pod_starts_its_window(started):
    obj, res = started
    kube = _cluster(obj, stored({}, res.status_update))
    loop = TuningLoop(Reconciler(kube, SETTINGS), SETTINGS, clock=lambda: NOW + 40)
    kube.pods = [{"metadata": {"name": "chat-canary-1", "labels": {LABEL_CANARY: "true"}},
                  "status": {"podIP": "127.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]}}]
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), {"tuned_at": NOW})
    run = kube.infd("chat")["status"]["tuning"]["pending"]["canary"]
    assert run["pod"] == "chat-canary-1" and run["startedAt"].startswith("1970-01-12T13:47:")  # NOW + 40
    assert "is Ready" in kube.infd("chat")["status"]["tuning"]["message"]


def test_a_canary_name_that_is_somebody_elses_is_never_written(started):
    obj, res = started
    kube = _cluster(obj, stored({}, res.status_update))
    theirs = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "chat-canary", "namespace": "llm", "ownerReferences": [
                  {"uid": "someone-else", "controller": True}]}, "spec": {"replicas": 3}}
    kube.objects[("apps/v1", "Deployment", "llm", "chat-canary")] = dict(theirs)
    outcome = Reconciler(kube, SETTINGS).reconcile("llm", "chat")
    assert _deployment(kube, "chat-canary") == theirs and "not this InferenceDeployment's" in (outcome.retry or "")
    assert canary_free(kube, infd("Apply", kube.infd("chat")["status"])) == ""
    # so the next restart change rolls every pod, judged before/after
    plain = dataclasses.replace(TARGET, deployment="")
    fresh = infd("Apply")
    gathered = window(effective_engine(fresh.spec, None, AutotuneMode.APPLY).config)
    r = tick(fresh.spec, fresh.status, plan_of(fresh), gathered, now=NOW, base_profile=PROFILE, canary=plain,
             trial={"block_size": 32})
    assert r.applied == {"block_size": 32} and "canary" not in r.status_update["tuning"]["pending"]
    assert state_from_status(infd("Apply", stored({}, r.status_update)).status.tuning).pending.restart


def test_on_vllm_every_change_runs_on_a_canary_deployment():
    """vLLM changes no knob live: a sequence-cap raise, live on our engine, is a restart on vLLM, so it
    goes to the canary Deployment's pod (vLLM's own command line), never to a pod's admin API."""
    obj = InferenceDeployment.from_body(infd_body(
        "chat", namespace="llm", generation=1, runtime="vllm", model={"path": "/models/m"},
        engine={"maxNumSeqs": 64, "gpuMemoryUtilization": 0.9, "maxModelLen": 8192},
        autotune={"mode": "Apply", "interval": "30s", "window": "2m", "cooldown": "10m",
                  "objectives": {"ttftP95": "2s", "tpotP95": "100ms"}, "bounds": {"maxNumSeqs": {"min": 32, "max": 192}}}))
    gathered = window(effective_engine(obj.spec, None, AutotuneMode.APPLY).config)
    res = tick(obj.spec, obj.status, plan_of(obj), gathered, now=NOW, base_profile=PROFILE, canary=TARGET,
               trial={"max_num_seqs": 128})
    t = res.status_update["tuning"]
    assert res.canary_call is None and "engine" not in res.status_update and t["phase"] == "Canary"
    assert t["pending"]["canary"]["deployment"] == "chat-canary" and t["lastChange"]["restart"] is True
    kube = _cluster(obj, stored({}, res.status_update))
    Reconciler(kube, SETTINGS).reconcile("llm", "chat")
    args = _deployment(kube, "chat-canary")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "128"
    main = _deployment(kube, "chat")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert main[main.index("--max-num-seqs") + 1] == "64"
    # with no canary Deployment to run on, vLLM keeps the before/after verdict (every pod rolls)
    r = tick(obj.spec, obj.status, plan_of(obj), gathered, now=NOW, base_profile=PROFILE,
             canary=dataclasses.replace(TARGET, deployment=""), trial={"max_num_seqs": 128})
    assert r.applied == {"max_num_seqs": 128} and "canary" not in r.status_update["tuning"]["pending"]


def _vllm_pod(pod: str, finished: float, fast: float, aborted: float) -> list[dict]:
    """One vLLM pod's series over a 60 s window: ``finished`` requests, ``fast`` of them under 0.5 s ttft."""
    lab = {"namespace": "llm", "inference_deployment": "chat", "pod": pod, "instance": f"10.0.0.{ord(pod[-1])}:8000",
           "model_name": "tiny"}

    def s(name: str, end: float, **more: str) -> dict:
        return {"metric": {"__name__": name, **lab, **more}, "values": [[0, "0"], [60, str(end)]]}
    return [s("vllm:e2e_request_latency_seconds_count", finished),
            s("vllm:e2e_request_latency_seconds_bucket", finished, le="+Inf"),
            s("vllm:time_to_first_token_seconds_bucket", fast, le="0.5"),
            s("vllm:time_to_first_token_seconds_bucket", finished, le="+Inf"),
            s("vllm:time_to_first_token_seconds_count", finished),
            s("vllm:generation_tokens_total", 50 * finished),
            s("vllm:request_success_total", aborted, finished_reason="abort"),
            {"metric": {"__name__": "vllm:num_requests_running", **lab}, "values": [[0, "4"], [30, "4"], [60, "4"]]}]


def test_each_vllm_pods_figures_come_from_its_own_vllm_series():
    series = _vllm_pod("chat-a", 100, 90, 3) + _vllm_pod("chat-b", 80, 20, 0)
    cfg = EngineConfig(max_num_seqs=64, max_model_len=8192)
    a, measured = pod_figures(series, "chat-a", 60, cfg, 0.5, None, runtime="vllm")
    b, _ = pod_figures(series, "chat-b", 60, cfg, 0.5, None, runtime="vllm")
    assert (a.requests, b.requests) == (100, 80) and a.good == pytest.approx(90) and b.good == pytest.approx(20)
    assert a.output_tokens == pytest.approx(5000) and (a.errors, b.errors) == (3, 0)
    assert measured["goodput_requests_per_s"] == pytest.approx(1.5)


def test_a_restart_canary_turned_to_recommend_is_dropped_and_its_pod_goes(started):
    """Recommend (or Off) mid-canary: nothing is judged or promoted in those modes, so the round drops
    the change unjudged and unbarred, and the canary Deployment goes to zero pods at once."""
    obj, res = started
    kube = _cluster(obj, stored({}, res.status_update))
    Reconciler(kube, SETTINGS).reconcile("llm", "chat")
    assert _deployment(kube, "chat-canary")["spec"]["replicas"] == 1
    kube.infd("chat")["spec"]["autotune"]["mode"] = "Recommend"
    loop = TuningLoop(Reconciler(kube, SETTINGS), SETTINGS, clock=lambda: NOW + 200)
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), {"tuned_at": NOW})
    t = kube.infd("chat")["status"]["tuning"]
    assert "pending" not in t and t["history"][-1]["action"] == "RollBack" and not t.get("rejected")
    assert "autotune mode is Recommend" in t["history"][-1]["message"]
    assert _deployment(kube, "chat-canary")["spec"]["replicas"] == 0
    assert "block_size: 32\n" not in _configmap(kube, "chat-engine")
