"""A change to real vLLM pods verified as a canary (issue 24, runtime vllm), on the control-plane harness.

Two vLLM replicas of one InferenceDeployment (the real vLLM of ``tests/vllm/setup.sh``, each pod's
command line as the operator rendered it), real Prometheus scraping each, the operator in Apply mode,
and a light load spread over the Ready pods as a Service spreads it. vLLM changes no knob live, so a
change (``kvtune.io/try``: maxNumSeqs 2 -> 4) goes to one extra pod first, the canary Deployment's,
started with ``--max-num-seqs 4`` beside the two untouched pods; a whole window after it is Ready it
is judged against both on vLLM's own per-pod series and promoted: status.engine and the pods'
Deployment then carry the change (the pods roll to it), and the canary Deployment goes to zero pods.
The load sees no failed request. A missing vLLM fails the test.

Time (~3 min on two cores, 3-5 beside another test): two vLLM start-ups side by side, a window before
the trial is taken, the canary's start-up and its window. The rollout that follows the promotion is
not waited for.
"""
from __future__ import annotations

import time

import pytest

from .e2e_load import OpenLoopLoad
from .test_canary_replicas import _balanced, _verdict_after, try_on_canary
from .test_operator_cluster import crd, eventually, get  # noqa: F401 - crd is a fixture
from .test_tuner_e2e import LABEL, log, wait_for
from .test_vllm_pod import VOCAB, infd, vllm_model, vllm_ns, vllm_run  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]


def _seqs(pod) -> str:
    return pod.argv[pod.argv.index("--max-num-seqs") + 1]


def test_a_vllm_change_runs_on_a_canary_pod_first_and_is_promoted_against_its_siblings(
        controlplane, pod_node, vllm_ns, vllm_model, vllm_run):
    ns, name = vllm_ns, "vllm-canary"
    op, cache = vllm_run
    t0 = time.monotonic()
    # an objective every request meets here, busy machine or not, so that the verdict settles in one
    # window (with a 1 s objective beside another test, a few slow first tokens per pod kept it within
    # the goodput gate's sampling noise for three windows: 200 s from the change to the verdict)
    controlplane.kubectl("apply", "-n", ns, "-f", "-",
                         input=infd(name, vllm_model, cache, mode="Apply", replicas=2, ttft="30s"))
    pods = pod_node.wait_for_selector(ns, {LABEL: name}, count=2, timeout=420)
    eventually(lambda: len(pod_node.urls_for_selector(ns, {LABEL: name})) == 2, timeout=420, interval=1,
               what="two Ready vLLM pods (40-140 s of start-up each on two cores)")
    names = sorted(p.name for p in pods)
    log(f"vllm canary: two vLLM pods serving after {time.monotonic() - t0:.0f}s")
    assert all(_seqs(p) == "2" for p in pods)
    # four requests a second of 32 + 16 tokens: far from what two sequences serve, nothing to fix, and
    # over 20 to the canary in a window (fewer keep even 1 vs 1 within the goodput gate's noise allowance)
    load = OpenLoopLoad(_balanced(pod_node, ns, name), "tiny", rate=4.0, prompt_tokens=32, output_tokens=16,
                        vocab=VOCAB, max_requests=2000, max_seconds=480, max_in_flight=16, seed=9)
    with load:
        obj, trial = try_on_canary(controlplane, ns, name, '{"maxNumSeqs": 4}', op, timeout=180)
        log(f"vllm canary: applied after {time.monotonic() - t0:.0f}s: {trial['message']}")
        assert trial["action"] == "Apply" and trial["restart"] is True
        assert f"canary Deployment {name}-canary" in trial["message"], trial["message"]
        assert obj["status"]["engine"]["maxNumSeqs"] == 2
        canary = eventually(lambda: next((p for p in pod_node.pods_for_selector(ns, {LABEL: name})
                                          if p.name not in names and p.ready), None),
                            timeout=420, interval=1, what="the canary vLLM pod to be Ready")
        assert _seqs(canary) == "4" and all(_seqs(p) == "2" for p in pods)  # vLLM's own command line
        obj = wait_for(controlplane, ns, name, lambda o: _verdict_after(o, trial), timeout=240,
                       what="the vLLM canary's verdict", operator=op)
        verdict = _verdict_after(obj, trial)
        log(f"vllm canary: verdict after {time.monotonic() - t0:.0f}s: {verdict['message']}")
        assert verdict["action"] == "Keep" and verdict["canary"]["verdict"] == "Promote", verdict
        assert verdict["canary"]["canary"] == canary.name and verdict["canary"]["controls"] == names
        gate = next(g for g in verdict["canary"]["gates"] if g["name"] == "goodputRatioMin")
        assert gate["passed"] and gate["canary"] > 0 and gate["control"] > 0, gate
        assert obj["status"]["engine"]["maxNumSeqs"] == 4
        args = get(controlplane, "deployment", name, ns)["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "4"                 # the pods roll to it
        eventually(lambda: get(controlplane, "deployment", f"{name}-canary", ns)["spec"]["replicas"] == 0,
                   timeout=30, what="the canary Deployment at zero pods")
        eventually(lambda: not any(p.name == canary.name and p.ready
                                   for p in pod_node.pods_for_selector(ns, {LABEL: name})),
                   timeout=60, what="the canary pod out of the Service")
    log(f"vllm canary: load {load.stats}")
    assert load.stats.ok > 0 and load.stats.failed == 0, load.stats.errors
