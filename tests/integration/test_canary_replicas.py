"""Canary verification on three real engine replicas (issue 24), on the control-plane harness.

Real apiserver and controllers, real Prometheus scraping three real engine processes of one
InferenceDeployment, the operator as a subprocess in Apply mode, and an open-loop load spread over
the Ready pods round-robin, as a Service spreads it. The deployment starts at maxNumSeqs 2 under a
load that outruns it.

1. **Promoted.** The tuner raises maxNumSeqs live. The change goes to one pod, the canary, through
   its admin API: status.engine and the ConfigMap keep 2, and the other two pods keep running 2. A
   whole window later the canary is judged against those two over the same window and promoted.
   status.engine and the ConfigMap then carry the new value, and all three pods run it, with no
   rollout.
2. **Reverted.** A bad candidate, forced with ``kvtune.io/try`` (maxNumSeqs 1), goes to a canary
   only. Judged against its two siblings, it is reverted: the canary runs the kept value again,
   status.engine never moved, and the candidate is barred.
3. **Stood down.** A third candidate on a canary, then the mode turned to Recommend before its
   verdict: nothing is judged or promoted in Recommend, so the canary is set back at once and the
   change dropped, not barred.

The load sees no failed request. ``kubectl describe`` shows each verdict's canary, its controls and
the gates' figures. Restart changes on a canary Deployment: test_canary_deployment.py.

Time (about 3 min): three engines start side by side on two cores, then one window for the first
decision, and one whole window (20 s) for each canary.
"""
from __future__ import annotations

import itertools
import threading
import time

import pytest
import yaml

from tests.infd import infd_body

from .e2e_load import OpenLoopLoad, served_rate
from .test_operator_cluster import (  # noqa: F401 - crd is a fixture
    OperatorProcess, admin_key, crd, engine_namespace, eventually, get,
)
from .test_tuner_e2e import (  # noqa: F401 - model is a fixture
    INTERVAL, LABEL, VOCAB, WINDOW, delete_and_wait, engine_state, history, log, model, tuning_events, url_of,
    wait_for,
)

pytestmark = pytest.mark.integration

REPLICAS = 3


@pytest.fixture(scope="module")
def canary_ns(controlplane, crd, pod_node):  # noqa: F811 - crd is a fixture
    with engine_namespace(controlplane, pod_node, "canary") as ns:
        yield ns


def _balanced(pod_node, ns: str, name: str):
    """A Service's view of the deployment: each request to the next Ready pod, in turn."""
    turn, lock = itertools.count(), threading.Lock()

    def url():
        urls = sorted(pod_node.urls_for_selector(ns, {LABEL: name}))
        if not urls:
            return None
        with lock:
            return urls[next(turn) % len(urls)]
    return url


def _seqs(pod_node, ns: str, name: str, key: str) -> dict[str, int]:
    """pod -> the maxNumSeqs its engine runs (from its admin API)."""
    return {p.name: engine_state(p.admin_url, key)["config"]["max_num_seqs"]
            for p in pod_node.pods_for_selector(ns, {LABEL: name}) if p.ready}


def try_on_canary(controlplane, ns: str, name: str, knobs: str, operator, timeout: float) -> tuple[dict, dict]:
    """Ask for ``knobs`` (kvtune.io/try) and wait until a canary runs them: (the object, its Apply)."""
    controlplane.kubectl("annotate", "infd", name, "-n", ns, "--overwrite", f"kvtune.io/try={knobs}")
    pending = lambda o: ((o.get("status") or {}).get("tuning") or {}).get("pending") or {}  # noqa: E731
    obj = wait_for(controlplane, ns, name, lambda o: pending(o).get("canary"), timeout=timeout,
                   what=f"{knobs} on a canary", operator=operator)
    return obj, obj["status"]["tuning"]["lastChange"]


def _verdict_after(obj: dict, apply: dict) -> dict | None:
    h = history(obj)
    i = next((k for k, e in enumerate(h) if e["time"] == apply["time"] and e["action"] == "Apply"), None)
    return next((e for e in h[i + 1:] if e["action"] in ("Keep", "RollBack")), None) if i is not None else None


def test_a_canary_is_promoted_then_a_bad_one_is_reverted_against_its_siblings(
        controlplane, prometheus, pod_node, canary_ns, model, tmp_path):
    ns, name = canary_ns, "canary"
    t0 = time.monotonic()
    env = {**controlplane.subprocess_env(), "KVTUNE_PROMETHEUS_URL": prometheus.url, "KVTUNE_TUNE_POLL_INTERVAL": "1"}
    op = OperatorProcess(env, [ns], tmp_path / "operator.log").start()
    try:
        controlplane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(infd_body(
            name, replicas=REPLICAS, model={"path": str(model), "servedModelName": "tiny"}, resources={"gpus": 0},
            engine={"swapSpaceGiB": 0, "enablePrefixCaching": False, "maxNumSeqs": 2, "kvCacheMemoryGiB": 0.05},
            autotune={"mode": "Apply", "interval": INTERVAL, "window": WINDOW, "cooldown": "10m",
                      "objectives": {"ttftP95": "1s"},
                      "bounds": {"blockSize": [16], "maxNumSeqs": {"min": 1, "max": 32}}},
            env=[{"name": "OMP_NUM_THREADS", "value": "1"}])))
        pods = pod_node.wait_for_selector(ns, {LABEL: name}, count=REPLICAS, timeout=300)
        eventually(lambda: len(pod_node.urls_for_selector(ns, {LABEL: name})) == REPLICAS, timeout=120,
                   what="three Ready engines")
        key = admin_key(controlplane, ns, name)
        names = sorted(p.name for p in pods)
        log(f"canary: {REPLICAS} engines ready after {time.monotonic() - t0:.0f}s: {names}")
        assert set(_seqs(pod_node, ns, name, key).values()) == {2}

        # twice what two sequences serve, to each pod, measured here first on one of them (the three
        # share two cores: under the whole load each serves less, so the queues grow at 2 all the more)
        served = served_rate(url_of(pod_node, ns, name), "tiny", requests=8, prompt_tokens=32, output_tokens=48,
                             vocab=VOCAB)
        rate = 2 * served * REPLICAS
        log(f"canary: two sequences serve {served:.1f} requests/s on one pod: the load sends {rate:.1f}/s")
        load = OpenLoopLoad(_balanced(pod_node, ns, name), "tiny", rate=rate, prompt_tokens=32, output_tokens=48,
                            vocab=VOCAB, max_requests=6000, max_seconds=420, max_in_flight=96, seed=7)
        with load:
            # -- 1. a canary promoted ----------------------------------------------------------------
            obj = wait_for(controlplane, ns, name, lambda o: (o.get("status", {}).get("tuning") or {}).get("pending"),
                           timeout=150, what="a change on a canary", operator=op)
            pending = obj["status"]["tuning"]["pending"]
            apply = obj["status"]["tuning"]["lastChange"]
            log(f"canary: applied after {time.monotonic() - t0:.0f}s: {apply['message']}")
            canary, controls = pending["canary"]["pod"], pending["canary"]["controls"]
            assert canary in names and sorted([canary, *controls]) == names, pending
            raised = apply["after"]["maxNumSeqs"]
            assert apply["action"] == "Apply" and apply["cause"] == "SequenceCap" and raised > 2, apply
            assert f"canary pod {canary}" in apply["message"], apply["message"]
            assert obj["status"]["tuning"]["phase"] == "Canary"
            assert obj["status"]["engine"]["maxNumSeqs"] == 2                  # the siblings' knobs stay
            assert "max_num_seqs: 2\n" in get(controlplane, "configmap", f"{name}-engine", ns)["data"]["engine.yaml"]
            eventually(lambda: _seqs(pod_node, ns, name, key).get(canary) == raised, timeout=30,
                       what="the canary to run the change")
            running = _seqs(pod_node, ns, name, key)
            assert all(running[c] == 2 for c in controls), running

            obj = wait_for(controlplane, ns, name, lambda o: _verdict_after(o, apply), timeout=120,
                           what="the canary's verdict", operator=op)
            verdict = _verdict_after(obj, apply)
            log(f"canary: verdict after {time.monotonic() - t0:.0f}s: {verdict['message']}")
            judged = verdict["canary"]
            assert verdict["action"] == "Keep" and judged["verdict"] == "Promote", verdict
            assert judged["canary"] == canary and judged["controls"] == controls
            gate = next(g for g in judged["gates"] if g["name"] == "goodputRatioMin")
            assert gate["passed"] and gate["value"] >= gate["limit"] and gate["canary"] > gate["control"], gate
            assert verdict["measured"]["goodputRequestsPerSecond"] > 0
            eventually(lambda: get(controlplane, "infd", name, ns)["status"]["engine"]["maxNumSeqs"] == raised,
                       timeout=30, what="status.engine to carry the promoted change")
            eventually(lambda: set(_seqs(pod_node, ns, name, key).values()) == {raised}, timeout=60,
                       what="every pod to run the promoted change")
            assert sorted(p.name for p in pod_node.pods_for_selector(ns, {LABEL: name})) == names  # no rollout

            # -- 2. a bad canary reverted ------------------------------------------------------------
            kept = get(controlplane, "infd", name, ns)["status"]["engine"]["maxNumSeqs"]
            controlplane.kubectl("annotate", "infd", name, "-n", ns, 'kvtune.io/try={"maxNumSeqs": 1}')
            obj = wait_for(controlplane, ns, name, lambda o: any(
                e["action"] == "Apply" and "kvtune.io/try" in e["message"] for e in history(o)),
                timeout=90, what="the forced candidate on a canary", operator=op)
            trial = next(e for e in history(obj) if e["action"] == "Apply" and "kvtune.io/try" in e["message"])
            canary = obj["status"]["tuning"]["pending"]["canary"]["pod"]
            assert obj["status"]["engine"]["maxNumSeqs"] == kept and "canary pod" in trial["message"]
            eventually(lambda: _seqs(pod_node, ns, name, key).get(canary) == 1, timeout=30,
                       what="the canary to run the forced candidate")
            assert sorted(_seqs(pod_node, ns, name, key).values()) == sorted([1] + [kept] * (REPLICAS - 1))
            obj = wait_for(controlplane, ns, name, lambda o: _verdict_after(o, trial), timeout=120,
                           what="the forced canary's verdict", operator=op)
            verdict = _verdict_after(obj, trial)
            log(f"canary: forced candidate judged after {time.monotonic() - t0:.0f}s: {verdict['message']}")
            assert verdict["action"] == "RollBack" and verdict["canary"]["verdict"] == "Revert", verdict
            assert verdict["canary"]["canary"] == canary and canary not in verdict["canary"]["controls"]
            assert obj["status"]["engine"]["maxNumSeqs"] == kept                # never moved
            assert any(r["knobs"]["maxNumSeqs"] == 1 for r in obj["status"]["tuning"]["rejected"])
            eventually(lambda: set(_seqs(pod_node, ns, name, key).values()) == {kept}, timeout=30,
                       what="the canary to run the kept value again")

            # -- 3. Recommend mode mid-canary: no verdict, the canary set back -----------------------
            controlplane.kubectl("annotate", "infd", name, "-n", ns, "--overwrite", 'kvtune.io/try={"maxNumSeqs": 3}')
            obj = wait_for(controlplane, ns, name, lambda o: (o["status"]["tuning"].get("pending") or {}).get("canary"),
                           timeout=90, what="a third change on a canary", operator=op)
            third = obj["status"]["tuning"]["lastChange"]
            canary = obj["status"]["tuning"]["pending"]["canary"]["pod"]
            eventually(lambda: _seqs(pod_node, ns, name, key).get(canary) == 3, timeout=30,
                       what="the canary to run maxNumSeqs 3")
            controlplane.kubectl("patch", "infd", name, "-n", ns, "--type=merge", "-p",
                                 '{"spec":{"autotune":{"mode":"Recommend"}}}')
            obj = wait_for(controlplane, ns, name, lambda o: _verdict_after(o, third), timeout=60,
                           what="the canary to stand down", operator=op)
            stood = _verdict_after(obj, third)
            log(f"canary: Recommend mid-canary after {time.monotonic() - t0:.0f}s: {stood['message']}")
            assert stood["action"] == "RollBack" and not stood.get("canary"), stood     # no verdict was given
            assert "autotune mode is Recommend" in stood["message"] and f"{canary} was set back" in stood["message"]
            assert obj["status"]["engine"]["maxNumSeqs"] == kept and not obj["status"]["tuning"].get("pending")
            assert not any(r["knobs"]["maxNumSeqs"] == 3 for r in obj["status"]["tuning"]["rejected"])  # not barred
            assert set(_seqs(pod_node, ns, name, key).values()) == {kept}
        log(f"canary: load {load.stats}")
        assert load.stats.failed == 0, load.stats.errors
        evs = tuning_events(controlplane, ns, name, including=("TuningKeep", "TuningRollBack"))
        assert ("Normal", "TuningKeep") in [(t, r) for t, r, _ in evs]
        assert ("Warning", "TuningRollBack") in [(t, r) for t, r, _ in evs], evs
        text = controlplane.kubectl("describe", "infd", name, "-n", ns).stdout
        for want in ("Canary:", "Controls:", "Promote", "Revert", "goodputRatioMin"):
            assert want in text, f"{want!r} not in kubectl describe:\n{text}"
        delete_and_wait(controlplane, pod_node, ns, name)
        log(f"canary: done in {time.monotonic() - t0:.0f}s")
    finally:
        op.stop()

