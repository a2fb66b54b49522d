"""The tuner keeps its memory in status.tuning only (issue 12): what an operator restart must find.

* the state round-trips through the status as the apiserver stores it (JSON, merge patch, the model);
* a recorded sequence of windows gives the same decisions whether the tuner's state stays in memory
  (`Tuner.round`, as `kvtune tune` runs it) or is rebuilt from status at every tick (the operator):
  an operator restarted between any two ticks decides exactly as one that never stopped;
* a restart change whose pods never come up is rolled back from the pods' status, without a window;
* the loop in the cluster (`TuningLoop`, against the in-memory fake of the apiserver) keeps no
  tuner of its own, rolls back a failed rollout before reading any metrics, and tries a
  kvtune.io/try value once, remembered in status.
"""
from __future__ import annotations

import datetime as dt
import json

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_operator.effective import effective_engine, resolve_autotune
from kvtune_operator.model import AutotuneMode, InferenceDeployment
from kvtune_operator.reconcile import Reconciler
from kvtune_operator.render import ANNOTATION_RESTART_HASH, restart_hash
from kvtune_operator.rollout import UNSCHEDULABLE_S, placement_note, rollout_failure, rollout_pending
from kvtune_operator.settings import Settings
from kvtune_operator.tuner.decide import TunerState, config_key
from kvtune_operator.tuner.loop import Tuner
from kvtune_operator.tuner.observation import Observation
from kvtune_operator.tuning import TRY_ANNOTATION, Gathered, TuningLoop, roll_back_failed_rollout, tick, tuner_settings
from kvtune_operator.tuning_state import state_from_status, state_status

from test_operator_reconcile import SPEC, FakeKube, merge_patch

SC = SCENARIOS["seq-cap"]
NOW = 1_800_000_000.0  # epoch seconds of the rollout checks
PROFILE = load_profile(SC.profile)
SPEC_DOC = {"model": {"path": "/models/m"},
            "engine": {"maxNumSeqs": 16, "gpuMemoryUtilization": 0.9, "maxModelLen": 8192},
            "autotune": {"mode": "Apply", "interval": "30s", "window": "2m", "cooldown": "10m",
                         "objectives": {"ttftP95": "2s", "tpotP95": "100ms"},
                         "bounds": {"maxNumSeqs": {"min": 8, "max": 256}}}}


def obj(status: dict | None = None, spec: dict | None = None) -> InferenceDeployment:
    return InferenceDeployment.from_body({
        "apiVersion": "kvtune.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "chat", "namespace": "llm", "generation": 1},
        "spec": spec or SPEC_DOC, "status": status or {}})


def stored(status: dict, update: dict) -> dict:
    """The status after the operator's merge patch, as the apiserver returns it (JSON)."""
    return json.loads(json.dumps(merge_patch(status, json.loads(json.dumps(update)))))


def window(cfg: EngineConfig, i: int, n: int = 400) -> Gathered:
    trace = [r for r in SC.trace(i)[:n]]
    summary = simulate(trace, cfg, PROFILE, SLO(SC.slo_ttft_s, SC.slo_tpot_s))
    return Gathered(Observation.from_sim_summary(summary, trace=trace, config=cfg), trace,
                    summary.get("duration_s", 60.0))


def test_the_state_round_trips_through_the_status():
    st = TunerState(last_restart_at=1_700_000_100.0, restarts=3)
    before = EngineConfig(max_num_seqs=16, swap_space=0.0)
    bad = before.with_changes(max_num_seqs=2, gpu_memory_utilization=0.5)
    st.bad[config_key(bad)] = 1_700_003_600.0
    st.bad_reasons[config_key(bad)] = (1_700_000_000.0, "goodput fell 40%")
    from kvtune_operator.tuner.decide import Decision
    d = Decision("change", "why", before, before.with_changes(block_size=32), {"block_size": 32}, restart=True)
    st.begin(d, {"goodput_share": 0.5, "output_tokens_per_s": 10.0}, 1_700_000_200.0, source="Annotation")
    back = state_from_status(obj(stored({}, {"tuning": state_status(st)})).status.tuning)
    assert back.phase == "Verifying" and back.pending == st.pending
    assert back.bad == st.bad and back.bad_reasons == st.bad_reasons
    assert back.restarts == 4 and back.last_restart_at == 1_700_000_200.0   # begin counted the restart
    assert back.is_bad(bad, 1_700_000_300.0)
    wire = stored({}, {"tuning": state_status(st)})["tuning"]
    assert wire["pending"]["restartHash"] == restart_hash(before.with_changes(block_size=32))
    assert wire["rejected"][0]["reason"] == "goodput fell 40%"


def test_the_same_decisions_with_the_state_in_memory_or_in_status():
    """Four windows of the seq-cap scenario, each measured under the config then in force."""
    spec = obj().spec
    plan = resolve_autotune(spec, Settings())
    tuner = Tuner(tuner_settings(spec, plan), base_profile=PROFILE)
    cfg_mem = cfg_status = effective_engine(spec, None, AutotuneMode.APPLY).config
    status: dict = {}
    mem, via_status = [], []
    for i in range(4):
        now = 1_000_000.0 + 300 * i
        w = window(cfg_mem, i)
        r = tuner.round(w.observation, w.trace, now)
        mem.append((r.verdict.keep if r.verdict else None, r.decision.changes if r.changed else None))
        cfg_mem = r.config
        # the operator: every tick from the stored status alone (a new process each time)
        w = window(cfg_status, i)
        res = tick(spec, obj(status).status, plan, w, now, base_profile=PROFILE)
        status = stored(status, res.status_update)
        actions = [h["action"] for h in status["tuning"].get("history", [])]
        via_status.append(actions)
        cfg_status = effective_engine(spec, obj(status).status, AutotuneMode.APPLY).config
    assert cfg_status == cfg_mem
    flat = via_status[-1]
    expected = []
    for keep, changes in mem:
        if keep is not None:
            expected.append("Keep" if keep else "RollBack")
        if changes:
            expected.append("Apply")
    assert flat == expected and "Apply" in flat and flat.count("Apply") <= 2


def test_a_pending_change_is_judged_on_its_window_after_an_operator_restart():
    spec = obj().spec
    plan = resolve_autotune(spec, Settings())
    cfg = effective_engine(spec, None, AutotuneMode.APPLY).config
    first = tick(spec, None, plan, window(cfg, 0), 1_000_000.0, base_profile=PROFILE)
    status = stored({}, first.status_update)
    assert status["tuning"]["phase"] == "Verifying" and status["tuning"]["pending"]["source"] == "Tuner"
    # a new operator process: nothing but the stored status
    after = obj(status)
    new_cfg = effective_engine(spec, after.status, AutotuneMode.APPLY).config
    res = tick(spec, after.status, plan, window(new_cfg, 1), 1_000_300.0, base_profile=PROFILE)
    actions = [h["action"] for h in stored(status, res.status_update)["tuning"]["history"]]
    assert actions[:2] == ["Apply", "Keep"]                 # the verdict comes first, on its own window
    assert [e.reason for e in res.events][0] == "TuningKeep"


def _pod(name: str, hsh: str, *, restarts: int, exit_code: int = 1, message: str = "", waiting: str | None = None,
         deleting: bool = False) -> dict:
    cs = {"name": "engine", "restartCount": restarts, "ready": False,
          "state": {"waiting": {"reason": waiting}} if waiting else {"running": {}},
          "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error", "message": message}}}
    meta = {"name": name, "annotations": {ANNOTATION_RESTART_HASH: hsh}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"containerStatuses": [cs]}}


def test_rollout_failure_reads_the_new_pods_and_the_deployment():
    msg = "kvtune serve: --gpu-memory-utilization 0.3 leaves no room for one KV block"
    old = _pod("a", "old", restarts=9, message="something else")
    assert rollout_failure([old], None, "new", NOW) is None                      # the old pods are not the change's
    assert rollout_failure([_pod("b", "new", restarts=0)], None, "new", NOW) is None   # one failure: not yet
    assert rollout_failure([_pod("b", "new", restarts=3, deleting=True, message=msg)], None, "new", NOW) is None
    why = rollout_failure([old, _pod("b", "new", restarts=2, message=f"loading\n{msg}", waiting="CrashLoopBackOff")],
                          None, "new", NOW)
    assert why is not None and msg in why and "CrashLoopBackOff" in why and "loading" not in why
    assert rollout_failure([_pod("b", "new", restarts=5, exit_code=0)], None, "new", NOW) is None   # not errors
    dep = {"metadata": {"name": "chat"},
           "spec": {"template": {"metadata": {"annotations": {ANNOTATION_RESTART_HASH: "new"}}}},
           "status": {"conditions": [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                      "message": 'ReplicaSet "chat-5d9" has timed out progressing.'}]}}
    assert "timed out progressing" in rollout_failure([], dep, "new", NOW)
    assert rollout_failure([], dep, "other", NOW) is None


def test_a_new_pod_the_scheduler_cannot_place_fails_the_rollout_after_a_bound_and_is_named_while_it_waits():
    """A rollout's or canary's extra pod with no room (a shared cluster with no spare GPU) is a failure
    after UNSCHEDULABLE_S, with the scheduler's words, not after the Deployment's 30-minute deadline;
    while it waits, the tuner's message says what the scheduler says."""
    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."

    def pending(hsh: str, since_s: float, deleting: bool = False) -> dict:
        pod = _pod("b", hsh, restarts=0, deleting=deleting)
        since = dt.datetime.fromtimestamp(NOW - since_s, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        pod["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                             "reason": "Unschedulable", "message": why,
                                                             "lastTransitionTime": since}]}
        return pod
    assert rollout_failure([pending("new", UNSCHEDULABLE_S - 5)], None, "new", NOW) is None   # not yet
    failed = rollout_failure([pending("new", UNSCHEDULABLE_S + 5)], None, "new", NOW)
    assert failed is not None and why in failed and "pod b" in failed and f"{UNSCHEDULABLE_S + 5:.0f}s" in failed
    assert rollout_failure([pending("old", UNSCHEDULABLE_S + 5)], None, "new", NOW) is None   # not the change's
    note = placement_note([_pod("a", "old", restarts=0), pending("new", 30)], NOW)
    assert why in note and "pod b for 30s" in note
    assert placement_note([_pod("a", "old", restarts=0)], NOW) == ""
    assert placement_note([pending("new", 30, deleting=True)], NOW) == ""


def _pending_restart_status() -> tuple[dict, EngineConfig, EngineConfig]:
    spec = obj().spec
    plan = resolve_autotune(spec, Settings())
    cfg = effective_engine(spec, None, AutotuneMode.APPLY).config
    first = tick(spec, None, plan, window(cfg, 0), 1_000_000.0, trial={"gpu_memory_utilization": 0.3},
                 base_profile=PROFILE)
    status = stored({}, first.status_update)
    return status, cfg, cfg.with_changes(gpu_memory_utilization=0.3)


def test_a_failed_rollout_is_rolled_back_and_the_candidate_barred():
    status, old, new = _pending_restart_status()
    assert status["tuning"]["pending"]["restart"] and status["engine"]["gpuMemoryUtilization"] == 0.3
    o = obj(status)
    res = roll_back_failed_rollout(o.spec, o.status, resolve_autotune(o.spec, Settings()),
                                   "pod chat-x: the engine exited with code 1 2 times: no room for one KV block",
                                   1_000_060.0)
    after = stored(status, res.status_update)
    assert after["engine"]["gpuMemoryUtilization"] == 0.9
    assert "pending" not in after["tuning"] and after["tuning"]["phase"] == "RolledBack"
    ev = [e for e in res.events if e.reason == "TuningRollBack"]
    assert ev and ev[0].type == "Warning" and "no room for one KV block" in ev[0].message
    assert state_from_status(obj(after).status.tuning).is_bad(new, 1_000_100.0)
    assert after["tuning"]["lastChange"]["restart"] is True


def _cluster_with_pending_restart(status: dict) -> tuple[FakeKube, TuningLoop]:
    """A FakeKube holding "chat" with a pending restart change in its status, and a loop whose
    Prometheus is unreachable (so a round that reads metrics says PrometheusUnreachable)."""
    kube = FakeKube()
    kube.add_infd({**SPEC, "engine": {**SPEC["engine"], "gpuMemoryUtilization": 0.9}}, name="chat")
    o = kube.infd("chat")
    o["spec"] = json.loads(json.dumps(SPEC_DOC))
    o["status"] = status
    settings = Settings.from_env({"KVTUNE_PROMETHEUS_URL": "http://127.0.0.1:9"})  # nothing listens
    return kube, TuningLoop(Reconciler(kube, settings), settings, clock=lambda: 1_000_060.0)


def test_the_loop_rolls_back_a_crashing_rollout_before_reading_metrics_and_tries_once():
    status, old, new = _pending_restart_status()
    kube, loop = _cluster_with_pending_restart(status)
    o = kube.infd("chat")
    o["metadata"]["annotations"] = {TRY_ANNOTATION: '{"gpuMemoryUtilization": 0.3}'}
    status["tuning"]["triedAnnotation"] = o["metadata"]["annotations"][TRY_ANNOTATION]
    kube.pods = [_pod("chat-new", restart_hash(new), restarts=2, waiting="CrashLoopBackOff",
                      message="kvtune serve: --gpu-memory-utilization 0.3 leaves no room for one KV block")]
    memo: dict = {}                                          # kopf's per-object memo
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo)
    st = kube.infd("chat")["status"]
    assert st["engine"]["gpuMemoryUtilization"] == 0.9 and "pending" not in st["tuning"]
    assert ("Warning", "TuningRollBack") in [(t, r) for t, r, _ in kube.events]
    assert not vars(loop).keys() - {"reconciler", "settings", "clock"}   # no tuner memory in the process
    # the next tick: no pending change, the annotation was tried already: no second try
    kube.pods = []
    loop.clock = lambda: 1_000_200.0
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo)
    st = kube.infd("chat")["status"]
    assert st["engine"]["gpuMemoryUtilization"] == 0.9 and "pending" not in st["tuning"]
    from kvtune_operator.conditions import get_condition
    assert get_condition(st["conditions"], "MetricsAvailable")["reason"] == "PrometheusUnreachable"


def test_no_window_is_judged_while_a_restart_change_rolls_out():
    """vLLM's metrics do not show the knobs a pod runs: until every replica runs the new template
    (the Deployment's own rollout status), a window could be the old pods'. The loop waits, reads no
    metrics, keeps the pending change; once the rollout is complete (old pods gone) it waits for a
    whole window of the new pods, then reads it."""
    status, old, new = _pending_restart_status()
    kube, loop = _cluster_with_pending_restart(status)
    hsh = status["tuning"]["pending"]["restartHash"]
    memo: dict = {}
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo)
    key = ("apps/v1", "Deployment", "llm", "chat")
    dep = kube.objects[key]                         # the round's reconcile rendered it: the new template
    assert dep["spec"]["template"]["metadata"]["annotations"][ANNOTATION_RESTART_HASH] == hsh
    dep["metadata"]["generation"] = 2
    dep["status"] = {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 1, "availableReplicas": 1}
    loop.clock = lambda: 1_000_200.0
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo)
    st = kube.infd("chat")["status"]
    assert st["tuning"]["phase"] == "Applying" and st["tuning"]["pending"]["restartHash"] == hsh
    assert st["tuning"]["message"] == "waiting for the rollout: 1 old pods are still running", st["tuning"]
    from kvtune_operator.conditions import get_condition
    assert (get_condition(st.get("conditions") or [], "MetricsAvailable") or {}).get("reason") != "PrometheusUnreachable"
    kube.objects[key]["status"] = {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1}
    # the Deployment is done, but the old pod still terminates: it finishes its requests beside the new one
    kube.pods = [_pod("chat-new", hsh, restarts=0), _pod("chat-old", "old", restarts=0, deleting=True)]
    loop.clock = lambda: 1_000_400.0
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo)
    st = kube.infd("chat")["status"]
    assert st["tuning"]["message"] == "waiting for the rollout: 1 old pods are still terminating", st["tuning"]
    # rolled out: the moment is kept, and a whole window (2m) of the new pods passes before any is read
    kube.pods = kube.pods[:1]
    loop.clock = lambda: 1_000_500.0
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo)
    st = kube.infd("chat")["status"]
    assert st["tuning"]["pending"]["rolledOutAt"] == "1970-01-12T13:55:00Z" and st["tuning"]["phase"] == "Verifying"
    assert "after a whole 120s window of the new pods" in st["tuning"]["message"]
    loop.clock = lambda: 1_000_600.0
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo)
    st = kube.infd("chat")["status"]
    assert (get_condition(st.get("conditions") or [], "MetricsAvailable") or {}).get("reason") != "PrometheusUnreachable"
    loop.clock = lambda: 1_000_630.0
    loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), memo)
    st = kube.infd("chat")["status"]
    assert get_condition(st["conditions"], "MetricsAvailable")["reason"] == "PrometheusUnreachable"  # read now
    assert st["tuning"]["pending"]["restartHash"] == hsh                  # still waiting for its verdict


def test_rollout_pending_reads_the_deployment_as_kubectl_rollout_status_does():
    def dep(hsh="new", gen=3, **st):
        return {"metadata": {"name": "d", "generation": gen},
                "spec": {"replicas": 2, "template": {"metadata": {"annotations": {ANNOTATION_RESTART_HASH: hsh}}}},
                "status": {"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2} | st}
    assert rollout_pending(dep(), "new") is None
    assert rollout_pending(dep(), None) is None
    assert "not there" in rollout_pending(None, "new")
    assert "has not seen" in rollout_pending(dep(gen=4), "new")
    assert rollout_pending(dep(updatedReplicas=1), "new") == "1 of 2 pods run the new template"
    assert rollout_pending(dep(replicas=3), "new") == "1 old pods are still running"
    assert rollout_pending(dep(availableReplicas=1), "new") == "1 of 2 new pods are available"
    leaving = {"metadata": {"name": "old", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert rollout_pending(dep(), "new", [{"metadata": {"name": "new"}}, leaving]) == "1 old pods are still terminating"


def test_a_bad_try_annotation_is_answered_once_with_what_is_allowed(monkeypatch):
    """A kvtune.io/try value that parses but the resource cannot take (blockSize 24, swap past its
    maximum) used to fail the timer at every interval, silently: now one Warning event says what was
    wrong and what is allowed, the value is recorded as tried, and the next rounds go on tuning."""
    import kvtune_operator.tuning as tuning
    kube = FakeKube()
    kube.add_infd(SPEC, name="chat")
    o = kube.infd("chat")
    o["spec"] = json.loads(json.dumps(SPEC_DOC))
    settings = Settings.from_env({})
    cfg = effective_engine(obj().spec, None, AutotuneMode.APPLY).config
    monkeypatch.setattr(tuning, "gather", lambda *a, **k: window(cfg, 0))
    for bad, allowed in (('{"blockSize": 24}', "8, 16, 32, 64 or 128"),
                         ('{"swapSpaceGiB": 1e308}', "less than or equal to 1024"),
                         ('{"maxNumBatchedTokens": 8}', "smaller than one block")):
        o["metadata"]["annotations"] = {TRY_ANNOTATION: bad}
        o["status"] = {}
        loop = TuningLoop(Reconciler(kube, settings), settings, clock=lambda: 1_000_000.0)
        kube.events.clear()
        loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), {})
        (warning,) = [(t, m) for t, r, m in kube.events if r == "InvalidTrial"]
        assert warning[0] == "Warning" and TRY_ANNOTATION in warning[1] and allowed in warning[1], warning
        st = kube.infd("chat")["status"]
        assert st["tuning"]["triedAnnotation"] == bad
        assert (st["tuning"].get("pending") or {}).get("source", "Tuner") == "Tuner"  # the tuner's own, if any
        loop.clock = lambda: 1_000_100.0                      # the next round: not parsed again
        kube.events.clear()
        loop.maybe_tick("llm", "chat", kube.get_infd("llm", "chat"), {})
        assert not [r for _, r, _ in kube.events if r == "InvalidTrial"]
