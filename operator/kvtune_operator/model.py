"""The InferenceDeployment resource as pydantic models: the single source of truth for the CRD.

`crd.py` turns these models into the CRD's structural OpenAPI schema (descriptions, defaults,
enums, bounds, and the cross-field CEL rules attached here with ``x-kubernetes-validations``), so
``kubectl explain`` and the apiserver's validation say exactly what this file says.

`spec.engine`, status.engine and `spec.autotune.bounds` are made from the engine's knob table
(kvtune_engine.knobs, which EngineConfig is made from too): the fields, their defaults, doc lines,
allowed ranges and vLLM flags come from it, not retyped. Two fields carry
their unit in the name (``swapSpaceGiB``, ``kvCacheMemoryGiB``); everything else is vLLM's flag name
in camelCase (``--max-num-seqs`` -> ``maxNumSeqs``).

Torch-free and kopf-free: the tuner, the CLI and the tests import this module freely.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Callable, ClassVar, Literal, Mapping, NamedTuple

from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic.alias_generators import to_camel

from kvtune_engine.knobs import BOOLS, BOUNDED_KNOBS, BY_NAME, TABLE, VLLM_LACKS, Knob
from kvtune_engine.sim.profiles import PROFILES

from .tuner.canary import CanaryJudgement
from .tuner.canary import Gates as CanaryGateValues

GROUP = "kvtune.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ["infd"]
CATEGORIES = ["kvtune"]

# --------------------------------------------------------------------------------------------
# Knob names: EngineConfig's snake_case <-> spec.engine's camelCase
# --------------------------------------------------------------------------------------------

#: EngineConfig field (snake_case) -> spec.engine field (camelCase), in EngineConfig's order (the
#: knob table's names: two carry their unit, ``swapSpaceGiB`` and ``kvCacheMemoryGiB``).
KNOBS: dict[str, str] = {k.name: k.camel for k in TABLE}
#: spec.engine field (camelCase) -> EngineConfig field (snake_case).
KNOBS_BY_CAMEL: dict[str, str] = {camel: snake for snake, camel in KNOBS.items()}

#: Bounds tighter than the engine's own (a cluster-facing safety margin): the knob table's `allowed`.
GPU_MEMORY_UTILIZATION_RANGE = BY_NAME["gpu_memory_utilization"].allowed


def _spec_metadata(k: Knob) -> list[Any]:
    """The bounds of a knob in the resource: the engine's limits, narrowed to the knob table's
    `allowed` range (its lower end where tighter than the engine's, its upper end always: every knob
    the resource takes has a maximum, so the apiserver refuses 1e308 instead of the operator failing)."""
    if k.allowed is None:
        return list(k.limits)
    lo, hi = k.allowed
    lower = [m for m in k.limits if isinstance(m, (Ge, Gt))]
    engine_lo = max((m.ge if isinstance(m, Ge) else m.gt for m in lower), default=None)
    if engine_lo is None or lo > engine_lo:
        lower = [Ge(lo)]
    return [*lower, Le(hi)]


def to_engine_dict(camel_values: dict[str, Any]) -> dict[str, Any]:
    """spec/status engine values (camelCase) -> EngineConfig keyword arguments (snake_case)."""
    return {KNOBS_BY_CAMEL[k]: v for k, v in camel_values.items() if k in KNOBS_BY_CAMEL}


def to_camel_dict(engine_values: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig values (snake_case) -> spec/status engine values (camelCase)."""
    return {KNOBS[k]: v for k, v in engine_values.items() if k in KNOBS}


def _knob_note(k: Knob) -> str:
    how = ("Changing it restarts the engine pods (a rolling update)." if k.restart
           else "Applied live through the engine's config file; no restart.")
    return f" {how} " + (f"vLLM flag {k.vllm}." if k.vllm else "vLLM has no such flag (runtime vllm refuses it).")


def _knob_field(k: Knob, *, with_default: bool) -> tuple[Any, Any]:
    """(annotation, FieldInfo) of one knob for spec.engine (defaults) or status (all optional), from
    the knob table: its doc line, how it applies, vLLM's flag, its allowed range or choices."""
    annotation: Any = Literal[k.choices] if k.choices and k.type is not bool else k.type  # type: ignore[valid-type]
    metadata = [] if k.choices else _spec_metadata(k)
    description = k.doc + _knob_note(k)
    if k.from_model:  # unset: what the engine takes from the model, which only the engine knows
        description += f" Default: {k.from_model}."
    default = k.default if with_default and not k.from_model else None
    if metadata:
        annotation = Annotated[(annotation, *metadata)]
    if default is None:
        annotation = annotation | None
    return annotation, Field(default, alias=k.camel, description=description)


class CRDModel(BaseModel):
    """Base of all resource models: camelCase on the wire, unknown fields ignored when reading."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore",
                              use_enum_values=True)

    #: admission rules the operator checks as the apiserver does (each is also a CEL rule of the CRD)
    _checks: ClassVar[tuple["Check", ...]] = ()

    @model_validator(mode="after")
    def _run_checks(self) -> "CRDModel":
        for check in type(self)._checks:
            if not check.ok(self):
                raise ValueError(check.message)
        return self

    def dump(self) -> dict[str, Any]:
        """The wire form: camelCase, without unset/None fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    @classmethod
    def checked(cls, wire: Mapping[str, Any]) -> dict[str, Any]:
        """``wire``, status written as a dict merged from parts (camelCase; None: the field removed by
        the merge patch), checked against this model: a name the model lacks is an error (reading
        ignores unknown fields, writing must not invent them) and every value is validated. Returned
        as given, so that the removals stay in the patch."""
        known = {f.alias or n for n, f in cls.model_fields.items()}
        unknown = sorted(set(wire) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}")
        cls.model_validate({k: v for k, v in wire.items() if v is not None})
        return dict(wire)


# --------------------------------------------------------------------------------------------
# Shared types
# --------------------------------------------------------------------------------------------

DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")

Duration = Annotated[str, Field(pattern=DURATION_PATTERN, max_length=32)]
Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]
Timestamp = Annotated[datetime, Field()]

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """'1m30s' -> 90.0 seconds (the Go/Kubernetes duration syntax, without µs/ns)."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 5m, 1h30m, 250ms)")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in re.findall(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)", text))


def _object_default(model: type["CRDModel"]) -> dict[str, Any]:
    """Schema default of an object whose fields all have defaults: all of them, spelled out (the
    apiserver checks an object default against the object's CEL rules as it is written)."""
    return {"default": model().dump()}


def _rules(*rules: dict[str, str]) -> dict[str, Any]:
    """json_schema_extra carrying CEL validation rules (x-kubernetes-validations)."""
    return {"x-kubernetes-validations": list(rules)}


class Check(NamedTuple):
    """One admission rule said twice: in CEL for the apiserver (``rule``) and in Python for the
    operator (``ok``), with one message that says what was wrong and what is allowed. A model lists
    its checks in ``_checks`` and their CEL in its ``json_schema_extra`` (``_rules(*cel(...))``)."""

    rule: str
    message: str
    ok: Callable[[Any], bool]
    field_path: str | None = None

    def cel(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def cel(checks: tuple[Check, ...]) -> list[dict[str, str]]:
    return [c.cel() for c in checks]


# --------------------------------------------------------------------------------------------
# The trust model: what the resource may not set (README, "Trust model")
# --------------------------------------------------------------------------------------------

#: Variables of spec.env that are refused: the operator's and the engine's own (KVTUNE_*: the admin
#: key, the ports, KVTUNE_EXT_DIR from which the engine loads its kernels' .so files), what the
#: dynamic loader and Python load before any of our code runs (LD_*, PYTHON*, PATH), and vLLM's
#: switches that open its API to more than completions. KVTUNE_API_KEY (the /v1 key) is allowed, as
#: is every other name (vLLM's tuning variables such as VLLM_CPU_OMP_THREADS_BIND among them).
RESERVED_ENV_PREFIXES = ("KVTUNE_", "LD_", "PYTHON")
ALLOWED_ENV = ("KVTUNE_API_KEY",)
RESERVED_ENV = ("PATH", "VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_PLUGINS")
#: The operator's admin-key Secrets are named <InferenceDeployment>-admin-key.
ADMIN_KEY_SECRET_SUFFIX = "-admin-key"


def reserved_env(name: str) -> bool:
    return name not in ALLOWED_ENV and (name.startswith(RESERVED_ENV_PREFIXES) or name in RESERVED_ENV)


def _flags_of_knobs() -> tuple[str, ...]:
    out: list[str] = []
    for k in TABLE:
        for flag in dict.fromkeys(f for f in (k.flag, k.vllm) if f):
            out += [flag, "--no-" + flag[2:]] if k.choices == BOOLS else [flag]
    return tuple(out)


#: Flags spec.extraArgs may not carry, on either runtime (kvtune serve, vllm serve): those the
#: operator sets (model, name, listen address and ports, config file, drain time: the Service, the
#: NetworkPolicy and the probes rely on them), those that decide what the engine trusts (keys, remote
#: code, a config file of more flags, local files and plugins it would load), and every knob's flag
#: (knobs belong in spec.engine, where their bounds are checked and the tuner sees them).
OPERATOR_FLAGS = ("--model", "--served-model-name", "--host", "--port", "--admin-port", "--config-file",
                  "--shutdown-timeout")
TRUST_FLAGS = ("--api-key", "--admin-key", "--trust-remote-code", "--no-trust-remote-code", "--config", "--uds",
               "--allowed-local-media-path", "--tool-parser-plugin", "--kv-offloading-backend")
RESERVED_FLAGS = tuple(dict.fromkeys(OPERATOR_FLAGS + TRUST_FLAGS + _flags_of_knobs()))


def reserved_arg(arg: str) -> str | None:
    """The reserved flag `arg` sets (``--flag``, ``--flag=value``, ``--flag_name`` as vLLM reads it, or
    an abbreviation argparse would expand), else None."""
    if not arg.startswith("--") or len(arg) == 2:
        return None
    flag = arg.split("=")[0].split(" ")[0].replace("_", "-")
    return next((f for f in RESERVED_FLAGS if f.startswith(flag)), None)


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


#: `$(VAR)` is expanded by Kubernetes in a container's args and env values, from the container's
#: environment (Secret values included): refused in every field of ours that lands there.
EXPANSION = "$("
_NO_EXPANSION = ("must not contain '$(': Kubernetes expands $(VAR) there from the container's environment, "
                 "Secret values included; write the text without '$('")


# --------------------------------------------------------------------------------------------
# spec
# --------------------------------------------------------------------------------------------

class PersistentVolumeClaimSource(CRDModel):
    """A PersistentVolumeClaim in the InferenceDeployment's namespace that holds the weights."""

    claim_name: str = Field(..., min_length=1, max_length=253, description="Name of the PersistentVolumeClaim.")
    read_only: bool = Field(True, description="Mount the claim read-only (the engine never writes weights).")


class HostPathSource(CRDModel):
    """A directory on the node that holds the weights (single-node and test clusters)."""

    path: str = Field(..., min_length=1, max_length=4096, pattern=r"^/", description="Absolute directory on the node.")
    type: Literal["", "Directory", "DirectoryOrCreate"] = Field(
        "Directory", description="hostPath type check done by the kubelet before mounting.")


class ModelVolume(CRDModel):
    """Where the weights come from: exactly one of persistentVolumeClaim or hostPath."""

    model_config = ConfigDict(json_schema_extra=_rules(
        {"rule": "has(self.persistentVolumeClaim) != has(self.hostPath)",
         "message": "set exactly one of persistentVolumeClaim or hostPath"},
        {"rule": "!(self.mountPath in ['/etc/kvtune', '/tmp', '/dev/shm', '/'])",
         "message": "mountPath must not be /, /etc/kvtune, /tmp or /dev/shm (the operator mounts those)",
         "fieldPath": ".mountPath"},
    ))

    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(
        None, description="Mount a PersistentVolumeClaim (the usual choice in production).")
    host_path: HostPathSource | None = Field(None, description="Mount a directory of the node.")
    mount_path: str = Field("/models", min_length=1, max_length=4096, pattern=r"^/",
                            description="Where the volume is mounted in the engine container; model.path "
                                        "must lie inside it.")
    sub_path: str | None = Field(None, max_length=4096, pattern=r"^[^/]",
                                 description="Mount only this sub-directory of the volume.")


_MODEL_CHECKS = (
    Check("!self.path.contains('$(')", "model.path " + _NO_EXPANSION, lambda m: EXPANSION not in m.path, ".path"),
    Check("!has(self.servedModelName) || !self.servedModelName.contains('$(')", "model.servedModelName " + _NO_EXPANSION,
          lambda m: EXPANSION not in (m.served_model_name or ""), ".servedModelName"),
)


class ModelSpec(CRDModel):
    """The model to serve. Weights are a local directory in Hugging Face layout; never fetched at run time."""

    model_config = ConfigDict(json_schema_extra=_rules(
        {"rule": "!has(self.volume) || self.path == self.volume.mountPath || "
                 "self.path.startsWith(self.volume.mountPath.endsWith('/') ? self.volume.mountPath "
                 ": self.volume.mountPath + '/')",
         "message": "model.path must lie inside model.volume.mountPath, where the volume is mounted",
         "fieldPath": ".path"},
        *cel(_MODEL_CHECKS),
    ))
    _checks = _MODEL_CHECKS

    path: str = Field(..., min_length=2, max_length=4096, pattern=r"^/",
                      description="Absolute path of the model directory inside the engine container "
                                  "(config.json, *.safetensors, tokenizer.json), e.g. /models/Qwen3-8B.")
    served_model_name: str | None = Field(
        None, min_length=1, max_length=253,
        description="Model name clients send in OpenAI requests; defaults to the InferenceDeployment's name.")
    volume: ModelVolume | None = Field(
        None, description="Volume holding the weights, mounted at mountPath. Omit when the weights are in the image.")


class Resources(CRDModel):
    """Compute resources of each engine pod."""

    gpus: int = Field(1, ge=0, le=16, description="GPUs per pod (0 runs the engine on CPU).")
    gpu_resource_name: str = Field("nvidia.com/gpu", min_length=1, max_length=253,
                                   description="Extended resource name of the GPU device plugin.")
    memory: Quantity | None = Field(None, description="Memory request and limit of the engine container, e.g. 48Gi.")
    cpu: Quantity | None = Field(None, description="CPU request of the engine container, e.g. 8.")


class Toleration(CRDModel):
    """A Kubernetes toleration (the core/v1 fields)."""

    key: str | None = Field(None, max_length=317, description="Taint key; empty with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: str | None = Field(None, max_length=63, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty matches all effects.")
    toleration_seconds: int | None = Field(None, ge=0, description="For NoExecute: how long the pod stays bound.")


class SecretKeyRef(CRDModel):
    """A key of a Secret in the resource's namespace."""

    name: str = Field(..., min_length=1, max_length=253, description="Secret name.")
    key: str = Field(..., min_length=1, max_length=253, description="Key in the Secret's data.")


_ENV_CHECKS = (
    Check(f"self.name in {_cel_list(ALLOWED_ENV)} || !(self.name in {_cel_list(RESERVED_ENV)} || "
          + " || ".join(f"self.name.startsWith({json.dumps(p)})" for p in RESERVED_ENV_PREFIXES) + ")",
          "env name is reserved: KVTUNE_* (the operator's and the engine's own variables, e.g. KVTUNE_ADMIN_KEY, "
          "KVTUNE_EXT_DIR; KVTUNE_API_KEY is allowed), LD_* and PYTHON* (what the loader and Python load), PATH, "
          "and vLLM's " + ", ".join(RESERVED_ENV[1:]) + "; other names are allowed, VLLM_* tuning variables "
          "such as VLLM_CPU_OMP_THREADS_BIND among them",
          lambda e: not reserved_env(e.name), ".name"),
    Check("!self.value.contains('$(')", "env value " + _NO_EXPANSION,
          lambda e: EXPANSION not in e.value, ".value"),
    Check(f"!has(self.secretKeyRef) || !self.secretKeyRef.name.endsWith('{ADMIN_KEY_SECRET_SUFFIX}')",
          f"secretKeyRef must not name an admin-key Secret of the operator (<name>{ADMIN_KEY_SECRET_SUFFIX}): its "
          "key retunes an engine and reads its request trace; name a Secret of your own",
          lambda e: e.secret_key_ref is None or not e.secret_key_ref.name.endswith(ADMIN_KEY_SECRET_SUFFIX),
          ".secretKeyRef.name"),
)


class EnvVar(CRDModel):
    """An extra environment variable of the engine container (reserved names are refused: README,
    "Trust model")."""

    model_config = ConfigDict(json_schema_extra=_rules(*cel(_ENV_CHECKS)))
    _checks = _ENV_CHECKS

    name: str = Field(..., min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                      description="Variable name.")
    value: str = Field("", max_length=32768, description="Variable value (ignored with secretKeyRef).")
    secret_key_ref: SecretKeyRef | None = Field(
        None, description="Take the value from a key of a Secret in the same namespace (e.g. KVTUNE_API_KEY, "
                          "the engine's /v1 API key, so that it never sits in plain text in this resource).")


class NetworkPeer(CRDModel):
    """Clients allowed to reach the engine's port: pods matching both selectors (an omitted one: any)."""

    namespace_selector: dict[str, str] | None = Field(
        None, description="Labels of the clients' namespaces; omitted: this resource's namespace.")
    pod_selector: dict[str, str] | None = Field(None, description="Labels of the client pods; omitted: all pods.")


class NetworkSpec(CRDModel):
    """Who may connect to the engine pods (a NetworkPolicy the operator renders)."""

    allow_from: list[NetworkPeer] | None = Field(
        None, max_length=32,
        description="Clients of the OpenAI API (port 8000). Default: every pod of this resource's namespace.")
    allow_metrics_from: list[NetworkPeer] | None = Field(
        None, max_length=32,
        description="Besides the operator and Prometheus (the operator's settings, always allowed), who may reach "
                    "/metrics and the admin API (port 8001; vLLM serves /metrics on 8000), e.g. the Gateway API "
                    "Inference Extension's endpoint picker (run it with --model-server-metrics-port 8001). The "
                    "admin API also needs the admin key the operator keeps in the Secret <name>-admin-key.")


_ENGINE_RULES = _rules(
    {"rule": "self.maxNumBatchedTokens >= self.blockSize",
     "message": "maxNumBatchedTokens must be at least blockSize: one step has to fit one block",
     "fieldPath": ".maxNumBatchedTokens"},
    {"rule": "self.enableChunkedPrefill || !has(self.maxModelLen) || self.maxNumBatchedTokens >= self.maxModelLen",
     "message": "without chunked prefill, maxNumBatchedTokens must be at least maxModelLen, or long "
                "prompts could never be scheduled; enable chunked prefill or raise the budget",
     "fieldPath": ".maxNumBatchedTokens"},
)

class _EngineSpecBase(CRDModel):
    model_config = ConfigDict(json_schema_extra=_ENGINE_RULES)


def engine_models(table: tuple[Knob, ...] = TABLE) -> tuple[type[CRDModel], type[CRDModel]]:
    """spec.engine (every knob of ``table``, camelCase, the engine's defaults) and status.engine /
    tuning before-after (the same knobs, all optional, no defaults)."""
    spec = create_model(  # type: ignore[call-overload]
        "EngineSpec", __base__=_EngineSpecBase,
        __doc__="The engine's KV-cache and scheduling knobs: the user's baseline (vLLM's flag names in "
                "camelCase). Tuned values never overwrite these: they live in status.engine.",
        **{k.name: _knob_field(k, with_default=True) for k in table})
    knobs = create_model(  # type: ignore[call-overload]
        "EngineKnobs", __base__=CRDModel, __doc__="Engine knobs (camelCase, as in spec.engine).",
        **{k.name: _knob_field(k, with_default=False) for k in table})
    return spec, knobs


EngineSpec, EngineKnobs = engine_models()


class AutotuneMode(str, Enum):
    OFF = "Off"
    RECOMMEND = "Recommend"
    APPLY = "Apply"


class IntRange(CRDModel):
    """An inclusive integer range; an omitted end means the knob's own limit."""

    model_config = ConfigDict(json_schema_extra=_rules(
        {"rule": "!has(self.min) || !has(self.max) || self.min <= self.max",
         "message": "min must not be greater than max"}))

    min: int | None = Field(None, ge=1, description="Smallest value the tuner may choose.")
    max: int | None = Field(None, ge=1, description="Largest value the tuner may choose.")


class _Range(CRDModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        {"rule": "!has(self.min) || !has(self.max) || self.min <= self.max",
         "message": "min must not be greater than max"}))


def _range_model(k: Knob) -> type[CRDModel]:
    """The bounds of one ranged knob: min and max inside its allowed range."""
    lo, hi = k.allowed or (None, None)
    end = lambda which: (k.type | None, Field(None, ge=lo, le=hi,  # noqa: E731
                                              description=f"{which} {k.camel} the tuner may choose."))
    return create_model(  # type: ignore[call-overload]
        k.camel[0].upper() + k.camel[1:] + "Range", __base__=_Range,
        __doc__=f"An inclusive range of {k.camel}; an omitted end means the allowed limit ({lo:g} / {hi:g}).",
        min=end("Smallest"), max=end("Largest"))


#: Knobs the tuner may change (the others stay at the baseline); a subset may be frozen by the user.
TUNABLE_KNOBS = BOUNDED_KNOBS
TunableKnob = Literal[tuple(KNOBS[k] for k in TUNABLE_KNOBS)]  # type: ignore[valid-type]
#: Knobs spec.autotune.bounds ranges (the switches are only frozen or not)
RANGED_KNOBS = tuple(k.name for k in TABLE if k.bounded and k.search)


_REPLICAS_BOUND = (IntRange | None, Field(
        None, description="Range of replicas the tuner may scale to (scale subresource, Apply mode) when one "
                          "engine is compute-bound and no knob helps; never while a HorizontalPodAutoscaler or a "
                          "KEDA ScaledObject targets the deployment. Omitted: the replica count is only predicted."))


def bounds_model(table: tuple[Knob, ...] = TABLE) -> type[CRDModel]:
    """spec.autotune.bounds: a subset of the choices (block size) or a range per bounded knob."""
    fields: dict[str, Any] = {}
    for k in table:
        if not k.bounded or k.type is bool:
            continue
        if k.choices:
            fields[k.name] = (list[Literal[k.choices]] | None, Field(  # type: ignore[valid-type]
                None, alias=k.camel, min_length=1, max_length=len(k.choices),
                json_schema_extra={"x-kubernetes-list-type": "set"},
                description=f"Values of {k.camel} the tuner may choose, a subset of {list(k.choices)}."))
        else:
            fields[k.name] = (_range_model(k) | None, Field(None, alias=k.camel, description=f"Range of {k.camel}."))
    return create_model(  # type: ignore[call-overload]
        "Bounds", __base__=CRDModel, **fields, replicas=_REPLICAS_BOUND,
        __doc__="Per-knob limits the tuner never leaves. An omitted knob may range over all its allowed values.")


Bounds = bounds_model()


class Objectives(CRDModel):
    """Service-level targets the tuner optimises for (goodput under these, then throughput)."""

    ttft_p95: Duration | None = Field(None, alias="ttftP95", description="95th percentile time to first token, e.g. 2s.")
    tpot_p95: Duration | None = Field(None, alias="tpotP95", description="95th percentile time per output token, e.g. 100ms.")
    queue_time_p95: Duration | None = Field(None, alias="queueTimeP95", description="95th percentile queue time, e.g. 1s.")
    max_preemptions_per_minute: float | None = Field(
        None, ge=0, description="Preemptions per minute (swap + recompute) above which the config is rejected.")


class CanaryGates(CRDModel):
    """What a canary engine must show against its untouched siblings over the same window to be
    promoted. Omitted gates: goodputRatioMin 0.9 (today's before/after rule: a fall of more than 10%
    is a regression), no ttft or error gate."""

    goodput_ratio_min: float | None = Field(
        None, ge=0, description="Least canary / controls slo attainment (share of requests meeting the objectives), "
                                "e.g. 1.0 for not lower. Default 0.9.")
    ttft_p99_ratio_max: float | None = Field(
        None, gt=0, description="Most canary / controls p99 ttft, e.g. 1.25. Default: no ttft gate.")
    error_rate_max: float | None = Field(
        None, ge=0, le=1, description="Most share of the canary's requests that fail, e.g. 0.01. Default: no error gate.")

    def gates(self) -> CanaryGateValues:
        """The tuner's gates, the defaults filled in."""
        d = CanaryGateValues()
        return CanaryGateValues(self.goodput_ratio_min if self.goodput_ratio_min is not None else d.goodput_ratio_min,
                                self.ttft_p99_ratio_max, self.error_rate_max)


class CanarySpec(CRDModel):
    """Canary verification (two or more replicas): a change goes to one engine first, is judged against
    the others over the same window, then promoted to all or reverted. One replica keeps the
    before/after verdict."""

    gates: CanaryGates | None = Field(None, description="What the canary must show to be promoted.")
    max_windows: int | None = Field(
        None, ge=1, le=10, description="Windows a canary may run while its goodput gate reads within the sampling "
                                       "noise of its limit (its share of requests is a sample): it measures on, "
                                       "and at the last window the figures decide as they are. Default 3; 1 "
                                       "judges after one window whatever the noise.")


#: Where autotune.interval and autotune.window may go (seconds): a round more often than every 5 s
#: reads windows of less than one scrape; less often than hourly, or a window of more than an hour,
#: is no closed loop.
INTERVAL_RANGE = (5.0, 3600.0)
WINDOW_RANGE = (10.0, 3600.0)


def _fmt(seconds: float) -> str:
    return f"{seconds / 3600:g}h" if seconds >= 3600 else f"{seconds:g}s"


def _duration_check(field: str, attr: str, lo: float, hi: float, why: str) -> Check:
    return Check(f"!has(self.{field}) || (duration(self.{field}) >= duration('{_fmt(lo)}') && "
                 f"duration(self.{field}) <= duration('{_fmt(hi)}'))",
                 f"autotune.{field} must be between {_fmt(lo)} and {_fmt(hi)} ({why})",
                 lambda a: getattr(a, attr) is None or lo <= parse_duration(getattr(a, attr)) <= hi, f".{field}")


_AUTOTUNE_CHECKS = (
    _duration_check("interval", "interval", *INTERVAL_RANGE, "how often the tuner looks, e.g. 60s"),
    _duration_check("window", "window", *WINDOW_RANGE, "the metrics each decision reads, e.g. 5m"),
    Check("!has(self.interval) || !has(self.window) || duration(self.window) >= duration(self.interval)",
          "autotune.window must be at least autotune.interval: each round reads the window before it, and a "
          "shorter one would leave what happened between two rounds unread",
          lambda a: a.interval is None or a.window is None
          or parse_duration(a.window) >= parse_duration(a.interval), ".window"),
)


class AutotuneSpec(CRDModel):
    """Closed-loop tuning of the engine knobs. Omitted fields take the operator's defaults."""

    model_config = ConfigDict(json_schema_extra=_rules(*cel(_AUTOTUNE_CHECKS)))
    _checks = _AUTOTUNE_CHECKS

    mode: AutotuneMode | None = Field(
        None, description="Off (quote it in YAML: \"Off\"): run spec.engine as written. Recommend: diagnose and predict, record the "
                          "recommendation in status, change nothing. Apply: also apply it, verify it and roll it "
                          "back if it did not help. Default: the operator's setting (Recommend unless configured).")
    interval: Duration | None = Field(
        None, description=f"How often the tuner looks, e.g. 60s; {_fmt(INTERVAL_RANGE[0])} to {_fmt(INTERVAL_RANGE[1])}. "
                          "Default: operator setting.")
    window: Duration | None = Field(
        None, description=f"Observation window of metrics per decision, e.g. 5m; {_fmt(WINDOW_RANGE[0])} to "
                          f"{_fmt(WINDOW_RANGE[1])}, at least the interval. Default: operator setting.")
    cooldown: Duration | None = Field(
        None, description="Least time between two restart-requiring changes, e.g. 15m. Default: operator setting.")
    objectives: Objectives | None = Field(None, description="Targets the tuner optimises for.")
    bounds: Bounds | None = Field(None, description="Per-knob limits; the baseline in spec.engine must lie inside them.")
    frozen_knobs: list[TunableKnob] | None = Field(  # type: ignore[valid-type]
        None, max_length=len(TUNABLE_KNOBS), json_schema_extra={"x-kubernetes-list-type": "set"},
        description="Knobs the tuner must never change, whatever the bounds.")
    canary: CanarySpec | None = Field(None, description="Canary verification with two or more replicas: gates.")


class MetricsSpec(CRDModel):
    """Where the engine's metrics are read from and how they are scraped."""

    prometheus_url: str | None = Field(
        None, max_length=2048, pattern=r"^https?://",
        description="Prometheus the tuner queries, e.g. http://prometheus-operated.monitoring:9090. "
                    "Default: the operator's setting.")
    scrape_interval: Duration = Field("15s", description="Scrape interval written into the PodMonitor.")


def _bounds_rule(knob: str) -> dict[str, str]:
    b = f"self.autotune.bounds.{knob}"
    return {
        "rule": f"!has(self.autotune) || !has(self.autotune.bounds) || !has({b}) || "
                f"((!has({b}.min) || self.engine.{knob} >= {b}.min) && "
                f"(!has({b}.max) || self.engine.{knob} <= {b}.max))",
        "message": f"engine.{knob} must lie inside autotune.bounds.{knob}: the baseline has to be a value "
                   "the tuner may choose",
        "fieldPath": f".engine.{knob}",
    }


def _vllm_lacks_rule(name: str) -> dict[str, str]:
    default = BY_NAME[name].default
    lit = json.dumps(default) if not isinstance(default, bool) else str(default).lower()
    unset = f"!has(self.engine.{KNOBS[name]})" if default is None else f"self.engine.{KNOBS[name]} == {lit}"
    return {"rule": f"self.runtime != 'vllm' || {unset}",
            "message": f"runtime vllm has no {KNOBS[name]} (vLLM lacks the knob): leave it "
                       + ("unset" if default is None else "at its default"),
            "fieldPath": f".engine.{KNOBS[name]}"}


#: Admission rules of spec.runtime vllm: the knobs vLLM lacks (from the knob table) and what vLLM
#: itself refuses at start-up, refused here with a message instead of a crash-looping pod.
_VLLM_RULES = (
    *(_vllm_lacks_rule(n) for n in sorted(VLLM_LACKS)),
    {"rule": "self.runtime != 'vllm' || self.engine.maxNumBatchedTokens >= self.engine.maxNumSeqs",
     "message": "runtime vllm: maxNumBatchedTokens must be at least maxNumSeqs (vLLM refuses to start otherwise)",
     "fieldPath": ".engine.maxNumBatchedTokens"},
)


#: spec.simulate's allowed values: the simulator's named profiles (sim/profiles.py), nothing else
#: (a profile file would have to be in the image; the names are what a user can rely on).
SIMULATE_PROFILES = tuple(sorted(PROFILES))

_SPEC_CHECKS = (
    Check("has(self.model) || has(self.simulate)",
          "spec.model is required (the model to serve), unless spec.simulate names a simulator profile",
          lambda s: s.model is not None or s.simulate is not None, ".model"),
    Check("!has(self.simulate) || self.runtime != 'vllm'",
          "spec.simulate runs kvtune's simulated engine (kvtune serve --simulate): runtime vllm has no such mode; "
          "use runtime kvtune with simulate, or drop simulate to run vLLM on a model",
          lambda s: s.simulate is None or s.runtime != "vllm", ".simulate"),
    Check("!has(self.extraArgs) || self.extraArgs.all(a, !a.startsWith('--') || a.size() == 2 || "
          f"!{_cel_list(RESERVED_FLAGS)}.exists(f, f.startsWith(a.split('=')[0].split(' ')[0].replace('_', '-'))))",
          "extraArgs must not set what the operator sets or what decides whom the engine trusts: "
          + ", ".join(OPERATOR_FLAGS + TRUST_FLAGS) + ", nor a knob's flag (set knobs in spec.engine); as --flag "
          "value, --flag=value or an abbreviation; an API key goes in env KVTUNE_API_KEY or VLLM_API_KEY from a Secret",
          lambda s: not any(reserved_arg(a) for a in s.extra_args or []), ".extraArgs"),
    Check("!has(self.extraArgs) || self.extraArgs.all(a, !a.contains('$('))", "extraArgs " + _NO_EXPANSION,
          lambda s: not any(EXPANSION in a for a in s.extra_args or []), ".extraArgs"),
)


class InferenceDeploymentSpec(CRDModel):
    """An LLM served by kvtune's paged-KV engine, and how its KV-cache knobs are tuned."""

    _checks = _SPEC_CHECKS

    model_config = ConfigDict(json_schema_extra=_rules(
        {"rule": "!has(self.autotune) || !has(self.autotune.bounds) || !has(self.autotune.bounds.blockSize) || "
                 "self.engine.blockSize in self.autotune.bounds.blockSize",
         "message": "engine.blockSize must be one of autotune.bounds.blockSize: the baseline has to be a value "
                    "the tuner may choose",
         "fieldPath": ".engine.blockSize"},
        *(_bounds_rule(KNOBS[k]) for k in RANGED_KNOBS),
        *_VLLM_RULES,
        *cel(_SPEC_CHECKS),
    ))

    model: ModelSpec | None = Field(
        None, description="The model to serve and where its weights are. Required unless simulate is set (then "
                          "only servedModelName is used: no weights are read and no volume is mounted).")
    simulate: Literal[SIMULATE_PROFILES] | None = Field(  # type: ignore[valid-type]
        None, description="Test and demo mode, never the default: run a simulated engine (kvtune serve --simulate "
                          "PROFILE) instead of a model: the real scheduler, KV block pool, prefix cache, metrics and "
                          "admin API, each step taking the simulator profile's time (an estimate of that GPU and "
                          "model) in wall-clock time, generated text from a fixed vocabulary. No GPU and no weights "
                          "needed. One of " + ", ".join(SIMULATE_PROFILES) + ". Runtime kvtune only.")
    runtime: Literal["kvtune", "vllm"] = Field(
        "kvtune", description="The engine: kvtune's own (live knob changes, admin API, recorded trace) or vLLM "
                              "0.30+ (every knob on `vllm serve`'s command line, every change a restart, tuned from "
                              "its metrics with a trace synthesized from them; swapSpaceGiB becomes vLLM's CPU KV "
                              "offloading).")
    image: str | None = Field(None, min_length=1, max_length=1024,
                              description="Engine container image. Default: the operator's engine image "
                                          "(runtime vllm: vllm/vllm-openai of the version kvtune reads).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="Image pull policy of the engine container (Kubernetes default when omitted).")
    replicas: int = Field(1, ge=0, le=1024, description="Number of engine pods (the scale subresource).")
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_object_default(Resources),
                                 description="Compute resources of each engine pod.")
    node_selector: dict[str, str] | None = Field(None, description="Node labels the engine pods must match.")
    tolerations: list[Toleration] | None = Field(None, max_length=32, description="Tolerations of the engine pods.")
    engine: EngineSpec = Field(default_factory=EngineSpec, json_schema_extra=_object_default(EngineSpec),  # type: ignore[valid-type]
                               description=EngineSpec.__doc__)
    autotune: AutotuneSpec | None = Field(None, description="Closed-loop tuning of the engine knobs.")
    metrics: MetricsSpec = Field(default_factory=MetricsSpec, json_schema_extra=_object_default(MetricsSpec),
                                 description="Metrics collection for the tuner.")
    extra_args: list[Annotated[str, Field(max_length=4096)]] | None = Field(
        None, max_length=64,
        description="Extra arguments appended to `kvtune serve` or `vllm serve` (e.g. --device cpu, --dtype "
                    "bfloat16). Knobs belong in engine; the flags the operator sets and those that decide whom "
                    "the engine trusts are refused (README, Trust model).")
    env: list[EnvVar] | None = Field(
        None, max_length=64, description="Extra environment variables of the engine container (reserved names are "
                                         "refused: README, Trust model).")
    network: NetworkSpec | None = Field(None, description="Who may connect to the engine pods (a NetworkPolicy).")

    @property
    def weights_volume(self) -> ModelVolume | None:
        """The volume the pods mount for the weights: none when simulated (the engine reads no weights)."""
        return None if self.simulate is not None or self.model is None else self.model.volume

    def served_name(self, default: str) -> str:
        """The model name clients send: model.servedModelName, else ``default`` (the resource's name)."""
        return (self.model.served_model_name if self.model else None) or default


# --------------------------------------------------------------------------------------------
# status
# --------------------------------------------------------------------------------------------

class ConditionType(str, Enum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    METRICS_AVAILABLE = "MetricsAvailable"
    TUNED = "Tuned"
    DEGRADED = "Degraded"
    ROUNDS_LATE = "RoundsLate"
    PREDICTIONS_UNRELIABLE = "PredictionsUnreliable"
    ENGINE_DRIFT = "EngineDrift"


class Condition(CRDModel):
    """One aspect of the resource's state, in the Kubernetes condition convention."""

    type: ConditionType = Field(..., description="Ready, Progressing, MetricsAvailable, Tuned, Degraded, "
                                                 "RoundsLate, PredictionsUnreliable or EngineDrift.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    reason: str = Field(..., min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                        description="One CamelCase word for machines.")
    message: str = Field("", max_length=32768, description="What happened, for humans.")
    observed_generation: int | None = Field(None, ge=0, description="metadata.generation this condition was computed for.")
    last_transition_time: Timestamp = Field(..., description="When status last changed.")


class Figures(CRDModel):
    """Measured or predicted figures behind a diagnosis or a decision. More keys may be present."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})

    kv_usage_percent: float | None = Field(None, description="Used KV blocks / all KV blocks, percent (what dashboards call KV usage).")
    waiting: int | None = Field(None, ge=0, description="Requests waiting.")
    running: int | None = Field(None, ge=0, description="Requests running.")
    swapped: int | None = Field(None, ge=0, description="Requests swapped out to CPU.")
    internal_fragmentation_percent: float | None = Field(
        None, description="Empty token slots in allocated blocks / allocated slots, percent.")
    swap_usage_percent: float | None = Field(None, description="CPU swap pool in use, percent.")
    prefix_cache_hit_percent: float | None = Field(None, description="Prefix cache hits / queries in tokens, percent.")
    preemptions_per_minute: float | None = Field(None, ge=0, description="Preemptions (swap + recompute) per minute.")
    queue_time_p95_seconds: float | None = Field(None, ge=0, description="95th percentile queue time, seconds.")
    ttft_p95_seconds: float | None = Field(None, ge=0, description="95th percentile time to first token, seconds.")
    tpot_p95_seconds: float | None = Field(None, ge=0, description="95th percentile time per output token, seconds.")
    throughput_tokens_per_second: float | None = Field(None, ge=0, description="Generated tokens per second.")
    goodput_requests_per_second: float | None = Field(
        None, ge=0, description="Request goodput: requests per second meeting the objectives (ttft and tpot).")
    goodput_tokens_per_second: float | None = Field(
        None, ge=0, description="Token goodput: output tokens per second of the requests meeting the objectives.")
    slo_attainment: float | None = Field(
        None, ge=0, description="Share of the offered requests that met the objectives (request goodput / offered rate).")
    ttft_p95_ms: float | None = Field(None, ge=0, description="95th percentile ttft (time to first token), ms.")
    tpot_p95_ms: float | None = Field(
        None, ge=0, description="95th percentile tpot (time per output token after the first, per request), ms.")
    e2el_p95_ms: float | None = Field(None, ge=0, alias="e2elP95Ms",  # vLLM's name, not the generator's e2El
                                      description="95th percentile e2el (end-to-end request latency), ms.")
    utilization: float | None = Field(
        None, ge=0, description="Predicted: the work offered over what the config computes with a full queue; "
                                "at 0.9 or more a prediction is near saturation and must win across its range.")
    goodput_range_requests_per_second: list[float] | None = Field(
        None, min_length=2, max_length=2,
        description="Predicted request goodput with the engine slower and faster by the cost model's speed error.")
    replicas_needed: int | None = Field(
        None, ge=1, description="Replicas predicted to meet the objectives for this load (compute-bound engines).")
    waiting_reason_shares: dict[str, float] | None = Field(
        None, description="Share of steps in which the waiting head was stopped, by reason "
                          "(max_num_seqs, token_budget, kv_blocks, watermark).")


class Diagnosis(CRDModel):
    """Why requests wait, in words and figures (written by the tuner)."""

    cause: str = Field(..., max_length=64, pattern=r"^[A-Z][A-Za-z0-9]*$",
                       description="Named cause: Healthy, SequenceCap, TokenBudget, LongPromptHeadOfLine, "
                                   "SharedPrefixPinning, BlockWaste, LowKVMemory, SwapFull, PrefillStallsDecodes or ComputeBound.")
    message: str = Field("", max_length=4096, description="One sentence a user understands.")
    figures: Figures | None = Field(None, description="The figures behind the cause.")
    observed_at: Timestamp | None = Field(None, description="End of the observation window.")
    window: Duration | None = Field(None, description="Length of the observation window.")


class TuningDecision(CRDModel):
    """One decision of the tuner, with what it predicted and what was then measured."""

    time: Timestamp = Field(..., description="When the decision was taken.")
    action: Literal["Recommend", "Apply", "Keep", "RollBack", "Hold", "Scale"] = Field(
        ..., description="Recommend (not applied), Apply, Keep (verified), RollBack (verified worse), Hold "
                         "(nothing better found) or Scale (replicas changed: the engine is compute-bound).")
    cause: str | None = Field(None, max_length=64, description="The diagnosis cause that led to it.")
    message: str = Field("", max_length=4096, description="The decision in one sentence.")
    before: EngineKnobs | None = Field(None, description="Knobs before the change (only those that change).")  # type: ignore[valid-type]
    after: EngineKnobs | None = Field(None, description="Knobs after the change (only those that change).")  # type: ignore[valid-type]
    restart: bool = Field(False, description="Whether the change needs a restart (a rollout).")
    predicted: Figures | None = Field(None, description="Simulator prediction for the new knobs.")
    measured: Figures | None = Field(None, description="Measured over the window after the change.")
    prediction_error_ratio: float | None = Field(
        None, ge=0, description="Keep and RollBack: |predicted - measured| / measured slo attainment of this verdict.")
    canary: CanaryStatus | None = Field(
        None, description="Keep and RollBack judged as a canary: the canary pod, its controls and the gate figures.")


class CanaryGateFigure(CRDModel):
    """One gate of a canary verdict, with the figures it compared."""

    name: Literal["goodputRatioMin", "ttftP99RatioMax", "errorRateMax"] = Field(..., description="The gate.")
    canary: float = Field(..., description="The canary's figure.")
    control: float | None = Field(None, description="The controls' figure (none for a gate on the canary alone).")
    value: float = Field(..., description="What the limit applies to: canary / control, or the canary's rate.")
    limit: float = Field(..., description="The gate's limit.")
    passed: bool = Field(..., description="Whether the gate passed.")
    note: str = Field("", max_length=256, description="What the figures are.")


class CanaryStatus(CRDModel):
    """A canary verdict: the canary pod, its controls over the same window, and each gate's figures."""

    verdict: Literal["Promote", "Revert"] = Field(..., description="Promote to every replica, or revert the canary.")
    canary: str = Field(..., max_length=253, description="The pod that ran the change.")
    controls: list[str] = Field(..., max_length=64, description="The untouched pods it was judged against.")
    gates: list[CanaryGateFigure] = Field(..., max_length=8, description="Each gate with its figures.")
    window: Duration | None = Field(None, description="The window canary and controls shared.")
    message: str = Field("", max_length=4096, description="The verdict in one sentence.")

    @classmethod
    def of(cls, j: CanaryJudgement) -> "CanaryStatus":
        """The status of a pure canary verdict (tuner/canary.py)."""
        return cls(verdict=j.verdict, canary=j.canary, controls=list(j.controls),
                   gates=[CanaryGateFigure(name=g.name, canary=_finite(g.canary),
                                           control=None if g.control is None else _finite(g.control),
                                           value=_finite(g.value), limit=g.limit, passed=g.passed, note=g.note)
                          for g in j.gates],
                   window=f"{int(j.window_s)}s" if j.window_s else None, message=j.reason[:4096])


def _finite(v: float) -> float:
    """JSON has no infinity: a ratio over a zero control is written as a large finite number."""
    return v if v == v and abs(v) != float("inf") else (1e9 if v > 0 else -1e9)


TUNING_HISTORY_LIMIT = 10
#: rolled-back candidates kept in status (the oldest barred ones go first)
REJECTED_LIMIT = 16

WindowFigures = Annotated[dict[str, float], Field(
    description="Window figures (snake_case names, e.g. goodput_share, output_tokens_per_s).")]


class CanaryRun(CRDModel):
    """The one engine pod that runs a pending change while its siblings keep status.engine: one of
    them for a live change, the pod of a canary Deployment beside them for a restart change."""

    pod: str | None = Field(None, max_length=253, description="The canary pod: the change went to its admin API (a "
                            "live change), or it is the canary Deployment's pod (unset until that pod is Ready).")
    controls: list[str] = Field(..., max_length=64, description="The untouched pods it is judged against.")
    started_at: Timestamp = Field(..., description="When the canary began running the change (its window starts here).")
    url: str | None = Field(None, max_length=512, description="Where the change was sent (the canary's admin API): "
                            "where it is set back when no verdict comes, only while it is one of the pods' addresses.")
    deployment: str | None = Field(None, max_length=253, description="A restart change: the canary Deployment, one pod "
                                   "with the new knobs beside the untouched ones, removed at the verdict.")


class PendingChange(CRDModel):
    """The change being verified: enough to give it its verdict after an operator restart."""

    applied_at: Timestamp = Field(..., description="When the change was applied (its window starts here).")
    source: Literal["Tuner", "Annotation"] = Field("Tuner", description="The tuner's choice, or kvtune.io/try.")
    before: EngineKnobs = Field(..., description="Every knob before the change (what a rollback restores).")  # type: ignore[valid-type]
    after: EngineKnobs = Field(..., description="Every knob after the change.")  # type: ignore[valid-type]
    restart: bool = Field(False, description="Whether the change rolls the engine pods.")
    restart_hash: str | None = Field(None, max_length=64,
                                     description="The new pods' kvtune.io/restart-hash (restart changes).")
    rolled_out_at: Timestamp | None = Field(
        None, description="When its rollout was seen complete, old pods gone (restart changes): the verdict "
                          "judges a whole window from here.")
    before_figures: WindowFigures = Field(default_factory=dict, description="Measured over the window before the change.")
    predicted_figures: WindowFigures = Field(default_factory=dict, description="Predicted for the new knobs.")
    canary: CanaryRun | None = Field(
        None, description="Judged as a canary: the pod that runs the change and its controls (two or more "
                          "replicas, a live change); unset: judged before/after on every pod.")


class RejectedCandidate(CRDModel):
    """A candidate that was rolled back, barred from being tried again until `until`."""

    knobs: EngineKnobs = Field(..., description="The candidate's tuned knobs.")  # type: ignore[valid-type]
    at: Timestamp = Field(..., description="When it was rolled back.")
    until: Timestamp = Field(..., description="Until when it is barred.")
    reason: str = Field("", max_length=4096, description="Why it was rolled back.")


class TuningStatus(CRDModel):
    """What the tuner is doing and what it did."""

    mode: AutotuneMode | None = Field(None, description="Effective autotune mode (spec or operator default).")
    phase: str | None = Field(
        None, max_length=32, pattern=r"^[A-Z][A-Za-z]*$",
        description="Off, Pending, Observing, Recommended, Applying, Canary (one pod runs a change, judged against "
                    "the others), Verifying, Settled or RolledBack.")
    message: str | None = Field(None, max_length=4096, description="What the tuner is waiting for or did last.")
    last_change: TuningDecision | None = Field(None, description="The latest decision.")
    last_restart_time: Timestamp | None = Field(None, description="When a restart-requiring change was last applied.")
    history: list[TuningDecision] | None = Field(
        None, max_length=TUNING_HISTORY_LIMIT, description=f"The last {TUNING_HISTORY_LIMIT} decisions, oldest first.")
    pending: PendingChange | None = Field(None, description="The change being verified, if any.")
    rejected: list[RejectedCandidate] | None = Field(
        None, max_length=REJECTED_LIMIT, description="Rolled-back candidates still barred, oldest first.")
    restarts: int | None = Field(None, ge=0, description="Restart-requiring changes made so far (rollbacks included).")
    tried_annotation: str | None = Field(
        None, max_length=4096, description="The last kvtune.io/try value handled (it is tried once).")
    prediction_error: float | None = Field(
        None, ge=0, description="Running prediction error: a moving average of the verdicts' |predicted - measured| "
                                "/ measured slo attainment. Above its bound for several verdicts in a row, the tuner "
                                "only recommends (condition PredictionsUnreliable).")
    prediction_errors_high: int | None = Field(
        None, ge=0, description="Verdicts in a row with the running prediction error above its bound.")
    predictions_unreliable_until: Timestamp | None = Field(
        None, description="Until when the tuner only recommends: its predictions were found unreliable.")
    trace_source: Literal["recorded", "synthesized"] | None = Field(
        None, description="Where the trace the predictions replay came from: recorded by the engine, or "
                          "synthesized from the metrics' rate and length histograms (runtime vllm records none).")


class InferenceDeploymentStatus(CRDModel):
    """Observed state, written by the operator only."""

    observed_generation: int | None = Field(None, ge=0, description="metadata.generation last reconciled.")
    replicas: int | None = Field(None, ge=0, description="Engine pods that exist (the scale subresource's status).")
    ready_replicas: int | None = Field(None, ge=0, description="Engine pods ready to serve.")
    updated_replicas: int | None = Field(None, ge=0, description="Engine pods running the current pod template.")
    replica_summary: str | None = Field(None, max_length=32, description="Ready pods / desired replicas, e.g. 1/2.")
    selector: str | None = Field(None, max_length=1024, description="Label selector of the engine pods (for the scale subresource).")
    engine: EngineKnobs | None = Field(  # type: ignore[valid-type]
        None, description="Effective knobs the engine runs with: spec.engine merged with tuned values.")
    baseline: EngineKnobs | None = Field(  # type: ignore[valid-type]
        None, description="spec.engine as it was when status.engine was computed; a knob the user has since "
                          "edited takes the user's new value instead of a tuned one.")
    restart_hash: str | None = Field(None, max_length=64, description="Hash of the restart-only knobs on the pod template.")
    image: str | None = Field(None, max_length=1024, description="Engine image in use.")
    diagnosis: Diagnosis | None = Field(None, description="The current waiting cause, in words and figures.")
    tuning: TuningStatus | None = Field(None, description="Tuner phase, last change and history.")
    conditions: list[Condition] | None = Field(
        None, max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="Ready, Progressing, MetricsAvailable, Tuned, Degraded, RoundsLate (True while tuning "
                    "rounds start more than one autotune interval after they are due: the operator is not "
                    "keeping up with its fleet) and PredictionsUnreliable (True while the tuner only "
                    "recommends: its running prediction error stayed above its bound).")


class ObjectMeta(CRDModel):
    """The part of metadata the operator reads."""

    name: str
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


def plain(obj: Any) -> Any:
    """A deep copy made of plain dicts and lists (kopf's bodies are read-only mapping views)."""
    if hasattr(obj, "keys"):
        return {k: plain(obj[k]) for k in obj.keys()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


class InferenceDeployment(CRDModel):
    """An InferenceDeployment as read from the API (metadata, spec, status)."""

    api_version: str = Field(API_VERSION, alias="apiVersion")
    kind: str = KIND
    metadata: ObjectMeta
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus = Field(default_factory=InferenceDeploymentStatus)

    @classmethod
    def from_body(cls, body: Any) -> "InferenceDeployment":
        """Parse an API object (dict or kopf Body); a missing status reads as empty."""
        data = plain(body)
        if not data.get("status"):
            data["status"] = {}
        return cls.model_validate(data)
