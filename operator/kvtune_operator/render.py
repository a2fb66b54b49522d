"""Children of an InferenceDeployment, rendered from the Jinja2 templates in templates/.

Pure: (resource, effective engine config, image, whether a PodMonitor is wanted) -> manifests.
Values go into the templates through ``tojson`` (JSON is YAML), so no value can break the YAML.

Contract with the engine container (kvtune serve):
  kvtune serve --model <spec.model.path> --served-model-name <name> --host 0.0.0.0 --port 8000
               --admin-port 8001 --config-file /etc/kvtune/engine.yaml --shutdown-timeout 50
               --device cpu|cuda [spec.extraArgs...]
(spec.simulate: ``--simulate <profile>`` instead of ``--model`` and ``--device``, and no model volume:
the simulated engine reads no weights and its device is the profile's.)
Port 8000 (``http``) serves the OpenAI API, port 8001 (``admin``) /metrics and /kvtune/v1/*, both
/health. The admin API answers only the key in the Secret ``<name>-admin-key`` (``KVTUNE_ADMIN_KEY``
from that Secret), which the operator creates once per InferenceDeployment and uses for its own
reads (at the address Prometheus scrapes: the admin port). The NetworkPolicy admits to 8000 the
clients spec.network.allowFrom names (default: the namespace), and to 8001 only the namespaces of
the operator and Prometheus and spec.network.allowMetricsFrom. vLLM serves everything on 8000.
The ConfigMap key ``engine.yaml`` holds every knob in ``EngineConfig.model_dump()`` form; the engine
watches it and applies the live knobs. The pod template carries ``kvtune.io/restart-hash``, a hash of
only the restart knobs, so a restart knob rolls the pods and a live knob does not, and
``kvtune.io/admin-key-hash``, a hash of the admin key: the container reads the key from the Secret
when it starts, so a new key (the Secret deleted and created again) rolls the pods onto it.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import jinja2
import yaml

from kvtune_engine.config import RESTART_KNOBS, EngineConfig
from kvtune_operator.effective import left_to_engine
from kvtune_operator.model import API_VERSION, KIND, InferenceDeployment
from kvtune_operator.pod_stop import DRAIN_TIMEOUT_S, PRESTOP_SLEEP_S, TERMINATION_GRACE_S
from kvtune_operator.render_vllm import VLLM_COMMAND, vllm_args, vllm_restart_hash

TEMPLATES = Path(__file__).with_name("templates")

PORT = 8000
ADMIN_PORT = 8001  # runtime kvtune: /metrics and the admin API
ENGINE_UID = 10001
CONFIG_DIR = "/etc/kvtune"
CONFIG_KEY = "engine.yaml"
CONFIG_FILE = f"{CONFIG_DIR}/{CONFIG_KEY}"
ENGINE_COMMAND = ["kvtune", "serve"]

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_INFD = "kvtune.io/inference-deployment"
ENGINE_APP = "kvtune-engine"
MANAGED_BY = "kvtune-operator"
LABEL_CANARY = "kvtune.io/canary"  # the canary Deployment's pod (a restart change on one pod first)
ANNOTATION_RESTART_HASH = "kvtune.io/restart-hash"
ANNOTATION_ADMIN_KEY_HASH = "kvtune.io/admin-key-hash"
ADMIN_KEY_ENV = "KVTUNE_ADMIN_KEY"
ADMIN_KEY_KEY = "admin-key"

#: Environment of every engine container (read-only root filesystem: caches go to /tmp).
BASE_ENV = {
    "HOME": "/tmp",
    "XDG_CACHE_HOME": "/tmp/.cache",
    "TRITON_CACHE_DIR": "/tmp/.triton",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@dataclasses.dataclass(frozen=True)
class Names:
    deployment: str
    service: str
    configmap: str
    podmonitor: str
    admin_secret: str
    networkpolicy: str


def child_names(name: str) -> Names:
    return Names(deployment=name, service=name, configmap=f"{name}-engine", podmonitor=name,
                 admin_secret=f"{name}-admin-key", networkpolicy=name)


def canary_names(name: str) -> Names:
    """The canary Deployment and its ConfigMap (a restart change runs on one pod first); the rest is
    the deployment's own (its Service, NetworkPolicy and PodMonitor select the canary's pod too)."""
    return dataclasses.replace(child_names(name), deployment=f"{name}-canary", configmap=f"{name}-canary-engine")


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment's (immutable) pod selector, also the Service's and the PodMonitor's."""
    return {LABEL_NAME: ENGINE_APP, LABEL_INSTANCE: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def common_labels(name: str) -> dict[str, str]:
    """Labels of every child and every engine pod; Prometheus reads inference_deployment from LABEL_INFD."""
    return {
        **selector_labels(name),
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/part-of": "kvtune",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_INFD: name,
    }


def restart_hash(config: EngineConfig) -> str:
    """Hash of the restart-only knobs: equal for configs that differ only in live knobs."""
    values = config.model_dump()
    canonical = json.dumps({k: values[k] for k in sorted(RESTART_KNOBS)}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def runtime_restart_hash(infd: InferenceDeployment, config: EngineConfig) -> str:
    """The pods' restart hash: the restart-only knobs on our engine, every knob on vLLM."""
    return vllm_restart_hash(config) if infd.spec.runtime == "vllm" else restart_hash(config)


def runtime_command(infd: InferenceDeployment, config: EngineConfig) -> tuple[list[str], list[str]]:
    """Container command and args of the runtime (vLLM: every knob on its command line)."""
    if infd.spec.runtime == "vllm":
        spec = infd.spec
        assert spec.model is not None  # the model's checks: runtime vllm is never simulated
        return VLLM_COMMAND, vllm_args(spec.model.path, spec.served_name(infd.metadata.name), PORT,
                                       config, omit=_left_to_engine(infd, config), extra=spec.extra_args)
    return ENGINE_COMMAND, engine_args(infd)


def engine_yaml(config: EngineConfig, omit: frozenset[str] = frozenset()) -> str:
    """The ConfigMap's engine.yaml: every knob but those left to the engine (``omit``: max_model_len
    when the spec does not set it, so the engine takes the model's context length)."""
    values = {k: v for k, v in config.model_dump().items() if k not in omit}
    return ("# Written by kvtune-operator from spec.engine (+ tuned values in status.engine); edits are "
            "overwritten.\n" + yaml.safe_dump(values, sort_keys=True))


def engine_args(infd: InferenceDeployment) -> list[str]:
    spec = infd.spec
    if spec.simulate is not None:
        source = ["--simulate", spec.simulate]
    else:
        assert spec.model is not None  # the model's checks: a model, unless simulated
        source = ["--model", spec.model.path]
    # The engine defaults to CPU; pods with GPUs run it on CUDA (a simulated engine's device is its profile).
    device = [] if spec.simulate is not None else ["--device", "cuda" if spec.resources.gpus else "cpu"]
    return [
        *source,
        "--served-model-name", spec.served_name(infd.metadata.name),
        "--host", "0.0.0.0",
        "--port", str(PORT),
        "--admin-port", str(ADMIN_PORT),
        "--config-file", CONFIG_FILE,
        "--shutdown-timeout", str(DRAIN_TIMEOUT_S),
        *device,
        *(spec.extra_args or []),  # last: they win
    ]


def owner_references(infd: InferenceDeployment) -> list[dict[str, Any]]:
    if not infd.metadata.uid:
        raise ValueError(f"{infd.metadata.name}: metadata.uid is required to own children")
    return [{
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": infd.metadata.name,
        "uid": infd.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }]


def _resources(infd: InferenceDeployment) -> dict[str, Any]:
    r = infd.spec.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if r.gpus:
        limits[r.gpu_resource_name] = r.gpus
    if r.memory:
        requests["memory"] = limits["memory"] = r.memory
    if r.cpu:
        requests["cpu"] = r.cpu
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _model_volume(infd: InferenceDeployment) -> dict[str, Any] | None:
    vol = infd.spec.weights_volume
    if vol is None:
        return None
    if vol.persistent_volume_claim is not None:
        pvc = vol.persistent_volume_claim
        return {"name": "model",
                "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": pvc.read_only}}
    assert vol.host_path is not None
    return {"name": "model", "hostPath": {"path": vol.host_path.path, "type": vol.host_path.type}}


#: libyaml's safe loader where PyYAML was built with it (the same documents at a tenth of the CPU: 0.27
#: against 2.7 ms for a 1 kB child; every reconcile parses each child it renders), else the pure-Python one
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        auto_reload=False,  # the templates ship with the package: no stat of each file at every render
    )


def _render(template: str, context: dict[str, Any]) -> dict[str, Any]:
    text = _env().get_template(template).render(**context)
    return yaml.load(text, Loader=SAFE_LOADER)


def _left_to_engine(infd: InferenceDeployment, config: EngineConfig) -> frozenset[str]:
    """Knobs not rendered: max_model_len unset in the spec (and untouched), the engine takes the model's
    context length (`effective.left_to_engine`, the same rule status.engine follows)."""
    return left_to_engine(infd.spec, config)


def render_admin_secret(infd: InferenceDeployment, admin_key: str) -> dict[str, Any]:
    """The Secret holding the engine's admin key (created once by the operator, owned by the resource)."""
    name = infd.metadata.name
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": child_names(name).admin_secret, "namespace": infd.metadata.namespace,
                         "labels": common_labels(name), "ownerReferences": owner_references(infd)},
            "data": {ADMIN_KEY_KEY: base64.b64encode(admin_key.encode()).decode()}}


def admin_key_hash(admin_key: str) -> str:
    """What the pod template carries of the admin key: enough to tell two keys apart, nothing to use."""
    return hashlib.sha256(b"kvtune-admin-key\0" + admin_key.encode()).hexdigest()[:16]


def admin_key_of(secret: dict[str, Any] | None) -> str | None:
    """The admin key in a Secret rendered by ``render_admin_secret`` (None: absent or unreadable)."""
    try:
        return base64.b64decode(((secret or {}).get("data") or {})[ADMIN_KEY_KEY]).decode() or None
    except (KeyError, ValueError, TypeError):
        return None


def _env_list(infd: InferenceDeployment) -> list[dict[str, Any]]:
    env: dict[str, dict[str, Any]] = {k: {"name": k, "value": v} for k, v in BASE_ENV.items()}
    env[ADMIN_KEY_ENV] = {"name": ADMIN_KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": child_names(infd.metadata.name).admin_secret, "key": ADMIN_KEY_KEY}}}
    for e in infd.spec.env or []:
        if e.secret_key_ref is not None:
            env[e.name] = {"name": e.name, "valueFrom": {"secretKeyRef": {"name": e.secret_key_ref.name,
                                                                            "key": e.secret_key_ref.key}}}
        elif e.name != ADMIN_KEY_ENV:
            env[e.name] = {"name": e.name, "value": e.value}
    return list(env.values())


def _peers(listed: list | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in listed or []:
        peer: dict[str, Any] = {"podSelector": {"matchLabels": p.pod_selector} if p.pod_selector else {}}
        if p.namespace_selector is not None:
            peer["namespaceSelector"] = {"matchLabels": p.namespace_selector}
        out.append(peer)
    return out


def _network_rules(infd: InferenceDeployment, always_namespaces: tuple[str, ...]) -> list[dict[str, Any]]:
    """The NetworkPolicy's ingress rules: the API port to spec.network.allowFrom (default: this
    namespace), the admin port to the operator's and Prometheus' namespaces and
    spec.network.allowMetricsFrom; on vLLM, which has one port for all, the union to that port."""
    net = infd.spec.network
    always = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}} for ns in always_namespaces]
    clients = _peers(net.allow_from if net else None) or [{"podSelector": {}}]  # default: this namespace
    monitors = [*always, *_peers(net.allow_metrics_from if net else None)]
    if infd.spec.runtime == "vllm":
        return [{"from": clients + [p for p in monitors if p not in clients], "ports": [_tcp(PORT)]}]
    rules = [{"from": clients, "ports": [_tcp(PORT)]}]
    return rules + [{"from": monitors, "ports": [_tcp(ADMIN_PORT)]}] if monitors else rules


def _tcp(port: int) -> dict[str, Any]:
    return {"port": port, "protocol": "TCP"}


def _context(infd: InferenceDeployment, config: EngineConfig, image: str, allow_namespaces: tuple[str, ...],
             admin_key: str | None) -> dict[str, Any]:
    """What the templates read, for the deployment's own children."""
    name = infd.metadata.name
    vol = infd.spec.weights_volume
    return {
        "spec": infd.spec,
        "replicas": infd.spec.replicas,
        "namespace": infd.metadata.namespace,
        "names": child_names(name),
        "labels": common_labels(name),
        "pod_labels": common_labels(name),
        "selector": selector_labels(name),
        "owner_references": owner_references(infd),
        "restart_hash": runtime_restart_hash(infd, config),
        "admin_key_hash": admin_key_hash(admin_key) if admin_key else None,
        "config_key": CONFIG_KEY,
        "config_dir": CONFIG_DIR,
        "engine_yaml": engine_yaml(config, _left_to_engine(infd, config)),
        "image": image,
        "command": runtime_command(infd, config)[0],
        "args": runtime_command(infd, config)[1],
        "port": PORT,
        "admin_port": None if infd.spec.runtime == "vllm" else ADMIN_PORT,
        "uid": ENGINE_UID,
        "termination_grace_s": TERMINATION_GRACE_S,
        "prestop_sleep_s": PRESTOP_SLEEP_S,
        "env": _env_list(infd),
        "network_rules": _network_rules(infd, allow_namespaces),
        "resources": _resources(infd),
        "tolerations": [t.dump() for t in infd.spec.tolerations or []],
        "model_volume": _model_volume(infd),
        "model_volume_spec": vol,
        "model_read_only": True if vol is None or vol.persistent_volume_claim is None
                           else vol.persistent_volume_claim.read_only,
        "scrape_interval": infd.spec.metrics.scrape_interval,
    }


def render_children(infd: InferenceDeployment, config: EngineConfig, *, image: str,
                    pod_monitor: bool, allow_namespaces: tuple[str, ...] = (),
                    admin_key: str | None = None) -> list[dict[str, Any]]:
    """The ConfigMap, Deployment, Service, NetworkPolicy (and PodMonitor) of one InferenceDeployment
    (the admin key's Secret is ``render_admin_secret``'s; ownership.apply_order orders the apply).
    ``allow_namespaces``: namespaces always admitted by the NetworkPolicy (operator, Prometheus).
    ``admin_key``: the key in the Secret, whose hash the pod template carries."""
    context = _context(infd, config, image, allow_namespaces, admin_key)
    children = [_render("configmap.yaml.j2", context), _render("deployment.yaml.j2", context),
                _render("service.yaml.j2", context), _render("networkpolicy.yaml.j2", context)]
    if pod_monitor:
        children.append(_render("podmonitor.yaml.j2", context))
    return children


def render_canary(infd: InferenceDeployment, config: EngineConfig, *, image: str,
                  admin_key: str | None = None, replicas: int = 1) -> list[dict[str, Any]]:
    """The ConfigMap and the Deployment of a restart change's canary: the deployment's pod template
    with ``config`` (status.engine plus the pending change), its one pod labelled LABEL_CANARY
    (``replicas`` 0 between canaries: canary_children.py).
    Its pod carries the deployment's selector labels, so the Service sends it its share and Prometheus
    scrapes it; the deployment's own ReplicaSets leave it alone (it has its own controller)."""
    name = infd.metadata.name
    context = _context(infd, config, image, (), admin_key)
    canary = {LABEL_CANARY: "true"}
    context.update(replicas=replicas, names=canary_names(name), labels={**common_labels(name), **canary},
                   pod_labels={**common_labels(name), **canary}, selector={**selector_labels(name), **canary})
    return [_render("configmap.yaml.j2", context), _render("deployment.yaml.j2", context)]
