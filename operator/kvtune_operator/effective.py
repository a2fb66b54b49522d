"""The effective engine config: the user's spec.engine merged with tuned values from status.

Pure functions, no Kubernetes. The rules (also in status.baseline's description):

* The user's spec is never written. Tuned values live in ``status.engine``, next to
  ``status.baseline`` -- spec.engine as it was when status.engine was computed.
* A tuned knob is kept while the autotune mode is not Off, the knob is tunable and not frozen,
  the user has not edited that knob since (spec value == baseline value), and the tuned value is
  still inside the current bounds. Otherwise the spec's value wins.
* The merged config must pass the engine's own validation (EngineConfig); if it does not, the
  spec's baseline is used as a whole.
* autotune mode Off runs the spec exactly as written (tuned values are dropped, not kept aside).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kvtune_engine.config import EngineConfig
from kvtune_engine.knobs import TABLE
from kvtune_operator.model import (
    KNOBS,
    KNOBS_BY_CAMEL,
    TUNABLE_KNOBS,
    AutotuneMode,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    parse_duration,
    to_camel_dict,
    to_engine_dict,
)
from kvtune_operator.tuner.candidates import Bounds, Range
from kvtune_operator.tuner.decide import Objectives
from kvtune_operator.tuner.loop import TunerSettings


@dataclasses.dataclass(frozen=True)
class Effective:
    """The merge's outcome: the config to render, which knobs are tuned, and tuned values dropped (why)."""

    config: EngineConfig
    baseline: EngineConfig
    tuned: dict[str, Any]
    dropped: dict[str, str]
    #: knobs the spec leaves to the engine (`left_to_engine`): not rendered, and not in status, where
    #: the config's default would claim a value the engine does not run
    omitted: frozenset[str] = frozenset()

    def status_engine(self) -> dict[str, Any]:
        """status.engine (camelCase; an unset or omitted knob is None, which a merge patch deletes)."""
        return to_camel_dict({k: None if k in self.omitted else v for k, v in self.config.model_dump().items()})

    def status_baseline(self) -> dict[str, Any]:
        """status.baseline (camelCase; an unset or omitted knob is None, which a merge patch deletes)."""
        return to_camel_dict({k: None if k in self.omitted else v for k, v in self.baseline.model_dump().items()})


def left_to_engine(spec: InferenceDeploymentSpec, config: EngineConfig) -> frozenset[str]:
    """Knobs the engine takes from the model (the knob table's ``from_model``): unset in spec.engine
    and untouched in ``config``. Only the engine knows their value (max_model_len: the model's context
    length), so the operator neither renders nor reports one."""
    return frozenset(k.name for k in TABLE if k.from_model and getattr(spec.engine, k.name, None) is None
                     and getattr(config, k.name) == EngineConfig.model_fields[k.name].default)


def autotune_mode(spec: InferenceDeploymentSpec, default: AutotuneMode | str) -> AutotuneMode:
    """spec.autotune.mode, or the operator's default."""
    mode = spec.autotune.mode if spec.autotune and spec.autotune.mode else default
    return AutotuneMode(mode)


@dataclasses.dataclass(frozen=True)
class AutotunePlan:
    """spec.autotune resolved against the operator's defaults (for the tuner's timer)."""

    mode: AutotuneMode
    interval_s: float
    window_s: float
    cooldown_s: float
    prometheus_url: str


def resolve_autotune(spec: InferenceDeploymentSpec, settings: Any) -> AutotunePlan:
    """Mode, interval, window, cooldown and Prometheus URL: the spec's, else the operator's settings."""
    a = spec.autotune
    pick = lambda v, d: parse_duration(v if v else d)  # noqa: E731
    return AutotunePlan(
        mode=autotune_mode(spec, settings.autotune_mode),
        interval_s=pick(a and a.interval, settings.autotune_interval),
        window_s=pick(a and a.window, settings.autotune_window),
        cooldown_s=pick(a and a.cooldown, settings.autotune_cooldown),
        prometheus_url=spec.metrics.prometheus_url or settings.prometheus_url,
    )


def baseline_config(spec: InferenceDeploymentSpec) -> EngineConfig:
    """spec.engine as an EngineConfig (raises ConfigError if the engine would refuse it)."""
    return EngineConfig.build(**to_engine_dict(spec.engine.dump()))


def frozen_knobs(spec: InferenceDeploymentSpec) -> set[str]:
    """Knobs (snake_case) the tuner may not change: untunable ones and those the user froze."""
    frozen = {k for k in KNOBS if k not in TUNABLE_KNOBS}
    if spec.autotune and spec.autotune.frozen_knobs:
        frozen |= set(to_engine_dict({k: True for k in spec.autotune.frozen_knobs}))
    return frozen


def knob_bounds(spec: InferenceDeploymentSpec) -> Bounds:
    """Where the tunable knobs may go in this cluster: spec.autotune.bounds within the knob table's
    allowed limits (an omitted bound is the limit). Frozen knobs are `frozen_knobs`' business."""
    b = spec.autotune.bounds if spec.autotune and spec.autotune.bounds else None
    out: dict[str, Any] = {}
    for k in TABLE:
        mine = getattr(b, k.name, None) if b else None
        if k.bounded and k.choices:
            out[k.name] = tuple(mine) if mine else k.choices
        elif k.bounded and k.allowed:
            lo, hi = k.allowed
            out[k.name] = Range(lo if mine is None or mine.min is None else mine.min,
                                hi if mine is None or mine.max is None else mine.max)
    return Bounds(**out)


def in_bounds(spec: InferenceDeploymentSpec, knob: str, value: Any) -> bool:
    """May the tuner set `knob` (snake_case) to `value`?"""
    return knob not in frozen_knobs(spec) and knob_bounds(spec).admits(knob, value)


def effective_engine(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus | None,
                     mode: AutotuneMode | str) -> Effective:
    """Merge spec.engine with the tuned values of status.engine (see the module's rules)."""
    base = baseline_config(spec)
    base_values = base.model_dump()
    tuned_status = to_engine_dict(status.engine.dump()) if status and status.engine else {}
    seen_baseline = to_engine_dict(status.baseline.dump()) if status and status.baseline else {}
    merged = dict(base_values)
    tuned: dict[str, Any] = {}
    dropped: dict[str, str] = {}
    bounds, frozen = knob_bounds(spec), frozen_knobs(spec)
    for knob, value in tuned_status.items():
        if value == base_values.get(knob) or (knob in seen_baseline and value == seen_baseline[knob]):
            continue  # not a tuned value: the spec's value, now or when status was written
        camel = KNOBS[knob]
        if AutotuneMode(mode) == AutotuneMode.OFF:
            dropped[knob] = "autotune mode is Off"
        elif knob in frozen:
            dropped[knob] = f"{camel} is not tuned (frozen)"
        elif seen_baseline.get(knob) != base_values.get(knob):
            dropped[knob] = f"spec.engine.{camel} was edited"
        elif not bounds.admits(knob, value):
            dropped[knob] = f"tuned {camel} {value} is outside autotune.bounds"
        else:
            merged[knob] = value
            tuned[knob] = value
    if tuned:
        try:
            config = EngineConfig.build(**merged)
            return Effective(config, base, tuned, dropped, left_to_engine(spec, config))
        except ValueError as e:
            dropped.update({k: f"tuned values are inconsistent with the spec: {e}" for k in tuned})
    return Effective(base, base, {}, dropped, left_to_engine(spec, base))


def tuned_status(spec: InferenceDeploymentSpec, current: EngineConfig, changes: dict[str, Any]) -> dict[str, Any]:
    """status.engine / status.baseline after the tuner applies `changes` (snake_case) to `current`.

    For the tuner: raises ValueError when a change is outside the bounds, frozen, or invalid.
    """
    for knob, value in changes.items():
        if not in_bounds(spec, knob, value):
            raise ValueError(f"{KNOBS.get(knob, knob)}={value!r} is outside the bounds or frozen")
    new = current.with_changes(**changes)
    base = baseline_config(spec)
    omit = left_to_engine(spec, new)
    return {
        "engine": {k: v for k, v in to_camel_dict(new.model_dump()).items() if v is not None
                   and KNOBS_BY_CAMEL.get(k) not in omit},
        "baseline": {k: v for k, v in to_camel_dict(base.model_dump()).items() if v is not None
                     and KNOBS_BY_CAMEL.get(k) not in omit},
    }


def tuner_settings(spec: InferenceDeploymentSpec, plan: AutotunePlan) -> TunerSettings:
    """spec.autotune (bounds, objectives, cooldown) as the tuner's settings: the user's bounds inside
    the tuner's search ranges, a frozen knob pinned to its baseline value."""
    bounds = knob_bounds(spec).within(Bounds()).freeze(baseline_config(spec), frozen_knobs(spec) & set(TUNABLE_KNOBS))
    o = spec.autotune.objectives if spec.autotune and spec.autotune.objectives else None
    dur = lambda v: parse_duration(v) if v else None  # noqa: E731
    objectives = Objectives(
        slo_ttft_s=dur(o and o.ttft_p95), slo_tpot_s=dur(o and o.tpot_p95),
        max_preemptions_per_min=o.max_preemptions_per_minute if o else None,
        cooldown_s=plan.cooldown_s, bad_memory_s=max(3600.0, 4 * plan.cooldown_s),
        live_knobs=frozenset() if spec.runtime == "vllm" else None)  # vLLM: every change is a restart
    return TunerSettings(bounds=bounds, objectives=objectives, vllm=spec.runtime == "vllm")
