"""Smoke tests proving the harness (issue 3, section 5): a real apiserver with schema validation,
controllers that roll Deployments and collect garbage, kwok GPU nodes, helm, kubectl, and a real
Prometheus scraping a process that the pod node started for a pod."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import httpx
import pytest
import yaml

from .waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.wallclock]




CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.smoke.kvtune.io"},
    "spec": {
        "group": "smoke.kvtune.io",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "subresources": {"status": {}},
            "additionalPrinterColumns": [
                {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"}],
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "spec": {
                        "type": "object",
                        "required": ["replicas"],
                        "x-kubernetes-validations": [{
                            "rule": "self.replicas <= self.maxReplicas",
                            "message": "replicas must not exceed maxReplicas"}],
                        "properties": {
                            "replicas": {"type": "integer", "minimum": 1},
                            "maxReplicas": {"type": "integer", "default": 4},
                        },
                    },
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
            }},
        }],
    },
}


def _widget(name: str, replicas: int, max_replicas: int = 4) -> str:
    return json.dumps({"apiVersion": "smoke.kvtune.io/v1", "kind": "Widget", "metadata": {"name": name},
                       "spec": {"replicas": replicas, "maxReplicas": max_replicas}})


def test_crd_schema_and_cel_rejection(controlplane, namespace):
    kc = controlplane.kubectl
    kc("apply", "-f", "-", input=json.dumps(CRD))
    kc("wait", "--for=condition=Established", "crd/widgets.smoke.kvtune.io", "--timeout=30s")

    # A valid object is accepted, defaults applied by the server, printer column shown.
    eventually(lambda: kc("apply", "-n", namespace, "-f", "-", input=_widget("ok", 2)), timeout=30,
                what="CRD served")
    obj = controlplane.kubectl_json("get", "widget", "ok", "-n", namespace)
    assert obj["spec"] == {"replicas": 2, "maxReplicas": 4}
    table = kc("get", "widgets", "-n", namespace).stdout
    assert "REPLICAS" in table and "ok" in table

    # OpenAPI schema violation: rejected by the server with the schema's message.
    bad = kc("apply", "-n", namespace, "-f", "-", input=_widget("bad", 0), check=False)
    assert bad.returncode != 0
    assert "spec.replicas" in bad.stderr and "should be greater than or equal to 1" in bad.stderr, bad.stderr

    # CEL rule violation: rejected with the rule's message.
    bad = kc("apply", "-n", namespace, "-f", "-", input=_widget("bad", 5, 4), check=False)
    assert bad.returncode != 0
    assert "replicas must not exceed maxReplicas" in bad.stderr, bad.stderr

    # Status subresource: spec updates do not touch status and vice versa.
    kc("patch", "widget", "ok", "-n", namespace, "--subresource=status", "--type=merge",
       "-p", '{"status": {"phase": "Ready"}}')
    assert controlplane.kubectl_json("get", "widget", "ok", "-n", namespace)["status"] == {"phase": "Ready"}


def test_deployment_rolls_pods_on_kwok_gpu_nodes_and_gc(controlplane, namespace):
    kc = controlplane.kubectl
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "gpu-app", "namespace": namespace},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "gpu-app"}},
            "template": {
                "metadata": {"labels": {"app": "gpu-app"}},
                "spec": {"containers": [{
                    "name": "main", "image": "example.invalid/none:1",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }]},
            },
        },
    }
    kc("apply", "-f", "-", input=json.dumps(deployment))

    def running_pods():
        pods = controlplane.kubectl_json("get", "pods", "-n", namespace, "-l", "app=gpu-app")["items"]
        running = [p for p in pods if p["status"].get("phase") == "Running"
                   and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
        return running if len(running) == 2 else None

    pods = eventually(running_pods, timeout=60, what="2 Running pods")
    for p in pods:
        assert p["spec"]["nodeName"] in controlplane.nodes  # scheduled onto a kwok GPU node
        owner = p["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "ReplicaSet"
    rs = controlplane.kubectl_json("get", "replicasets", "-n", namespace)["items"]
    assert len(rs) == 1 and rs[0]["metadata"]["ownerReferences"][0]["name"] == "gpu-app"
    kc("rollout", "status", "deployment/gpu-app", "-n", namespace, "--timeout=60s")

    # Deleting the owner garbage-collects the ReplicaSet and its pods (background cascade).
    kc("delete", "deployment", "gpu-app", "-n", namespace, "--cascade=background", "--wait=false")

    def all_gone():
        rs = controlplane.kubectl_json("get", "replicasets", "-n", namespace)["items"]
        pods = controlplane.kubectl_json("get", "pods", "-n", namespace)["items"]
        return not rs and not pods

    eventually(all_gone, timeout=60, what="ReplicaSet and pods garbage-collected")


def test_helm_install_trivial_chart(controlplane, namespace, tmp_path: Path):
    chart = tmp_path / "smoke"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "v2", "name": "smoke", "version": "0.1.0", "appVersion": "1.0"}))
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "configmap.yaml").write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata:
          name: {{ .Release.Name }}-cm
        data:
          greeting: {{ .Values.greeting | quote }}
        """))
    out = controlplane.helm("install", "smoke", str(chart), "-n", namespace, "--set", "greeting=hi",
                            "--wait", "--timeout", "60s")
    assert "STATUS: deployed" in out.stdout, out.stdout
    releases = json.loads(controlplane.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("smoke", "deployed")]
    cm = controlplane.kubectl_json("get", "configmap", "smoke-cm", "-n", namespace)
    assert cm["data"] == {"greeting": "hi"}
    controlplane.helm("uninstall", "smoke", "-n", namespace, "--wait")
    assert controlplane.kubectl("get", "configmap", "smoke-cm", "-n", namespace, check=False).returncode != 0


def test_kubectl_get_describe_explain(controlplane):
    kc = controlplane.kubectl
    nodes = kc("get", "nodes", "-o", "wide").stdout
    for n in controlplane.nodes:
        assert n in nodes
    assert "Ready" in nodes
    desc = kc("describe", "node", controlplane.nodes[0]).stdout
    assert "nvidia.com/gpu:" in desc and "kwok" in desc
    gpu = controlplane.kubectl_json("get", "node", controlplane.nodes[0])["status"]["allocatable"]["nvidia.com/gpu"]
    assert gpu == "8"
    explain = kc("explain", "deployment.spec.replicas").stdout
    assert "replicas" in explain and "integer" in explain
    version = json.loads(kc("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.36.3"


METRICS_SERVER = textwrap.dedent("""\
    import argparse, http.server, os
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--metrics-file", required=True)
    a = ap.parse_args()
    assert int(os.environ["KVTUNE_PORT"]) == a.port
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/metrics":
                body = open(a.metrics_file, "rb").read()
            else:
                body = os.environ.get("GREETING", "").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.ThreadingHTTPServer(("127.0.0.1", a.port), H).serve_forever()
    """)


def _metrics_cm(namespace: str, value: int) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "fake-engine", "namespace": namespace},
        "data": {"server.py": METRICS_SERVER,
                 "metrics.txt": f"# TYPE kvtune_smoke_value gauge\nkvtune_smoke_value {value}\n"},
    })


def test_pod_node_runs_pod_and_prometheus_scrapes_it(controlplane, prometheus, pod_node, namespace):
    kc = controlplane.kubectl
    kc("apply", "-f", "-", input=_metrics_cm(namespace, 42))
    labels = {"app.kubernetes.io/name": "kvtune-engine", "kvtune.io/inference-deployment": "smoke-id"}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "smoke-id-engine", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{
                        "name": "engine", "image": "example.invalid/kvtune-engine:dev",
                        "command": ["python3", "/etc/kvtune/server.py"],
                        "args": ["--port", "8000", "--metrics-file=/etc/kvtune/metrics.txt"],
                        "ports": [{"containerPort": 8000, "name": "http"}],
                        "env": [{"name": "GREETING", "value": "hello from $(POD_NAME)"},
                                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                        "volumeMounts": [{"name": "cfg", "mountPath": "/etc/kvtune"}],
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    }],
                    "volumes": [{"name": "cfg", "configMap": {"name": "fake-engine"}}],
                },
            },
        },
    }
    kc("apply", "-f", "-", input=json.dumps(deployment))
    kc("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "smoke-id", "namespace": namespace},
        "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": "http"}]}}))

    with pod_node.restricted_to(namespace):
        _check_pod_node(controlplane, prometheus, pod_node, namespace, labels)


def _check_pod_node(controlplane, prometheus, pod_node, namespace, labels):
    from prometheus_api_client import PrometheusConnect

    kc = controlplane.kubectl
    (lp,) = pod_node.wait_for_selector(namespace, labels, count=1, timeout=60)
    lp = pod_node.wait_for_pod(namespace, lp.name, timeout=30)
    assert lp.labels["kvtune.io/inference-deployment"] == "smoke-id"
    url = pod_node.url_for(namespace, lp.name)
    assert pod_node.urls_for_selector(namespace, labels) == [url]
    assert pod_node.urls_for_service(namespace, "smoke-id") == [url]
    assert httpx.get(url + "/metrics").text.strip().endswith("kvtune_smoke_value 42")
    # $(VAR) expansion is done with the env defined so far (POD_NAME comes after GREETING here,
    # so, as in Kubernetes, it stays unexpanded).
    assert httpx.get(url + "/").text == "hello from $(POD_NAME)"
    pod = controlplane.kubectl_json("get", "pod", lp.name, "-n", namespace)
    if pod["status"].get("podIP"):
        assert pod_node.rewrite_url(f"http://{pod['status']['podIP']}:8000/metrics") == url + "/metrics"

    prom = PrometheusConnect(url=prometheus.url, disable_ssl=True)
    query = f'kvtune_smoke_value{{namespace="{namespace}", inference_deployment="smoke-id"}}'

    def value():
        res = prom.custom_query(query)
        return res[0] if res else None

    sample = eventually(value, timeout=30, what="Prometheus to scrape the pod")
    assert sample["value"][1] == "42"
    assert sample["metric"]["pod"] == lp.name
    assert sample["metric"]["job"] == "kvtune-engine"

    # The ConfigMap is kept in sync in the local copy; Prometheus sees the new value.
    kc("apply", "-f", "-", input=_metrics_cm(namespace, 43))
    eventually(lambda: (value() or {}).get("value", [0, ""])[1] == "43", timeout=30, what="updated metric")

    # Pod deleted (owner deleted) -> process stopped and target withdrawn.
    kc("delete", "deployment", "smoke-id-engine", "-n", namespace, "--wait=false")
    eventually(lambda: pod_node.get(namespace, lp.name) is None, timeout=60, what="local process stopped")
    assert lp.returncode is not None
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/metrics", timeout=2)
    eventually(lambda: not [t for t in prometheus.active_targets()
                             if t["labels"].get("namespace") == namespace], timeout=30, what="target removed")


def test_kwok_renews_node_leases_so_nodes_stay_ready(controlplane):
    """Without lease renewal the node controller marks every fake node (and its pods) NotReady
    about 50 s into a session; kwok must keep renewing the nodes' leases."""
    import datetime as dt
    import time

    def renewals() -> dict[str, str]:
        leases = controlplane.kubectl_json("get", "lease", "-n", "kube-node-lease")["items"]
        return {x["metadata"]["name"]: x["spec"].get("renewTime") for x in leases}

    first = renewals()
    assert set(controlplane.nodes) <= set(first), f"no lease for some nodes: {first}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(renewals()[n] == first[n] for n in controlplane.nodes):
        time.sleep(1)
    again = renewals()
    assert all(again[n] != first[n] for n in controlplane.nodes), f"leases not renewed in 30 s: {again}"
    newest = max(dt.datetime.fromisoformat(again[n].replace("Z", "+00:00")) for n in controlplane.nodes)
    assert (dt.datetime.now(dt.timezone.utc) - newest).total_seconds() < 30
