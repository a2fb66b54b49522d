"""The Helm chart: same CRD as crds/, least-privilege RBAC equal to the operator's API calls,
values that match their schema and the operator's settings, and (when helm is here) lint + template."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvtune_operator.crd import CRD_FILE
from kvtune_operator.kube import API_CALLS, CLUSTER_API_CALLS
from kvtune_operator.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvtune"


def _helm() -> str | None:
    local = ROOT / "tests" / "controlplane" / "bin" / "helm"
    return str(local) if os.access(local, os.X_OK) else shutil.which("helm")


def _rules_as_calls(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


def test_chart_crd_is_byte_identical_to_crds_dir():
    assert (CHART / "crds" / CRD_FILE).read_bytes() == (ROOT / "crds" / CRD_FILE).read_bytes(), (
        "charts/kvtune/crds/ differs from crds/: cp crds/*.yaml charts/kvtune/crds/")


def test_rbac_rules_are_exactly_the_operators_calls():
    rules = yaml.safe_load((CHART / "files" / "rbac-rules.yaml").read_text())
    assert _rules_as_calls(rules) == API_CALLS
    cluster = yaml.safe_load((CHART / "files" / "rbac-cluster-rules.yaml").read_text())
    assert _rules_as_calls(cluster) == CLUSTER_API_CALLS == {("", "persistentvolumes"): {"get"}}
    for rule in rules + cluster:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        assert not {"delete", "deletecollection", "update", "escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_values_match_schema_and_settings():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values) == set(schema["properties"])
    assert set(schema["required"]) <= set(values)
    assert values["autotune"]["mode"] in schema["properties"]["autotune"]["properties"]["mode"]["enum"]
    template = (CHART / "templates" / "deployment.yaml").read_text()
    assert 'command: ["kvtune", "operator", "run"]' in template
    for var in re.findall(r"name: (KVTUNE_[A-Z_]+)", template):
        assert var.removeprefix(ENV_PREFIX).lower() in Settings.model_fields, var
    # the chart's defaults are the operator's defaults
    s = Settings()
    assert values["prometheusUrl"] == s.prometheus_url
    assert (values["autotune"]["interval"], values["autotune"]["window"], values["autotune"]["cooldown"]) == (
        s.autotune_interval, s.autotune_window, s.autotune_cooldown)


def test_dashboard_queries_engine_metrics():
    dash = json.loads((CHART / "files" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all("kvtune_" in e for e in exprs)
    for needed in ("kvtune_kv_usage_ratio", "kvtune_scheduler_waiting_reason_steps_total", "kvtune_preemptions_total",
                   "kvtune_requests", "kvtune_kv_blocks"):
        assert any(needed in e for e in exprs), needed


def _template(*args: str) -> list[dict]:
    helm = _helm()
    out = subprocess.run([helm, "template", "t", str(CHART), "--namespace", "kvtune-system", *args],
                         check=True, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache", "HELM_CONFIG_HOME": "/tmp/helm-cfg",
                              "HELM_DATA_HOME": "/tmp/helm-data"}).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_helm_lint_and_template():
    helm = _helm()
    assert helm is not None, "helm is not installed: bash tests/controlplane/setup.sh (or make controlplane)"
    for extra in ([], ["--set", "grafanaDashboard.enabled=true", "--set", "watchNamespaces={a,b}"]):
        res = subprocess.run([helm, "lint", "--strict", str(CHART), *extra], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache",
                                  "HELM_CONFIG_HOME": "/tmp/helm-cfg", "HELM_DATA_HOME": "/tmp/helm-data"})
        assert res.returncode == 0, res.stdout + res.stderr
    docs = _template()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Role", "RoleBinding", "ServiceAccount",
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    role = next(d for d in docs if d["kind"] == "Role")
    assert _rules_as_calls(role["rules"]) == API_CALLS and role["metadata"]["namespace"] == "kvtune-system"
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "kvtune/kvtune-operator:0.1.0"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["KVTUNE_ENGINE_IMAGE"] == "kvtune/kvtune-engine:0.1.0" and env["KVTUNE_NAMESPACES"] == "kvtune-system"
    settings = Settings.from_env(env)
    assert settings.namespaces == ("kvtune-system",) and settings.liveness == "http://0.0.0.0:8080/healthz"
    wide = _template("--set", "rbac.clusterWide=true")
    role = next(d for d in wide if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "t-kvtune")
    assert _rules_as_calls(role["rules"]) == API_CALLS and not [d for d in wide if d["kind"] == "Role"]
    env = {e["name"]: e["value"] for e in next(d for d in wide if d["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]["env"]}
    assert Settings.from_env(env).clusterwide
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    scoped = _template("--set", "watchNamespaces={a,b}", "--set", "grafanaDashboard.enabled=true")
    kinds = sorted(d["kind"] for d in scoped)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "Role", "Role", "RoleBinding",
                     "RoleBinding", "ServiceAccount", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert sorted(d["metadata"]["namespace"] for d in scoped if d["kind"] == "Role") == ["a", "b"]
    dash = next(d for d in scoped if d["kind"] == "ConfigMap")
    assert json.loads(dash["data"]["kvtune-engine.json"])["uid"] == "kvtune-engine"
    env = {e["name"]: e["value"] for e in next(d for d in scoped if d["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]["env"]}
    assert Settings.from_env(env).namespaces == ("a", "b")


def _secret_verbs(docs: list[dict], kind: str) -> set[str]:
    return {v for d in docs if d["kind"] == kind for r in d.get("rules") or []
            if "" in r["apiGroups"] and ("secrets" in r["resources"] or "*" in r["resources"]) for v in r["verbs"]}


def _cluster_grants(docs: list[dict]) -> dict[tuple[str, str], set[str]]:
    """What the ClusterRoles bound by the chart's ClusterRoleBindings grant, together."""
    bound = {b["roleRef"]["name"] for b in docs if b["kind"] == "ClusterRoleBinding"}
    return _rules_as_calls([r for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] in bound
                            for r in d["rules"]])


def test_default_install_grants_no_cluster_wide_secret_access():
    """The chart's defaults (watchNamespaces empty): cluster-wide only get on persistentvolumes (to
    refuse a model claim bound to a node directory), so nothing on Secrets (nor on Deployments,
    ConfigMaps, ...) outside the one namespace the operator watches, its own; every other grant is a
    Role bound in a watched namespace; with allowHostPath (nothing to refuse) no cluster grant at all.
    Cluster-wide only as the explicit rbac.clusterWide, which also refuses a watchNamespaces list it
    would silently ignore."""
    for args in ([], ["--set", "watchNamespaces={a,b}"]):
        docs = _template(*args)
        assert _cluster_grants(docs) == CLUSTER_API_CALLS == {("", "persistentvolumes"): {"get"}}, args
        assert len([d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]) == 2, args
        assert not [d for d in _template(*args, "--set", "allowHostPath=true")
                    if d["kind"] in ("ClusterRole", "ClusterRoleBinding")], args
        watched = {e["value"] for d in docs if d["kind"] == "Deployment"
                   for e in d["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == "KVTUNE_NAMESPACES"}
        (watched,) = watched
        assert watched and {d["metadata"]["namespace"] for d in docs if d["kind"] in ("Role", "RoleBinding")} \
            == set(watched.split(","))
        for rb in (d for d in docs if d["kind"] == "RoleBinding"):
            assert rb["roleRef"]["kind"] == "Role"
    assert _secret_verbs(_template(), "Role") == {"get", "create", "patch"}
    wide = _template("--set", "rbac.clusterWide=true")
    assert _secret_verbs(wide, "ClusterRole") == {"get", "create", "patch"}  # what README says it grants
    helm = _helm()
    res = subprocess.run([helm, "template", "t", str(CHART), "--set", "rbac.clusterWide=true",
                          "--set", "watchNamespaces={a}"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache", "HELM_CONFIG_HOME": "/tmp/helm-cfg",
                              "HELM_DATA_HOME": "/tmp/helm-data"})
    assert res.returncode != 0 and "rbac.clusterWide" in res.stderr


def test_host_path_refused_by_the_apiserver_unless_allowed():
    """allowHostPath false (the default): a ValidatingAdmissionPolicy refuses InferenceDeployments with
    spec.model.volume.hostPath, bound to the watched namespaces (all of them with rbac.clusterWide);
    allowHostPath true: no policy."""
    policy, binding = (next(d for d in _template() if d["kind"] == k)
                       for k in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"))
    rule = policy["spec"]["matchConstraints"]["resourceRules"][0]
    assert rule["apiGroups"] == ["kvtune.io"] and rule["resources"] == ["inferencedeployments"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE"}
    (v,) = policy["spec"]["validations"]
    assert "hostPath" in v["expression"] and "allowHostPath" in v["message"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    (sel,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]  # the one it watches
    assert sel["values"] == ["kvtune-system"]
    wide = next(d for d in _template("--set", "rbac.clusterWide=true") if d["kind"] == "ValidatingAdmissionPolicyBinding")
    assert "matchResources" not in wide["spec"]
    scoped = next(d for d in _template("--set", "watchNamespaces={a,b}") if d["kind"] == "ValidatingAdmissionPolicyBinding")
    (sel,) = scoped["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert sel == {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["a", "b"]}
    assert not [d for d in _template("--set", "allowHostPath=true") if "ValidatingAdmission" in d["kind"]]


def test_inference_pool_selects_the_deployments_engine_pods():
    """An InferencePool per listed InferenceDeployment: its pods (the operator's selector labels), port
    8000, the endpoint picker named; none by default."""
    from kvtune_operator.render import PORT, selector_labels

    assert not [d for d in _template() if d["kind"] == "InferencePool"]
    docs = _template("--set", "inferencePools[0].inferenceDeployment=qwen3-chat",
                     "--set", "inferencePools[0].namespace=models",
                     "--set", "inferencePools[0].endpointPicker.name=qwen3-epp")
    pools = [d for d in docs if d["kind"] == "InferencePool"]
    assert len(pools) == 1
    p = pools[0]
    assert p["apiVersion"] == "inference.networking.k8s.io/v1"
    assert p["metadata"]["name"] == "qwen3-chat" and p["metadata"]["namespace"] == "models"
    assert p["spec"]["selector"]["matchLabels"] == selector_labels("qwen3-chat")
    assert p["spec"]["targetPorts"] == [{"number": PORT}]
    assert p["spec"]["endpointPickerRef"] == {"name": "qwen3-epp", "kind": "Service", "port": {"number": 9002},
                                              "failureMode": "FailClose"}
    helm = _helm()
    bad = subprocess.run([helm, "template", "t", str(CHART), "--set", "inferencePools[0].inferenceDeployment=x"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache", "HELM_CONFIG_HOME": "/tmp/helm-cfg",
                              "HELM_DATA_HOME": "/tmp/helm-data"})
    assert bad.returncode != 0 and "endpointPicker" in bad.stderr


def test_replicas_share_the_fleet_through_leases_in_the_release_namespace_only():
    """replicaCount 1 (the default): one operator, no shard, no Lease grant, no POD_NAME. More: the
    Deployment runs them, each gets its pod name (downward API) as its Lease identity and the shard
    settings, and one Role in the release namespace grants exactly the Lease calls (leases.py)."""
    from kvtune_operator.leases import LEASE_API_CALLS

    lease_rules = yaml.safe_load((CHART / "files" / "rbac-lease-rules.yaml").read_text())
    assert _rules_as_calls(lease_rules) == LEASE_API_CALLS
    assert not {"delete", "deletecollection", "patch", "escalate", "bind", "impersonate", "*"} \
        & {v for r in lease_rules for v in r["verbs"]}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["replicaCount"] == 1 and Settings().shards == 0
    for docs in (_template(), _template("--set", "watchNamespaces={a,b}")):
        dep = next(d for d in docs if d["kind"] == "Deployment")
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert dep["spec"]["replicas"] == 1 and "POD_NAME" not in {e["name"] for e in c["env"]}
        assert Settings.from_env({e["name"]: e["value"] for e in c["env"]}).shards == 0
        assert not [r for d in docs if d["kind"] in ("Role", "ClusterRole") for r in d["rules"]
                    if "coordination.k8s.io" in r["apiGroups"]]
    docs = _template("--set", "replicaCount=3", "--set", "watchNamespaces={a,b}")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    assert dep["spec"]["replicas"] == 3
    assert next(e for e in env if e["name"] == "POD_NAME")["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    settings = Settings.from_env({e["name"]: e["value"] for e in env if "value" in e})
    assert (settings.shards, settings.lease_duration, settings.lease_namespace) == (16, 15.0, "kvtune-system")
    leases = [d for d in docs if d["kind"] in ("Role", "ClusterRole")
              and any("coordination.k8s.io" in r["apiGroups"] for r in d["rules"])]
    assert [(d["kind"], d["metadata"]["namespace"]) for d in leases] == [("Role", "kvtune-system")]
    assert _rules_as_calls(leases[0]["rules"]) == LEASE_API_CALLS
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["name"] == leases[0]["metadata"]["name"])
    assert binding["metadata"]["namespace"] == "kvtune-system"
    assert binding["subjects"][0]["name"] == dep["spec"]["template"]["spec"]["serviceAccountName"]
    helm = _helm()
    bad = subprocess.run([helm, "template", "t", str(CHART), "--set", "replicaCount=0"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache",
                                                     "HELM_CONFIG_HOME": "/tmp/helm-cfg", "HELM_DATA_HOME": "/tmp/helm-data"})
    assert bad.returncode != 0 and "replicaCount" in bad.stderr
