"""The tuner in the cluster: one tick per InferenceDeployment, as pure as the cluster allows.

`tick` takes what the timer gathered (spec, status, the Prometheus window, the engine's state and
trace), rebuilds the tuner's state from status.tuning, runs one round of the very loop `kvtune tune`
runs (`tune_round`), and returns what to write: status (diagnosis, tuning with the tuner's new state,
tuned knobs in status.engine), conditions, events and a replica count to scale to. It never writes
spec.engine. `gather` is the I/O half: Prometheus over the window, then the trace and state of one
engine replica it scraped; `TuningLoop` checks a pending restart's pods first (a failed rollout is
rolled back without a window).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, MutableMapping

from kvtune_engine.config import RESTART_KNOBS, EngineConfig
from kvtune_engine.sim.profile import Profile
from pydantic import ValidationError

from . import conditions as c
from . import operator_metrics
from .effective import (AutotunePlan, baseline_config, effective_engine, frozen_knobs, knob_bounds,
                        resolve_autotune, tuned_status)
from .model import (KNOBS_BY_CAMEL, TUNABLE_KNOBS, TUNING_HISTORY_LIMIT, AutotuneMode, Diagnosis, EngineKnobs,
                    Figures, InferenceDeployment, InferenceDeploymentSpec, InferenceDeploymentStatus, TuningDecision,
                    TuningStatus, parse_duration, to_camel_dict)
from .engine_client import EngineClient, EngineError
from .prometheus import MAX_RESPONSE_BYTES, MetricsUnavailable, check_allowed, pod_host, pod_ips, read_window
from .reconcile import EventSpec, engine_admin_key
from .render import selector_string
from .rollout import rollout_failure, rollout_pending
from .round_queue import Admission, RoundQueue
from .scaling import autoscaler_of, replica_target, replicas_needed
from .tuner.backlog import in_engine
from .tuner.candidates import Bounds
from .tuner.decide import Decision, Objectives, knob_changes, window_figures
from .tuner.loop import Round, TunerSettings, measured_figures, tune_round
from .tuner.observation import WAITING_CAUSES, Observation
from .tuning_state import state_from_status, state_status
from .tuning_vllm import gather_vllm

#: shortest window worth judging (after a change, the window only counts what ran under it)
MIN_WINDOW_S = 10.0


@dataclass
class Gathered:
    observation: Observation
    trace: list[dict[str, Any]]
    window_s: float
    #: the trace was synthesized from the metrics (runtime vllm records none), not recorded
    trace_synthesized: bool = False
    #: the requests that arrived in the window before this one (the backlog this window inherited is
    #: among them) and where this window starts, in the trace's clock: the verdict's replay runs them
    lead: list[dict[str, Any]] = field(default_factory=list)
    window_start: float | None = None


@dataclass
class TickResult:
    status_update: dict[str, Any] = field(default_factory=dict)
    conditions: list[c.Cond] = field(default_factory=list)
    events: list[EventSpec] = field(default_factory=list)
    applied: dict[str, Any] = field(default_factory=dict)  # knob -> value written to status.engine
    scale: int | None = None  # replicas to set through the scale subresource (compute-bound, Apply mode)


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


def gather(plan: AutotunePlan, namespace: str, name: str, spec: InferenceDeploymentSpec,
           since_change_s: float | None, *, allowed: tuple[str, ...], pods: set[str],
           timeout_s: float = 10.0, admin_key: str | None = None, running: EngineConfig | None = None,
           max_bytes: int = MAX_RESPONSE_BYTES) -> Gathered:
    """Prometheus over the window (never reaching back past the last change, nor past the start of
    the engine it reads: after a restart change, the new pods' start), then the state, trace and step
    log of one replica Prometheus scraped. Raises MetricsUnavailable with a reason.

    ``allowed``: the Prometheus base URLs the operator may query (`Settings.prometheus_allowlist`);
    ``pods``: the IPs of this InferenceDeployment's own pods, as the API lists them: the admin key goes
    to those only, whatever addresses Prometheus lists. Every request has a total deadline
    (``timeout_s``) and a byte cap (``max_bytes``)."""
    check_allowed(plan.prometheus_url, allowed)
    window = plan.window_s if since_change_s is None else min(plan.window_s, since_change_s)
    if window < MIN_WINDOW_S:
        raise MetricsUnavailable("WindowTooShort", f"only {window:.0f}s since the last change; "
                                 f"waiting for at least {MIN_WINDOW_S:.0f}s of metrics under the new knobs")
    if spec.runtime == "vllm":  # no admin API: vLLM's series alone, the knobs from its command line
        objectives = tuner_settings(spec, plan).objectives
        obs, trace, window = gather_vllm(plan, namespace, name, running or baseline_config(spec), window,
                                         slo_ttft_s=objectives.slo_ttft_s, slo_tpot_s=objectives.slo_tpot_s,
                                         timeout_s=timeout_s)
        return Gathered(obs, trace, window, trace_synthesized=True)
    w = read_window(plan.prometheus_url, namespace, name, window, timeout_s=timeout_s, max_bytes=max_bytes)
    errors, young = [], []
    for inst in w.instances:
        url = inst if inst.startswith("http") else f"http://{inst}"
        if pod_host(url) not in pods:  # Prometheus' word is no proof: only our own pods get the key
            errors.append(f"{inst[:80]}: not an IP of this InferenceDeployment's pods, not contacted")
            continue
        # the admin API answers only the admin key of the operator's Secret <name>-admin-key; the
        # client too refuses to send it to any host but our pods
        engine = EngineClient(url, admin_key=admin_key, key_only_to=pods, deadline_s=timeout_s, max_bytes=max_bytes)
        try:
            state = engine.state()
            uptime = state.uptime_s
            if uptime < MIN_WINDOW_S:
                young.append(f"{inst} started {uptime:.0f}s ago")
                continue
            if uptime < window:
                # The engine started inside the window (a restart change rolled the pods): the
                # window before its start is another engine (the old pod, under the old knobs,
                # then none while the new one loaded), not the config this one runs.
                window = uptime
                w = read_window(plan.prometheus_url, namespace, name, window, timeout_s=timeout_s,
                                new_instances=[inst], max_bytes=max_bytes)
            since = max(0.0, uptime - window)
            # the replays run the requests still queued or running too (``backlog``); the
            # window's own figures only the finished ones, as the engine's histograms do
            wt = engine.trace(since_s=max(0.0, since - window), limit=10000, unfinished=True).split(since)
            steps = engine.steps(limit=2000)
        except EngineError as e:  # a short fixed reason: no part of the engine's answer
            errors.append(f"{url}: {e}")
            continue
        objectives = tuner_settings(spec, plan).objectives
        obs = Observation.from_metrics(w.figures, state=state.raw, trace=wt.finished, window_s=window,
                                       slo_ttft_s=objectives.slo_ttft_s, slo_tpot_s=objectives.slo_tpot_s)
        # the step log gives the cost fit one sample per step (the histograms only their means)
        return Gathered(obs.with_engine_steps(steps.steps), wt.trace, window, lead=wt.lead,
                        window_start=since)
    if young:
        raise MetricsUnavailable("WindowTooShort", f"the engine started less than {MIN_WINDOW_S:.0f}s ago "
                                 f"({'; '.join(young)}); waiting for metrics from it")
    raise MetricsUnavailable("EngineUnreachable", "cannot read the engine's state and trace: "
                             + ("; ".join(errors) or "Prometheus lists no engine instance"))


def _stamp(t: float) -> dt.datetime:
    """A status timestamp: whole seconds, UTC (what kubectl shows)."""
    return dt.datetime.fromtimestamp(int(t), dt.timezone.utc)


def diagnosis_status(rnd: Round, window_s: float, now: float, replicas: int = 1) -> dict[str, Any]:
    """status.diagnosis of a round; ``replicas``: engine pods now (a compute-bound prediction is for one's share)."""
    o, d = rnd.observation, rnd.diagnosis
    message, needed = d.message, None
    if rnd.replicas is not None:
        per = rnd.replicas.replicas
        needed = replicas_needed(per, replicas) if per is not None else None
        message += f" Predicted for one engine's load: {rnd.replicas.message}"
        if needed is not None and replicas > 1:
            message += f"; {replicas} replicas run now, so about {needed} in all"
        message += "."
    figures = Figures(
        kv_usage_percent=round(100 * o.kv_usage_mean, 1),
        waiting=int(round(o.waiting_mean)), running=int(round(o.running_mean)),
        internal_fragmentation_percent=round(100 * o.internal_fragmentation_mean, 1),
        swap_usage_percent=round(100 * o.swap_usage_peak, 1),
        preemptions_per_minute=round(60 * o.preemptions / window_s, 2) if window_s else 0.0,
        queue_time_p95_seconds=round(o.queue_time_p95_s, 3),
        ttft_p95_seconds=round(o.ttft_p95_s, 3),
        tpot_p95_seconds=round(o.tpot_p95_s, 4),
        throughput_tokens_per_second=round(o.output_tokens_per_s, 2),
        goodput_requests_per_second=round(o.goodput_requests_per_s, 3),
        # every cause, also those the engine did not report (0): the map replaces the previous one
        waiting_reason_shares={k: round(v, 3) for k, v in {**dict.fromkeys(WAITING_CAUSES, 0.0),
                                                           **o.waiting_cause_share}.items()},
        prefix_cache_hit_percent=None if o.prefix_cache_hit_rate is None else round(100 * o.prefix_cache_hit_rate, 1),
        replicas_needed=needed,
    )
    return Diagnosis(cause=d.cause, message=message[:4096], figures=figures, observed_at=_stamp(now),
                     window=f"{int(window_s)}s").dump()


def _figures(f: Mapping[str, float] | None) -> Figures | None:
    """The window figures a decision quotes, by the field's names: request and token goodput, slo
    attainment, ttft, tpot and e2el p95 in ms (where the window has them), throughput, p95 queue
    time; a prediction's utilization and goodput range too."""
    if not f:
        return None
    get = lambda k: round(float(f[k]), 3) if f.get(k) is not None else None  # noqa: E731
    ms = lambda k: round(1000 * float(f[k]), 1) if f.get(k) is not None else None  # noqa: E731
    low, high = get("goodput_low_requests_per_s"), get("goodput_high_requests_per_s")
    out = Figures(goodput_requests_per_second=get("goodput_requests_per_s"),
                  goodput_tokens_per_second=get("goodput_tokens_per_s"),
                  slo_attainment=get("goodput_share"),
                  ttft_p95_ms=ms("ttft_p95_s"), tpot_p95_ms=ms("tpot_p95_s"), e2el_p95_ms=ms("e2el_p95_s"),
                  throughput_tokens_per_second=get("output_tokens_per_s"),
                  queue_time_p95_seconds=get("queue_time_p95_s"),
                  utilization=get("utilization"),
                  goodput_range_requests_per_second=[low, high] if low is not None and high is not None else None)
    return out if out.dump() else None


def _predicted(f: Mapping[str, float] | None) -> Figures | None:
    """A prediction's figures; None for a decision that had none (a kvtune.io/try candidate is not
    simulated: its pending figures are all zero)."""
    out = _figures(f)
    if out is None or not (out.goodput_requests_per_second or out.throughput_tokens_per_second):
        return None
    return out


def _decision(now: float, action: str, message: str, *, cause: str | None = None, restart: bool = False,
              before: dict[str, Any] | None = None, after: dict[str, Any] | None = None,
              predicted: Figures | None = None, measured: Figures | None = None,
              prediction_error_ratio: float | None = None) -> dict[str, Any]:
    """One entry of status.tuning.history (and lastChange), through the status model."""
    return TuningDecision(time=_stamp(now), action=action, cause=cause, message=message, restart=restart,
                          before=_camel(before) if before else None, after=_camel(after) if after else None,
                          predicted=predicted, measured=measured,
                          prediction_error_ratio=round(prediction_error_ratio, 4)
                          if prediction_error_ratio is not None else None).dump()


def _replacing(old: Any, new: Any) -> Any:
    """``new`` as a JSON merge patch that replaces ``old``: keys of ``old`` that ``new`` lacks become
    None (deleted), at every depth. The status is written by merge patch, which merges nested objects:
    without this, a RollBack in tuning.lastChange would keep the before/after/restart of the Apply it
    replaced, and a diagnosis the figures of an earlier one."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = {k: _replacing(old.get(k), v) for k, v in new.items()}
        out.update({k: None for k in old if k not in new})
        return out
    return new


def _camel(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in to_camel_dict(d).items() if v is not None}


TRY_ANNOTATION = "kvtune.io/try"


def parse_trial(annotations: dict[str, str] | None) -> dict[str, Any] | None:
    """The knobs of the `kvtune.io/try` annotation (JSON, camelCase, e.g. {"maxNumSeqs": 96}): a
    candidate the user asks to try; applied like a tuner decision, verified, rolled back if worse."""
    raw = (annotations or {}).get(TRY_ANNOTATION)
    if not raw:
        return None
    what = (f"annotation {TRY_ANNOTATION} must be a JSON object of engine knobs "
            f"({', '.join(sorted(KNOBS_BY_CAMEL))}) within the resource's limits")
    try:
        if len(raw) > TRIED_MAX:
            raise ValueError(f"{len(raw)} characters, more than {TRIED_MAX}")
        knobs = json.loads(raw)
        if not isinstance(knobs, dict):
            raise ValueError("not an object")
        trial = {KNOBS_BY_CAMEL[k]: v for k, v in knobs.items()}
    except (ValueError, KeyError, RecursionError) as e:
        raise ValueError(f"{what}: {e}") from None
    try:  # each value as the resource takes it (types, the knob table's limits)
        EngineKnobs.model_validate(knobs)
    except ValidationError as e:
        raise ValueError(f"{what}: " + "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                                 for err in e.errors())) from None
    return trial


#: the longest kvtune.io/try value status.tuning.triedAnnotation holds; a longer one is kept as its digest
TRIED_MAX = 4096


def tried_key(raw: str) -> str:
    """How status.tuning.triedAnnotation remembers a kvtune.io/try value (tried once, valid or not)."""
    return raw if len(raw) <= TRIED_MAX else "sha256:" + hashlib.sha256(raw.encode()).hexdigest()


def _record(out: TickResult, tuning: dict[str, Any], history: list[dict[str, Any]], entry: dict[str, Any],
            event_type: str) -> None:
    """One decision (a `_decision`): into the history, as tuning.lastChange, and as an Event."""
    history.append(entry)
    tuning["lastChange"] = entry
    out.events.append(EventSpec(event_type, f"Tuning{entry['action']}", entry["message"]))


def _scale_decision(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus | None, plan: AutotunePlan,
                    rnd: Round, autoscaler: str | None, now: float) -> tuple[int, str] | None:
    """(replicas, why) when a compute-bound round should scale: Apply mode, autotune.bounds.replicas
    set, no other autoscaler, and no scale within the cooldown. None otherwise (the prediction stays
    in the diagnosis: a recommendation)."""
    b = spec.autotune.bounds.replicas if spec.autotune and spec.autotune.bounds else None
    if b is None or plan.mode != AutotuneMode.APPLY or autoscaler is not None or rnd.replicas is None:
        return None
    history = (status.tuning.history if status and status.tuning else None) or []
    last = next((h for h in reversed(history) if h.action == "Scale"), None)
    if last is not None and now - last.time.timestamp() < plan.cooldown_s:
        return None
    per = rnd.replicas.replicas
    target = replica_target(replicas_needed(per, spec.replicas) if per is not None else None, spec.replicas,
                            b.min, b.max)
    if target is None:
        return None
    return target, (f"the engine is compute-bound and no knob helps: scaling {spec.replicas} -> {target} replicas "
                    f"(autotune.bounds.replicas {b.min or 1}..{b.max if b.max is not None else spec.replicas}); "
                    f"predicted for one engine's load: {rnd.replicas.message}")


def tick(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus | None, plan: AutotunePlan,
         gathered: Gathered, now: float, *, trial: dict[str, Any] | None = None,
         base_profile: Profile | None = None, autoscaler: str | None = None) -> TickResult:
    """One round of the tuning loop for one deployment: what to write back (never the spec).

    A pure function of (status, window, now): the tuner's state is read from ``status.tuning`` and its
    new state is part of the returned status update, written with the decision that made it.
    `trial`: knobs the user asked to try (kvtune.io/try), decided instead of the tuner's choice.
    `autoscaler`: an HPA or ScaledObject that owns the replica count (the tuner then only predicts)."""
    out = TickResult()
    obs, mode = gathered.observation, plan.mode
    current = effective_engine(spec, status, mode).config
    old_tuning = status.tuning.dump() if status and status.tuning else {}
    old_diagnosis = status.diagnosis.dump() if status and status.diagnosis else {}
    tuning = dict(old_tuning)
    history = list(tuning.get("history") or [])
    settings = tuner_settings(spec, plan)
    traced = (f"{len(gathered.trace)} requests synthesized from vLLM's histograms (vLLM records no trace)"
              if gathered.trace_synthesized else
              f"{len(gathered.trace)} traced requests ({len(in_engine(gathered.trace))} "
              "still in the engine, their output lengths estimated)")
    out.conditions.append(c.Cond("MetricsAvailable", "True", "WindowRead",
                                 f"{int(gathered.window_s)}s of engine metrics and {traced}"))
    stale = knob_changes(obs.config, current)
    refused = _refused_live(obs, current, stale)
    if refused:  # the engines will never run it live: waiting in Applying would wedge the loop
        if state_from_status(status.tuning if status else None).phase == "Verifying":
            return roll_back_failed_rollout(spec, status, plan, refused, now, what="the engines refused the change")
        tuning.update(mode=mode.value, phase="Applying", message=f"the engines cannot run it without a restart: {refused}")
        out.status_update = {"tuning": TuningStatus.checked(tuning)}
        out.conditions.append(c.Cond("Tuned", "False", "NeedsRestart", tuning["message"]))
        return out
    if stale:  # a change is still rolling out: a window of the old knobs would judge the wrong config
        tuning.update(mode=mode.value, phase="Applying",
                      message=f"waiting for the engines to run {_camel(stale)}")
        out.status_update = {"tuning": TuningStatus.checked(tuning)}
        return out
    state = state_from_status(status.tuning if status else None)
    trying = trial is not None and mode == AutotuneMode.APPLY and state.phase != "Verifying"
    rnd, state = tune_round(settings, state, obs, gathered.trace, now, base_profile=base_profile,
                            apply=mode == AutotuneMode.APPLY, decide=not trying, lead=gathered.lead,
                            window_start=gathered.window_start)
    if trying and rnd.verdict is None:
        cfg = current.with_changes(**trial)
        rnd.decision = Decision("change", f"trying the knobs of annotation {TRY_ANNOTATION}", current, cfg,
                                knob_changes(current, cfg), restart=bool(current.restart_changes(cfg)))
        state.begin(rnd.decision, measured_figures(obs), now, source="Annotation")
    out.status_update["diagnosis"] = _replacing(old_diagnosis,
                                                diagnosis_status(rnd, gathered.window_s, now, spec.replicas))

    def record(entry: dict[str, Any], event_type: str) -> None:
        _record(out, tuning, history, entry, event_type)

    target, phase, message = current, "Observing", rnd.note
    if rnd.verdict is not None:
        v = rnd.verdict
        action = "Keep" if v.keep else "RollBack"
        # a rollback's own change (a rolled-back round decides nothing else, so rnd.config is the
        # restored config); a Keep changes nothing (rnd.config may be a decision of this same round)
        undo = {} if v.keep else knob_changes(current, rnd.config)
        before = {k: getattr(current, k) for k in undo}
        # a rollback says which change it undid: two rollbacks with the same figures read apart
        said = f"{v.reason} ({_camel(before)} back to {_camel(undo)})" if undo else v.reason
        record(_decision(now, action, said, cause=rnd.diagnosis.cause, restart=bool(RESTART_KNOBS & undo.keys()),
                         before=before, after=undo,
                         predicted=_predicted(v.predicted), measured=_figures(v.measured),
                         prediction_error_ratio=v.prediction_error_ratio),
               "Normal" if v.keep else "Warning")
        target, phase, message = rnd.config, ("Settled" if v.keep else "RolledBack"), said
    d = rnd.decision
    if d is not None and d.action == "change":
        apply = mode == AutotuneMode.APPLY and not rnd.unreliable  # unreliable predictions: recommend only
        repeated = not apply and (tuning.get("lastChange") or {}).get("after") == _camel(d.changes)
        if not repeated:  # Recommend mode: one event per new recommendation, not one per tick
            said = d.explained(rnd.diagnosis.message, rnd.diagnosis.suggestion)
            record(_decision(now, "Apply" if apply else "Recommend", said,
                             cause=rnd.diagnosis.cause, restart=d.restart or spec.runtime == "vllm",
                             before={k: getattr(d.current, k) for k in d.changes}, after=d.changes,
                             predicted=_predicted({**window_figures(d.predicted), **(d.confidence or {})}
                                                  if d.predicted else None)), "Normal")
        if apply:
            target, phase = d.config, "Verifying"
            message = f"applied {_camel(d.changes)}; verifying over the next window"
        else:
            phase, message = "Recommended", f"recommends {_camel(d.changes)} (" + (
                f"not applied: {rnd.unreliable}" if rnd.unreliable else "Recommend mode: not applied") + ")"
    elif d is not None and rnd.verdict is None:
        message = d.reason
    scale = _scale_decision(spec, status, plan, rnd, autoscaler, now) if rnd.replicas is not None else None
    if scale is not None:
        out.scale, note = scale
        record(_decision(now, "Scale", note, cause=rnd.diagnosis.cause), "Normal")
        phase, message = "Observing", note
    changes = knob_changes(current, target)
    if changes and mode == AutotuneMode.APPLY:
        out.status_update.update(tuned_status(spec, current, changes))
        out.applied = changes
    tuning.update(mode=mode.value, phase=phase, message=message or "", history=history[-TUNING_HISTORY_LIMIT:],
                  traceSource="synthesized" if gathered.trace_synthesized else "recorded", **state_status(state))
    out.status_update["tuning"] = _replacing(old_tuning, TuningStatus.checked(tuning))
    out.conditions.append(c.predictions_condition(rnd.unreliable, state.prediction_error))
    settled = rnd.diagnosis.cause == "Healthy" or phase in ("Settled",)
    out.conditions.append(c.Cond("Tuned", "True" if settled else "False", phase, message or rnd.diagnosis.message))
    return out


def roll_back_failed_rollout(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus, plan: AutotunePlan,
                             failure: str, now: float, *, what: str = "the new engine pods did not start") -> TickResult:
    """The pending restart change's pods never came up (or, ``what``, the engines refused a live
    change): restore the knobs that ran before it (the old pods still serve: maxUnavailable 0), bar
    the candidate, and say why in the engine's own words. No window is judged: the change never ran."""
    out = TickResult()
    objectives = tuner_settings(spec, plan).objectives
    state = state_from_status(status.tuning)
    current = effective_engine(spec, status, plan.mode).config
    restored = state.fail(now, f"{what}: {failure}", objectives)
    undo = knob_changes(current, restored)
    old_tuning = status.tuning.dump() if status.tuning else {}
    tuning = dict(old_tuning)
    history = list(tuning.get("history") or [])
    message = (f"{what}: {failure}; rolled back to "
               f"{_camel({k: getattr(restored, k) for k in undo})}, the candidate is barred")
    _record(out, tuning, history, _decision(
        now, "RollBack", message, cause=status.diagnosis.cause if status.diagnosis else None,
        restart=bool(RESTART_KNOBS & undo.keys()), before={k: getattr(current, k) for k in undo}, after=undo),
        "Warning")
    if undo:
        out.status_update.update(tuned_status(spec, current, undo))
        out.applied = undo
    tuning.update(mode=plan.mode.value, phase="RolledBack", message=message,
                  history=history[-TUNING_HISTORY_LIMIT:], **state_status(state))
    out.status_update["tuning"] = _replacing(old_tuning, TuningStatus.checked(tuning))
    out.conditions.append(c.Cond("Tuned", "False", "RolledBack", message))
    return out


def _refused_live(obs: Observation, current: EngineConfig, stale: dict[str, Any]) -> str | None:
    """Why the engines will not run ``current``'s live knobs (a raise past the step their start-up
    memory profile covered: they keep it pending a restart), or None."""
    p = getattr(obs, "activation_profile", None)
    if not stale or p is None or RESTART_KNOBS & stale.keys():
        return None
    over = p.exceeded(current.max_num_batched_tokens, current.max_num_seqs)
    if not over:
        return None
    return ("; ".join(f"{k} {want} is past the {most} the engine's start-up memory profile covered"
                      for k, (most, want) in sorted(over.items()))
            + " (a bigger step may not fit in device memory; it takes a restart)")


def _since_last_change(status: InferenceDeploymentStatus | None, now: float) -> float | None:
    """Seconds the running knobs have served: since the last change, or since a restart change's
    rollout completed (a window before it is the old pods' or the new ones' start-up)."""
    last = status.tuning.last_change if status and status.tuning else None
    if last is None or last.action not in ("Apply", "RollBack"):
        return None
    t = dt.datetime.fromisoformat(str(last.time).replace("Z", "+00:00")).timestamp()
    rolled_out = status.tuning.pending.rolled_out_at if status.tuning.pending else None
    if rolled_out is not None:
        t = max(t, rolled_out.timestamp())
    return max(0.0, now - t)


class TuningLoop:
    """One tuning round per deployment every spec.autotune.interval; the kopf timer calls `maybe_tick`
    often. It keeps nothing of its own: kopf's per-object ``memo`` holds when the object was last
    looked at, and the object's status.tuning all the tuner remembers (tuning_state.py), read fresh
    at every round."""

    def __init__(self, reconciler: Any, settings: Any, clock: Callable[[], float] = time.time):
        self.reconciler, self.settings, self.clock = reconciler, settings, clock

    def maybe_tick(self, namespace: str, name: str, body: Mapping[str, Any],
                   memo: MutableMapping[str, Any], queue: RoundQueue | None = None) -> TickResult | None:
        """One round if this deployment is due (its last round's start plus its interval; the first
        round is due when first seen) and ``queue`` (the process's, shared by every deployment's
        timer) admits it; its lateness is a metric and the RoundsLate condition."""
        infd = InferenceDeployment.from_body(body)
        plan = resolve_autotune(infd.spec, self.settings)
        now = self.clock()
        if plan.mode == AutotuneMode.OFF:
            memo.pop("tuned_at", None)
            memo.pop("first_due_at", None)
            if queue is not None:
                queue.withdraw((namespace, name))
            return None
        due_at = memo["tuned_at"] + plan.interval_s if "tuned_at" in memo else memo.setdefault("first_due_at", now)
        if now < due_at:
            return None
        admission = queue.offer((namespace, name), due_at, now) if queue is not None else \
            Admission((namespace, name), due_at, now)
        if queue is not None:
            operator_metrics.ROUNDS_WAITING.set(queue.waiting)
        if admission is None:  # others were due before it: it keeps its place until its next poll
            return None
        operator_metrics.ROUND_LAG.observe(admission.lag_s)
        late = admission.lag_s > plan.interval_s
        try:
            operator_metrics.ROUNDS_RUNNING.set(queue.running if queue is not None else 1)
            with operator_metrics.ROUND_DURATION.time():
                return self._tick(namespace, name, memo, now, admission, queue)
        finally:
            if queue is not None:
                queue.done((namespace, name), late=late)
                operator_metrics.ROUNDS_RUNNING.set(queue.running)
                operator_metrics.ROUNDS_LATE.set(queue.late)

    def _tick(self, namespace: str, name: str, memo: MutableMapping[str, Any], now: float, admission: Admission,
              queue: RoundQueue | None) -> TickResult | None:
        memo["tuned_at"] = now
        # kopf's body may predate our own last status patch: the state must come from a fresh read
        raw = self.reconciler.kube.get_infd(namespace, name)
        if raw is None or (raw.get("metadata") or {}).get("deletionTimestamp"):
            return None
        infd = InferenceDeployment.from_body(raw)
        plan = resolve_autotune(infd.spec, self.settings)
        result = self._round(namespace, name, infd, plan, now)
        error = (result.status_update.get("tuning") or {}).get("predictionError")
        if error is not None:
            operator_metrics.PREDICTION_ERROR.labels(namespace, name).set(error)
        result.conditions.append(c.rounds_late(admission.lag_s, plan.interval_s,
                                               queue.capacity if queue is not None else 1, now))
        # several replicas: recorded only if no other round wrote the tuner's state since this read
        self.reconciler.reconcile(namespace, name, status_update=result.status_update,
                                  conditions=result.conditions, events=result.events,
                                  basis=(raw.get("status") or {}).get("tuning") or {})
        return result

    def _round(self, namespace: str, name: str, infd: InferenceDeployment, plan: AutotunePlan,
               now: float) -> TickResult:
        status, tuning = infd.status, infd.status.tuning
        pending = tuning.pending if tuning else None
        if pending is not None and pending.restart and plan.mode == AutotuneMode.APPLY:
            deployment = self.reconciler.kube.get("apps/v1", "Deployment", namespace, name)
            pods = self.reconciler.kube.list_pods(namespace, selector_string(name))
            failure = rollout_failure(pods, deployment, pending.restart_hash)
            if failure:
                return roll_back_failed_rollout(infd.spec, status, plan, failure, now)
            rolling = rollout_pending(deployment, pending.restart_hash, pods)
            if rolling:  # a window now could be the old pods' (vLLM's metrics do not tell its knobs)
                return TickResult(status_update={"tuning": TuningStatus.checked(
                    {**tuning.dump(), "phase": "Applying", "message": f"waiting for the rollout: {rolling}"})})
            if pending.rolled_out_at is None:  # the verdict's window starts now (_since_last_change)
                done = pending.model_copy(update={"rolled_out_at": dt.datetime.fromtimestamp(now, dt.timezone.utc)})
                return TickResult(status_update={"tuning": TuningStatus.checked({
                    **tuning.dump(), "pending": done.dump(), "phase": "Verifying",
                    "message": f"rolled out; the verdict comes after a whole {plan.window_s:.0f}s window of the "
                               "new pods"})})
            if now - pending.rolled_out_at.timestamp() < plan.window_s:
                return TickResult()
        try:
            own_pods = pod_ips(self.reconciler.kube.list_pods(namespace, selector_string(name)))
            if getattr(self.settings, "allow_loopback_engines", False):  # a test harness' local engines
                own_pods |= {"127.0.0.1", "::1"}
            gathered = gather(plan, namespace, name, infd.spec, _since_last_change(status, now),
                              allowed=self.settings.prometheus_allowlist, pods=own_pods,
                              admin_key=engine_admin_key(self.reconciler.kube, namespace, name, infd.metadata.uid),
                              running=effective_engine(infd.spec, status, plan.mode).config)
        except MetricsUnavailable as e:
            waiting = " A pending change keeps waiting for its verdict." if pending is not None else ""
            return TickResult(conditions=[c.Cond("MetricsAvailable", "False", e.reason, f"{e}.{waiting}")])
        trial, invalid = None, None
        raw = (infd.metadata.annotations or {}).get(TRY_ANNOTATION)
        if raw and (tuning.tried_annotation if tuning else None) != tried_key(raw):
            try:
                trial = parse_trial({TRY_ANNOTATION: raw})
                effective_engine(infd.spec, status, plan.mode).config.with_changes(**trial)  # the engine's checks
            except ValueError as e:  # answered once, with what is allowed; never a failing timer
                why = str(e) if str(e).startswith("annotation") else \
                    f"annotation {TRY_ANNOTATION}: the engine refuses these knobs: {e}"
                trial, invalid = None, EventSpec("Warning", "InvalidTrial", why)
        scaling = bool(infd.spec.autotune and infd.spec.autotune.bounds and infd.spec.autotune.bounds.replicas)
        autoscaler = autoscaler_of(self.reconciler.kube.autoscalers(namespace), name) if scaling else None
        result = tick(infd.spec, status, plan, gathered, now, trial=trial, autoscaler=autoscaler)
        if result.scale is not None:  # the scale subresource, as an autoscaler would (spec.replicas)
            self.reconciler.kube.patch_infd_scale(namespace, name, result.scale)
        if invalid is not None or (trial is not None and result.applied):  # each value is tried once
            result.status_update.setdefault("tuning", {})["triedAnnotation"] = tried_key(raw)
        result.events[:0] = [invalid] if invalid else []
        return result
