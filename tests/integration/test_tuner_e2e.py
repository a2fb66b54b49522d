"""The tuner end to end on the control-plane harness (issue 5, section 7).

Real apiserver, real Prometheus scraping real engine processes (the pod node runs each engine pod's
`kvtune serve` locally), the operator as a subprocess (`kvtune operator run`) tuning in Apply mode,
and an open-loop load generator on the loopback interface. Two mis-tuned InferenceDeployments, one
after the other (one engine at a time on a 2-core machine):

* ``seqcap``: maxNumSeqs 2 with a KV cache that is almost empty. The operator diagnoses the
  sequence cap and raises maxNumSeqs live: the ConfigMap changes, the Deployment does not roll
  (same ReplicaSet, same pod, same process); the change is verified and kept. Then a deliberately
  bad candidate, forced with the ``kvtune.io/try`` annotation (maxNumSeqs 1), is applied, measured
  worse over the next window and rolled back (a Warning event), status.engine back where it was.
* ``lowmem``: gpuMemoryUtilization 0.1 on a CPU standing in for a small device (``--device-memory``)
  leaves 24 KV blocks; under load, requests preempt each other. The operator diagnoses too little
  KV memory and raises gpuMemoryUtilization: a restart knob, so the Deployment rolls a new
  ReplicaSet and the new engine runs with ~80 times the blocks; the change is verified on the new
  engine's own window and kept.

Status, the printer columns (`kubectl get infd -o wide`) and `kubectl describe` tell the story each
time. Not the READY/REPLICAS columns: the harness' kwok renews no node leases, so about 50 s into a
session the node controller marks every pod not ready.

During the rollout the old pod keeps serving until the new engine answers its readiness probe
(the pod node reports readiness as a kubelet does, maxUnavailable is 0) and the load goes only to
Ready pods, as through a Service. The requests the old engine still had when it was stopped reach
the new one together (the load retries them, as clients of a Service would); maxNumSeqs 96 lets
them in at once, so the window that verifies the restart judges the new memory size.

The model is a tiny random Llama whose weights are most of the small device's memory (a 120k-token
vocabulary), so a low gpuMemoryUtilization leaves only a few KV blocks while each step stays cheap
(overhead-bound: a bigger batch costs little more than a small one, as on a GPU).
"""
from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.infd import infd_body

from .e2e_load import OpenLoopLoad, served_rate
from .test_operator_cluster import (  # noqa: F401 - crd is a fixture
    SELECTOR, OperatorProcess, engine_namespace, admin_key, condition, crd, eventually, get,
)

pytestmark = [pytest.mark.integration, pytest.mark.alone]

VOCAB = 122_880            # the weights are ~121 MiB: most of the small device
BLOCK_BYTES = 16 * 2048    # block size 16 x K/V bytes per token (2 layers, 4 KV heads of 32, float32)
LOW_BLOCKS = 24            # KV blocks at gpuMemoryUtilization 0.1 on the stand-in device
INTERVAL, WINDOW = "8s", "20s"
LABEL = "kvtune.io/inference-deployment"


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")


def weights_bytes(model: Path) -> int:
    """Bytes of the model's weights (what the engine's runner counts), from the safetensors header."""
    with open(model / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


# -- fixtures -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    # Not under /tmp: the engine pod mounts an emptyDir there, which the pod node maps to its own dir.
    root = Path(tempfile.mkdtemp(prefix="kvtune-e2e-model-", dir="/var/tmp"))
    path = root / "tiny"
    subprocess.run([str(Path(sys.executable).with_name("kvtune")), "make-tiny-model", str(path), "--layers", "2",
                    "--hidden", "128", "--heads", "4", "--kv-heads", "4", "--intermediate", "256",
                    "--vocab", str(VOCAB)], check=True, capture_output=True, timeout=300)
    yield path
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tune_ns(controlplane, crd, pod_node):  # noqa: F811 - crd is a fixture
    with engine_namespace(controlplane, pod_node, "tune") as ns:
        yield ns


@pytest.fixture(scope="module")
def tuning_operator(controlplane, prometheus, tune_ns, tmp_path_factory):
    env = {**controlplane.subprocess_env(), "KVTUNE_PROMETHEUS_URL": prometheus.url,
           "KVTUNE_TUNE_POLL_INTERVAL": "1"}
    op = OperatorProcess(env, [tune_ns], tmp_path_factory.mktemp("operator-tune") / "operator.log").start()
    yield op
    op.stop()
    sys.stderr.write(f"\n[operator log tail]\n{op.tail(40)}\n")


# -- helpers ----------------------------------------------------------------------------------------

def infd(name: str, model: Path, engine: dict, bounds: dict, extra_args: list[str] | None = None) -> str:
    return yaml.safe_dump(infd_body(
        name, model={"path": str(model), "servedModelName": "tiny"},
        resources={"gpus": 0},
        engine={"swapSpaceGiB": 0, "enablePrefixCaching": False, **engine},
        autotune={"mode": "Apply", "interval": INTERVAL, "window": WINDOW, "cooldown": "10m",
                  "objectives": {"ttftP95": "1s"}, "bounds": {"blockSize": [16], **bounds}},
        env=[{"name": "OMP_NUM_THREADS", "value": "1"}],
        extraArgs=extra_args or []))


def history(obj: dict) -> list[dict]:
    return ((obj.get("status") or {}).get("tuning") or {}).get("history") or []


def wait_for(controlplane, ns: str, name: str, pred, timeout: float, what: str, operator: OperatorProcess) -> dict:
    """The first InferenceDeployment object (polled) for which pred(obj) is true."""
    def check():
        obj = get(controlplane, "infd", name, ns)
        return obj if pred(obj) else None
    try:
        return eventually(check, timeout=timeout, interval=0.3, what=what)
    except AssertionError:
        obj = get(controlplane, "infd", name, ns)
        st = obj.get("status") or {}
        raise AssertionError(
            f"{name}: timed out after {timeout}s waiting for {what}\n"
            f"diagnosis: {json.dumps(st.get('diagnosis'), indent=1)}\n"
            f"tuning: {json.dumps(st.get('tuning'), indent=1)}\n"
            f"conditions: {json.dumps(st.get('conditions'), indent=1)}\noperator log:\n{operator.tail(40)}") from None


def first_apply(controlplane, ns: str, name: str, timeout: float, operator: OperatorProcess) -> tuple[dict, dict]:
    """(the object, its first Apply entry of status.tuning.history) once the tuner applied a change."""
    obj = wait_for(controlplane, ns, name, lambda o: any(h["action"] == "Apply" for h in history(o)),
                   timeout=timeout, what="the tuner to apply a change", operator=operator)
    return obj, next(h for h in history(obj) if h["action"] == "Apply")


def events(controlplane, ns: str, name: str) -> list[dict]:
    return controlplane.kubectl_json("get", "events", "-n", ns, "--field-selector",
                                     f"involvedObject.name={name},involvedObject.kind=InferenceDeployment",
                                     "-o", "json")["items"]


def replica_sets(controlplane, ns: str, name: str) -> set[str]:
    return {r["metadata"]["name"] for r in controlplane.kubectl_json(
        "get", "rs", "-n", ns, "-l", SELECTOR.format(name), "-o", "json")["items"]}


def table_row(controlplane, ns: str, name: str) -> tuple[dict[str, str], dict]:
    """`kubectl get infd NAME -o wide` as {column: value}, with the object it showed (same
    resourceVersion). Not READY/REPLICAS: the harness' kwok renews no node leases, so about 50 s
    into a session the node controller marks every pod not ready (a harness matter)."""
    def read():
        before = get(controlplane, "infd", name, ns)
        lines = controlplane.kubectl("get", "infd", name, "-n", ns, "-o", "wide").stdout.splitlines()
        after = get(controlplane, "infd", name, ns)
        if before["metadata"]["resourceVersion"] != after["metadata"]["resourceVersion"]:
            return None  # the status moved while we looked: read again
        return dict(zip(lines[0].split(), lines[1].split())), after
    return eventually(read, timeout=30, what="a stable `kubectl get infd`")


def engine_state(url: str, key: str) -> dict:
    """The engine's admin state (its key: `admin_key`)."""
    return httpx.get(f"{url}/kvtune/v1/state", timeout=5, headers={"Authorization": f"Bearer {key}"}) \
        .raise_for_status().json()


def start_engine(controlplane, pod_node, ns: str, name: str, timeout: float = 180):
    """Wait for the one engine process of `name` to listen; returns its LocalPod."""
    labels = {LABEL: name}

    def started():
        pods = [p for p in pod_node.pods.values() if p.namespace == ns and p.labels.get(LABEL) == name]
        for p in pods:
            assert p.returncode is None, f"engine exited {p.returncode}:\n{p.log_path.read_text()[-3000:]}"
        return pod_node.wait_for_selector(ns, labels, count=1, timeout=1) if pods else None
    local = eventually(started, timeout=timeout, interval=0.5, what=f"the {name} engine to listen")
    assert len(local) == 1, [p.name for p in local]
    eventually(lambda: httpx.get(f"{local[0].url}/health", timeout=2).status_code == 200, timeout=60,
               what=f"the {name} engine to be healthy")
    return local[0]


def url_of(pod_node, ns: str, name: str):
    """What a client of the Service reaches: the first live engine process of `name`."""
    labels = {LABEL: name}
    return lambda: next(iter(pod_node.urls_for_selector(ns, labels)), None)


def tuning_events(controlplane, ns: str, name: str, *, including: tuple[str, ...] = ()
                  ) -> list[tuple[str, str, str]]:
    """(type, reason, message) of its Tuning* events, oldest first, once one of each reason in
    `including` is there: the operator posts a decision's event after it wrote the status, so a test
    that just saw the decision in the status waits for its event rather than racing it."""
    def read():
        return [(e["type"], e["reason"], e["message"]) for e in sorted(
            events(controlplane, ns, name), key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
            if e["reason"].startswith("Tuning")]
    if not including:
        return read()
    return eventually(lambda: (evs := read()) and set(including) <= {r for _, r, _ in evs} and evs,
                      timeout=30, what=f"events {', '.join(including)}")


def delete_and_wait(controlplane, pod_node, ns: str, name: str) -> None:
    """Delete the InferenceDeployment and stop its engine now, for the next test's CPU. The resource
    itself may take a minute to go: kopf removes its finalizer only once the timers stopped, and it
    polls a timer that was running at the deletion every settings.background.cancellation_polling
    (60 s by default); its Deployment is deleted here directly (the operator no longer reconciles a
    resource that is being deleted)."""
    controlplane.kubectl("delete", "infd", name, "-n", ns, "--wait=false")
    controlplane.kubectl("delete", "deployment", name, f"{name}-canary", "-n", ns, "--wait=false",
                         "--ignore-not-found", check=False)
    eventually(lambda: not [p for p in pod_node.pods.values() if p.namespace == ns
                            and p.labels.get(LABEL) == name],
               timeout=60, what=f"the {name} engine processes to stop")


# -- the sequence cap: a live change; a forced bad candidate rolled back ------------------------------

def test_sequence_cap_live_change_then_forced_bad_candidate_rolled_back(
        controlplane, pod_node, tune_ns, tuning_operator, model):
    ns, name, op = tune_ns, "seqcap", tuning_operator
    t0 = time.monotonic()
    controlplane.kubectl("apply", "-n", ns, "-f", "-", input=infd(
        name, model, engine={"maxNumSeqs": 2, "kvCacheMemoryGiB": 0.05},
        bounds={"maxNumSeqs": {"min": 1, "max": 32}}))
    local = start_engine(controlplane, pod_node, ns, name)
    key = admin_key(controlplane, ns, name)
    log(f"seqcap: engine listening after {time.monotonic() - t0:.0f}s")
    assert engine_state(local.admin_url, key)["config"]["max_num_seqs"] == 2
    dep = get(controlplane, "deployment", name, ns)
    gen, template, pod_name = dep["metadata"]["generation"], dep["spec"]["template"], local.name
    rs_before = replica_sets(controlplane, ns, name)

    # Twice what two sequences serve, measured here first (~4 requests/s of 32 + 48 tokens on two quiet
    # Zen 3 cores: 8/s; a faster machine gets more, a slower one less): the queue grows. At most 32 in flight: the
    # backlog a raised cap has to drain before the next window's requests meet the 1 s TTFT stays
    # small next to the window, even on a machine whose speed the cost fit catches at its worst
    # (each further sequence costs ~1 ms more per step here, the 120k-token vocabulary's head: a
    # fit from two sequences only cannot see that, and a busy machine has made it predict 50 ms
    # steps at 32, i.e. ~13 requests/s)
    served = served_rate(url_of(pod_node, ns, name), "tiny", requests=8, prompt_tokens=32, output_tokens=48,
                         vocab=VOCAB)
    log(f"seqcap: two sequences serve {served:.1f} requests/s here: the load sends {2 * served:.1f}/s")
    load = OpenLoopLoad(url_of(pod_node, ns, name), "tiny", rate=2 * served, prompt_tokens=32, output_tokens=48,
                        vocab=VOCAB, max_requests=1500, max_seconds=240, max_in_flight=32, seed=1)
    with load:
        # 1. the diagnosis and a live change of maxNumSeqs
        obj, apply = first_apply(controlplane, ns, name, timeout=90, operator=op)
        log(f"seqcap: applied after {time.monotonic() - t0:.0f}s: {apply}")
        st = obj["status"]
        assert apply["cause"] == "SequenceCap", apply
        assert apply["restart"] is False
        assert apply["before"] == {"maxNumSeqs": 2}
        raised = apply["after"]["maxNumSeqs"]
        assert 2 < raised <= 32 and set(apply["after"]) == {"maxNumSeqs"}, apply
        assert "sequence cap" in apply["message"] and "live change" in apply["message"], apply["message"]
        assert apply["predicted"]["goodputRequestsPerSecond"] > 0
        diag = st["diagnosis"]
        assert diag["cause"] == "SequenceCap" and diag["observedAt"] == apply["time"], diag
        assert diag["message"].startswith("Requests wait on the sequence cap"), diag["message"]
        assert diag["figures"]["waitingReasonShares"]["max_num_seqs"] > 0.5
        assert diag["figures"]["kvUsagePercent"] < 70
        assert st["engine"]["maxNumSeqs"] == raised and obj["spec"]["engine"]["maxNumSeqs"] == 2  # spec untouched
        assert st["tuning"]["phase"] == "Verifying"
        assert condition(obj, "MetricsAvailable")["status"] == "True"

        # ... reaches the running engine through the ConfigMap, without a rollout
        eventually(lambda: f"max_num_seqs: {raised}\n" in get(controlplane, "configmap", f"{name}-engine", ns)
                   ["data"]["engine.yaml"], timeout=30, what="the ConfigMap to carry the tuned maxNumSeqs")
        eventually(lambda: engine_state(local.admin_url, key)["config"]["max_num_seqs"] == raised, timeout=60,
                   what="the engine to run the tuned maxNumSeqs")
        log(f"seqcap: engine runs maxNumSeqs {raised} after {time.monotonic() - t0:.0f}s")

        # 2. verified over the next window and kept; columns and describe tell it
        obj = wait_for(controlplane, ns, name, lambda o: any(h["action"] in ("Keep", "RollBack") for h in history(o)),
                       timeout=60, what="the verification of the live change", operator=op)
        verdict = next(h for h in history(obj) if h["action"] in ("Keep", "RollBack"))
        log(f"seqcap: verified after {time.monotonic() - t0:.0f}s: {verdict}")
        assert verdict["action"] == "Keep", verdict
        assert verdict["measured"]["goodputRequestsPerSecond"] > 0
        assert "after" not in verdict and verdict["restart"] is False  # a Keep changes nothing
        dep = get(controlplane, "deployment", name, ns)
        assert dep["metadata"]["generation"] == gen and dep["spec"]["template"] == template
        assert replica_sets(controlplane, ns, name) == rs_before
        assert [p.name for p in pod_node.pods_for_selector(ns, {LABEL: name})] == [pod_name]
        assert pod_node.get(ns, pod_name) is local and local.alive()  # the same process all along

        row, shown = table_row(controlplane, ns, name)
        d = shown["status"]["diagnosis"]
        assert row["KV%"] == f"{d['figures']['kvUsagePercent']:g}" and row["WAITING"] == str(d["figures"]["waiting"])
        assert row["CAUSE"] == d["cause"] and row["TUNING"] == shown["status"]["tuning"]["phase"]
        assert row["MAXSEQS"] == str(shown["status"]["engine"]["maxNumSeqs"]) and row["MODE"] == "Apply"

        # 3. a deliberately bad candidate, forced: applied, measured worse, rolled back
        controlplane.kubectl("annotate", "infd", name, "-n", ns, 'kvtune.io/try={"maxNumSeqs": 1}')
        obj = wait_for(controlplane, ns, name, lambda o: any(
            h["action"] == "Apply" and "kvtune.io/try" in h["message"] for h in history(o)),
            timeout=60, what="the forced candidate to be applied", operator=op)
        trial = next(h for h in history(obj) if h["action"] == "Apply" and "kvtune.io/try" in h["message"])
        log(f"seqcap: trial applied after {time.monotonic() - t0:.0f}s: {trial}")
        before_trial = trial["before"]["maxNumSeqs"]
        assert trial["after"] == {"maxNumSeqs": 1} and before_trial > 1 and trial["restart"] is False
        assert "predicted" not in trial  # a forced candidate is not simulated
        assert obj["status"]["engine"]["maxNumSeqs"] == 1
        eventually(lambda: engine_state(local.admin_url, key)["config"]["max_num_seqs"] == 1, timeout=60,
                   what="the engine to run the forced candidate")

        def rolled_back(o):
            h = history(o)
            i = next((k for k, e in enumerate(h) if e is not None and e.get("time") == trial["time"]
                      and e["action"] == "Apply"), None)
            return i is not None and any(e["action"] in ("Keep", "RollBack") for e in h[i + 1:])
        obj = wait_for(controlplane, ns, name, rolled_back, timeout=60,
                       what="the verification of the forced candidate", operator=op)
        h = history(obj)
        i = max(k for k, e in enumerate(h) if e["time"] == trial["time"] and e["action"] == "Apply")
        verdict = next(e for e in h[i + 1:] if e["action"] in ("Keep", "RollBack"))
        log(f"seqcap: trial verified after {time.monotonic() - t0:.0f}s: {verdict}")
        assert verdict["action"] == "RollBack", verdict
        assert "fell" in verdict["message"] and "rolled back" in verdict["message"], verdict["message"]
        assert verdict["before"] == {"maxNumSeqs": 1} and verdict["after"] == {"maxNumSeqs": before_trial}
        assert verdict["restart"] is False and "predicted" not in verdict
        st = obj["status"]
        assert st["engine"]["maxNumSeqs"] == before_trial  # back to the value before the candidate
        if h[-1] is verdict:  # (a later round may have moved on already)
            assert st["tuning"]["phase"] == "RolledBack" and st["tuning"]["lastChange"] == verdict
        eventually(lambda: engine_state(local.admin_url, key)["config"]["max_num_seqs"] == before_trial, timeout=60,
                   what="the engine to run the rolled-back value again")
        assert pod_node.get(ns, pod_name) is local and local.alive()
        assert get(controlplane, "deployment", name, ns)["metadata"]["generation"] == gen

    log(f"seqcap: load {load.stats}")
    assert load.stats.failed == 0, load.stats.errors
    evs = tuning_events(controlplane, ns, name, including=("TuningApply", "TuningKeep", "TuningRollBack"))
    reasons = [(t, r) for t, r, _ in evs]
    assert ("Normal", "TuningApply") in reasons and ("Normal", "TuningKeep") in reasons
    assert ("Warning", "TuningRollBack") in reasons, evs
    assert any("kvtune.io/try" in m for _, r, m in evs if r == "TuningApply")
    text = controlplane.kubectl("describe", "infd", name, "-n", ns).stdout
    for want in ("Diagnosis:", "Cause:", "Tuning:", "Last Change:", "History:", "TuningApply", "TuningKeep",
                 "TuningRollBack", "EngineConfigChanged", "maxNumSeqs 2 -> "):
        assert want in text, f"{want!r} not in kubectl describe:\n{text}"
    assert any(line.split()[:2] == ["Warning", "TuningRollBack"] for line in text.splitlines()), text
    delete_and_wait(controlplane, pod_node, ns, name)
    log(f"seqcap: done in {time.monotonic() - t0:.0f}s")


# -- too little KV memory: a restart change rolls the Deployment -------------------------------------

def test_low_kv_memory_restart_change_rolls_the_deployment(controlplane, pod_node, tune_ns, tuning_operator, model):
    """Time (~1.5 min): two engine starts, a window before the change, the rollout, and a whole window
    of the new pod alone before the verdict."""
    ns, name, op = tune_ns, "lowmem", tuning_operator
    t0 = time.monotonic()
    # the stand-in device: 10% of it holds the weights and LOW_BLOCKS KV blocks (and half a block)
    device = (weights_bytes(model) + LOW_BLOCKS * BLOCK_BYTES + BLOCK_BYTES // 2) / 0.1 / 2**30
    controlplane.kubectl("apply", "-n", ns, "-f", "-", input=infd(
        name, model, engine={"maxNumSeqs": 96, "gpuMemoryUtilization": 0.1},
        bounds={"maxNumSeqs": {"min": 8, "max": 128}, "gpuMemoryUtilization": {"min": 0.1, "max": 0.3}},
        extra_args=["--device-memory", f"{device:.9f}"]))
    local = start_engine(controlplane, pod_node, ns, name)
    key = admin_key(controlplane, ns, name)
    log(f"lowmem: engine listening after {time.monotonic() - t0:.0f}s")
    state = engine_state(local.admin_url, key)
    assert state["blocks"]["total"] == LOW_BLOCKS and state["config"]["gpu_memory_utilization"] == 0.1
    dep = get(controlplane, "deployment", name, ns)
    gen, pod_name = dep["metadata"]["generation"], local.name
    old_hash = dep["spec"]["template"]["metadata"]["annotations"]["kvtune.io/restart-hash"]
    rs_before = replica_sets(controlplane, ns, name)
    assert len(rs_before) == 1

    # requests of 16 + 112 tokens (8 blocks each): 24 blocks hold three of them. The rate is twice what
    # three at once serve here, measured first (a fixed 5/s kept only three in flight on a fast machine:
    # no KV pressure, diagnosis Healthy), and at least the 5/s this test was written with
    three = served_rate(url_of(pod_node, ns, name), "tiny", requests=3, prompt_tokens=16, output_tokens=112,
                        vocab=VOCAB)
    log(f"lowmem: three sequences serve {three:.1f} requests/s here")
    load = OpenLoopLoad(url_of(pod_node, ns, name), "tiny", rate=max(5.0, 2 * three), prompt_tokens=16,
                        output_tokens=112, vocab=VOCAB, max_requests=1200, max_seconds=200, max_in_flight=96, seed=2)
    with load:
        obj, apply = first_apply(controlplane, ns, name, timeout=90, operator=op)
        log(f"lowmem: applied after {time.monotonic() - t0:.0f}s: {apply}")
        st = obj["status"]
        assert apply["cause"] == "LowKVMemory", apply
        assert apply["restart"] is True and "needs a restart" in apply["message"]
        assert apply["before"]["gpuMemoryUtilization"] == 0.1
        raised = apply["after"]["gpuMemoryUtilization"]
        assert 0.1 < raised <= 0.3, apply
        diag = st["diagnosis"]
        assert diag["cause"] == "LowKVMemory" and diag["observedAt"] == apply["time"], diag
        assert diag["message"].startswith("Too little KV memory"), diag["message"]
        # figures consistent with the engine's own state (how full the 24 blocks ran on average is the
        # machine's speed, not the cause): blocks in use, the cache's own size quoted, more blocks proposed
        assert 0 < diag["figures"]["kvUsagePercent"] <= 100 and diag["figures"]["running"] <= 96, diag["figures"]
        added = re.search(r"adds (\d+) blocks", diag["message"])
        assert added and int(added.group(1)) > 0, diag["message"]
        assert diag["figures"]["preemptionsPerMinute"] > 0 or diag["figures"]["waitingReasonShares"]["kv_blocks"] > 0.1
        assert st["engine"]["gpuMemoryUtilization"] == raised and obj["spec"]["engine"]["gpuMemoryUtilization"] == 0.1
        assert st["tuning"]["lastRestartTime"] == apply["time"]

        # a restart knob: the Deployment rolls a new ReplicaSet, a new pod runs the new memory size
        dep = eventually(lambda: (d := get(controlplane, "deployment", name, ns))["metadata"]["generation"] > gen and d,
                         timeout=30, what="the Deployment to roll")
        assert dep["spec"]["template"]["metadata"]["annotations"]["kvtune.io/restart-hash"] != old_hash
        eventually(lambda: len(replica_sets(controlplane, ns, name) - rs_before) == 1, timeout=30,
                   what="a new ReplicaSet")

        def new_engine():
            pods = [p for p in pod_node.pods_for_selector(ns, {LABEL: name})
                    if p.name != pod_name]
            if not pods:
                return None
            s = engine_state(pods[0].admin_url, key)
            return (pods[0], s) if s["config"]["gpu_memory_utilization"] == raised else None
        new, state = eventually(new_engine, timeout=120, interval=0.5, what="the new engine pod to serve")
        log(f"lowmem: new engine {new.name} serves after {time.monotonic() - t0:.0f}s with "
            f"{state['blocks']['total']} blocks")
        assert state["blocks"]["total"] > 10 * LOW_BLOCKS
        eventually(lambda: pod_node.get(ns, pod_name) is None and not local.alive(), timeout=60,
                   what="the old engine pod to go")
        obj = eventually(lambda: (o := get(controlplane, "infd", name, ns)) and
                         condition(o, "Progressing").get("reason") == "RolloutComplete" and o, timeout=60,
                         what="the rollout to complete")
        assert obj["status"]["engine"]["gpuMemoryUtilization"] == raised

        # verified on the new engine's own window and kept: no rollback, no second rollout
        obj = wait_for(controlplane, ns, name, lambda o: any(h["action"] in ("Keep", "RollBack") for h in history(o)),
                       timeout=90, what="the verification of the restart change", operator=op)
        verdict = next(h for h in history(obj) if h["action"] in ("Keep", "RollBack"))
        log(f"lowmem: verified after {time.monotonic() - t0:.0f}s: {verdict}")
        assert verdict["action"] == "Keep", verdict
        assert "after" not in verdict and verdict["restart"] is False  # a Keep changes nothing
        assert obj["status"]["engine"]["gpuMemoryUtilization"] == raised
        assert len(replica_sets(controlplane, ns, name)) == 2
        assert [p.name for p in pod_node.pods_for_selector(ns, {LABEL: name})] == [new.name]
        row, shown = table_row(controlplane, ns, name)
        assert row["MEMUTIL"] == f"{raised:g}"
        d = shown["status"]["diagnosis"]
        assert row["CAUSE"] == d["cause"] and row["TUNING"] == shown["status"]["tuning"]["phase"]
        assert row["KV%"] == f"{d['figures']['kvUsagePercent']:g}" and row["WAITING"] == str(d["figures"]["waiting"])

    log(f"lowmem: load {load.stats}")
    assert load.stats.failed == 0, load.stats.errors
    evs = tuning_events(controlplane, ns, name, including=("TuningApply",))
    assert any(r == "TuningApply" and "needs a restart" in m for _, r, m in evs), evs
    text = controlplane.kubectl("describe", "infd", name, "-n", ns).stdout
    for want in ("Cause:", "LowKVMemory", "TuningApply", "RollingRestart", "gpuMemoryUtilization 0.1 -> "):
        assert want in text, f"{want!r} not in kubectl describe:\n{text}"
    delete_and_wait(controlplane, pod_node, ns, name)
    log(f"lowmem: done in {time.monotonic() - t0:.0f}s")
