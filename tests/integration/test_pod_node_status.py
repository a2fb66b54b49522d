"""The pod node reports its containers as a kubelet does, and the real controllers act on it.

What a user sees in ``kubectl get pod -o json``: a container that exits 1 is restarted with a
doubling back-off (CrashLoopBackOff), its exit code and termination message (the log's tail,
FallbackToLogsOnError) in ``lastState.terminated``, a growing ``restartCount``, and the pod not
Ready. A container is Ready only once its readiness probe answers; a rollout with maxUnavailable 0
then keeps the old pod serving while the new one is not Ready, until ProgressDeadlineExceeded,
and completes once it is.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from .waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.wallclock]

HEALTH_SERVER = Path(__file__).with_name("health_server.py")
#: 100 lines of 30 bytes or so: more than the kubelet keeps (the last 80 lines, then their last
#: 2048 bytes, which may begin inside a line)
CRASH = ("import sys\n"
         "for i in range(99): print(f'engine log line {i:03d} .........')\n"
         "print('kvtune serve: no room at all (test)', file=sys.stderr)\n"
         "sys.exit(1)\n")
CRASH_LOG = [f"engine log line {i:03d} .........\n" for i in range(99)] + ["kvtune serve: no room at all (test)\n"]


def deployment(namespace: str, name: str, container: dict, **spec) -> str:
    labels = {"app.kubernetes.io/name": "kvtune-engine", "kvtune.io/inference-deployment": name}
    return json.dumps({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, **spec, "template": {
            "metadata": {"labels": labels},
            "spec": {"terminationGracePeriodSeconds": 2, "containers": [{
                "name": "main", "image": "example.invalid/kvtune-engine:test",
                "terminationMessagePolicy": "FallbackToLogsOnError", **container}]}}}})


def pods(controlplane, namespace: str, name: str) -> list[dict]:
    return controlplane.kubectl_json("get", "pods", "-n", namespace, "-l",
                                     f"kvtune.io/inference-deployment={name}")["items"]


def condition(obj: dict, kind: str) -> dict:
    return next((c for c in obj["status"].get("conditions") or [] if c["type"] == kind), {})


def test_crash_loop_shows_exit_code_message_restarts_and_back_off(controlplane, pod_node, namespace):
    controlplane.kubectl("apply", "-f", "-", input=deployment(namespace, "crash", {
        "command": ["python3", "-c", CRASH]}))
    seen: list[str] = []  # the waiting messages, in order: every status patch is a watch event
    from kubernetes import client, watch

    core = client.CoreV1Api(controlplane.api_client())
    with pod_node.restricted_to(namespace):
        for event in watch.Watch().stream(core.list_namespaced_pod, namespace, timeout_seconds=90,
                                          label_selector="kvtune.io/inference-deployment=crash"):
            cs = (event["object"].status.container_statuses or [None])[0]
            waiting = cs and cs.state and cs.state.waiting
            if waiting and waiting.message and waiting.message not in seen:
                seen.append(waiting.message)
            if cs and cs.restart_count >= 3 and waiting and "back-off 4s" in (waiting.message or ""):
                break
        (pod,) = pods(controlplane, namespace, "crash")
    name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
    tail = f"restarting failed container=main pod={name}_{namespace}({uid})"
    # the kubelet's back-off, scaled: at once, then 1 s, 2 s, 4 s, ... (a waiting message per wait)
    assert seen[:3] == [f"back-off {s} {tail}" for s in ("1s", "2s", "4s")], seen
    cs = pod["status"]["containerStatuses"][0]
    assert cs["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert cs["ready"] is False and cs["restartCount"] >= 3
    last = cs["lastState"]["terminated"]
    assert last["exitCode"] == 1 and last["reason"] == "Error"
    assert last["message"] == "".join(CRASH_LOG[-80:]).encode()[-2048:].decode()
    assert len(last["message"].encode()) == 2048 and last["message"].endswith("kvtune serve: no room at all (test)\n")
    assert last["startedAt"] <= last["finishedAt"]
    assert pod["status"]["phase"] == "Running"  # restartPolicy Always: Running while it restarts
    for kind in ("Ready", "ContainersReady"):
        c = condition(pod, kind)
        assert c["status"] == "False" and c["reason"] == "ContainersNotReady", c
        assert c["message"] == "containers with unready status: [main]"
    row = controlplane.kubectl("get", "pod", name, "-n", namespace, "--no-headers").stdout.split()
    assert row[1] == "0/1" and row[2] in ("CrashLoopBackOff", "Error") and int(row[3]) >= 3, row
    dep = controlplane.kubectl_json("get", "deployment", "crash", "-n", namespace)
    assert not dep["status"].get("readyReplicas") and dep["status"]["unavailableReplicas"] == 1


def test_ready_only_once_the_probe_answers_and_rollouts_wait_for_it(controlplane, pod_node, namespace):
    """Time (~15 s): readiness probes every 5 s, and the rollout's 10 s progress deadline, which must
    pass before the Deployment reads ProgressDeadlineExceeded."""
    container = {
        "command": ["python3", str(HEALTH_SERVER), "/gate/ready"],
        "ports": [{"containerPort": 8000, "name": "http"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "volumeMounts": [{"name": "gate", "mountPath": "/gate"}]}
    volumes = {"volumes": [{"name": "gate", "emptyDir": {}}]}
    body = json.loads(deployment(namespace, "gated", container, progressDeadlineSeconds=10,
                                 strategy={"type": "RollingUpdate",
                                           "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}))
    body["spec"]["template"]["spec"].update(volumes)
    labels = {"kvtune.io/inference-deployment": "gated"}
    controlplane.kubectl("apply", "-f", "-", input=json.dumps(body))

    with pod_node.restricted_to(namespace):
        (old,) = pod_node.wait_for_selector(namespace, labels, timeout=60)
        assert httpx.get(old.url + "/health").status_code == 503
        time.sleep(3)  # several probes: still not Ready
        (pod,) = pods(controlplane, namespace, "gated")
        cs = pod["status"]["containerStatuses"][0]
        assert "running" in cs["state"] and cs["ready"] is False and cs["restartCount"] == 0
        assert condition(pod, "Ready")["status"] == "False" and condition(pod, "ContainersReady")["status"] == "False"
        assert pod_node.urls_for_selector(namespace, labels) == []  # a Service has no endpoint yet

        Path(old.local_path("/gate/ready")).touch()
        pod = eventually(lambda: (p := pods(controlplane, namespace, "gated")[0]) and
                         condition(p, "Ready").get("status") == "True" and p, timeout=20, what="Ready")
        assert condition(pod, "ContainersReady")["status"] == "True"
        assert pod["status"]["containerStatuses"][0]["ready"] is True
        assert pod_node.urls_for_selector(namespace, labels) == [old.url]
        eventually(lambda: controlplane.kubectl_json("get", "deployment", "gated", "-n", namespace)["status"]
                   .get("availableReplicas") == 1, timeout=20, what="the Deployment to count it available")

        # A rollout whose new pod never gets Ready: the old one keeps serving, the deadline passes.
        controlplane.kubectl("set", "env", "deployment/gated", "-n", namespace, "ROLL=1")

        def stuck():
            dep = controlplane.kubectl_json("get", "deployment", "gated", "-n", namespace)
            prog = next((c for c in dep["status"].get("conditions") or [] if c["type"] == "Progressing"), {})
            return dep if prog.get("reason") == "ProgressDeadlineExceeded" else None
        dep = eventually(stuck, timeout=60, interval=0.5, what="ProgressDeadlineExceeded")
        assert dep["status"]["availableReplicas"] == 1 and dep["status"]["updatedReplicas"] == 1
        both = pods(controlplane, namespace, "gated")
        assert len(both) == 2
        assert [p["metadata"]["name"] for p in both if condition(p, "Ready")["status"] == "True"] == [old.name]
        assert pod_node.urls_for_selector(namespace, labels) == [old.url] and old.alive()
        new = next(lp for lp in pod_node.pods_for_selector(namespace, labels) if lp.name != old.name)

        # The new pod gets Ready: the rollout completes and the old pod goes.
        Path(new.local_path("/gate/ready")).touch()
        eventually(lambda: pod_node.get(namespace, old.name) is None, timeout=60, what="the old pod to go")
        assert pod_node.urls_for_selector(namespace, labels) == [new.url]
        controlplane.kubectl("rollout", "status", "deployment/gated", "-n", namespace, "--timeout=60s")


def test_a_deleted_pod_leaves_the_service_at_once_and_serves_through_its_prestop_sleep(
        controlplane, pod_node, namespace):
    """A rollout's old pod stops while its clients still send to it: out of the Service's endpoints
    first, then the ``preStop`` sleep in which it still answers, then SIGTERM. Like a kubelet's, the
    pod stays Terminating in the API while its process runs (what the operator waits for before it
    judges a rollout's new pods), and goes once it stopped."""
    container = {"command": ["python3", str(HEALTH_SERVER)], "ports": [{"containerPort": 8000, "name": "http"}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
                 "lifecycle": {"preStop": {"sleep": {"seconds": 3}}}}
    body = json.loads(deployment(namespace, "draining", container))
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 10
    labels = {"kvtune.io/inference-deployment": "draining"}
    controlplane.kubectl("apply", "-f", "-", input=json.dumps(body))
    with pod_node.restricted_to(namespace):
        (old,) = pod_node.wait_for_selector(namespace, labels, timeout=60)
        eventually(lambda: pod_node.urls_for_selector(namespace, labels) == [old.url], timeout=20, what="Ready")
        deleted = time.monotonic()
        controlplane.kubectl("delete", "pod", old.name, "-n", namespace, "--wait=false")
        eventually(lambda: old.url not in pod_node.urls_for_selector(namespace, labels), timeout=20, interval=0.05,
                   what="the deleted pod to leave the Service")
        shown_terminating = 0
        while True:
            # read before the process answers: an answer after it means it ran when the API was read
            api = controlplane.kubectl("get", "pod", old.name, "-n", namespace, "-o", "json", check=False)
            try:
                assert httpx.get(old.url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                break
            assert api.returncode == 0, f"the pod left the API while its process still served: {api.stderr}"
            shown_terminating += bool(json.loads(api.stdout)["metadata"].get("deletionTimestamp"))
            time.sleep(0.05)
        served_s = time.monotonic() - deleted
        # the preStop sleep is a clock (3 s from the deletion at the earliest), and the grace period
        # (10 s) bounds the whole stop: whatever the machine's speed
        assert 3 - 0.1 <= served_s <= 10 + 5, served_s
        assert shown_terminating > 0
        eventually(lambda: pod_node.get(namespace, old.name) is None, timeout=20, what="the process to stop")
        eventually(lambda: controlplane.kubectl("get", "pod", old.name, "-n", namespace, check=False).returncode != 0,
                   timeout=20, what="the stopped pod to leave the API")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
