"""Restart changes verified as canaries on real engines (issue 24), on the control-plane harness.

Real apiserver and controllers, real Prometheus scraping each engine process of one
InferenceDeployment of two replicas, the operator as a subprocess in Apply mode, and an open-loop
load spread over the Ready pods round-robin, as a Service spreads it (the canary's pod too, once
Ready: it carries the deployment's selector labels). A restart change runs first on one extra pod,
the canary Deployment's, beside the untouched replicas; a promoted one then rolls the pods, a
reverted one (or one the engine cannot start with) never restarts any of them.
"""
from __future__ import annotations

import time

import pytest
import yaml

from kvtune_operator.model import parse_duration
from tests.infd import infd_body

from .e2e_load import OpenLoopLoad, served_rate
from .test_canary_replicas import _balanced, _verdict_after, try_on_canary
from .test_operator_cluster import (  # noqa: F401 - crd is a fixture
    OperatorProcess, admin_key, crd, engine_namespace, eventually, get,
)
from .test_tuner_e2e import (  # noqa: F401 - model is a fixture
    INTERVAL, LABEL, VOCAB, WINDOW, delete_and_wait, engine_state, history, log, model, url_of, wait_for,
    weights_bytes,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def canary_ns(controlplane, crd, pod_node):  # noqa: F811 - crd is a fixture
    with engine_namespace(controlplane, pod_node, "canary-deploy") as ns:
        yield ns


def _knob(pod_node, ns: str, name: str, key: str, knob: str) -> dict[str, float]:
    """pod -> the value of ``knob`` its engine runs, for every Ready pod (the canary's too)."""
    return {p.name: engine_state(p.admin_url, key)["config"][knob]
            for p in pod_node.pods_for_selector(ns, {LABEL: name}) if p.ready}


def test_a_restart_change_runs_on_a_canary_pod_first_promoted_then_one_that_cannot_start_reverted(
        controlplane, prometheus, pod_node, canary_ns, model, tmp_path):
    """Restart changes on a canary Deployment, two replicas, under a load they serve.

    1. **Promoted.** A restart change (``kvtune.io/try``: gpuMemoryUtilization 0.3 -> 0.25) starts one
       extra pod, the canary Deployment's, beside the two untouched ones; the Service's share reaches it
       once Ready; a whole window later it is judged against both and promoted: status.engine carries
       it, the two pods roll to it, and the canary Deployment goes to zero pods.
    2. **Reverted without a rollout.** A candidate the engine cannot start with (gpuMemoryUtilization
       0.1: the weights alone) crash-loops on the canary pod only; it is rolled back with the engine's
       words, barred, and no pod of the deployment ever restarted.

    Time (~2.5 min): two engines start, a window before the first decision, the canary's start and
    window, the rollout of two pods, the crash loop's back-off."""
    ns, name = canary_ns, "restart"
    t0 = time.monotonic()
    device = weights_bytes(model) / 0.1 / 2**30  # 0.1 of it is the weights alone; 0.3 leaves twice that for KV
    env = {**controlplane.subprocess_env(), "KVTUNE_PROMETHEUS_URL": prometheus.url, "KVTUNE_TUNE_POLL_INTERVAL": "1"}
    op = OperatorProcess(env, [ns], tmp_path / "operator.log").start()
    try:
        controlplane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(infd_body(
            name, replicas=2, model={"path": str(model), "servedModelName": "tiny"}, resources={"gpus": 0},
            engine={"swapSpaceGiB": 0, "enablePrefixCaching": False, "maxNumSeqs": 8, "gpuMemoryUtilization": 0.3},
            autotune={"mode": "Apply", "interval": INTERVAL, "window": WINDOW, "cooldown": "10m",
                      "objectives": {"ttftP95": "2s"},
                      "bounds": {"blockSize": [16], "maxNumSeqs": {"min": 8, "max": 8},
                                 "gpuMemoryUtilization": {"min": 0.1, "max": 0.3}}},
            env=[{"name": "OMP_NUM_THREADS", "value": "1"}], extraArgs=["--device-memory", f"{device:.9f}"])))
        pods = pod_node.wait_for_selector(ns, {LABEL: name}, count=2, timeout=300)
        eventually(lambda: len(pod_node.urls_for_selector(ns, {LABEL: name})) == 2, timeout=120,
                   what="two Ready engines")
        key = admin_key(controlplane, ns, name)
        names = sorted(p.name for p in pods)
        # a quarter of what eight sequences serve on one pod, to each: no queue, nothing for the tuner to fix
        served = served_rate(url_of(pod_node, ns, name), "tiny", requests=8, prompt_tokens=32, output_tokens=32,
                             vocab=VOCAB)
        load = OpenLoopLoad(_balanced(pod_node, ns, name), "tiny", rate=0.5 * served, prompt_tokens=32,
                            output_tokens=32, vocab=VOCAB, max_requests=6000, max_seconds=420, max_in_flight=32,
                            seed=11)
        with load:
            # -- 1. a restart change on a canary pod, promoted --------------------------------------------
            obj, trial = try_on_canary(controlplane, ns, name, '{"gpuMemoryUtilization": 0.25}', op, timeout=120)
            log(f"restart canary: applied after {time.monotonic() - t0:.0f}s: {trial['message']}")
            assert trial["action"] == "Apply" and trial["restart"]
            assert f"canary Deployment {name}-canary" in trial["message"], trial["message"]
            assert obj["status"]["engine"]["gpuMemoryUtilization"] == 0.3            # the pods keep theirs
            canary = eventually(lambda: next((p for p in pod_node.pods_for_selector(ns, {LABEL: name})
                                              if p.name not in names and p.ready), None),
                                timeout=120, what="the canary pod to be Ready")
            assert engine_state(canary.admin_url, key)["config"]["gpu_memory_utilization"] == 0.25
            assert _knob(pod_node, ns, name, key, "gpu_memory_utilization") == {names[0]: 0.3, names[1]: 0.3,
                                                                               canary.name: 0.25}
            obj = wait_for(controlplane, ns, name, lambda o: _verdict_after(o, trial), timeout=150,
                           what="the restart canary's verdict", operator=op)
            verdict = _verdict_after(obj, trial)
            log(f"restart canary: verdict after {time.monotonic() - t0:.0f}s: {verdict['message']}")
            assert verdict["action"] == "Keep" and verdict["canary"]["verdict"] == "Promote", verdict
            assert verdict["canary"]["canary"] == canary.name and verdict["canary"]["controls"] == names
            assert obj["status"]["engine"]["gpuMemoryUtilization"] == 0.25
            eventually(lambda: get(controlplane, "deployment", f"{name}-canary", ns)["spec"]["replicas"] == 0,
                       timeout=30, what="the canary Deployment at zero pods")
            rolled = eventually(lambda: (k := _knob(pod_node, ns, name, key, "gpu_memory_utilization")) and len(k) == 2
                                and set(k.values()) == {0.25} and canary.name not in k and k, timeout=180,
                                what="both pods rolled to the promoted change, the canary gone")
            assert not set(rolled) & set(names)                                     # new pods: a rollout

            # -- 2. a candidate that cannot start: only the canary tried it ------------------------------
            wait_for(controlplane, ns, name, lambda o: not o["status"]["tuning"].get("pending"), timeout=60,
                     what="no pending change", operator=op)
            serving = sorted(rolled)
            controlplane.kubectl("annotate", "infd", name, "-n", ns, "--overwrite",
                                 'kvtune.io/try={"gpuMemoryUtilization": 0.1}')
            obj = wait_for(controlplane, ns, name, lambda o: any(
                e["action"] == "Apply" and e.get("after") == {"gpuMemoryUtilization": 0.1} for e in history(o)),
                timeout=120, what="the bad restart change on a canary", operator=op)
            bad = next(e for e in history(obj)
                       if e["action"] == "Apply" and e.get("after") == {"gpuMemoryUtilization": 0.1})
            obj = wait_for(controlplane, ns, name, lambda o: _verdict_after(o, bad), timeout=180,
                           what="the canary that cannot start rolled back", operator=op)
            verdict = _verdict_after(obj, bad)
            log(f"restart canary: bad candidate rolled back after {time.monotonic() - t0:.0f}s: {verdict['message']}")
            assert verdict["action"] == "RollBack" and "canary Deployment" in verdict["message"], verdict
            assert "--gpu-memory-utilization" in verdict["message"] and "no other pod ever ran it" in verdict["message"]
            assert obj["status"]["engine"]["gpuMemoryUtilization"] == 0.25
            assert any(r["knobs"]["gpuMemoryUtilization"] == 0.1 for r in obj["status"]["tuning"]["rejected"])
            eventually(lambda: get(controlplane, "deployment", f"{name}-canary", ns)["spec"]["replicas"] == 0,
                       timeout=30, what="the canary Deployment at zero pods again")
            assert sorted(_knob(pod_node, ns, name, key, "gpu_memory_utilization")) == serving  # nothing rolled
            time.sleep(2 * parse_duration(INTERVAL))  # two more rounds: each kvtune.io/try value is tried once
            obj = get(controlplane, "infd", name, ns)
            assert not obj["status"]["tuning"].get("pending"), obj["status"]["tuning"]
            tried = [e.get("after") for e in history(obj) if e["action"] == "Apply" and "kvtune.io/try" in e["message"]]
            assert tried == [{"gpuMemoryUtilization": 0.25}, {"gpuMemoryUtilization": 0.1}], history(obj)
        log(f"restart canary: load {load.stats}")
        assert load.stats.failed == 0, load.stats.errors
        delete_and_wait(controlplane, pod_node, ns, name)
        log(f"restart canary: done in {time.monotonic() - t0:.0f}s")
    finally:
        op.stop()
