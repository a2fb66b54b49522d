"""Conditions from observed state, their transition times, and the events they deserve."""
from __future__ import annotations

from kvtune_operator import conditions as c


def dep(desired=2, ready=2, updated=2, current=2, available=None, generation=1, observed=1, conds=()):
    return {"metadata": {"generation": generation},
            "status": {"replicas": current, "readyReplicas": ready, "updatedReplicas": updated,
                       "availableReplicas": ready if available is None else available,
                       "observedGeneration": observed, "conditions": list(conds)}}


def pod(name="p", waiting=None, last=None, terminated=None, unschedulable=None):
    cs = {"name": "engine", "state": {}, "lastState": {}}
    if waiting:
        cs["state"]["waiting"] = {"reason": waiting, "message": "back-off"}
    if terminated:
        cs["state"]["terminated"] = terminated
    if last:
        cs["lastState"]["terminated"] = last
    status = {"containerStatuses": [cs]}
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": unschedulable}]
    return {"metadata": {"name": name}, "status": status}


def test_set_condition_keeps_transition_time_while_status_holds():
    conds = c.set_condition([], c.Cond("Ready", "False", "ReplicasNotReady", "0/1"), generation=1, now="t1")
    conds = c.set_condition(conds, c.Cond("Ready", "False", "ReplicasNotReady", "0/2"), generation=2, now="t2")
    assert conds == [{"type": "Ready", "status": "False", "reason": "ReplicasNotReady", "message": "0/2",
                      "lastTransitionTime": "t1", "observedGeneration": 2}]
    conds = c.set_condition(conds, c.Cond("Ready", "True", "AllReplicasReady", "2/2"), generation=2, now="t3")
    assert conds[0]["lastTransitionTime"] == "t3"


def test_conditions_are_ordered_by_type():
    conds = []
    for t in ["Degraded", "Tuned", "Ready", "MetricsAvailable", "Progressing"]:
        conds = c.set_condition(conds, c.Cond(t, "Unknown", "X"), generation=1, now="t")
    assert [x["type"] for x in conds] == ["Ready", "Progressing", "MetricsAvailable", "Tuned", "Degraded"]


def test_ready():
    assert c.ready_condition(2, None).reason == "DeploymentMissing"
    assert c.ready_condition(2, dep()).status == "True"
    assert c.ready_condition(2, dep(ready=1)).message == "1/2 engine pods ready"
    assert c.ready_condition(0, dep(desired=0, ready=0)).reason == "ScaledToZero"


def test_progressing():
    assert c.progressing_condition(2, dep(), []).reason == "RolloutComplete"
    assert c.progressing_condition(2, dep(generation=2, observed=1), []).reason == "RolloutPending"
    p = c.progressing_condition(2, dep(updated=1, current=3), ["blockSize"])
    assert p.status == "True" and p.reason == "RollingOut" and "blockSize" in p.message
    stuck = dep(conds=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "m"}])
    assert c.progressing_condition(2, stuck, []).reason == "ProgressDeadlineExceeded"


def test_degraded_order_and_messages():
    kw = dict(deployment=dep(), pods=[])
    assert c.degraded_condition(config_error=None, apply_error=None, missing_pvc=None, **kw).status == "False"
    assert c.degraded_condition(config_error="bad", apply_error="x", missing_pvc="w", **kw).reason == "InvalidSpec"
    assert c.degraded_condition(config_error=None, apply_error="x", missing_pvc="w", **kw).reason == "ApplyFailed"
    missing = c.degraded_condition(config_error=None, apply_error=None, missing_pvc="weights", **kw)
    assert missing.reason == "ModelVolumeMissing" and "weights" in missing.message
    crash = c.degraded_condition(config_error=None, apply_error=None, missing_pvc=None, deployment=dep(),
                                 pods=[pod(waiting="CrashLoopBackOff",
                                           last={"exitCode": 2, "message": "model path /m does not exist"})])
    assert crash.reason == "EngineFailing" and "/m does not exist" in crash.message
    pull = c.pod_problem([pod(waiting="ImagePullBackOff")])
    assert pull.reason == "ImagePullFailed"
    exited = c.pod_problem([pod(terminated={"exitCode": 1, "message": "boom"})])
    assert exited.reason == "EngineFailing" and "boom" in exited.message
    unsched = c.pod_problem([pod(unschedulable="0/3 nodes: insufficient nvidia.com/gpu")])
    assert unsched.reason == "Unschedulable" and "nvidia.com/gpu" in unsched.message
    assert c.pod_problem([pod(waiting="ContainerCreating")]) is None


def test_tuner_conditions_initialised_not_overwritten():
    init = {x.type: x for x in c.tuner_conditions([], "Recommend")}
    assert init["MetricsAvailable"].status == "Unknown" and init["Tuned"].reason == "Pending"
    owned = [{"type": "MetricsAvailable", "status": "False", "reason": "NoPrometheus"},
             {"type": "Tuned", "status": "True", "reason": "Settled"}]
    assert c.tuner_conditions(owned, "Apply") == []
    off = {x.type: x for x in c.tuner_conditions(owned, "Off")}
    assert off["Tuned"].status == "False" and off["Tuned"].reason == "AutotuneOff" and "MetricsAvailable" not in off


def test_transition_events():
    new = {"type": "Degraded", "status": "True", "reason": "ModelVolumeMissing", "message": "m"}
    assert c.transition_event(None, new) == ("Warning", "ModelVolumeMissing", "m")
    assert c.transition_event(new, new) is None
    ok = {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": ""}
    assert c.transition_event(new, ok)[1] == "Recovered"
    assert c.transition_event(None, ok) is None
    ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "1/1"}
    assert c.transition_event(None, ready) == ("Normal", "Ready", "1/1")
    assert c.transition_event(ready, {**ready, "status": "False", "message": "0/1"})[0:2] == ("Warning", "NotReady")
    assert c.transition_event(ready, {**ready, "status": "False", "message": "1/2"},
                              progressing=True)[0:2] == ("Normal", "NotReady")
