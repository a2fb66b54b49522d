"""Cluster side of issue 10: the admin key Secret, the NetworkPolicy, hostPath refusal, API keys from
Secrets, and the operator's own admin reads (against a real engine server with an admin key)."""
from __future__ import annotations

import copy

import httpx
from click.testing import CliRunner
from conftest_engine import run_server, tiny_llama  # noqa: F401  (fixture)
from test_operator_reconcile import SPEC, FakeKube

from kvtune_operator.conditions import get_condition
from kvtune_operator.reconcile import Reconciler, engine_admin_key
from kvtune_operator.render import admin_key_of
from kvtune_operator.settings import Settings
from kvtune_operator.volume_policy import claim_refusal
from tests.infd import infd_body


def reconciled(spec: dict | None = None, name: str = "qwen", **settings):
    kube = FakeKube()
    kube.add_infd(copy.deepcopy(spec or SPEC), name=name)
    rec = Reconciler(kube, Settings.from_env({}, **settings))
    rec.reconcile("llm", name)
    return kube, rec


def obj(kube, kind: str, name: str) -> dict:
    return next(v for (av, k, ns, n), v in kube.objects.items() if k == kind and n == name)


def test_admin_key_secret_is_random_per_resource_stable_and_fed_to_the_pods():
    kube, rec = reconciled()
    key = engine_admin_key(kube, "llm", "qwen")
    assert key and len(key) >= 32
    secret = obj(kube, "Secret", "qwen-admin-key")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    rec.reconcile("llm", "qwen")
    assert engine_admin_key(kube, "llm", "qwen") == key            # kept, not regenerated
    other, _ = reconciled(name="other")
    assert engine_admin_key(other, "llm", "other") != key           # one key per resource
    env = obj(kube, "Deployment", "qwen")["spec"]["template"]["spec"]["containers"][0]["env"]
    (admin,) = [e for e in env if e["name"] == "KVTUNE_ADMIN_KEY"]
    assert admin == {"name": "KVTUNE_ADMIN_KEY", "valueFrom": {"secretKeyRef": {"name": "qwen-admin-key",
                                                                                "key": "admin-key"}}}
    assert key not in str(obj(kube, "Deployment", "qwen"))


def test_api_key_from_a_user_secret():
    spec = {**SPEC, "env": [{"name": "KVTUNE_API_KEY", "secretKeyRef": {"name": "my-keys", "key": "api"}}]}
    kube, _ = reconciled(spec)
    env = obj(kube, "Deployment", "qwen")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "KVTUNE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "my-keys", "key": "api"}}} in env


def test_network_policy_api_port_to_clients_admin_port_to_operator_and_prometheus():
    kube, _ = reconciled(network_allow_namespaces=("kvtune-system", "monitoring"))
    np = obj(kube, "NetworkPolicy", "qwen")["spec"]
    assert np["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "qwen"
    assert np["policyTypes"] == ["Ingress"]
    ops = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvtune-system"}}},
           {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    api, admin = np["ingress"]
    # the OpenAI API: this namespace by default; /metrics and the admin API: the operator and Prometheus
    assert api == {"from": [{"podSelector": {}}], "ports": [{"port": 8000, "protocol": "TCP"}]}
    assert admin == {"from": ops, "ports": [{"port": 8001, "protocol": "TCP"}]}
    spec = {**SPEC, "network": {"allowFrom": [{"namespaceSelector": {"team": "web"}, "podSelector": {"app": "ui"}}],
                                "allowMetricsFrom": [{"podSelector": {"app": "epp"}}]}}
    kube, _ = reconciled(spec, network_allow_namespaces=("kvtune-system",))
    api, admin = obj(kube, "NetworkPolicy", "qwen")["spec"]["ingress"]
    assert api["from"] == [
        {"podSelector": {"matchLabels": {"app": "ui"}}, "namespaceSelector": {"matchLabels": {"team": "web"}}}]
    assert admin["from"] == [ops[0], {"podSelector": {"matchLabels": {"app": "epp"}}}]
    # vLLM serves the API and /metrics on one port: one rule, clients and monitors
    kube, _ = reconciled({**spec, "runtime": "vllm"}, network_allow_namespaces=("kvtune-system",))
    (rule,) = obj(kube, "NetworkPolicy", "qwen")["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}] and rule["from"] == api["from"] + admin["from"]


def test_host_path_refused_unless_the_operator_allows_it():
    spec = {**SPEC, "model": {"path": "/models/qwen", "volume": {"hostPath": {"path": "/etc"}, "mountPath": "/models"}}}
    kube, _ = reconciled(spec)
    assert not [k for k in kube.objects if k[1] == "Deployment"]
    deg = get_condition(kube.infd()["status"]["conditions"], "Degraded")
    assert deg["status"] == "True" and "hostPath is not allowed" in deg["message"]
    kube, _ = reconciled(spec, allow_host_path=True)
    vols = obj(kube, "Deployment", "qwen")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "hostPath": {"path": "/etc", "type": "Directory"}} in vols


HOST_PV = {"hostPath": {"path": "/"}}
LOCAL_PV = {"local": {"path": "/mnt/disks/ssd1"}}
CSI_PV = {"csi": {"driver": "disk.example.com", "volumeHandle": "weights-1"}}


def _pv(source: dict) -> dict:
    return {"metadata": {"name": "pv-w"}, "spec": {"capacity": {"storage": "1Gi"}, **source}}


def test_claim_refusal_decides_from_the_claim_and_its_volume():
    """The pure decision: a claim may be mounted only when it exists, is bound, and its PersistentVolume
    was read and is not a node directory (hostPath or local); anything else refuses, saying why."""
    bound = {"metadata": {"name": "w"}, "spec": {"volumeName": "pv-w"}}
    assert claim_refusal("w", bound, _pv(CSI_PV)) is None
    assert claim_refusal("w", bound, _pv({"nfs": {"server": "nfs.example.com", "path": "/models"}})) is None
    for source, kind in ((HOST_PV, "hostPath"), (LOCAL_PV, "local")):
        r = claim_refusal("w", bound, _pv(source))
        assert (r.type, r.status, r.reason) == ("Degraded", "True", "HostPathVolume")
        assert f"pv-w of type {kind}" in r.message and "allowHostPath" in r.message and "csi" in r.message
    assert claim_refusal("w", None, None).reason == "ModelVolumeMissing"
    unbound = claim_refusal("w", {"metadata": {"name": "w"}, "spec": {}}, None)
    assert unbound.reason == "ModelVolumeUnbound" and "not bound" in unbound.message
    forbidden = claim_refusal("w", bound, None, pv_error="persistentvolumes \"pv-w\" is forbidden")
    assert forbidden.reason == "ModelVolumeUnverified" and "cannot verify" in forbidden.message
    assert "get on persistentvolumes" in forbidden.message
    assert claim_refusal("w", bound, None).reason == "ModelVolumeUnverified"  # bound to a PV that is gone
    assert claim_refusal("w", None, None, pvc_error="forbidden").reason == "ModelVolumeUnverified"


def _claim_spec(claim: str = "weights") -> dict:
    return {**SPEC, "model": {"path": "/models/qwen", "volume": {"persistentVolumeClaim": {"claimName": claim},
                                                                  "mountPath": "/models"}}}


def _reconciled_with_claim(source: dict | None, *, forbidden: bool = False, **settings):
    kube = FakeKube()
    kube.add_claim("weights", source)
    kube.pv_forbidden = forbidden
    kube.add_infd(copy.deepcopy(_claim_spec()))
    Reconciler(kube, Settings.from_env({}, **settings)).reconcile("llm", "qwen")
    return kube


def test_claim_bound_to_a_node_directory_is_refused_unless_the_operator_allows_it():
    for source in (HOST_PV, LOCAL_PV):
        kube = _reconciled_with_claim(source)
        assert not [k for k in kube.objects if k[1] == "Deployment"], source
        deg = get_condition(kube.infd()["status"]["conditions"], "Degraded")
        assert deg["status"] == "True" and deg["reason"] == "HostPathVolume" and "weights" in deg["message"]
        assert ("Warning", "HostPathVolume", deg["message"]) in kube.events
    kube = _reconciled_with_claim(CSI_PV)
    assert get_condition(kube.infd()["status"]["conditions"], "Degraded")["status"] == "False"
    vols = obj(kube, "Deployment", "qwen")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in vols
    kube = _reconciled_with_claim(HOST_PV, allow_host_path=True)  # allowed: not even read
    assert obj(kube, "Deployment", "qwen") and ("persistentvolumes", "get") not in kube.calls
    # a claim not bound yet, or a volume the operator may not read: refused until it can be checked
    kube = _reconciled_with_claim(None)
    assert get_condition(kube.infd()["status"]["conditions"], "Degraded")["reason"] == "ModelVolumeUnbound"
    assert not [k for k in kube.objects if k[1] == "Deployment"]
    kube = _reconciled_with_claim(CSI_PV, forbidden=True)
    deg = get_condition(kube.infd()["status"]["conditions"], "Degraded")
    assert deg["reason"] == "ModelVolumeUnverified" and "forbidden" in deg["message"]
    assert not [k for k in kube.objects if k[1] == "Deployment"]


def test_operator_admin_reads_and_diagnose_use_the_admin_key(tiny_llama):  # noqa: F811
    from kvtune_operator.tuner_cli import diagnose_cmd, read_engine
    with run_server(tiny_llama, server_settings={"admin_key": "k-123"}) as s:
        httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert httpx.get(s.url + "/kvtune/v1/state").status_code == 401
        obs = read_engine(s.url, admin_key="k-123")
        assert obs.num_blocks == s.engine.num_blocks
        r = CliRunner().invoke(diagnose_cmd, ["--url", s.url, "--window", "0"])
        assert r.exit_code != 0 and "401" in r.output
        r = CliRunner().invoke(diagnose_cmd, ["--url", s.url, "--window", "0", "--admin-key", "k-123"])
        assert r.exit_code == 0, r.output
        r = CliRunner(env={"KVTUNE_ADMIN_KEY": "k-123"}).invoke(diagnose_cmd, ["--url", s.url, "--window", "0"])
        assert r.exit_code == 0, r.output


def test_secret_key_round_trip():
    from kvtune_operator.model import InferenceDeployment
    from kvtune_operator.render import render_admin_secret
    infd = InferenceDeployment.from_body(infd_body("a", namespace="n", uid="u", model_path="/m"))
    assert admin_key_of(render_admin_secret(infd, "s3cret")) == "s3cret"
    assert admin_key_of(None) is None and admin_key_of({"data": {}}) is None
