"""One reconcile against an in-memory fake of `Kube`: apply, idempotence, events, status, errors."""
from __future__ import annotations

import copy
import json

from kvtune_operator.conditions import Cond, get_condition
from kvtune_operator.kube import API_CALLS, CLUSTER_API_CALLS, KubeError
from kvtune_operator.reconcile import EventSpec, Reconciler
from kvtune_operator.render import ANNOTATION_RESTART_HASH
from kvtune_operator.settings import Settings


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch, as the apiserver applies it to the status subresource."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class FakeKube:
    """Objects keyed by (apiVersion, kind, namespace, name); a resourceVersion bump only on change."""

    def __init__(self, podmonitor: bool = False):
        self.objects: dict[tuple, dict] = {}
        self.events: list[tuple[str, str, str]] = []
        self.pvcs: set[tuple[str, str]] = set()
        self.bound: dict[tuple[str, str], str] = {}  # claim -> the PersistentVolume it is bound to
        self.pvs: dict[str, dict] = {}  # PersistentVolumes (cluster-scoped) by name
        self.pv_forbidden = False
        self.pods: list[dict] = []
        self.podmonitor = podmonitor
        self.fail_kind: str | None = None
        self.rv = 0
        self.calls: list[tuple[str, str]] = []
        self.hpas: list[dict] = []
        self.scaled: list[int] = []

    def _bump(self) -> str:
        self.rv += 1
        return str(self.rv)

    def add_infd(self, spec: dict, name="qwen", namespace="llm") -> None:
        self.objects[("kvtune.io/v1alpha1", "InferenceDeployment", namespace, name)] = {
            "apiVersion": "kvtune.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": namespace, "uid": "uid-1", "generation": 1,
                         "resourceVersion": self._bump()},
            "spec": spec, "status": {}}

    def infd(self, name="qwen", namespace="llm") -> dict:
        return self.objects[("kvtune.io/v1alpha1", "InferenceDeployment", namespace, name)]

    def edit_spec(self, **changes) -> None:
        obj = self.infd()
        for path, value in changes.items():
            node = obj["spec"]
            *parents, leaf = path.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        obj["metadata"]["generation"] += 1

    # -- the Kube interface ----------------------------------------------------------------------
    def get_infd(self, namespace, name):
        self.calls.append(("kvtune.io/inferencedeployments", "get"))
        obj = self.objects.get(("kvtune.io/v1alpha1", "InferenceDeployment", namespace, name))
        return copy.deepcopy(obj)

    def patch_infd_status(self, namespace, name, status):
        self.calls.append(("kvtune.io/inferencedeployments/status", "patch"))
        obj = self.infd(name, namespace)
        obj["status"] = merge_patch(obj.get("status") or {}, json.loads(json.dumps(status)))
        return obj

    def get(self, api_version, kind, namespace, name):
        self.calls.append((kind, "get"))
        return copy.deepcopy(self.objects.get((api_version, kind, namespace, name)))

    def apply(self, obj):
        self.calls.append((obj["kind"], "patch"))
        if obj["kind"] == self.fail_kind:
            raise KubeError("admission webhook denied the request", 422)
        key = (obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        old = self.objects.get(key)
        # as the apiserver: a resourceVersion is a precondition on an object that exists; one that does
        # not is created, whatever resourceVersion the apply carries (checked on a v1.36 kube-apiserver)
        want_rv = obj["metadata"].get("resourceVersion")
        if want_rv is not None and old is not None and old["metadata"]["resourceVersion"] != want_rv:
            raise KubeError(f"Operation cannot be fulfilled on {obj['kind']} {obj['metadata']['name']}: "
                            "the object has been modified", 409)
        new = copy.deepcopy(obj)
        new.setdefault("status", (old or {}).get("status", {}))
        strip = lambda o: {k: v for k, v in o.items() if k not in ("status",)} | {  # noqa: E731
            "metadata": {k: v for k, v in o["metadata"].items() if k not in ("resourceVersion", "generation")}}
        if old is not None and strip(old) == strip(new):
            return copy.deepcopy(old)
        gen = (old or {}).get("metadata", {}).get("generation", 0)
        if old is None or old.get("spec") != new.get("spec"):
            gen += 1
        new["metadata"]["generation"] = gen
        new["metadata"]["resourceVersion"] = self._bump()
        self.objects[key] = new
        return copy.deepcopy(new)

    def update_if_current(self, obj, resource_version):
        key = (obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key not in self.objects:
            self.calls.append((obj["kind"], "patch"))
            raise KubeError(f"{obj['kind']} {obj['metadata']['name']} is gone since it was read", 404)
        return self.apply({**obj, "metadata": {**obj["metadata"], "resourceVersion": resource_version}})

    def list_pods(self, namespace, label_selector):
        self.calls.append(("pods", "list"))
        return copy.deepcopy(self.pods)

    def patch_infd_scale(self, namespace, name, replicas):
        self.calls.append(("inferencedeployments/scale", "patch"))
        self.infd(name, namespace)["spec"]["replicas"] = replicas
        self.scaled.append(replicas)

    def autoscalers(self, namespace):
        self.calls.append(("horizontalpodautoscalers", "list"))
        return copy.deepcopy(self.hpas)

    def get_pvc(self, namespace, name):
        self.calls.append(("persistentvolumeclaims", "get"))
        if (namespace, name) not in self.pvcs:
            return None
        volume = self.bound.get((namespace, name))
        return {"metadata": {"name": name}, "spec": {"volumeName": volume} if volume else {}}

    def get_pv(self, name):
        self.calls.append(("persistentvolumes", "get"))
        if self.pv_forbidden:
            raise KubeError(f'persistentvolumes "{name}" is forbidden: cannot get resource "persistentvolumes" '
                            'at the cluster scope', 403)
        return copy.deepcopy(self.pvs.get(name))

    def add_claim(self, name, pv_source: dict | None, namespace="llm", pv="pv-1") -> None:
        """A claim; bound to PersistentVolume `pv` with source `pv_source` (None: unbound)."""
        self.pvcs.add((namespace, name))
        if pv_source is not None:
            self.bound[(namespace, name)] = pv
            self.pvs[pv] = {"metadata": {"name": pv}, "spec": {"capacity": {"storage": "1Gi"}, **pv_source}}

    def served(self, group, version, plural):
        return self.podmonitor

    def event(self, involved, type_, reason, message):
        self.calls.append(("events", "create"))
        self.events.append((type_, reason, message))

    # -- helpers -----------------------------------------------------------------------------------
    def child(self, kind, name="qwen"):
        return next(v for k, v in self.objects.items() if k[1] == kind and k[3] == name)

    def rollout(self, ready=None):
        """Play the Deployment controller: everything updated and ready."""
        d = self.child("Deployment")
        n = d["spec"]["replicas"]
        d["status"] = {"observedGeneration": d["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
                       "readyReplicas": n if ready is None else ready, "availableReplicas": n if ready is None else ready}


SPEC = {"model": {"path": "/models/qwen"}, "replicas": 1,
        "engine": {"blockSize": 16, "gpuMemoryUtilization": 0.9, "swapSpaceGiB": 4, "maxNumSeqs": 64,
                   "maxNumBatchedTokens": 8192, "maxModelLen": 8192, "watermark": 0.01,
                   "enablePrefixCaching": True, "enableChunkedPrefill": True},
        "autotune": {"mode": "Apply"}}


def setup(**kw):
    kube = FakeKube(**kw)
    kube.add_infd(copy.deepcopy(SPEC))
    return kube, Reconciler(kube, Settings.from_env({}))


def reasons(kube):
    return [e[1] for e in kube.events]


def test_create_applies_children_and_writes_status():
    kube, rec = setup(podmonitor=True)
    out = rec.reconcile("llm", "qwen")
    assert out.retry is None
    assert {k[1] for k in kube.objects} == {"InferenceDeployment", "Secret", "ConfigMap", "Deployment", "Service",
                                            "NetworkPolicy", "PodMonitor"}
    assert reasons(kube).count("Created") == 6
    st = kube.infd()["status"]
    assert st["engine"]["maxNumSeqs"] == 64 and st["baseline"] == st["engine"]
    assert st["observedGeneration"] == 1 and st["replicaSummary"] == "0/1"
    assert st["selector"] == "app.kubernetes.io/instance=qwen,app.kubernetes.io/name=kvtune-engine"
    assert st["tuning"] == {"mode": "Apply", "phase": "Pending"}
    assert st["restartHash"] == kube.child("Deployment")["spec"]["template"]["metadata"]["annotations"][ANNOTATION_RESTART_HASH]
    types = [x["type"] for x in st["conditions"]]
    assert types == ["Ready", "Progressing", "MetricsAvailable", "Tuned", "Degraded"]
    assert get_condition(st["conditions"], "Degraded")["status"] == "False"


def test_second_reconcile_changes_nothing():
    kube, rec = setup()
    rec.reconcile("llm", "qwen")
    kube.rollout()
    rec.reconcile("llm", "qwen")  # Ready / RolloutComplete transitions
    before = copy.deepcopy({k: v for k, v in kube.objects.items() if k[1] != "InferenceDeployment"})
    n_events = len(kube.events)
    kube.calls.clear()
    out = rec.reconcile("llm", "qwen")
    assert out.events == [] and len(kube.events) == n_events
    assert ("kvtune.io/inferencedeployments/status", "patch") not in kube.calls  # nothing to write
    assert [call for call in kube.calls if call[1] == "patch"] == []  # no child sent again either
    assert {k: v for k, v in kube.objects.items() if k[1] != "InferenceDeployment"} == before
    assert get_condition(kube.infd()["status"]["conditions"], "Ready")["status"] == "True"
    rec.applied.check()


def test_a_child_edited_by_someone_else_is_applied_again_and_only_it():
    """Unchanged children are not sent again; one whose resourceVersion moved since our apply (a
    user's edit) is, and the edit of a field we own is undone."""
    kube, rec = setup()
    rec.reconcile("llm", "qwen")
    cm = kube.child("ConfigMap", "qwen-engine")
    rendered = cm["data"]["engine.yaml"]
    cm["data"]["engine.yaml"] = "max_num_seqs: 1\n"
    cm["metadata"]["resourceVersion"] = kube._bump()
    kube.calls.clear()
    rec.reconcile("llm", "qwen")
    assert [call for call in kube.calls if call[1] == "patch"] == [("ConfigMap", "patch")]
    assert kube.child("ConfigMap", "qwen-engine")["data"]["engine.yaml"] == rendered
    kube.objects = {k: v for k, v in kube.objects.items() if k[1] != "Service"}  # deleted by a user
    kube.calls.clear()
    rec.reconcile("llm", "qwen")
    assert [call for call in kube.calls if call[1] == "patch"] == [("Service", "patch")]
    assert kube.child("Service")
    rec.forget("llm", "qwen")
    assert len(rec.applied) == 0


def test_a_secret_deleted_mid_reconcile_is_not_written_back_with_the_old_key():
    """A user deletes the admin-key Secret to rotate the key while a reconcile runs, between its read of
    the Secret and its write: that write must not create the Secret again with the old key (pods and
    operator would agree on it, and the rotation would silently not happen). Server-side apply would
    create it, whatever resourceVersion it carried (the fake does as the apiserver does): the kept key is
    written only onto the Secret read; the next pass makes a new key and rolls the pods onto it."""
    kube, rec = setup()
    rec.reconcile("llm", "qwen")
    skey = ("v1", "Secret", "llm", "qwen-admin-key")
    old_key = kube.objects[skey]["stringData" if "stringData" in kube.objects[skey] else "data"]
    get = kube.get

    def get_then_delete(api_version, kind, namespace, name):
        out = get(api_version, kind, namespace, name)
        if kind == "Secret":
            kube.objects.pop(skey, None)  # the user's kubectl delete, just after the read
        return out
    kube.get = get_then_delete
    rec.reconcile("llm", "qwen")
    assert skey not in kube.objects  # not written back
    kube.get = get
    rec.reconcile("llm", "qwen")
    new_key = kube.objects[skey]["stringData" if "stringData" in kube.objects[skey] else "data"]
    assert new_key != old_key
    assert "AdminKeyRecreated" in reasons(kube)


def test_live_knob_changes_only_the_configmap():
    kube, rec = setup()
    rec.reconcile("llm", "qwen")
    kube.rollout()
    rec.reconcile("llm", "qwen")
    dep_rv = kube.child("Deployment")["metadata"]["resourceVersion"]
    cm_rv = kube.child("ConfigMap", "qwen-engine")["metadata"]["resourceVersion"]
    kube.edit_spec(**{"engine.maxNumSeqs": 160})
    out = rec.reconcile("llm", "qwen")
    assert kube.child("Deployment")["metadata"]["resourceVersion"] == dep_rv
    assert kube.child("ConfigMap", "qwen-engine")["metadata"]["resourceVersion"] != cm_rv
    assert "max_num_seqs: 160" in kube.child("ConfigMap", "qwen-engine")["data"]["engine.yaml"]
    assert [e.reason for e in out.events] == ["EngineConfigChanged"]
    assert "maxNumSeqs 64 -> 160" in out.events[0].message and "no restart" in out.events[0].message


def test_restart_knob_rolls_the_deployment():
    kube, rec = setup()
    rec.reconcile("llm", "qwen")
    kube.rollout()
    rec.reconcile("llm", "qwen")
    old_hash = kube.infd()["status"]["restartHash"]
    kube.edit_spec(**{"engine.blockSize": 32})
    out = rec.reconcile("llm", "qwen")
    tmpl = kube.child("Deployment")["spec"]["template"]
    assert tmpl["metadata"]["annotations"][ANNOTATION_RESTART_HASH] != old_hash
    assert [e.reason for e in out.events] == ["RollingRestart"]
    st = kube.infd()["status"]
    assert st["engine"]["blockSize"] == 32 and st["observedGeneration"] == 2
    prog = get_condition(st["conditions"], "Progressing")
    assert prog["status"] == "True" and "blockSize" in prog["message"]


def test_scale():
    kube, rec = setup()
    rec.reconcile("llm", "qwen")
    kube.edit_spec(replicas=3)
    out = rec.reconcile("llm", "qwen")
    assert kube.child("Deployment")["spec"]["replicas"] == 3
    assert [e.reason for e in out.events] == ["Scaled"]


def test_tuner_status_update_is_applied_and_kept():
    kube, rec = setup()
    rec.reconcile("llm", "qwen")
    status = kube.infd()["status"]
    tuned = {**status["engine"], "maxNumSeqs": 160}
    out = rec.reconcile("llm", "qwen", status_update={
        "engine": tuned, "tuning": {"phase": "Verifying"},
        "diagnosis": {"cause": "SequenceCap", "message": "64 of 64 running", "figures": {"kvUsagePercent": 26.0}}},
        conditions=[Cond("MetricsAvailable", "True", "SeriesFound", "ok")])
    assert "max_num_seqs: 160" in kube.child("ConfigMap", "qwen-engine")["data"]["engine.yaml"]
    assert "(tuned)" in out.events[0].message
    st = kube.infd()["status"]
    assert st["engine"]["maxNumSeqs"] == 160 and st["baseline"]["maxNumSeqs"] == 64
    assert st["tuning"] == {"mode": "Apply", "phase": "Verifying"} and st["diagnosis"]["cause"] == "SequenceCap"
    assert get_condition(st["conditions"], "MetricsAvailable")["reason"] == "SeriesFound"
    rec.reconcile("llm", "qwen")  # a later refresh keeps the tuned value and the tuner's conditions
    st = kube.infd()["status"]
    assert st["engine"]["maxNumSeqs"] == 160
    assert get_condition(st["conditions"], "MetricsAvailable")["reason"] == "SeriesFound"
    kube.edit_spec(**{"autotune.mode": "Off"})
    out = rec.reconcile("llm", "qwen")
    assert kube.infd()["status"]["engine"]["maxNumSeqs"] == 64
    assert kube.infd()["status"]["tuning"]["phase"] == "Off"
    assert get_condition(kube.infd()["status"]["conditions"], "Tuned")["reason"] == "AutotuneOff"


def test_apply_failure_is_degraded_and_retried():
    kube, rec = setup()
    kube.fail_kind = "Deployment"
    out = rec.reconcile("llm", "qwen")
    assert out.retry and "webhook denied" in out.retry
    st = kube.infd()["status"]
    deg = get_condition(st["conditions"], "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "ApplyFailed"
    assert "observedGeneration" not in st
    assert ("Warning", "ApplyFailed") in [(t, r) for t, r, _ in kube.events]
    kube.fail_kind = None
    out = rec.reconcile("llm", "qwen")
    assert out.retry is None and "Recovered" in reasons(kube)


def test_missing_pvc_is_degraded_until_it_exists():
    kube, rec = setup()
    kube.edit_spec(**{"model.volume": {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
                                       "mountPath": "/models"}})
    rec.reconcile("llm", "qwen")
    deg = get_condition(kube.infd()["status"]["conditions"], "Degraded")
    assert deg["reason"] == "ModelVolumeMissing" and "weights" in deg["message"]
    # no engine pods until the claim exists and its volume is checked (it could come bound to a node directory)
    assert not [k for k in kube.objects if k[1] == "Deployment"] and kube.child("ConfigMap", "qwen-engine")
    kube.add_claim("weights", {"csi": {"driver": "disk.example.com", "volumeHandle": "w-1"}})
    rec.reconcile("llm", "qwen")
    assert get_condition(kube.infd()["status"]["conditions"], "Degraded")["status"] == "False"
    assert kube.child("Deployment")


def test_crashing_engine_is_degraded_with_its_last_words():
    kube, rec = setup()
    kube.pods = [{"metadata": {"name": "qwen-1"}, "status": {"containerStatuses": [{
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
        "lastState": {"terminated": {"exitCode": 1, "message": "error: model path /models/qwen does not exist"}}}]}}]
    rec.reconcile("llm", "qwen")
    deg = get_condition(kube.infd()["status"]["conditions"], "Degraded")
    assert deg["reason"] == "EngineFailing" and "does not exist" in deg["message"]


def test_deleted_object_is_left_alone():
    kube, rec = setup()
    kube.infd()["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    assert rec.reconcile("llm", "qwen").gone
    assert rec.reconcile("llm", "other").gone
    assert [k for k in kube.objects if k[1] != "InferenceDeployment"] == []


def test_calls_are_covered_by_the_declared_rbac():
    kube, rec = setup(podmonitor=True)
    rec.reconcile("llm", "qwen")
    granted = {(res, verb) for (_, res), verbs in (API_CALLS | CLUSTER_API_CALLS).items() for verb in verbs}
    kinds = {"ConfigMap": "configmaps", "Deployment": "deployments", "Service": "services", "PodMonitor": "podmonitors",
             "Secret": "secrets", "NetworkPolicy": "networkpolicies",
             "kvtune.io/inferencedeployments": "inferencedeployments",
             "kvtune.io/inferencedeployments/status": "inferencedeployments/status"}
    for what, verb in set(kube.calls):
        assert (kinds.get(what, what), verb) in granted, (what, verb)


def test_unset_knob_leaves_status():
    kube, rec = setup()
    kube.edit_spec(**{"engine.kvCacheMemoryGiB": 0.05})
    rec.reconcile("llm", "qwen")
    assert kube.infd()["status"]["engine"]["kvCacheMemoryGiB"] == 0.05
    del kube.infd()["spec"]["engine"]["kvCacheMemoryGiB"]
    out = rec.reconcile("llm", "qwen")
    assert "kvCacheMemoryGiB" not in kube.infd()["status"]["engine"]
    assert "kvCacheMemoryGiB 0.05 -> unset" in out.events[0].message
    assert "kv_cache_memory: null" in kube.child("ConfigMap", "qwen-engine")["data"]["engine.yaml"]


def test_a_decision_whose_status_was_not_written_posts_no_event():
    """An apiserver that refuses the status patch (an outage): the tuner's decision did not happen,
    so its event is not posted either (the next tick decides again and posts it once)."""
    kube, rec = setup()
    rec.reconcile("llm", "qwen")

    def refuse(*a, **k):
        raise KubeError("connection refused", 503)

    kube.patch_infd_status = refuse
    tuner_event = EventSpec("Normal", "TuningApply", "maxNumSeqs 64 -> 160")
    out = rec.reconcile("llm", "qwen", status_update={"tuning": {"phase": "Verifying"}}, events=[tuner_event])
    assert out.retry and "status update failed" in out.retry
    assert "TuningApply" not in reasons(kube)


def test_an_unreachable_apiserver_is_a_kube_error_and_no_event_is_lost_or_doubled():
    """The real client against an address where nothing listens (an apiserver outage): every call is
    a KubeError the reconcile and the tuner already handle, and Kube.event never raises."""
    from kubernetes import client

    from kvtune_operator.kube import Kube

    cfg = client.Configuration()
    cfg.host = "http://127.0.0.1:9"
    cfg.retries = 0
    kube = Kube(client.ApiClient(cfg))
    try:
        kube.get_infd("llm", "qwen")
    except KubeError as e:
        assert "cannot reach the Kubernetes API" in str(e)
    else:
        raise AssertionError("no error from an unreachable apiserver")
    kube.event({"metadata": {"name": "qwen", "namespace": "llm"}}, "Normal", "TuningApply", "x")  # logs, no raise
