"""Rendering the children, and the restart hash: only restart knobs roll the pods."""
from __future__ import annotations

import copy

import pytest
import yaml

from kvtune_engine.config import LIVE_KNOBS, RESTART_KNOBS, EngineConfig
from kvtune_operator import render as r
from kvtune_operator.model import InferenceDeployment
from tests.infd import infd_body

CHANGES = {  # one valid new value per knob
    "block_size": 32, "gpu_memory_utilization": 0.8, "swap_space": 8.0, "kv_cache_memory": 0.05,
    "max_model_len": 4096, "max_num_seqs": 160, "max_num_batched_tokens": 4096, "watermark": 0.02,
    "enable_prefix_caching": False, "enable_chunked_prefill": False, "profile_batched_tokens": 16384,
}


def infd(**spec) -> InferenceDeployment:
    return InferenceDeployment.from_body(infd_body("qwen", namespace="llm", uid="uid-1", generation=1, **spec))


def children(resource: InferenceDeployment | None = None, config: EngineConfig | None = None, **kw):
    out = r.render_children(resource or infd(), config or EngineConfig(), image=kw.pop("image", "img:1"),
                            pod_monitor=kw.pop("pod_monitor", True))
    return {c["kind"]: c for c in out}


def test_every_knob_is_live_or_restart():
    assert set(CHANGES) == set(EngineConfig.model_fields) == LIVE_KNOBS | RESTART_KNOBS
    assert not LIVE_KNOBS & RESTART_KNOBS


@pytest.mark.parametrize("knob", sorted(CHANGES))
def test_restart_hash_changes_only_for_restart_knobs(knob):
    base = EngineConfig(max_num_batched_tokens=8192, max_model_len=8192)
    changed = base.with_changes(**{knob: CHANGES[knob]}) if knob != "enable_chunked_prefill" \
        else base.with_changes(enable_chunked_prefill=False)
    assert (r.restart_hash(changed) != r.restart_hash(base)) == (knob in RESTART_KNOBS)
    a, b = children(config=base), children(config=changed)
    # the ConfigMap always carries the change; the pod template changes only for restart knobs
    assert a["ConfigMap"] != b["ConfigMap"]
    assert (a["Deployment"]["spec"]["template"] != b["Deployment"]["spec"]["template"]) == (knob in RESTART_KNOBS)
    if knob in RESTART_KNOBS:  # and then only through the hash annotation
        ta, tb = copy.deepcopy(a["Deployment"]["spec"]["template"]), copy.deepcopy(b["Deployment"]["spec"]["template"])
        del ta["metadata"]["annotations"][r.ANNOTATION_RESTART_HASH], tb["metadata"]["annotations"][r.ANNOTATION_RESTART_HASH]
        assert ta == tb


def test_configmap_holds_every_knob_as_engine_config():
    cfg = EngineConfig(max_num_seqs=64, block_size=32)
    cm = children(config=cfg)["ConfigMap"]
    assert cm["metadata"]["name"] == "qwen-engine"
    loaded = yaml.safe_load(cm["data"]["engine.yaml"])
    # max_model_len unset in the spec is left to the engine (the model's context length)
    assert set(loaded) == set(EngineConfig.model_fields) - {"max_model_len"}
    assert EngineConfig.model_validate(loaded) == cfg
    set_len = children(infd(engine={"maxModelLen": 2048}), cfg.with_changes(max_model_len=2048))["ConfigMap"]
    assert yaml.safe_load(set_len["data"]["engine.yaml"])["max_model_len"] == 2048


def test_deployment_contract_with_the_engine():
    resource = infd(extraArgs=["--device", "cpu"], model={"path": "/models/qwen", "servedModelName": "q"},
                    env=[{"name": "FOO", "value": "1"}, {"name": "HOME", "value": "/tmp/home"}])
    dep = children(resource)["Deployment"]
    pod = dep["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["kvtune", "serve"]
    assert c["args"] == ["--model", "/models/qwen", "--served-model-name", "q", "--host", "0.0.0.0",
                         "--port", "8000", "--admin-port", "8001", "--config-file", "/etc/kvtune/engine.yaml",
                         "--shutdown-timeout", "50", "--device", "cuda", "--device", "cpu"]
    # the API on 8000; /metrics and the admin API on 8001, which Prometheus scrapes
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                          {"name": "admin", "containerPort": 8001, "protocol": "TCP"}]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == "8001" and ann["prometheus.io/path"] == "/metrics"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["FOO"] == "1" and env["HOME"] == "/tmp/home" and len(env) == len(c["env"])
    # the admin key comes from the operator's Secret, never as a plain value
    assert env["KVTUNE_ADMIN_KEY"] == {"secretKeyRef": {"name": "qwen-admin-key", "key": "admin-key"}}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["engine-config"] == {"name": "engine-config", "mountPath": "/etc/kvtune", "readOnly": True}
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["engine-config"]["configMap"]["name"] == "qwen-engine"
    labels = pod["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "kvtune-engine"
    assert labels["app.kubernetes.io/instance"] == "qwen"
    assert labels["kvtune.io/inference-deployment"] == "qwen"
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_deployment_is_locked_down():
    dep = children()["Deployment"]
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    assert spec["automountServiceAccountToken"] is False
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/dev/shm"}


def test_gpu_and_memory_resources():
    dep = children(infd(resources={"gpus": 2, "memory": "48Gi", "cpu": "8"}))["Deployment"]
    res = dep["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res == {"limits": {"nvidia.com/gpu": 2, "memory": "48Gi"}, "requests": {"memory": "48Gi", "cpu": "8"}}
    cpu_only = children(infd(resources={"gpus": 0}))["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert cpu_only["resources"] == {} and cpu_only["args"][-2:] == ["--device", "cpu"]


def test_model_from_pvc_or_hostpath():
    pvc = children(infd(model={"path": "/models/qwen", "volume": {"persistentVolumeClaim": {"claimName": "w"}}}))
    spec = pvc["Deployment"]["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "w", "readOnly": True}} in spec["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in spec["containers"][0]["volumeMounts"]
    host = children(infd(model={"path": "/w/qwen", "volume": {"hostPath": {"path": "/srv/w"}, "mountPath": "/w",
                                                              "subPath": "v1"}}))
    spec = host["Deployment"]["spec"]["template"]["spec"]
    assert {"name": "model", "hostPath": {"path": "/srv/w", "type": "Directory"}} in spec["volumes"]
    assert {"name": "model", "mountPath": "/w", "readOnly": True, "subPath": "v1"} in spec["containers"][0]["volumeMounts"]
    none = children()["Deployment"]["spec"]["template"]["spec"]
    assert "model" not in {v["name"] for v in none["volumes"]}


def test_scheduling_and_replicas():
    dep = children(infd(replicas=3, nodeSelector={"gpu": "h100"},
                        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]))["Deployment"]
    assert dep["spec"]["replicas"] == 3
    spec = dep["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu": "h100"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_children_are_owned_and_named():
    out = children()
    assert list(out) == ["ConfigMap", "Deployment", "Service", "NetworkPolicy", "PodMonitor"]
    for child in out.values():
        assert child["metadata"]["namespace"] == "llm"
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "kvtune.io/v1alpha1", "kind": "InferenceDeployment", "name": "qwen", "uid": "uid-1",
            "controller": True, "blockOwnerDeletion": True}]
    svc = out["Service"]["spec"]
    assert svc["ports"][0]["port"] == 8000 and svc["ports"][0]["targetPort"] == "http"
    assert svc["selector"] == r.selector_labels("qwen")
    pm = out["PodMonitor"]["spec"]
    assert pm["selector"]["matchLabels"] == r.selector_labels("qwen")
    assert pm["podMetricsEndpoints"][0]["relabelings"][0]["targetLabel"] == "inference_deployment"
    assert pm["podMetricsEndpoints"][0]["port"] == "admin" and pm["podMetricsEndpoints"][0]["path"] == "/metrics"
    assert [p["port"] for p in svc["ports"]] == [8000]  # the Service carries the API only
    assert "PodMonitor" not in children(pod_monitor=False)


def test_values_cannot_break_the_yaml():
    nasty = 'a: b\n- "c" {{ x }} #'
    out = children(infd(extraArgs=[nasty], env=[{"name": "X", "value": nasty}]), image="img:1 # x")
    c = out["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][-1] == nasty and {"name": "X", "value": nasty} in c["env"] and c["image"] == "img:1 # x"


def test_selector_string():
    assert r.selector_string("qwen") == "app.kubernetes.io/instance=qwen,app.kubernetes.io/name=kvtune-engine"
