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

import pytest

from kvtune_operator.canary_children import canary_free
from kvtune_operator.effective import effective_engine
from kvtune_operator.model import AutotuneMode
from kvtune_operator.reconcile import Reconciler
from kvtune_operator.render import LABEL_CANARY
from kvtune_operator.settings import Settings
from kvtune_operator.tuner.canary import PodFigures, judge_canary
from kvtune_operator.tuning import TuningLoop, tick
from kvtune_operator.tuning_canary import CanaryTarget, judged
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
    loop = TuningLoop(Reconciler(kube, SETTINGS), SETTINGS, clock=lambda: NOW + 40)
    hash_ = res.status_update["tuning"]["pending"]["restartHash"]
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
