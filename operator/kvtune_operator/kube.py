"""A small Kubernetes client for the operator: server-side apply, reads, status patches, events.

Everything the operator does to the cluster goes through `Kube`, so the chart's RBAC can list
exactly these calls (see `API_CALLS`, which a test checks against the chart's Role rules) and unit
tests can swap in a fake with the same methods.

Responses are plain dicts (JSON), never the client's generated model classes.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from kvtune_operator import model as m

log = logging.getLogger(__name__)

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"

#: (apiGroup, resource) -> verbs: every call this module makes. The chart's ClusterRole must grant
#: exactly these (tests/unit/test_chart.py). kopf itself needs list/watch/patch on the custom
#: resource (watching, progress annotations) and create on events (its own error events).
API_CALLS: dict[tuple[str, str], set[str]] = {
    (m.GROUP, m.PLURAL): {"get", "list", "watch", "patch"},
    (m.GROUP, f"{m.PLURAL}/status"): {"patch"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("", "services"): {"get", "create", "patch"},
    ("", "secrets"): {"get", "create", "patch"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch"},
    ("apps", "deployments"): {"get", "create", "patch"},
    ("monitoring.coreos.com", "podmonitors"): {"get", "create", "patch"},
    ("", "pods"): {"list"},
    (m.GROUP, f"{m.PLURAL}/scale"): {"patch"},
    ("autoscaling", "horizontalpodautoscalers"): {"list"},
    ("keda.sh", "scaledobjects"): {"list"},
    ("", "persistentvolumeclaims"): {"get"},
    ("", "events"): {"create"},
}

#: Cluster-scoped calls, granted by the chart's one small ClusterRole (files/rbac-cluster-rules.yaml;
#: tests/unit/test_chart.py keeps them equal): reading the PersistentVolume a model volume's claim is
#: bound to, to refuse hostPath and local ones (volume_policy.py). Not needed with allowHostPath.
CLUSTER_API_CALLS: dict[tuple[str, str], set[str]] = {
    ("", "persistentvolumes"): {"get"},
}

#: apiVersion/kind -> how to reach it: ("core"|"apps", suffix of the typed method) or ("custom", plural).
_KINDS: dict[tuple[str, str], tuple[str, str]] = {
    ("v1", "ConfigMap"): ("core", "config_map"),
    ("v1", "Service"): ("core", "service"),
    ("v1", "Secret"): ("core", "secret"),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networking", "network_policy"),
    ("apps/v1", "Deployment"): ("apps", "deployment"),
    ("monitoring.coreos.com/v1", "PodMonitor"): ("custom", "podmonitors"),
    (m.API_VERSION, m.KIND): ("custom", m.PLURAL),
}


class KubeError(RuntimeError):
    """An API call failed; `status` is the HTTP status (0 when unknown)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def _api_error(e: Exception) -> KubeError:
    status = int(getattr(e, "status", 0) or 0)
    body = getattr(e, "body", None)
    message = str(e)
    if body:
        try:
            message = json.loads(body).get("message") or message
        except (ValueError, AttributeError):
            message = body if isinstance(body, str) else message
    return KubeError(message, status)


class Kube:
    """Thin synchronous wrapper over the official client (thread-safe: kopf runs sync handlers in threads)."""

    def __init__(self, api_client: Any, *, field_manager: str = "kvtune-operator", component: str = "kvtune-operator"):
        from kubernetes import client

        self._client = client
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.autoscaling = client.AutoscalingV2Api(api_client)
        self.field_manager = field_manager
        self.component = component
        self.instance = os.environ.get("HOSTNAME") or socket.gethostname()
        self._discovery: dict[tuple[str, str], tuple[float, set[str]]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, *, connections: int | None = None,
                         **kwargs: Any) -> "Kube":
        """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config).
        ``connections``: the most threads calling at once (the client's pool is 5 per CPU: on a
        2-CPU pod 10, and a busier pool drops and reopens connections: "Connection pool is full")."""
        from kubernetes import client, config

        try:
            if kubeconfig:
                raise config.ConfigException("explicit kubeconfig")
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=kubeconfig)
        conf = client.Configuration.get_default_copy()
        if connections is not None:
            conf.connection_pool_maxsize = max(conf.connection_pool_maxsize, connections)
        return cls(client.ApiClient(conf), **kwargs)

    # -- generic ------------------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        """Call a typed API method, returning the JSON body as a dict; None on 404."""
        from kubernetes.client.exceptions import ApiException

        from urllib3.exceptions import HTTPError as TransportError

        try:
            resp = fn(*args, _preload_content=False, **kwargs)
        except ApiException as e:
            if e.status == 404:
                return None
            raise _api_error(e) from None
        except (TransportError, OSError) as e:  # apiserver down or unreachable: a KubeError like any other
            raise KubeError(f"cannot reach the Kubernetes API: {e}") from None
        data = resp.data
        return json.loads(data) if data else {}

    def _route(self, api_version: str, kind: str) -> tuple[str, str]:
        try:
            return _KINDS[(api_version, kind)]
        except KeyError:
            raise KubeError(f"kvtune-operator does not manage {api_version} {kind}") from None

    def _typed(self, api: str) -> Any:
        return {"core": self.core, "apps": self.apps, "networking": self.networking}[api]

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        api, what = self._route(api_version, kind)
        if api == "custom":
            group, version = api_version.split("/")
            return self._call(self.custom.get_namespaced_custom_object, group, version, namespace, what, name)
        return self._call(getattr(self._typed(api), f"read_namespaced_{what}"), name, namespace)

    def _patch(self, obj: dict[str, Any], **kwargs: Any) -> dict[str, Any] | None:
        """PATCH `obj` onto the object of its kind and name (None on 404)."""
        api_version, kind = obj["apiVersion"], obj["kind"]
        name, namespace = obj["metadata"]["name"], obj["metadata"]["namespace"]
        api, what = self._route(api_version, kind)
        if api == "custom":
            group, version = api_version.split("/")
            fn, args = self.custom.patch_namespaced_custom_object, (group, version, namespace, what, name)
        else:
            fn = getattr(self._typed(api), f"patch_namespaced_{what}")
            args = (name, namespace)
        try:
            return self._call(fn, *args, obj, field_manager=self.field_manager, **kwargs)
        except KubeError as e:
            # Clients before v33 send a YAML content type only from a string body (JSON is YAML).
            if e.status != 0 or "Cannot prepare a request message" not in str(e):
                raise
            return self._call(fn, *args, json.dumps(obj), field_manager=self.field_manager, **kwargs)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` (create or update) as this operator's field manager, forcing conflicts.
        A resourceVersion in `obj` is a precondition only on an object that exists: one deleted since
        it was read is created again (see `update_if_current`)."""
        out = self._patch(obj, force=True, _content_type=APPLY_CONTENT_TYPE)
        if out is None:  # 404 on apply: the namespace is gone (being deleted)
            raise KubeError(f"cannot apply {obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']}: "
                            "not found", 404)
        return out

    def update_if_current(self, obj: dict[str, Any], resource_version: str) -> dict[str, Any]:
        """Merge-patch `obj` onto the object of its name only while that object is the one read at
        ``resource_version``: refused (KubeError 409) when it changed since, (404) when it is gone.
        Never creates it, where server-side apply creates an object deleted since the read whatever
        resourceVersion it carries (a deleted admin-key Secret came back with the old key)."""
        body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": resource_version}}
        out = self._patch(body, _content_type=MERGE_CONTENT_TYPE)
        if out is None:
            raise KubeError(f"{obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']} is gone "
                            "since it was read", 404)
        return out

    # -- the custom resource ----------------------------------------------------------------

    def get_infd(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call(self.custom.get_namespaced_custom_object, m.GROUP, m.VERSION, namespace, m.PLURAL, name)

    def patch_infd_status(self, namespace: str, name: str, status: dict[str, Any], *,
                          resource_version: str | None = None) -> dict[str, Any] | None:
        """JSON merge patch of the status subresource (None values delete fields). With
        ``resource_version`` the apiserver refuses it (KubeError 409) unless the object still has it."""
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return self._call(self.custom.patch_namespaced_custom_object_status, m.GROUP, m.VERSION, namespace,
                          m.PLURAL, name, body, _content_type=MERGE_CONTENT_TYPE)

    # -- reads --------------------------------------------------------------------------------

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        out = self._call(self.core.list_namespaced_pod, namespace, label_selector=label_selector)
        return list((out or {}).get("items") or [])

    def patch_infd_scale(self, namespace: str, name: str, replicas: int) -> dict[str, Any] | None:
        """Scale through the resource's scale subresource (spec.replicas), as an autoscaler does."""
        return self._call(self.custom.patch_namespaced_custom_object_scale, m.GROUP, m.VERSION, namespace,
                          m.PLURAL, name, {"spec": {"replicas": int(replicas)}}, _content_type=MERGE_CONTENT_TYPE)

    def autoscalers(self, namespace: str) -> list[dict[str, Any]]:
        """HorizontalPodAutoscalers and KEDA ScaledObjects of the namespace (the latter when KEDA is installed)."""
        hpas = self._call(self.autoscaling.list_namespaced_horizontal_pod_autoscaler, namespace)
        out = list((hpas or {}).get("items") or [])
        if self.served("keda.sh", "v1alpha1", "scaledobjects"):
            keda = self._call(self.custom.list_namespaced_custom_object, "keda.sh", "v1alpha1", namespace,
                              "scaledobjects")
            out += list((keda or {}).get("items") or [])
        return out

    def get_pvc(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call(self.core.read_namespaced_persistent_volume_claim, name, namespace)

    def get_pv(self, name: str) -> dict[str, Any] | None:
        """A PersistentVolume (cluster-scoped); None when it does not exist, KubeError (403) when not granted."""
        return self._call(self.core.read_persistent_volume, name)

    def served(self, group: str, version: str, plural: str, *, ttl: float = 60.0) -> bool:
        """Whether the apiserver serves group/version/plural (discovery; cached for `ttl` seconds)."""
        key = (group, version)
        with self._lock:
            cached = self._discovery.get(key)
        if cached and time.monotonic() - cached[0] < ttl:
            return plural in cached[1]
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self.custom.get_api_resources(group, version, _preload_content=False)
            names = {r["name"] for r in json.loads(resp.data).get("resources", [])}
        except ApiException as e:
            if e.status not in (404, 503):
                raise _api_error(e) from None
            names = set()
        with self._lock:
            self._discovery[key] = (time.monotonic(), names)
        return plural in names

    # -- events -------------------------------------------------------------------------------

    def event(self, involved: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Post a core/v1 Event about `involved` (an object with apiVersion, kind, metadata). Never raises."""
        meta = involved.get("metadata", {})
        ts = now_rfc3339()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name', 'kvtune')}.", "namespace": meta.get("namespace")},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                "name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.instance[:128],
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
        }
        try:
            self._call(self.core.create_namespaced_event, meta.get("namespace"), body)
        except KubeError as e:  # an event is worth a log line, never a failed reconcile
            log.warning("could not post event %s/%s: %s", reason, message, e)
