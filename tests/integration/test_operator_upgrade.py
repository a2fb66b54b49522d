"""An operator upgrade in the middle of a rollout (issue 18), end to end on the control-plane harness.

The chart is installed with real helm into an operator namespace, watching one namespace, and the
operator runs as the chart's ServiceAccount (a kubeconfig holding a token from ``kubectl create
token``) with the KVTUNE_* environment of the chart's Deployment: the chart's least-privilege Role
is all it has, for the whole tuning loop (admin-key Secret, pods, Prometheus, status, events, the
Deployment's rollout). One InferenceDeployment in Apply mode serves an open-loop load; a restart
change is asked for (``kvtune.io/try``: gpuMemoryUtilization 0.3 -> 0.2 on the stand-in device) and
while its rollout is under way (status.tuning.pending written, the new ReplicaSet created, the old
pod still serving) the chart is upgraded as a cluster does it: the old operator gets SIGTERM (its
Deployment's Recreate strategy), ``helm upgrade`` changes the operator's pod template, and a new
operator starts with a fresh token. Then:

* the pending change gets exactly one verdict (one TuningKeep or TuningRollBack event, one history
  entry), judged on a whole window after its rollout; nothing is decided twice (one Apply, one
  TuningApply event, the annotation not tried again by the new operator);
* status tells the truth: status.engine is what every running engine pod runs (its admin state),
  nothing is left pending, Progressing ends RolloutComplete, Degraded is not True;
* the load loses nothing: every request sent got its whole answer (0 failed).

Time (~1.5 min with the fixtures, ~1 min of it the test's own): two engine starts (each imports
torch; a rollback would be a third), a first window before the change, the rollout's preStop sleep
and drain, the two operator starts, and a whole window (10 s, the shortest the CRD allows; interval
5 s) of the new pod alone after its rollout before the verdict.
"""
from __future__ import annotations

import datetime as dt
import os
import signal
import time

import pytest
import yaml

from .e2e_load import OpenLoopLoad, served_rate
from .test_operator_cluster import (  # noqa: F401 - crd is a fixture
    ROOT, OperatorProcess, _make_namespace, admin_key, condition, crd, eventually, get,
)
from .test_tuner_e2e import (  # noqa: F401 - model is a fixture
    LABEL, VOCAB, engine_state, history, infd, log, model, replica_sets, start_engine, tuning_events, url_of,
    wait_for, weights_bytes,
)
from kvtune_operator.model import KNOBS_BY_CAMEL

pytestmark = pytest.mark.integration

RELEASE = "kvtune-upg"
CHART = ROOT / "charts" / "kvtune"
TRIAL = '{"gpuMemoryUtilization": 0.2}'


@pytest.fixture
def upgrade_ns(controlplane, crd, pod_node):  # noqa: F811 - crd is a fixture
    system = _make_namespace(controlplane, "kvtune-op")
    watched = _make_namespace(controlplane, "upgrade")
    with pod_node.restricted_to(watched):
        try:
            yield system, watched
        finally:
            controlplane.helm("uninstall", RELEASE, "-n", system, check=False)
            for ns in (watched, system):
                controlplane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
            eventually(lambda: not [p for p in pod_node.pods.values() if p.namespace == watched], timeout=90,
                       what="the engine processes to stop")


def chart_operator(controlplane, system: str, log_path) -> OperatorProcess:
    """The operator as the chart's Deployment runs it: its ServiceAccount's token (a new one, as a new
    pod gets), the KVTUNE_* variables of its container; only what the harness needs on top (the
    engines are local processes; the tuner's timer polled every second)."""
    dep = get(controlplane, "deployment", RELEASE, system)
    pod = dep["spec"]["template"]["spec"]
    chart_env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]
                 if e["name"].startswith("KVTUNE_") and "value" in e}
    token = controlplane.kubectl("create", "token", pod["serviceAccountName"], "-n", system,
                                 "--duration=1h").stdout.strip()
    kubeconfig = log_path.with_suffix(".kubeconfig")
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": {"server": controlplane.server,
                                               "certificate-authority": str(controlplane.ca_file)}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa"}}]}))
    env = {k: v for k, v in controlplane.subprocess_env().items()
           if k != "KUBECONFIG" and not k.startswith("KVTUNE_")}
    env.update(chart_env, KVTUNE_TUNE_POLL_INTERVAL="1")
    return OperatorProcess(env, chart_env["KVTUNE_NAMESPACES"].split(","), log_path, kubeconfig=str(kubeconfig))


def stamp(t: str) -> float:
    """A status timestamp (RFC 3339) in seconds."""
    return dt.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()


def sigterm(op: OperatorProcess, grace_s: float = 30) -> int:
    """SIGTERM, as the kubelet stops the old operator pod; its exit code (it must exit by itself)."""
    assert op.proc is not None and op.proc.poll() is None, op.tail(40)
    os.killpg(op.proc.pid, signal.SIGTERM)
    try:
        code = op.proc.wait(grace_s)
    except Exception:  # noqa: BLE001 - still running after the grace period: a finding
        os.killpg(op.proc.pid, signal.SIGKILL)
        op.proc.wait(5)
        raise AssertionError(f"the operator did not exit within {grace_s}s of SIGTERM:\n{op.tail(40)}") from None
    op.proc = None
    return code


def test_chart_upgrade_during_a_restart_rollout_keeps_requests_and_status_true(
        controlplane, prometheus, pod_node, upgrade_ns, model, tmp_path):
    system, ns = upgrade_ns
    name = "upgrade"
    t0 = time.monotonic()
    values = {"watchNamespaces": [ns], "prometheusUrl": prometheus.url, "statusInterval": 1}
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    controlplane.helm("install", RELEASE, str(CHART), "-n", system, "-f", str(tmp_path / "values.yaml"),
                      "--wait=false")
    op = chart_operator(controlplane, system, tmp_path / "operator-1.log").start()
    ops = [op]
    try:
        # the stand-in device: gpuMemoryUtilization 0.1 of it is the weights alone; 0.3 leaves twice the
        # weights for the KV cache, 0.2 once: both start. Every knob but the one tried is frozen, and it
        # is at its bound: the tuner itself has nothing to change, the one decision is the user's.
        device = weights_bytes(model) / 0.1 / 2**30
        body = yaml.safe_load(infd(
            # maxModelLen left to the engine (the model's context length, 4096): status.engine must not claim
            # the config's default 8192 for it (it did)
            name, model, engine={"maxNumSeqs": 8, "gpuMemoryUtilization": 0.3},
            bounds={"gpuMemoryUtilization": {"min": 0.2, "max": 0.3}},
            extra_args=["--device-memory", f"{device:.9f}"]))
        body["spec"]["autotune"].update(
            interval="5s", window="10s",
            frozenKnobs=["blockSize", "swapSpaceGiB", "maxNumSeqs", "maxNumBatchedTokens", "enablePrefixCaching",
                         "enableChunkedPrefill"])
        controlplane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))
        local = start_engine(controlplane, pod_node, ns, name)
        key = admin_key(controlplane, ns, name)
        eventually(url_of(pod_node, ns, name), timeout=60, what="the engine pod Ready")
        log(f"upgrade: engine Ready after {time.monotonic() - t0:.0f}s")
        # half of what its 8 sequences serve here, measured first: a load it keeps up with, so a window
        # judges the knobs, not a backlog
        served = served_rate(url_of(pod_node, ns, name), "tiny", requests=8, prompt_tokens=32, output_tokens=48,
                             vocab=VOCAB)
        log(f"upgrade: 8 sequences serve {served:.1f} requests/s here: the load sends {served / 2:.1f}/s")
        load = OpenLoopLoad(url_of(pod_node, ns, name), "tiny", rate=served / 2, prompt_tokens=32, output_tokens=48,
                            vocab=VOCAB, max_requests=3000, max_seconds=300, max_in_flight=64, seed=4)
        with load:
            rs_before = replica_sets(controlplane, ns, name)
            controlplane.kubectl("annotate", "infd", name, "-n", ns, f"kvtune.io/try={TRIAL}")

            # -- the restart change is applied and its rollout begins ---------------------------------
            def rolling(o):
                pending = (o.get("status") or {}).get("tuning", {}).get("pending")
                return pending and pending.get("restart") and len(replica_sets(controlplane, ns, name) - rs_before) == 1
            obj = wait_for(controlplane, ns, name, rolling, timeout=90,
                           what="the restart change pending and its new ReplicaSet", operator=op)
            apply = next(e for e in history(obj) if e["action"] == "Apply")
            assert apply["after"] == {"gpuMemoryUtilization": 0.2} and apply["restart"] is True, apply
            assert "kvtune.io/try" in apply["message"]
            # the rollout is under way: the old pod still serves (the new one is not Ready yet, or the old
            # one is in its preStop sleep)
            assert local.alive() and pod_node.get(ns, local.name) is local
            log(f"upgrade: restart change applied, rollout under way {time.monotonic() - t0:.0f}s in: {apply['message']}")

            # -- the upgrade: the old operator stops, helm upgrades the chart, the new operator starts ---
            code = sigterm(op)
            stopped = time.monotonic()
            mid = get(controlplane, "infd", name, ns)
            assert mid["status"]["tuning"]["pending"]["after"]["gpuMemoryUtilization"] == 0.2
            log(f"upgrade: old operator exited {code} on SIGTERM; Deployment {name}: "
                f"{get(controlplane, 'deployment', name, ns).get('status')}")
            dep_before = get(controlplane, "deployment", RELEASE, system)
            values2 = {**values, "podAnnotations": {"kvtune.io/upgraded": "2"},
                       "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "768Mi"}}}
            (tmp_path / "values2.yaml").write_text(yaml.safe_dump(values2))
            controlplane.helm("upgrade", RELEASE, str(CHART), "-n", system, "-f", str(tmp_path / "values2.yaml"),
                              "--wait=false")
            dep_after = get(controlplane, "deployment", RELEASE, system)
            assert dep_after["metadata"]["generation"] > dep_before["metadata"]["generation"]
            assert dep_after["spec"]["template"]["metadata"]["annotations"] == {"kvtune.io/upgraded": "2"}
            op = chart_operator(controlplane, system, tmp_path / "operator-2.log").start()
            ops.append(op)
            log(f"upgrade: chart upgraded, new operator up {time.monotonic() - stopped:.0f}s after the old one "
                "stopped")

            # -- the pending change gets its verdict, once ----------------------------------------------
            seen: dict = {}  # the last pending change the status showed: when its rollout was seen complete

            def verdicts(o):
                pending = (o.get("status") or {}).get("tuning", {}).get("pending")
                if pending and pending.get("rolledOutAt"):
                    seen.update(pending)
                h = history(o)
                i = h.index(next(e for e in h if e["time"] == apply["time"] and e["action"] == "Apply"))
                return [e for e in h[i + 1:] if e["action"] in ("Keep", "RollBack")]
            obj = wait_for(controlplane, ns, name, lambda o: verdicts(o), timeout=120,
                           what="the verdict on the change after the upgrade", operator=op)
            verdict = verdicts(obj)[0]
            log(f"upgrade: verdict {time.monotonic() - stopped:.0f}s after the upgrade began: {verdict['action']}: "
                f"{verdict['message']}")
            t_apply = stamp(apply["time"])
            t_verdict = stamp(verdict["time"])
            assert t_verdict - t_apply >= 10, (apply, verdict)  # a whole window after the change, at least
            if seen:  # judged on a whole window (10 s) of the new pods alone, the rollout over
                t_rolled = stamp(seen["rolledOutAt"])
                assert t_verdict - t_rolled >= 10 - 1, (seen, verdict)
            log(f"upgrade: rolled out at {seen.get('rolledOutAt')}, verdict at {verdict['time']}; measured "
                f"{verdict.get('measured')}, before {mid['status']['tuning']['pending'].get('beforeFigures')}")
            want = {"gpuMemoryUtilization": 0.2 if verdict["action"] == "Keep" else 0.3}

            # -- the end state: the rollout (and a rollback's, if any) complete, status true ------------
            def settled():
                o = get(controlplane, "infd", name, ns)
                st = o.get("status") or {}
                if st.get("tuning", {}).get("pending") or st["engine"]["gpuMemoryUtilization"] != \
                        want["gpuMemoryUtilization"]:
                    return None
                if condition(o, "Progressing").get("reason") != "RolloutComplete":
                    return None
                # the tuner's phase leaves Applying at its first window with no series of the pod that went
                # (a rollback's rollout completes a window before the tuner's view is clean of that pod)
                if st["tuning"].get("phase") in ("Applying", "Verifying"):
                    return None
                pods = pod_node.pods_for_selector(ns, {LABEL: name})
                if len(pods) != 1 or not pods[0].ready:
                    return None
                running = engine_state(pods[0].admin_url, key)["config"]
                again = get(controlplane, "infd", name, ns)
                if again["metadata"]["resourceVersion"] != o["metadata"]["resourceVersion"]:
                    return None  # the status moved while we looked: look again
                return o, pods[0], running
            obj, pod, running = eventually(settled, timeout=120, interval=0.5,
                                           what="the rollout complete, one engine pod running status.engine")
            st = obj["status"]
            engine = st["engine"]
            lies = {k: (v, running.get(KNOBS_BY_CAMEL[k])) for k, v in engine.items()
                    if k in KNOBS_BY_CAMEL and KNOBS_BY_CAMEL[k] in running and running[KNOBS_BY_CAMEL[k]] != v}
            assert not lies, f"status.engine says (status, engine runs): {lies}"
            assert running["gpu_memory_utilization"] == want["gpuMemoryUtilization"]
            if verdict["action"] == "Keep":  # the change's pod serves, the old one went
                assert pod.name != local.name and not local.alive()
                assert st["tuning"]["restarts"] == 1, st["tuning"]
            assert condition(obj, "Progressing")["status"] == "False", condition(obj, "Progressing")
            assert condition(obj, "Degraded").get("status") != "True", condition(obj, "Degraded")
            assert st["tuning"]["triedAnnotation"] == TRIAL
            dep = get(controlplane, "deployment", name, ns)
            assert dep["status"].get("updatedReplicas") == dep["status"].get("replicas") == 1, dep["status"]
            assert len(replica_sets(controlplane, ns, name)) == 2  # the old template's and the change's

            # each decision once: in the history, and as an event
            h = history(obj)
            assert len({(e["time"], e["action"], e["message"]) for e in h}) == len(h), h
            assert [e for e in h if e["action"] == "Apply"] == [apply], h
            assert verdicts(obj) == [verdict], h
            evs = tuning_events(controlplane, ns, name, including=("TuningApply", f"Tuning{verdict['action']}"))
            assert [m for _, r, m in evs if r == "TuningApply"] == [apply["message"][:1024]], evs
            assert [m for _, r, m in evs if r in ("TuningKeep", "TuningRollBack")] == [verdict["message"][:1024]], evs
        log(f"upgrade: load {load.stats}")
        assert load.stats.failed == 0, load.stats.errors
        assert load.stats.ok == load.stats.sent, load.stats  # every request sent got its whole answer
        for o in ops:  # the chart's Role was enough for all of it
            text = o.log_path.read_text(errors="replace")
            assert "Forbidden" not in text, o.tail(60)
        assert code == 0, f"the old operator exited {code} on SIGTERM:\n{ops[0].tail(40)}"
        log(f"upgrade: done in {time.monotonic() - t0:.0f}s")
    finally:
        op.stop()
        sys_log = "\n".join(f"[{o.log_path.name}]\n{o.tail(30)}" for o in ops)
        log(f"upgrade: operator logs:\n{sys_log}")
