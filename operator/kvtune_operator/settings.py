"""Operator settings: defaults < environment (KVTUNE_*) < command-line flags.

The Helm chart sets the environment; `kvtune operator run --flag` overrides it for local runs.
"""
from __future__ import annotations

import os
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvtune_engine import __version__
from kvtune_operator.model import DURATION_PATTERN, AutotuneMode, parse_duration
from kvtune_operator.prometheus import base_url

ENV_PREFIX = "KVTUNE_"
DEFAULT_ENGINE_IMAGE = f"kvtune/kvtune-engine:{__version__}"
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"


class Settings(BaseModel):
    """Everything the operator reads at start-up."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=True, validate_default=True)

    namespaces: tuple[str, ...] = Field(
        (), description="Namespaces to watch; empty watches all namespaces (cluster-wide).")
    prometheus_url: str = Field(DEFAULT_PROMETHEUS_URL, pattern=r"^https?://",
                                description="Prometheus the tuner reads when spec.metrics.prometheusUrl is unset "
                                            "(always in the allowlist).")
    prometheus_allowed_urls: tuple[str, ...] = Field(
        (), description="Other Prometheus base URLs spec.metrics.prometheusUrl may name (scheme, host, port and "
                        "path, exactly); any other URL is refused: the operator fetches what the resource names.")
    engine_image: str = Field(DEFAULT_ENGINE_IMAGE, min_length=1,
                              description="Engine image when spec.image is unset.")
    autotune_mode: AutotuneMode = Field(AutotuneMode.RECOMMEND, description="Mode when spec.autotune.mode is unset.")
    autotune_interval: str = Field("60s", pattern=DURATION_PATTERN, description="Default spec.autotune.interval.")
    autotune_window: str = Field("5m", pattern=DURATION_PATTERN, description="Default spec.autotune.window.")
    autotune_cooldown: str = Field("15m", pattern=DURATION_PATTERN, description="Default spec.autotune.cooldown.")
    status_interval: float = Field(15.0, gt=0, description="Seconds between status refreshes of each resource.")
    tune_poll_interval: float = Field(5.0, gt=0, description="Seconds between checks whether a resource is due "
                                                             "for a tuning round (each has its own interval).")
    tuning_rounds_at_once: int = Field(
        4, ge=1, le=256, description="Tuning rounds run at once at most (each reads Prometheus, replays the trace in "
                                     "the simulator and writes status); more due ones wait, the one due longest "
                                     "first (round_queue.py).")
    handler_threads: int = Field(
        8, ge=1, le=256, description="Threads for the reconciles and timer polls, besides the tuning rounds' (kopf's "
                                     "handler pool has tuning_rounds_at_once + this many): a round holds its thread "
                                     "for seconds, and the fleet's reconciles must not wait for them.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Port of the operator's own /metrics (tuning round "
                                                             "lag, rounds running and waiting); 0: not served.")
    retry_backoff: float = Field(5.0, gt=0, description="First retry delay (s) after a failed reconcile; doubles.")
    retry_backoff_max: float = Field(300.0, gt=0, description="Longest retry delay (s).")
    pod_monitor: Literal["auto", "never"] = Field(
        "auto", description="auto: create a PodMonitor when the prometheus-operator CRD exists; never: do not.")
    liveness: str | None = Field("http://0.0.0.0:8080/healthz",
                                 description="Liveness endpoint URL the operator serves; empty disables it.")
    field_manager: str = Field("kvtune-operator", min_length=1, max_length=128,
                               description="Field manager of the operator's server-side applies.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    allow_host_path: bool = Field(
        False, description="Allow spec.model.volume.hostPath (a directory of the node); off by default: it "
                           "would let anyone who may create the resource mount any node directory.")
    network_allow_namespaces: tuple[str, ...] = Field(
        (), description="Namespaces every engine NetworkPolicy admits to the admin port, /metrics and the admin "
                        "API (the operator's, Prometheus').")

    allow_loopback_engines: bool = Field(
        False, description="Count engine addresses on 127.0.0.1 as the resource's own pods (the admin key goes "
                           "there). Only for test harnesses that run engine pods as local processes; never "
                           "needed in a cluster, where the key goes only to the pod IPs the API lists.")

    shards: int = Field(
        0, ge=0, le=1024, description="Several replicas: the watched objects are spread over this many shards, "
                                      "each a Lease kvtune-shard-<i> in lease_namespace held by one replica, which "
                                      "alone reconciles and tunes its objects. 0: this one replica works on every "
                                      "object and uses no Lease.")
    identity: str = Field("", max_length=128, description="This replica's holderIdentity in the shard Leases, unique "
                                                          "among the replicas (the chart: the pod name); empty: "
                                                          "$POD_NAME, else the host name.")
    lease_namespace: str = Field("", max_length=63, description="Namespace of the shard Leases (the chart: the "
                                                                "release's); empty: $POD_NAMESPACE.")
    lease_duration: float = Field(15.0, ge=3, le=300, description="leaseDurationSeconds of the shard Leases (s): a "
                                                                  "dead replica's objects move after about this long.")

    @field_validator("namespaces", "network_allow_namespaces", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.split(",")
        return tuple(sorted({n.strip() for n in v if n and n.strip()}))

    @field_validator("prometheus_allowed_urls", mode="before")
    @classmethod
    def _split_urls(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.split(",")
        return tuple(dict.fromkeys(u.strip() for u in v if u and u.strip()))

    @field_validator("prometheus_url")
    @classmethod
    def _one_base_url(cls, v: str) -> str:
        base_url(v)  # raises ValueError: query, fragment, userinfo
        return v

    @field_validator("prometheus_allowed_urls")
    @classmethod
    def _base_urls(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for u in v:
            base_url(u)
        return v

    @property
    def prometheus_allowlist(self) -> tuple[str, ...]:
        """The Prometheus base URLs the tuner may query, normalized (`prometheus.base_url`)."""
        return tuple(dict.fromkeys(base_url(u) for u in (self.prometheus_url, *self.prometheus_allowed_urls)))

    @field_validator("liveness", mode="before")
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        return v or None

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    @property
    def autotune_interval_seconds(self) -> float:
        return parse_duration(self.autotune_interval)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Defaults, then KVTUNE_<FIELD> variables, then the non-None overrides (flags)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            key = ENV_PREFIX + name.upper()
            if key in environ:
                values[name] = environ[key]
        values.update({k: v for k, v in overrides.items() if v is not None and v != ()})
        return cls(**values)

    def env(self) -> dict[str, str]:
        """These settings as KVTUNE_* variables (the chart renders the same)."""
        out = {}
        for name, value in self.model_dump().items():
            if isinstance(value, (tuple, list)):
                value = ",".join(value)
            out[ENV_PREFIX + name.upper()] = "" if value is None else str(value)
        return out
