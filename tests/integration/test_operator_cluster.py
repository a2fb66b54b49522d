"""The operator against the real control plane (issue 4, section 5).

The operator runs as a subprocess (`kvtune operator run`) watching only this module's namespaces,
so it never touches objects of other tests sharing the session's cluster. A pod is Ready only when
its container answers its readiness probe (the pod node plays the kubelet), so the engine pods of
`opns` run a stand-in that answers /health (`health_server.py`): these tests are about the operator,
and `kvtune serve` would not start on their model path. `test_engine_pod_applies_live_knobs` runs a
real engine on a tiny model.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from kvtune_operator.demo.engine import free_port
from kvtune_operator.kube import Kube
from kvtune_operator.reconcile import Reconciler
from kvtune_operator.settings import Settings

from tests.infd import infd_body

from .waiting import eventually

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CRD_NAME = "inferencedeployments.kvtune.io"
HEALTH_SERVER = Path(__file__).with_name("health_server.py")
SELECTOR = "app.kubernetes.io/instance={},app.kubernetes.io/name=kvtune-engine"




def admin_key(controlplane, namespace: str, name: str) -> str:
    """The engine's admin key, from the Secret the operator keeps for the InferenceDeployment (the
    engine's admin API answers nothing else, loopback included, once it has a key)."""
    def read():
        out = controlplane.kubectl("get", "secret", f"{name}-admin-key", "-n", namespace, "-o", "json", check=False)
        return out.returncode == 0 and base64.b64decode(json.loads(out.stdout)["data"]["admin-key"]).decode()
    return eventually(read, timeout=30, what=f"the admin-key Secret of {name}")


class OperatorProcess:
    """`kvtune operator run` as a subprocess, with its log in a file."""

    def __init__(self, env: dict[str, str], namespaces: list[str], log_path: Path, kubeconfig: str | None = None):
        self.env, self.namespaces, self.log_path, self.kubeconfig = env, namespaces, log_path, kubeconfig
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "OperatorProcess":
        exe = Path(sys.executable).with_name("kvtune")
        argv = [str(exe), "operator", "run", *sum((["--namespace", n] for n in self.namespaces), [])]
        if self.kubeconfig:
            argv += ["--kubeconfig", self.kubeconfig]
        # the tests' defaults, then the caller's env (a fleet sets a longer status interval)
        env = {"KVTUNE_STATUS_INTERVAL": "1", "KVTUNE_RETRY_BACKOFF": "1",
               "KVTUNE_ENGINE_IMAGE": "kvtune/kvtune-engine:test", **self.env,
               "KVTUNE_LIVENESS": f"http://127.0.0.1:{self.port}/healthz", "PYTHONUNBUFFERED": "1",
               # the pod node runs engine pods as local processes, scraped at 127.0.0.1 (not their pod IPs)
               "KVTUNE_ALLOW_LOOPBACK_ENGINES": "true"}
        if self.kubeconfig:
            env["KUBECONFIG"] = self.kubeconfig
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        eventually(self.healthy, timeout=60, what="the operator's liveness endpoint")
        return self

    def healthy(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"operator exited:\n{self.tail()}"
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
            return r.status == 200 and "uptime_seconds" in json.loads(r.read())

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the operator dies mid-work, without a chance to finish or clean up."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


# -- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def crd(controlplane):
    controlplane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    eventually(lambda: controlplane.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}",
                                            "--timeout=10s", check=False).returncode == 0, what="the CRD established")
    eventually(lambda: controlplane.kubectl("get", "infd", "-A", check=False).returncode == 0,
               what="kubectl to discover infd")
    # the OpenAPI document (kubectl explain) is published a moment after the CRD is established
    eventually(lambda: controlplane.kubectl("explain", "infd.spec.engine", check=False).returncode == 0,
               what="the CRD's OpenAPI schema to be published")
    return CRD_NAME


def _make_namespace(controlplane, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    controlplane.kubectl("create", "namespace", name)
    eventually(lambda: controlplane.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
               what="the default ServiceAccount")
    return name


@contextlib.contextmanager
def engine_namespace(controlplane, pod_node, prefix: str):
    """A fresh namespace whose pods the pod node runs (and no other test's); on exit it is deleted
    and its engine processes are waited for, so the next module starts on a quiet machine."""
    ns = _make_namespace(controlplane, prefix)
    with pod_node.restricted_to(ns):
        yield ns
        controlplane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        eventually(lambda: not [p for p in pod_node.pods.values() if p.namespace == ns], timeout=60,
                   what="the engine processes to stop")


@pytest.fixture(scope="module")
def opns(controlplane, crd, pod_node):
    """The namespace this module's operator watches; its engine pods run `health_server.py`."""
    name = _make_namespace(controlplane, "op")
    before = pod_node.translate

    def stand_in(pod, container, argv):
        if pod["metadata"]["namespace"] == name:
            return [sys.executable, str(HEALTH_SERVER)]
        return before(pod, container, argv) if before else pod_node.default_translate(argv)
    pod_node.translate = stand_in
    try:
        with pod_node.restricted_to(name):
            yield name
    finally:
        pod_node.translate = before
        controlplane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(controlplane, crd, opns, tmp_path_factory):
    op = OperatorProcess(controlplane.subprocess_env(), [opns], tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()
    sys.stderr.write(f"\n[operator log tail]\n{op.tail(30)}\n")


def infd_yaml(name: str, **spec) -> str:
    return yaml.safe_dump(infd_body(name, model_path="/models/tiny", **spec))


def get(controlplane, kind: str, name: str, ns: str) -> dict:
    return controlplane.kubectl_json("get", kind, name, "-n", ns, "-o", "json")


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def wait_ready(controlplane, name: str, ns: str, operator: OperatorProcess, replicas: str = "1/1") -> dict:
    def ready():
        obj = get(controlplane, "infd", name, ns)
        st = obj.get("status") or {}
        ok = condition(obj, "Ready").get("status") == "True" and st.get("replicaSummary") == replicas \
            and st.get("observedGeneration") == obj["metadata"]["generation"]
        return obj if ok else None
    try:
        return eventually(ready, timeout=90, what=f"{name} Ready {replicas}")
    except AssertionError:
        raise AssertionError(f"{name} never got Ready; operator log:\n{operator.tail()}") from None


def children(controlplane, name: str, ns: str) -> dict[str, list[dict]]:
    out = {}
    for kind in ("deployments", "configmaps", "services"):
        items = controlplane.kubectl_json("get", kind, "-n", ns, "-l", f"kvtune.io/inference-deployment={name}",
                                          "-o", "json")["items"]
        out[kind] = items
    return out


# -- the resource, without the operator --------------------------------------------------------------

def test_crd_is_discoverable_and_explained(controlplane, crd):
    res = controlplane.kubectl("api-resources", "--api-group=kvtune.io", "-o", "wide").stdout
    assert "inferencedeployments" in res and "infd" in res and "kvtune" in res
    explain = controlplane.kubectl("explain", "inferencedeployment.spec.engine").stdout
    for text in ("Token slots per KV-cache block", "maxNumSeqs", "gpuMemoryUtilization", "vLLM flag --block-size",
                 "restarts the engine pods"):
        assert text in explain, text
    autotune = controlplane.kubectl("explain", "infd.spec.autotune.mode").stdout
    assert "Recommend" in autotune and "Apply" in autotune
    status = controlplane.kubectl("explain", "infd.status.diagnosis").stdout
    assert "waiting cause" in status


BAD = [
    ({"engine": {"blockSize": 24}}, ["spec.engine.blockSize", "Unsupported value: 24", '"8", "16", "32", "64", "128"']),
    ({"engine": {"gpuMemoryUtilization": 0.99}}, ["spec.engine.gpuMemoryUtilization", "less than or equal to 0.98"]),
    ({"engine": {"maxNumSeqs": 0}}, ["spec.engine.maxNumSeqs", "greater than or equal to 1"]),
    ({"engine": {"swapSpaceGiB": -1}}, ["spec.engine.swapSpaceGiB", "greater than or equal to 0"]),
    ({"autotune": {"mode": "Auto"}}, ["spec.autotune.mode", '"Off", "Recommend", "Apply"']),
    ({"engine": {"maxNumSeqs": 16}, "autotune": {"bounds": {"maxNumSeqs": {"min": 32, "max": 512}}}},
     ["spec.engine.maxNumSeqs", "must lie inside autotune.bounds.maxNumSeqs"]),
    ({"autotune": {"bounds": {"maxNumSeqs": {"min": 600, "max": 512}}}},
     ["spec.autotune.bounds.maxNumSeqs", "min must not be greater than max"]),
    ({"engine": {"blockSize": 64}, "autotune": {"bounds": {"blockSize": [16, 32]}}},
     ["spec.engine.blockSize", "must be one of autotune.bounds.blockSize"]),
    ({"autotune": {"bounds": {"blockSize": [16, 24]}}}, ["spec.autotune.bounds.blockSize", "Unsupported value: 24"]),
    ({"engine": {"enableChunkedPrefill": False, "maxNumBatchedTokens": 2048, "maxModelLen": 8192}},
     ["spec.engine.maxNumBatchedTokens", "without chunked prefill"]),
    ({"model": {"path": "/data/m", "volume": {"persistentVolumeClaim": {"claimName": "w"}}}},
     ["spec.model.path", "must lie inside model.volume.mountPath"]),
    ({"model": {"path": "/models/m", "volume": {}}}, ["set exactly one of persistentVolumeClaim or hostPath"]),
    ({"model": {"path": "relative"}}, ["spec.model.path", "should match '^/'"]),
    ({"autotune": {"interval": "soon"}}, ["spec.autotune.interval", "should match"]),
    # the trust model (README): what the resource may not set
    ({"env": [{"name": "LD_PRELOAD", "value": "/models/x.so"}]}, ["spec.env[0].name", "env name is reserved",
                                                                  "KVTUNE_API_KEY is allowed"]),
    ({"env": [{"name": "KVTUNE_ADMIN_KEY", "secretKeyRef": {"name": "mine", "key": "k"}}]},
     ["spec.env[0].name", "env name is reserved"]),
    ({"env": [{"name": "T", "secretKeyRef": {"name": "other-admin-key", "key": "admin-key"}}]},
     ["spec.env[0].secretKeyRef.name", "must not name an admin-key Secret of the operator"]),
    ({"env": [{"name": "G", "value": "$(KVTUNE_ADMIN_KEY)"}]}, ["spec.env[0].value", "must not contain '$('"]),
    ({"model": {"path": "/models/tiny", "servedModelName": "$(S)"}},
     ["spec.model.servedModelName", "must not contain '$('"]),
    ({"extraArgs": ["--dtype", "$(S)"]}, ["spec.extraArgs", "must not contain '$('"]),
    ({"extraArgs": ["--admin-port=9"]}, ["spec.extraArgs", "must not set what the operator sets"]),
    ({"runtime": "vllm", "extraArgs": ["--trust_remote_code"]}, ["spec.extraArgs", "--trust-remote-code"]),
    ({"runtime": "vllm", "engine": {"profileBatchedTokens": 4096}},
     ["spec.engine.profileBatchedTokens", "runtime vllm has no profileBatchedTokens", "leave it unset"]),
    ({"extraArgs": ["--port", "9000"]}, ["spec.extraArgs", "must not set what the operator sets"]),
    ({"engine": {"swapSpaceGiB": 1e308}}, ["spec.engine.swapSpaceGiB", "less than or equal to 1024"]),
    ({"engine": {"maxNumSeqs": 1000000}}, ["spec.engine.maxNumSeqs", "less than or equal to 16384"]),
    ({"engine": {"kvCacheMemoryGiB": 1e9}}, ["spec.engine.kvCacheMemoryGiB", "less than or equal to 2048"]),
    ({"engine": {"maxNumBatchedTokens": 10 ** 9}}, ["spec.engine.maxNumBatchedTokens", "less than or equal to"]),
    ({"autotune": {"interval": "1ms"}}, ["spec.autotune.interval", "must be between 5s and 1h"]),
    ({"autotune": {"interval": "720h"}}, ["spec.autotune.interval", "must be between 5s and 1h"]),
    ({"autotune": {"window": "2h"}}, ["spec.autotune.window", "must be between 10s and 1h"]),
    ({"autotune": {"interval": "10m", "window": "5m"}}, ["spec.autotune.window", "at least autotune.interval"]),
]


@pytest.mark.parametrize("spec,messages", BAD, ids=[str(i) for i in range(len(BAD))])
def test_invalid_objects_are_refused_with_their_messages(controlplane, opns, spec, messages):
    body = infd_yaml("bad", **{"model": {"path": "/models/tiny"}, **spec})
    res = controlplane.kubectl("create", "--dry-run=server", "-n", opns, "-f", "-", input=body, check=False)
    assert res.returncode != 0, f"accepted: {spec}"
    for m in messages:
        assert m in res.stderr, f"{m!r} not in {res.stderr!r}"


def test_bad_name_and_unquoted_off_are_refused(controlplane, opns):
    res = controlplane.kubectl("create", "--dry-run=server", "-n", opns, "-f", "-", check=False,
                               input=infd_yaml("9lives"))
    assert res.returncode != 0 and "DNS-1035" in res.stderr
    res = controlplane.kubectl("create", "--dry-run=server", "-n", opns, "-f", "-", check=False,
                               input=infd_yaml("off").replace("spec:", "spec:\n  autotune: {mode: Off}"))
    assert res.returncode != 0 and "spec.autotune.mode" in res.stderr


def test_defaults_are_filled_by_the_apiserver(controlplane, opns):
    obj = json.loads(controlplane.kubectl("create", "--dry-run=server", "-n", opns, "-o", "json", "-f", "-",
                                          input=infd_yaml("defaults")).stdout)
    assert obj["spec"]["engine"]["blockSize"] == 16 and obj["spec"]["engine"]["maxNumSeqs"] == 256
    assert obj["spec"]["replicas"] == 1 and obj["spec"]["resources"]["gpus"] == 1
    assert obj["spec"]["metrics"]["scrapeInterval"] == "15s"


def test_examples_are_valid(controlplane, opns):
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        controlplane.kubectl("apply", "--dry-run=server", "-n", opns, "-f", str(example))


# -- with the operator --------------------------------------------------------------------------------

def test_example_gets_owned_children_columns_conditions_and_events(controlplane, operator, opns):
    controlplane.kubectl("apply", "-n", opns, "-f", str(ROOT / "examples" / "minimal.yaml"))
    obj = wait_ready(controlplane, "tiny", opns, operator)
    uid = obj["metadata"]["uid"]
    kids = children(controlplane, "tiny", opns)
    assert [len(kids[k]) for k in ("deployments", "configmaps", "services")] == [1, 1, 1]
    for items in kids.values():
        refs = items[0]["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "kvtune.io/v1alpha1", "kind": "InferenceDeployment", "name": "tiny",
                         "uid": uid, "controller": True, "blockOwnerDeletion": True}]
    cm = kids["configmaps"][0]
    assert yaml.safe_load(cm["data"]["engine.yaml"])["block_size"] == 16
    dep = controlplane.kubectl_json("get", "deployment", "tiny", "-n", opns, "-o", "json", "--show-managed-fields")
    applied = [m for m in dep["metadata"]["managedFields"] if m["manager"] == "kvtune-operator"]
    assert applied and applied[0]["operation"] == "Apply"  # server-side apply with our field manager
    st = obj["status"]
    assert st["engine"]["blockSize"] == 16 and st["image"] == "kvtune/kvtune-engine:test"
    assert st["selector"] == SELECTOR.format("tiny")
    # kubectl get shows the columns (KV%, Waiting and Cause stay empty until the tuner diagnoses)
    table = controlplane.kubectl("get", "infd", "tiny", "-n", opns).stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "REPLICAS", "BLOCK", "MEMUTIL", "KV%", "WAITING", "CAUSE",
                                "TUNING", "AGE"]
    assert table[1].split()[:6] == ["tiny", "True", "1/1", "16", "0.9", "Pending"]
    wide = controlplane.kubectl("get", "infd", "tiny", "-n", opns, "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-3:] == ["MODE", "MAXSEQS", "DEGRADED"] and "Recommend" in wide[1]
    assert "tiny" in controlplane.kubectl("get", "kvtune", "-n", opns).stdout  # the category
    # kubectl describe tells the story: conditions and events
    def described():
        text = controlplane.kubectl("describe", "infd", "tiny", "-n", opns).stdout
        wanted = ["Conditions:", "Ready", "Progressing", "MetricsAvailable", "Tuned", "Degraded", "AsExpected",
                  "Created Deployment tiny", "Created ConfigMap tiny-engine", "Created Service tiny",
                  "1/1 engine pods ready"]
        return text if all(w in text for w in wanted) else None
    eventually(described, timeout=30, what="describe to show conditions and events")


def test_live_knob_changes_configmap_and_restart_knob_rolls(controlplane, operator, opns):
    controlplane.kubectl("apply", "-n", opns, "-f", "-", input=infd_yaml("roll", engine={"maxNumSeqs": 64}))
    obj = wait_ready(controlplane, "roll", opns, operator)
    dep = get(controlplane, "deployment", "roll", opns)
    gen, tmpl = dep["metadata"]["generation"], dep["spec"]["template"]
    rs_before = {r["metadata"]["name"] for r in controlplane.kubectl_json(
        "get", "rs", "-n", opns, "-l", SELECTOR.format("roll"), "-o", "json")["items"]}

    controlplane.kubectl("patch", "infd", "roll", "-n", opns, "--type=merge", "-p",
                         '{"spec":{"engine":{"maxNumSeqs":100}}}')
    eventually(lambda: "max_num_seqs: 100" in get(controlplane, "configmap", "roll-engine", opns)["data"]["engine.yaml"],
               what="the ConfigMap to carry maxNumSeqs 100")
    eventually(lambda: get(controlplane, "infd", "roll", opns)["status"]["engine"]["maxNumSeqs"] == 100,
               what="status.engine.maxNumSeqs 100")
    time.sleep(2)  # a few refreshes: the Deployment must stay untouched
    dep = get(controlplane, "deployment", "roll", opns)
    assert dep["metadata"]["generation"] == gen and dep["spec"]["template"] == tmpl
    assert {r["metadata"]["name"] for r in controlplane.kubectl_json(
        "get", "rs", "-n", opns, "-l", SELECTOR.format("roll"), "-o", "json")["items"]} == rs_before

    old_hash = tmpl["metadata"]["annotations"]["kvtune.io/restart-hash"]
    controlplane.kubectl("patch", "infd", "roll", "-n", opns, "--type=merge", "-p",
                         '{"spec":{"engine":{"blockSize":32}}}')
    eventually(lambda: get(controlplane, "deployment", "roll", opns)["metadata"]["generation"] > gen,
               what="the Deployment to roll")
    dep = get(controlplane, "deployment", "roll", opns)
    assert dep["spec"]["template"]["metadata"]["annotations"]["kvtune.io/restart-hash"] != old_hash
    eventually(lambda: len(controlplane.kubectl_json("get", "rs", "-n", opns, "-l", SELECTOR.format("roll"),
                                                     "-o", "json")["items"]) == len(rs_before) + 1,
               what="a new ReplicaSet")
    obj = eventually(lambda: (o := get(controlplane, "infd", "roll", opns)) and
                     condition(o, "Progressing").get("reason") == "RolloutComplete" and o, timeout=60,
                     what="the rollout to complete")
    assert obj["status"]["engine"]["blockSize"] == 32 and condition(obj, "Ready")["status"] == "True"
    events = controlplane.kubectl_json("get", "events", "-n", opns, "--field-selector",
                                       "involvedObject.name=roll,involvedObject.kind=InferenceDeployment",
                                       "-o", "json")["items"]
    reasons = {e["reason"]: e["message"] for e in events}
    assert "maxNumSeqs 64 -> 100" in reasons["EngineConfigChanged"] and "no restart" in reasons["EngineConfigChanged"]
    assert "blockSize 16 -> 32" in reasons["RollingRestart"]


def test_scale_subresource(controlplane, operator, opns):
    controlplane.kubectl("apply", "-n", opns, "-f", "-", input=infd_yaml("scaled"))
    wait_ready(controlplane, "scaled", opns, operator)
    controlplane.kubectl("scale", "infd", "scaled", "-n", opns, "--replicas=2")
    wait_ready(controlplane, "scaled", opns, operator, replicas="2/2")
    assert get(controlplane, "deployment", "scaled", opns)["spec"]["replicas"] == 2
    scale = json.loads(controlplane.kubectl(
        "get", "--raw", f"/apis/kvtune.io/v1alpha1/namespaces/{opns}/inferencedeployments/scaled/scale").stdout)
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == SELECTOR.format("scaled")


def test_missing_pvc_is_degraded_with_an_event(controlplane, operator, opns):
    controlplane.kubectl("apply", "-n", opns, "-f", "-", input=infd_yaml(
        "nopvc", model={"path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "absent"}}}))

    def degraded():
        c = condition(get(controlplane, "infd", "nopvc", opns), "Degraded")
        return c if c.get("status") == "True" and c.get("reason") == "ModelVolumeMissing" else None
    c = eventually(degraded, timeout=60, what="Degraded ModelVolumeMissing")
    assert "absent" in c["message"]
    # the operator posts its events after it wrote the status: wait for the event, do not race it
    events = eventually(lambda: events_of(controlplane, opns, "nopvc", "ModelVolumeMissing"),
                        timeout=30, what="a ModelVolumeMissing event")
    assert events[0]["type"] == "Warning"
    # no engine pods until the claim exists and its volume is checked (it could come bound to a node directory)
    assert controlplane.kubectl("get", "deployment", "nopvc", "-n", opns, check=False).returncode != 0
    assert get(controlplane, "configmap", "nopvc-engine", opns)
    controlplane.kubectl("apply", "-n", opns, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "absent"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
    eventually(lambda: condition(get(controlplane, "infd", "nopvc", opns), "Degraded").get("reason")
               != "ModelVolumeMissing", what="ModelVolumeMissing to clear")


def _bound_claim(controlplane, ns: str, claim: str, source: dict) -> str:
    """A PersistentVolume with `source` and a claim `claim` bound to it (claimRef and volumeName): its name."""
    pv = f"{claim}-{uuid.uuid4().hex[:6]}"
    controlplane.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "claimRef": {"namespace": ns, "name": claim}, **source}}))
    controlplane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv,
                 "resources": {"requests": {"storage": "1Gi"}}}}))
    eventually(lambda: get(controlplane, "pvc", claim, ns).get("status", {}).get("phase") == "Bound",
               what=f"claim {claim} bound to {pv}")
    return pv


def test_a_claim_bound_to_a_host_path_volume_gets_no_pods(controlplane, operator, opns):
    """A persistentVolumeClaim whose PersistentVolume is a hostPath reaches the node's filesystem like
    spec.model.volume.hostPath: refused (Degraded HostPathVolume, a Warning event, no Deployment). A
    claim bound to any other kind of PersistentVolume gets its Deployment."""
    pvs = [_bound_claim(controlplane, opns, "node-dir", {"hostPath": {"path": "/", "type": "Directory"}}),
           _bound_claim(controlplane, opns, "disk", {"csi": {"driver": "disk.example.com", "volumeHandle": "w-1"}})]
    try:
        for name, claim in (("viahost", "node-dir"), ("viacsi", "disk")):
            controlplane.kubectl("apply", "-n", opns, "-f", "-", input=infd_yaml(name, model={
                "path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": claim}, "mountPath": "/models"}}))

        def refused():
            c = condition(get(controlplane, "infd", "viahost", opns), "Degraded")
            return c if c.get("status") == "True" and c.get("reason") == "HostPathVolume" else None
        c = eventually(refused, timeout=60, what="Degraded HostPathVolume")
        assert "node-dir" in c["message"] and pvs[0] in c["message"] and "hostPath" in c["message"]
        assert "allowHostPath" in c["message"]  # and what is allowed
        events = eventually(lambda: events_of(controlplane, opns, "viahost", "HostPathVolume"),
                            timeout=30, what="a HostPathVolume event")  # posted after the status
        assert events[0]["type"] == "Warning" and pvs[0] in events[0]["message"]
        dep = eventually(lambda: controlplane.kubectl_json("get", "deployments", "-n", opns, "-o", "json")["items"]
                         if get(controlplane, "deployment", "viacsi", opns) else None, what="viacsi's Deployment")
        assert "viahost" not in [d["metadata"]["name"] for d in dep]
        vols = get(controlplane, "deployment", "viacsi", opns)["spec"]["template"]["spec"]["volumes"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "disk", "readOnly": True}} in vols
        assert condition(get(controlplane, "infd", "viacsi", opns), "Degraded").get("reason") != "HostPathVolume"
    finally:
        controlplane.kubectl("delete", "infd", "viahost", "viacsi", "-n", opns, "--wait=false", check=False)
        controlplane.kubectl("delete", "pvc", "node-dir", "disk", "-n", opns, "--wait=false", check=False)
        controlplane.kubectl("delete", "pv", *pvs, "--wait=false", check=False)


def test_restart_resumes_without_duplicating_children(controlplane, operator, opns):
    controlplane.kubectl("apply", "-n", opns, "-f", "-", input=infd_yaml("resume"))
    wait_ready(controlplane, "resume", opns, operator)
    before = {k: [(i["metadata"]["uid"], i["metadata"]["resourceVersion"]) for i in v]
              for k, v in children(controlplane, "resume", opns).items()}
    operator.stop()
    controlplane.kubectl("patch", "infd", "resume", "-n", opns, "--type=merge", "-p",
                         '{"spec":{"engine":{"maxNumSeqs":77}}}')
    operator.start()
    eventually(lambda: "max_num_seqs: 77" in get(controlplane, "configmap", "resume-engine", opns)["data"]["engine.yaml"],
               what="the change made while the operator was down")
    wait_ready(controlplane, "resume", opns, operator)
    after = {k: [(i["metadata"]["uid"], i["metadata"]["resourceVersion"]) for i in v]
             for k, v in children(controlplane, "resume", opns).items()}
    assert [len(v) for v in after.values()] == [1, 1, 1]
    assert after["deployments"] == before["deployments"]  # same object, not even rewritten
    assert after["services"] == before["services"]
    assert after["configmaps"][0][0] == before["configmaps"][0][0]  # same ConfigMap, new content


def test_delete_removes_children(controlplane, operator, opns):
    controlplane.kubectl("apply", "-n", opns, "-f", "-", input=infd_yaml("gone"))
    wait_ready(controlplane, "gone", opns, operator)
    controlplane.kubectl("delete", "infd", "gone", "-n", opns, "--wait=true", "--timeout=60s")
    eventually(lambda: not any(children(controlplane, "gone", opns).values()), timeout=60,
               what="garbage collection of the children")
    assert controlplane.kubectl_json("get", "pods", "-n", opns, "-l", SELECTOR.format("gone"), "-o", "json")["items"] == [] \
        or eventually(lambda: controlplane.kubectl_json("get", "pods", "-n", opns, "-l", SELECTOR.format("gone"),
                                                        "-o", "json")["items"] == [], what="pods to go")


# -- in a shared cluster (issue 23): adopt nothing, policy before pods, the admin key -------------------

def events_of(controlplane, ns: str, name: str, reason: str) -> list[dict]:
    return controlplane.kubectl_json("get", "events", "-n", ns, "--field-selector",
                                     f"involvedObject.name={name},involvedObject.kind=InferenceDeployment,"
                                     f"reason={reason}", "-o", "json")["items"]


def test_a_users_objects_of_its_names_are_never_adopted(controlplane, operator, opns):
    """A NetworkPolicy and a ConfigMap of the user's under the names an InferenceDeployment "mine"
    takes: the operator leaves both alone, runs no engine pods, says why, and deleting the
    InferenceDeployment deletes neither."""
    controlplane.kubectl("apply", "-n", opns, "-f", "-", input=yaml.safe_dump_all([
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "mine"},
         "spec": {"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"]}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "mine-engine"}, "data": {"owner": "me"}}]))
    theirs = {k: get(controlplane, k, n, opns) for k, n in (("networkpolicy", "mine"), ("configmap", "mine-engine"))}
    controlplane.kubectl("apply", "-n", opns, "-f", "-", input=infd_yaml("mine"))

    def refused():
        c = condition(get(controlplane, "infd", "mine", opns), "Degraded")
        return c if c.get("reason") == "ChildNotOwned" else None
    deg = eventually(refused, timeout=60, what="Degraded ChildNotOwned")
    assert deg["status"] == "True" and "NetworkPolicy mine" in deg["message"] and "ConfigMap mine-engine" in deg["message"]
    warnings = eventually(lambda: events_of(controlplane, opns, "mine", "ChildNotOwned"), what="a ChildNotOwned event")
    assert warnings[0]["type"] == "Warning" and "NetworkPolicy mine" in warnings[0]["message"]
    time.sleep(3)  # a few refreshes (1 s apart): still nothing written, no engine pods
    for kind, obj in theirs.items():
        now = controlplane.kubectl_json("get", kind, obj["metadata"]["name"], "-n", opns, "-o", "json",
                                        "--show-managed-fields")
        assert now["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"], kind
        assert "ownerReferences" not in now["metadata"], kind
        assert not [m for m in now["metadata"].get("managedFields") or [] if m["manager"] == "kvtune-operator"]
    assert controlplane.kubectl("get", "deployment", "mine", "-n", opns, check=False).returncode != 0
    assert condition(get(controlplane, "infd", "mine", opns), "Ready")["status"] == "False"
    assert len(events_of(controlplane, opns, "mine", "ChildNotOwned")) == 1  # told once, not every refresh

    controlplane.kubectl("delete", "infd", "mine", "-n", opns, "--wait=true", "--timeout=60s")
    time.sleep(2)  # the garbage collector had its chance
    for kind, obj in theirs.items():
        assert get(controlplane, kind, obj["metadata"]["name"], opns)["metadata"]["uid"] == obj["metadata"]["uid"]


def test_the_network_policy_is_in_place_before_the_engine_pods(controlplane, crd, tmp_path):
    """ResourceQuotas that refuse NetworkPolicies and Services: no Deployment, a condition says why.
    NetworkPolicies allowed again: the policy and then the Deployment are there, only the Service
    is missing (before, the first refused apply stopped the rest, after the Deployment: a quota on
    Services left the engine pods running without their NetworkPolicy)."""
    ns = _make_namespace(controlplane, "op-quota")
    op = OperatorProcess(controlplane.subprocess_env(), [ns], tmp_path / "operator.log").start()

    def quota(name: str, resource: str) -> None:
        controlplane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump({
            "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": name},
            "spec": {"hard": {resource: "0"}}}))
        eventually(lambda: (get(controlplane, "resourcequota", name, ns).get("status") or {}).get("hard"),
                   what=f"quota {name} to be enforced")
    try:
        quota("no-policies", "count/networkpolicies.networking.k8s.io")
        quota("no-services", "services")
        controlplane.kubectl("apply", "-n", ns, "-f", "-", input=infd_yaml("fenced"))

        def held_back():
            c = condition(get(controlplane, "infd", "fenced", ns), "Degraded")
            return c if c.get("reason") == "ApplyFailed" and "NetworkPolicy fenced" in c.get("message", "") else None
        deg = eventually(held_back, timeout=60, what="Degraded: the NetworkPolicy refused")
        assert "Deployment fenced not applied" in deg["message"], deg
        time.sleep(3)  # retries and refreshes: still no engine pods without their policy
        assert controlplane.kubectl("get", "deployment", "fenced", "-n", ns, check=False).returncode != 0

        controlplane.kubectl("delete", "resourcequota", "no-policies", "-n", ns)
        dep = eventually(lambda: get(controlplane, "deployment", "fenced", ns), timeout=60,
                         what="the Deployment once its NetworkPolicy can exist")
        np = get(controlplane, "networkpolicy", "fenced", ns)
        assert np["metadata"]["ownerReferences"][0]["name"] == "fenced"
        assert np["spec"]["podSelector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        assert controlplane.kubectl("get", "service", "fenced", "-n", ns, check=False).returncode != 0
        eventually(lambda: "Service fenced" in condition(get(controlplane, "infd", "fenced", ns), "Degraded")
                   .get("message", ""), what="Degraded to name the refused Service")
    finally:
        op.stop()
        controlplane.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_secret_deleted_between_the_read_and_the_write_is_not_created_again_with_the_old_key(controlplane, crd):
    """The race behind the test below, made certain on the real apiserver: a reconcile (in this
    process, on a namespace no operator watches) reads the admin-key Secret, the user deletes it, then
    the reconcile writes. A server-side apply would create it again with the old key whatever
    resourceVersion it carried (a CI run saw exactly that); the Secret read is written back only onto
    itself, so the write fails, nothing is created, and the next pass makes a new key."""
    kube = Kube(controlplane.api_client())
    rec = Reconciler(kube, Settings.from_env({}))
    ns = _make_namespace(controlplane, "keyrace")
    try:
        controlplane.kubectl("apply", "-n", ns, "-f", "-", input=infd_yaml("raced"))
        rec.reconcile(ns, "raced")
        old_key = admin_key(controlplane, ns, "raced")
        read = kube.get

        def read_then_delete(api_version, kind, namespace, name):
            out = read(api_version, kind, namespace, name)
            if kind == "Secret":  # the user's kubectl delete, just after the reconcile's read
                controlplane.kubectl("delete", "secret", name, "-n", namespace)
            return out
        kube.get = read_then_delete
        rec.reconcile(ns, "raced")
        kube.get = read
        gone = controlplane.kubectl("get", "secret", "raced-admin-key", "-n", ns, check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr, gone.stdout
        rec.reconcile(ns, "raced")
        assert admin_key(controlplane, ns, "raced") != old_key
    finally:
        controlplane.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_refresh_sends_only_what_changed_and_undoes_a_users_edit(controlplane, crd):
    """Every refresh renders every child; on the real apiserver a reconcile with nothing changed
    sends no write (a fleet's refreshes would otherwise cost six server-side applies per deployment
    every statusInterval), while a child somebody edited is applied again and its edit of our fields
    undone, and a spec change reaches its child. Run in this process on a namespace no operator
    watches; the Deployment's status moves while its controller works on it, so a quiet reconcile is
    waited for, then every later one must be quiet."""
    kube = Kube(controlplane.api_client())
    rec = Reconciler(kube, Settings.from_env({}))
    sent: list[str] = []
    apply, update_if_current = kube.apply, kube.update_if_current
    kube.apply = lambda obj: sent.append(obj["kind"]) or apply(obj)
    kube.update_if_current = lambda obj, rv: sent.append(obj["kind"]) or update_if_current(obj, rv)
    ns = _make_namespace(controlplane, "refresh")

    def sends() -> list[str]:
        sent.clear()
        rec.reconcile(ns, "steady")
        return sorted(sent)
    try:
        controlplane.kubectl("apply", "-n", ns, "-f", "-", input=infd_yaml("steady"))
        assert {"ConfigMap", "Deployment", "NetworkPolicy", "Secret", "Service"} <= set(sends())
        eventually(lambda: sends() == [], timeout=30, what="a reconcile that sends nothing")
        assert sends() == [] and sends() == []
        engine_yaml = get(controlplane, "configmap", "steady-engine", ns)["data"]["engine.yaml"]
        controlplane.kubectl("patch", "configmap", "steady-engine", "-n", ns, "--type", "merge",
                             "-p", json.dumps({"data": {"engine.yaml": "max_num_seqs: 1\n"}}))
        assert sends() == ["ConfigMap"]
        assert get(controlplane, "configmap", "steady-engine", ns)["data"]["engine.yaml"] == engine_yaml
        controlplane.kubectl("label", "service", "steady", "-n", ns, "kvtune.io/inference-deployment=other",
                             "--overwrite")
        assert sends() == ["Service"]
        assert get(controlplane, "service", "steady", ns)["metadata"]["labels"][
            "kvtune.io/inference-deployment"] == "steady"
        controlplane.kubectl("patch", "infd", "steady", "-n", ns, "--type", "merge",
                             "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 24}}}))
        assert "ConfigMap" in sends()
        assert "max_num_seqs: 24" in get(controlplane, "configmap", "steady-engine", ns)["data"]["engine.yaml"]
        rec.applied.check()
    finally:
        controlplane.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_deleted_admin_key_secret_brings_pods_and_operator_to_one_key(controlplane, operator, opns, pod_node):
    """The engine reads its admin key from the Secret when it starts. Delete the Secret: the operator
    makes a new key, and the running pods are replaced by pods that hold it (before, they kept the
    old key until something restarted them, and the operator's admin reads were refused)."""
    controlplane.kubectl("apply", "-n", opns, "-f", "-", input=infd_yaml("keyed"))
    wait_ready(controlplane, "keyed", opns, operator)
    old_key = admin_key(controlplane, opns, "keyed")

    def pod_keys() -> set[str] | None:
        """The admin key each Ready engine process of "keyed" runs with (None while a rollout is on)."""
        pods = controlplane.kubectl_json("get", "pods", "-n", opns, "-l", SELECTOR.format("keyed"), "-o", "json")["items"]
        if len(pods) != 1 or pods[0]["metadata"].get("deletionTimestamp"):
            return None
        local = pod_node.get(opns, pods[0]["metadata"]["name"])
        return {local.env.get("KVTUNE_ADMIN_KEY")} if local is not None and local.ready else None
    assert eventually(pod_keys, what="the engine pod") == {old_key}

    controlplane.kubectl("delete", "secret", "keyed-admin-key", "-n", opns)
    new_key = eventually(lambda: (k := admin_key(controlplane, opns, "keyed")) != old_key and k,
                         timeout=30, what="a new admin key")
    eventually(lambda: pod_keys() == {new_key}, timeout=90,
               what="the engine pods to run with the new admin key")
    wait_ready(controlplane, "keyed", opns, operator)
    assert admin_key(controlplane, opns, "keyed") == new_key  # stable: not regenerated again
    eventually(lambda: events_of(controlplane, opns, "keyed", "AdminKeyRecreated"), timeout=30,
               what="an AdminKeyRecreated event")


# -- the chart, and its RBAC being enough -------------------------------------------------------------

def test_helm_install_and_least_privilege_rbac(controlplane, crd, tmp_path):
    system = _make_namespace(controlplane, "kvtune-sys")
    watched = _make_namespace(controlplane, "kvtune-app")
    release = "kvt"
    op = None
    try:
        controlplane.helm("install", release, str(ROOT / "charts" / "kvtune"), "-n", system,
                          "--set", f"watchNamespaces={{{watched}}}", "--wait=false")
        sa = controlplane.kubectl_json("get", "serviceaccount", "-n", system, "-l",
                                       f"app.kubernetes.io/instance={release}", "-o", "json")["items"]
        assert len(sa) == 1
        sa_name = sa[0]["metadata"]["name"]
        dep = get(controlplane, "deployment", sa_name, system)
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["kvtune", "operator", "run"]
        assert {"name": "KVTUNE_NAMESPACES", "value": watched} in c["env"]
        role = get(controlplane, "role", sa_name, watched)
        assert role["rules"] and get(controlplane, "rolebinding", sa_name, watched)
        # The chart's ServiceAccount may do what the operator does in the watched namespace, nothing more
        who = f"system:serviceaccount:{system}:{sa_name}"
        can = lambda *a: controlplane.kubectl("auth", "can-i", *a, "--as", who, check=False).stdout.strip()  # noqa: E731
        assert can("patch", "deployments", "-n", watched) == "yes"
        assert can("patch", "inferencedeployments.kvtune.io/status", "-n", watched) == "yes"
        assert can("delete", "deployments", "-n", watched) == "no"
        # the admin-key Secrets it owns: it reads and creates them by name, it never lists or deletes any
        assert can("get", "secrets", "-n", watched) == "yes"
        assert can("list", "secrets", "-n", watched) == "no"
        assert can("delete", "secrets", "-n", watched) == "no"
        assert can("patch", "deployments", "-n", system) == "no"
        # nothing outside the watched namespace: no Secret of kube-system (nor of any other namespace)
        assert can("get", "secrets", "-n", "kube-system") == "no"
        assert can("patch", "secrets", "-n", "kube-system") == "no"
        assert can("list", "secrets", "--all-namespaces") == "no"
        # the chart's defaults (no watchNamespaces) watch the release's own namespace: still no Secret of
        # kube-system, no Deployment elsewhere; cluster-wide only as the explicit rbac.clusterWide
        dflt = _make_namespace(controlplane, "kvtune-dflt")
        try:
            controlplane.helm("install", "kvd", str(ROOT / "charts" / "kvtune"), "-n", dflt, "--wait=false")
            dsa = controlplane.kubectl_json("get", "serviceaccount", "-n", dflt, "-l",
                                            "app.kubernetes.io/instance=kvd", "-o", "json")["items"][0]["metadata"]["name"]
            dwho = f"system:serviceaccount:{dflt}:{dsa}"
            dcan = lambda *a: controlplane.kubectl("auth", "can-i", *a, "--as", dwho, check=False).stdout.strip()  # noqa: E731
            assert dcan("get", "secrets", "-n", "kube-system") == "no"
            assert dcan("create", "secrets", "-n", "kube-system") == "no"
            assert dcan("get", "secrets", "-n", watched) == "no" and dcan("patch", "deployments", "-n", watched) == "no"
            assert dcan("patch", "deployments", "-n", dflt) == "yes"
            # cluster-wide only get on persistentvolumes (to refuse a claim bound to a node directory)
            (crb,) = controlplane.kubectl_json("get", "clusterrolebindings", "-l", "app.kubernetes.io/instance=kvd",
                                               "-o", "json")["items"]
            assert controlplane.kubectl_json("get", "clusterrole", crb["roleRef"]["name"], "-o", "json")["rules"] == [
                {"apiGroups": [""], "resources": ["persistentvolumes"], "verbs": ["get"]}]
            assert dcan("get", "persistentvolumes") == "yes" and dcan("list", "persistentvolumes") == "no"
        finally:
            controlplane.helm("uninstall", "kvd", "-n", dflt, check=False)
            controlplane.kubectl("delete", "namespace", dflt, "--wait=false", check=False)
        # a node directory as the model volume: the apiserver refuses it (allowHostPath is false)
        host_path = infd_yaml("hostpath", model={"path": "/models/m",
                                                 "volume": {"hostPath": {"path": "/etc"}, "mountPath": "/models"}})

        def refused():
            r = controlplane.kubectl("apply", "--dry-run=server", "-n", watched, "-f", "-", input=host_path, check=False)
            return r.returncode != 0 and r.stderr
        err = eventually(refused, what="the chart's admission policy to refuse a hostPath model volume")
        assert "spec.model.volume.hostPath is not allowed" in err and "allowHostPath" in err, err
        pvc = infd_yaml("pvc", model={"path": "/models/m",
                                      "volume": {"persistentVolumeClaim": {"claimName": "w"}, "mountPath": "/models"}})
        controlplane.kubectl("apply", "--dry-run=server", "-n", watched, "-f", "-", input=pvc)  # a claim is fine
        # ... and that is enough: the operator, running with the ServiceAccount's token, reconciles fully.
        token = controlplane.kubectl("create", "token", sa_name, "-n", system, "--duration=1h").stdout.strip()
        kubeconfig = tmp_path / "sa.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "sa",
            "clusters": [{"name": "c", "cluster": {"server": controlplane.server,
                                                   "certificate-authority": str(controlplane.ca_file)}}],
            "users": [{"name": "sa", "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa", "namespace": watched}}]}))
        env = {k: v for k, v in controlplane.subprocess_env().items() if k != "KUBECONFIG"}
        op = OperatorProcess(env, [watched], tmp_path / "sa-operator.log", kubeconfig=str(kubeconfig)).start()
        controlplane.kubectl("apply", "-n", watched, "-f", "-", input=infd_yaml(
            "rbac", model={"path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "absent"}}}))
        eventually(lambda: condition(get(controlplane, "infd", "rbac", watched), "Degraded").get("reason")
                   == "ModelVolumeMissing", what="the operator to reconcile with the chart's RBAC")
        controlplane.kubectl("patch", "infd", "rbac", "-n", watched, "--type=merge", "-p",
                             '{"spec":{"engine":{"maxNumSeqs":99}}}')
        eventually(lambda: "max_num_seqs: 99" in get(controlplane, "configmap", "rbac-engine", watched)["data"]["engine.yaml"],
                   what="an update with the chart's RBAC")
        assert [e["reason"] for e in controlplane.kubectl_json(
            "get", "events", "-n", watched, "--field-selector", "involvedObject.name=rbac", "-o", "json")["items"]]
        log = op.tail(400)
        assert "403" not in log and "Forbidden" not in log, log
        notes = controlplane.helm("status", release, "-n", system).stdout
        assert "kubectl get infd" in notes
    finally:
        if op:
            op.stop()
        controlplane.helm("uninstall", release, "-n", system, check=False)
        for ns in (system, watched):
            controlplane.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# -- a real engine in the pod: the ConfigMap contract ------------------------------------------------

def test_engine_pod_applies_live_knobs(controlplane, crd, pod_node, tmp_path_factory):
    """The pod node runs the rendered container command: the engine reads the operator's ConfigMap,
    and a live knob edited in spec.engine reaches the running engine without a restart."""
    # Not under /tmp: the engine pod mounts an emptyDir there, which the pod node maps to its own dir.
    model_root = Path(tempfile.mkdtemp(prefix="kvtune-model-", dir="/var/tmp"))
    model = model_root / "tiny"
    subprocess.run([str(Path(sys.executable).with_name("kvtune")), "make-tiny-model", str(model)], check=True,
                   capture_output=True, timeout=300)
    ns = _make_namespace(controlplane, "op-engine")
    op = OperatorProcess(controlplane.subprocess_env(), [ns],
                         tmp_path_factory.mktemp("operator-engine") / "operator.log").start()
    try:
        with pod_node.restricted_to(ns):  # this test's engine only
            controlplane.kubectl("apply", "-n", ns, "-f", "-", input=infd_yaml(
                "live", model={"path": str(model), "servedModelName": "tiny"}, resources={"gpus": 0},
                engine={"maxNumSeqs": 8, "maxModelLen": 256, "maxNumBatchedTokens": 256, "kvCacheMemoryGiB": 0.01,
                        "swapSpaceGiB": 0}))
            labels = {"kvtune.io/inference-deployment": "live"}

            def started():
                pods = [p for p in pod_node.pods.values() if p.namespace == ns]
                for p in pods:
                    assert p.returncode is None, f"engine exited {p.returncode}:\n{p.log_path.read_text()[-3000:]}"
                return pod_node.wait_for_selector(ns, labels, count=1, timeout=1) if pods else None
            local = eventually(started, timeout=180, interval=1, what="the engine pod's process to listen")[0]
            url, admin = local.url, local.admin_url
            assert admin != url  # the pod's admin port (8001) is a port of its own

            key = admin_key(controlplane, ns, "live")
            # the admin API and /metrics on the admin port only, the OpenAI API on its port only
            assert httpx.get(f"{url}/kvtune/v1/config", headers={"Authorization": f"Bearer {key}"}).status_code == 404
            assert httpx.get(f"{url}/metrics").status_code == 404 and httpx.get(f"{admin}/v1/models").status_code == 404

            def config():
                req = urllib.request.Request(f"{admin}/kvtune/v1/config", headers={"Authorization": f"Bearer {key}"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    return json.loads(r.read())["config"]
            assert eventually(lambda: config()["max_num_seqs"] == 8, timeout=60, what="the engine to run maxNumSeqs 8")
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                assert json.loads(r.read())["data"][0]["id"] == "tiny"
            controlplane.kubectl("patch", "infd", "live", "-n", ns, "--type=merge", "-p",
                                 '{"spec":{"engine":{"maxNumSeqs":4}}}')
            eventually(lambda: config()["max_num_seqs"] == 4, timeout=60, what="the live knob to reach the engine")
            assert pod_node.wait_for_selector(ns, labels, count=1)[0] is local and local.alive()  # no restart
            # the pod is Ready (its engine answers /health), never restarted; the resource says so
            wait_ready(controlplane, "live", ns, op)
            pod = get(controlplane, "pod", local.name, ns)
            assert condition(pod, "Ready")["status"] == "True"
            assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    finally:
        op.stop()
        controlplane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        shutil.rmtree(model_root, ignore_errors=True)
