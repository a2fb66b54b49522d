"""The canary round's pure halves (tuning.tick with a canary target, tuning_canary): with siblings a live
change goes to one pod first and status.engine stays until the canary is promoted; a revert bars the
candidate; a canary that cannot be judged is dropped unbarred; a restart change with no canary
Deployment to run on (tests/unit/test_canary_restart.py) rolls every pod; each pod's figures come
from its own series only. The I/O half runs in
tests/integration/test_canary_replicas.py against three real engines."""
from __future__ import annotations

import json
import socket

import pytest

from kvtune_operator.effective import effective_engine
from kvtune_operator.model import AutotuneMode
from kvtune_operator.reconcile import Reconciler
from kvtune_operator.settings import Settings
from kvtune_operator.tuner.canary import PodFigures, judge_canary
from kvtune_operator.tuning import TuningLoop, tick
from kvtune_operator.tuning_canary import CanaryTarget, choose_target, judged, lost, pod_figures, ready_pods
from kvtune_operator.tuning_state import state_from_status

from test_operator_reconcile import FakeKube
from test_operator_tuning import PROFILE, infd, plan_of, window
from test_tuner_state import stored

TARGET = CanaryTarget("chat-a", "http://10.0.0.1:8001", ("chat-b", "chat-c"))
NOW = 1_000_000.0


@pytest.fixture(scope="module")
def started():
    obj = infd("Apply")
    gathered = window(effective_engine(obj.spec, None, AutotuneMode.APPLY).config)
    return obj, tick(obj.spec, obj.status, plan_of(obj), gathered, now=NOW, base_profile=PROFILE, canary=TARGET)


def _after(obj, res) -> object:
    return infd("Apply", {k: res.status_update[k] for k in ("engine", "baseline", "tuning") if k in res.status_update})


def test_a_live_change_goes_to_the_canary_and_status_engine_stays(started):
    obj, res = started
    t = res.status_update["tuning"]
    assert res.applied == {} and "engine" not in res.status_update      # the other pods keep their knobs
    assert t["phase"] == "Canary" and t["lastChange"]["action"] == "Apply"
    assert t["pending"]["canary"]["pod"] == "chat-a" and t["pending"]["canary"]["controls"] == ["chat-b", "chat-c"]
    url, knobs = res.canary_call
    assert url == TARGET.url and set(knobs) == {"max_num_seqs"} and knobs["max_num_seqs"] > 64
    assert "canary pod chat-a" in t["lastChange"]["message"] and "chat-b, chat-c" in t["message"]


def _judged(started, canary_good: float):
    obj, res = started
    after = _after(obj, res)
    j = judge_canary(PodFigures("chat-a", 100, canary_good, 5000), [PodFigures("chat-b", 100, 60, 5000),
                                                                      PodFigures("chat-c", 100, 60, 5000)],
                     window_s=120)
    return after, judged(after.spec, after.status, plan_of(after), j, {"goodput_share": canary_good / 100}, NOW + 150)


def test_a_promoted_canary_goes_to_every_pod(started):
    knobs = started[1].canary_call[1]
    after, res = _judged(started, canary_good=90)
    t = res.status_update["tuning"]
    assert res.status_update["engine"]["maxNumSeqs"] == knobs["max_num_seqs"] and res.applied == knobs
    assert [h["action"] for h in t["history"]] == ["Apply", "Keep"] and t["phase"] == "Settled"
    c = t["lastChange"]["canary"]
    assert c["verdict"] == "Promote" and c["canary"] == "chat-a" and c["controls"] == ["chat-b", "chat-c"]
    assert c["gates"][0]["name"] == "goodputRatioMin" and c["gates"][0]["passed"] is True
    assert t["pending"] is None                                         # removed by the merge patch


def test_a_reverted_canary_is_barred_and_status_engine_never_moved(started):
    knobs = started[1].canary_call[1]
    after, res = _judged(started, canary_good=20)
    t = res.status_update["tuning"]
    assert "engine" not in res.status_update and res.applied == {}
    assert [h["action"] for h in t["history"]] == ["Apply", "RollBack"] and t["phase"] == "RolledBack"
    assert t["lastChange"]["canary"]["verdict"] == "Revert" and t["lastChange"]["after"] == {"maxNumSeqs": 64}
    assert any(e.reason == "TuningRollBack" and e.type == "Warning" for e in res.events)
    later = infd("Apply", {"tuning": t})
    cfg = effective_engine(after.spec, after.status, AutotuneMode.APPLY).config.with_changes(**knobs)
    assert state_from_status(later.status.tuning).is_bad(cfg, NOW + 200)


def test_a_canary_that_cannot_be_judged_is_dropped_unbarred(started):
    obj, res = started
    after = _after(obj, res)
    out = lost(after.spec, after.status, plan_of(after), "canary pod chat-a went before its verdict", NOW + 60)
    t = out.status_update["tuning"]
    assert [h["action"] for h in t["history"]] == ["Apply", "RollBack"] and "not judged" in t["message"]
    assert t["pending"] is None and not t.get("rejected") and "engine" not in out.status_update


def test_a_restart_change_rolls_every_pod_when_no_canary_deployment_may_run():
    obj = infd("Apply")
    gathered = window(effective_engine(obj.spec, None, AutotuneMode.APPLY).config)
    res = tick(obj.spec, obj.status, plan_of(obj), gathered, now=NOW, base_profile=PROFILE, canary=TARGET,
               trial={"block_size": 32})
    assert res.canary_call is None and res.applied == {"block_size": 32}
    assert res.status_update["tuning"]["phase"] == "Verifying" and "canary" not in res.status_update["tuning"]["pending"]


def _series(pod: str, finished: float, fast: float) -> list[dict]:
    """One pod's histogram series over a window: ``finished`` requests, ``fast`` of them under 0.5 s ttft."""
    lab = {"namespace": "llm", "inference_deployment": "chat", "pod": pod, "instance": f"10.0.0.{ord(pod[-1])}:8001"}
    def s(name: str, end: float, **more: str) -> dict:
        return {"metric": {"__name__": name, **lab, **more}, "values": [[0, "0"], [60, str(end)]]}
    return [s("kvtune_e2e_request_latency_seconds_count", finished),
            s("kvtune_time_to_first_token_seconds_bucket", fast, le="0.5"),
            s("kvtune_time_to_first_token_seconds_bucket", finished, le="+Inf"),
            s("kvtune_time_to_first_token_seconds_count", finished),
            s("kvtune_request_output_tokens_sum", 50 * finished),
            s("kvtune_requests_finished_total", 2.0, finish_reason="error")]


def test_each_pods_figures_come_from_its_own_series():
    series = _series("chat-a", 100, 90) + _series("chat-b", 80, 20)
    cfg = effective_engine(infd("Apply").spec, None, AutotuneMode.APPLY).config
    a, measured = pod_figures(series, "chat-a", 60, cfg, 0.5, None)
    b, _ = pod_figures(series, "chat-b", 60, cfg, 0.5, None)
    assert (a.requests, b.requests) == (100, 80) and a.good == pytest.approx(90) and b.good == pytest.approx(20)
    assert a.output_tokens == pytest.approx(5000) and a.errors == 2
    assert measured["goodput_share"] == pytest.approx(0.9, abs=0.01)


def test_the_canary_is_a_ready_scraped_pod_and_needs_a_control():
    pods = [{"metadata": {"name": n}, "status": {"conditions": [{"type": "Ready", "status": s}]}}
            for n, s in (("chat-b", "True"), ("chat-a", "True"), ("chat-c", "False"))]
    scraped = {"chat-a": "http://a", "chat-b": "http://b", "chat-c": "http://c"}
    assert ready_pods(pods) == {"chat-a", "chat-b"}
    assert choose_target(ready_pods(pods), scraped) == CanaryTarget("chat-a", "http://a", ("chat-b",))
    assert choose_target(ready_pods(pods), {"chat-a": "http://a"}) is None   # no control scraped: before/after


def test_a_canary_turned_off_is_set_back_then_dropped_not_left_running(started):
    """Autotune turned Off (or Recommend) mid-canary: nothing is judged or promoted in those modes, so
    the round that comes at once (Off runs no other round) sets the canary back to what status.engine
    makes every pod run; a canary that cannot be reached is tried again, then dropped after two
    windows, saying it runs the change until it restarts."""
    obj, res = started
    with socket.socket() as s:  # a closed loopback port: the canary's admin API does not answer
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    status = stored({}, res.status_update)
    status["tuning"]["pending"]["canary"]["url"] = url
    kube = FakeKube()
    kube.add_infd({}, name="chat")
    raw = kube.infd("chat")
    raw["spec"] = json.loads(obj.spec.model_dump_json(by_alias=True, exclude_none=True))
    raw["spec"]["autotune"]["mode"] = "Off"
    raw["status"] = status
    kube.pods = [{"metadata": {"name": n}, "status": {"podIP": "127.0.0.1"}} for n in ("chat-a", "chat-b", "chat-c")]
    settings = Settings.from_env({"KVTUNE_PROMETHEUS_URL": "http://127.0.0.1:9", "KVTUNE_ALLOW_LOOPBACK_ENGINES": "1"})
    now = [NOW + 30]
    loop = TuningLoop(Reconciler(kube, settings), settings, clock=lambda: now[0])
    memo: dict = {"tuned_at": NOW}  # Off: the interval is not waited for
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo)
    t = kube.infd("chat")["status"]["tuning"]
    assert t["pending"]["canary"]["pod"] == "chat-a" and "autotune mode is Off" in t["message"]
    assert "setting canary pod chat-a back failed" in t["message"] and "trying again" in t["message"]
    now[0] = NOW + 2 * 120 + 31  # two windows: dropped, unjudged and unbarred
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo)
    t = kube.infd("chat")["status"]["tuning"]
    assert "pending" not in t and t["history"][-1]["action"] == "RollBack" and not t.get("rejected")
    assert "could not be set back" in t["history"][-1]["message"] and "until it is restarted" in t["history"][-1]["message"]
    assert loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo) is None  # Off: no more rounds
