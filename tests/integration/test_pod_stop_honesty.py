"""An engine pod a user breaks stays honest (issue 18): deleted mid-request, or killed mid-request.

Real apiserver and controllers, real Prometheus, a real engine process (the pod node plays the
kubelet: the pod's ``preStop`` sleep, SIGTERM, the grace period; a process that exits is restarted),
the operator as a subprocess. Two breaks, one after the other, on one InferenceDeployment:

1. **The pod is deleted while requests run on it** (``kubectl delete pod``, as a node drain or an
   eviction does): every request the engine had accepted finishes with all the tokens it asked for
   (the pod serves through its ``preStop`` sleep, then drains on SIGTERM), requests sent meanwhile
   are served by the replacement pod, and the resource's status says the deployment is not ready
   while no pod can take a request, then ready again once the replacement serves.
2. **The engine is killed (SIGKILL) while requests run on it** (an OOM kill): the requests it held
   are lost (no process can finish them), and no client is told otherwise: every one of those
   streams ends in an error or without its final chunk, none reads as complete. The pod node
   restarts the process; the status shows the pod not ready while it is down and the restart in
   the pod's own status, then ready again.

Time (~2 min): three engine start-ups (the first, the replacement pod, the restart) of a tiny model.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from .e2e_load import OpenLoopLoad, served_rate
from .test_operator_cluster import (  # noqa: F401 - crd is a fixture
    OperatorProcess, engine_namespace, condition, crd, eventually, get,
)
from .test_tuner_e2e import LABEL, VOCAB, log, model, start_engine, url_of  # noqa: F401 - model is a fixture
from kvtune_operator.demo.load import completion_body
from kvtune_operator.pod_stop import PRESTOP_SLEEP_S
from tests.infd import infd_body

pytestmark = pytest.mark.integration

NAME = "honest"
PROMPT_TOKENS = 32
MAX_OUTPUT = 4000  # within the test model's 4096 positions, with the prompt
STREAMS = 8        # the deployment's maxNumSeqs: all of them run at once


@pytest.fixture(scope="module")
def honest_ns(controlplane, crd, pod_node):  # noqa: F811 - crd is a fixture
    with engine_namespace(controlplane, pod_node, "honest") as ns:
        yield ns


class StatusWatch:
    """Samples the resource's Ready condition and ready replicas in the background, so a test can
    say what the status showed while something happened, not only at the end."""

    def __init__(self, controlplane, ns: str, name: str):
        self.controlplane, self.ns, self.name = controlplane, ns, name
        self.samples: list[tuple[float, str, int]] = []   # (monotonic, Ready status, readyReplicas)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                obj = get(self.controlplane, "infd", self.name, self.ns)
                st = obj.get("status") or {}
                self.samples.append((time.monotonic(), condition(obj, "Ready").get("status", ""),
                                     int(st.get("readyReplicas") or 0)))
            except Exception:  # noqa: BLE001 - a failed read is no sample
                pass
            self._stop.wait(0.3)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def dipped_and_recovered(self, t: float) -> bool:
        """After `t`, the status showed no pod ready (Ready not True, 0 ready replicas) and later the
        one pod ready again."""
        down = next((ts for ts, ready, n in self.samples if ts >= t and ready != "True" and n == 0), None)
        return down is not None and any(ts > down and ready == "True" and n == 1 for ts, ready, n in self.samples)


def _stream(base: str, output_tokens: int, seed: int, started: threading.Event, out: dict) -> None:
    """One streamed completion; out['tokens'] counts its text chunks, out['finish'] its finish reason,
    out['done'] whether [DONE] came, out['error'] what ended it otherwise."""
    body = {**completion_body("tiny", [16 + (seed * 7 + i) % (VOCAB - 16) for i in range(PROMPT_TOKENS)],
                              output_tokens), "stream": True}
    out.update(tokens=0, finish=None, done=False, error=None)
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=httpx.Timeout(120, connect=5)) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = r.read().decode(errors="replace")[:300]
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                choice = json.loads(line[6:])["choices"][0]
                out["tokens"] += 1
                started.set()
                out["finish"] = choice.get("finish_reason") or out["finish"]
    except Exception as e:  # noqa: BLE001 - what the client saw is the result
        out["error"] = repr(e)


def _streams(base: str, n: int, output_tokens: int) -> tuple[list[threading.Thread], list[dict], list[threading.Event]]:
    outs, started, threads = [{} for _ in range(n)], [threading.Event() for _ in range(n)], []
    for i in range(n):
        t = threading.Thread(target=_stream, args=(base, output_tokens, i, started[i], outs[i]), daemon=True)
        t.start()
        threads.append(t)
    for i, ev in enumerate(started):
        assert ev.wait(60) or outs[i].get("error"), f"stream {i} got no token in 60 s: {outs[i]}"
        assert ev.is_set(), f"stream {i} was refused: {outs[i]}"
    return threads, outs, started


def test_a_pod_deleted_or_killed_mid_request_loses_no_accepted_request_and_its_status_tells_the_truth(
        controlplane, prometheus, pod_node, honest_ns, model, tmp_path):
    ns = honest_ns
    env = {**controlplane.subprocess_env(), "KVTUNE_PROMETHEUS_URL": prometheus.url}
    op = OperatorProcess(env, [ns], tmp_path / "operator.log").start()
    watch = StatusWatch(controlplane, ns, NAME)
    try:
        controlplane.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(infd_body(
            NAME, model={"path": str(model), "servedModelName": "tiny"}, resources={"gpus": 0},
            engine={"maxNumSeqs": 8, "swapSpaceGiB": 0, "enablePrefixCaching": False},
            autotune={"mode": "Off"}, env=[{"name": "OMP_NUM_THREADS", "value": "1"}])))
        old = start_engine(controlplane, pod_node, ns, NAME)
        eventually(lambda: condition(get(controlplane, "infd", NAME, ns), "Ready").get("status") == "True",
                   timeout=90, what="the resource to be Ready")
        # Size the requests from this machine's speed (STREAMS at once, as the streams below run): each
        # stream should run for ~10 s, longer than the preStop sleep (so SIGTERM finds it running) and
        # short enough to finish within the drain (50 s).
        tokens_per_s = served_rate(url_of(pod_node, ns, NAME), "tiny", requests=STREAMS, prompt_tokens=PROMPT_TOKENS,
                                   output_tokens=32, vocab=VOCAB) * 32
        output_tokens = max(64, min(MAX_OUTPUT, int(tokens_per_s / STREAMS * 10)))  # a share each, for 10 s
        log(f"honest: the engine serves {tokens_per_s:.0f} tokens/s here: {STREAMS} streams of {output_tokens} tokens")
        watch.start()

        # -- 1. the pod is deleted mid-request ----------------------------------------------------------
        load = OpenLoopLoad(url_of(pod_node, ns, NAME), "tiny", rate=max(0.5, tokens_per_s / 64 / 4),
                            prompt_tokens=PROMPT_TOKENS, output_tokens=16, vocab=VOCAB, max_requests=400,
                            max_seconds=240, max_in_flight=16, seed=5)
        with load:
            threads, outs, _ = _streams(old.url, STREAMS, output_tokens)
            deleted = time.monotonic()
            controlplane.kubectl("delete", "pod", old.name, "-n", ns, "--wait=false")
            log(f"honest: pod deleted with {STREAMS} streams running on it")
            for t in threads:
                t.join(120)
            assert time.monotonic() > deleted + PRESTOP_SLEEP_S, \
                "the streams ended before SIGTERM: the test did not exercise the drain (longer streams needed)"
            # every accepted request finished with all its tokens, through the preStop sleep and the drain
            assert [(o["error"], o["finish"], o["done"], o["tokens"]) for o in outs] == \
                [(None, "length", True, output_tokens)] * STREAMS, outs
            new = eventually(lambda: next((p for p in pod_node.pods_for_selector(ns, {LABEL: NAME})
                                           if p.name != old.name and p.ready), None),
                             timeout=180, what="the replacement pod to be ready")
            eventually(lambda: pod_node.get(ns, old.name) is None, timeout=60, what="the old pod to stop")
            sent_before = load.stats.sent
            eventually(lambda: load.stats.ok > 0 and load.stats.sent > sent_before, timeout=60,
                       what="the load to be served by the replacement pod")
        assert load.stats.failed == 0, load.stats.errors
        assert load.stats.ok > 0
        # the status said so: not ready while no pod could take a request, ready again after
        eventually(lambda: watch.dipped_and_recovered(deleted), timeout=30,
                   what=f"the status to show the deployment not ready, then ready again: {watch.samples[-5:]}")

        # -- 2. the engine is killed mid-request ------------------------------------------------------
        threads, outs, _ = _streams(new.url, 4, MAX_OUTPUT)  # still running when it is killed
        killed = time.monotonic()
        os.killpg(new.proc.pid, signal.SIGKILL)
        log("honest: engine killed (SIGKILL) with 4 streams running on it")
        for t in threads:
            t.join(60)
        # lost, and no client is told otherwise: an error or a stream without its end, never a complete one
        for o in outs:
            assert o["error"] is not None or not o["done"], o
            assert o["finish"] is None, o
        restarted = eventually(lambda: (p := pod_node.get(ns, new.name)) is not None and p.ready and p.run >= 2 and p,
                               timeout=180, what="the engine to be restarted and ready")
        pod = get(controlplane, "pod", new.name, ns)
        cs = pod["status"]["containerStatuses"][0]
        assert cs["restartCount"] >= 1 and cs["lastState"]["terminated"]["exitCode"] == 137, cs
        eventually(lambda: watch.dipped_and_recovered(killed), timeout=30,
                   what=f"the status to show the deployment not ready while its engine was down, then ready: "
                        f"{watch.samples[-5:]}")
        # and the restarted engine serves
        r = httpx.post(f"{restarted.url}/v1/completions", json=completion_body("tiny", list(range(16, 48)), 8), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    finally:
        watch.stop()
        op.stop()
        controlplane.kubectl("delete", "infd", NAME, "-n", ns, "--wait=false", check=False)
        controlplane.kubectl("delete", "deployment", NAME, "-n", ns, "--wait=false", check=False)
