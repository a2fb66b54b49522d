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
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, MutableMapping

from kvtune_engine.config import RESTART_KNOBS, EngineConfig
from kvtune_engine.sim.profile import Profile
from pydantic import ValidationError

from . import conditions as c
from . import operator_metrics
from .effective import (AutotunePlan, baseline_config, effective_engine, left_to_engine, resolve_autotune, tuned_status,
                        tuner_settings)
from .model import (KNOBS_BY_CAMEL, TUNING_HISTORY_LIMIT, AutotuneMode, Diagnosis, EngineKnobs, Figures,
                    InferenceDeployment, InferenceDeploymentSpec, InferenceDeploymentStatus, TuningStatus)
from .engine_client import EngineClient, EngineError
from .prometheus import (MAX_RESPONSE_BYTES, QUERY_DEADLINE_S, MetricsUnavailable, check_allowed, pod_host, pod_ips,
                         read_window)
from .canary_children import canary_free, is_canary_pod
from .reconcile import EventSpec, engine_admin_key
from .render import selector_string
from .rollout import placement_note, rollout_failure, rollout_pending, template_restart_hash
from .round_queue import Admission, RoundQueue
from .scaling import autoscaler_of, replica_target, replicas_needed
from .tuner.backlog import in_engine
from .tuner.canary import judge_canary
from .tuner.decide import Decision, knob_changes, window_figures
from .tuner.loop import Round, measured_figures, tune_round
from .tuner.observation import WAITING_CAUSES, Observation
from .tuning_canary import (CanaryTarget, canary_pod_ready, canary_run, choose_target, gates_of, judged, lost,
                            pod_figures, pod_instances, ready_pods, restarted, waiting)
from .tuning_state import state_from_status, state_status
from .tuning_record import (TickResult, camel, decision_entry, quoted_figures, quoted_prediction, record,
                            replacing, stamp)
from .tuning_vllm import gather_vllm

log = logging.getLogger(__name__)

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
    #: pod name -> where Prometheus scrapes it (this deployment's own pods)
    instances: dict[str, str] = field(default_factory=dict)
    #: where the engines' own report contradicts the knobs the operator gave them (runtime vllm)
    drift: tuple[str, ...] | None = None


def gather(plan: AutotunePlan, namespace: str, name: str, spec: InferenceDeploymentSpec,
           since_change_s: float | None, *, allowed: tuple[str, ...], pods: set[str],
           timeout_s: float = QUERY_DEADLINE_S, admin_key: str | None = None, running: EngineConfig | None = None,
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
        config = running or baseline_config(spec)
        obs, trace, window, series, found = gather_vllm(
            plan, namespace, name, config, window, slo_ttft_s=objectives.slo_ttft_s, slo_tpot_s=objectives.slo_tpot_s,
            timeout_s=timeout_s, left_to_engine=left_to_engine(spec, config))
        return Gathered(obs, trace, window, trace_synthesized=True, drift=tuple(found),
                        instances=pod_instances(series, pods))
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
                        window_start=since, instances=pod_instances(w.series, pods))
    if young:
        raise MetricsUnavailable("WindowTooShort", f"the engine started less than {MIN_WINDOW_S:.0f}s ago "
                                 f"({'; '.join(young)}); waiting for metrics from it")
    raise MetricsUnavailable("EngineUnreachable", "cannot read the engine's state and trace: "
                             + ("; ".join(errors) or "Prometheus lists no engine instance"))


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
    return Diagnosis(cause=d.cause, message=message[:4096], figures=figures, observed_at=stamp(now),
                     window=f"{int(window_s)}s").dump()


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
         base_profile: Profile | None = None, autoscaler: str | None = None,
         canary: CanaryTarget | None = None) -> TickResult:
    """One round of the tuning loop for one deployment: what to write back (never the spec).

    A pure function of (status, window, now): the tuner's state is read from ``status.tuning`` and its
    new state is part of the returned status update, written with the decision that made it.
    `trial`: knobs the user asked to try (kvtune.io/try), decided instead of the tuner's choice.
    `autoscaler`: an HPA or ScaledObject that owns the replica count (the tuner then only predicts).
    `canary`: two or more replicas serve: a live change goes to this pod first (tuning_canary.py)."""
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
                      message=f"waiting for a window in which every engine runs {camel(stale)}")
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
    out.status_update["diagnosis"] = replacing(old_diagnosis,
                                               diagnosis_status(rnd, gathered.window_s, now, spec.replicas))

    def note(entry: dict[str, Any], event_type: str) -> None:
        record(out, tuning, history, entry, event_type)

    target, phase, message = current, "Observing", rnd.note
    started: CanaryTarget | None = None  # the canary a change begins on
    if rnd.verdict is not None:
        v = rnd.verdict
        action = "Keep" if v.keep else "RollBack"
        # a rollback's own change (a rolled-back round decides nothing else, so rnd.config is the
        # restored config); a Keep changes nothing (rnd.config may be a decision of this same round)
        undo = {} if v.keep else knob_changes(current, rnd.config)
        before = {k: getattr(current, k) for k in undo}
        # a rollback says which change it undid: two rollbacks with the same figures read apart
        said = f"{v.reason} ({camel(before)} back to {camel(undo)})" if undo else v.reason
        note(decision_entry(now, action, said, cause=rnd.diagnosis.cause, restart=bool(RESTART_KNOBS & undo.keys()),
                            before=before, after=undo,
                            predicted=quoted_prediction(v.predicted), measured=quoted_figures(v.measured),
                            prediction_error_ratio=v.prediction_error_ratio),
             "Normal" if v.keep else "Warning")
        target, phase, message = rnd.config, ("Settled" if v.keep else "RolledBack"), said
    d = rnd.decision
    if d is not None and d.action == "change":
        apply = mode == AutotuneMode.APPLY and not rnd.unreliable  # unreliable predictions: recommend only
        restart = d.restart or spec.runtime == "vllm"  # vLLM changes no knob live
        on_canary = canary if canary is not None and apply and (not restart or canary.deployment) else None
        repeated = not apply and (tuning.get("lastChange") or {}).get("after") == camel(d.changes)
        if not repeated:  # Recommend mode: one event per new recommendation, not one per tick
            said = d.explained(rnd.diagnosis.message, rnd.diagnosis.suggestion)
            if on_canary is not None and restart:
                said += (f"; first on one pod of canary Deployment {on_canary.deployment}, judged against "
                         f"{', '.join((on_canary.pod, *on_canary.controls))} over the same window")
            elif on_canary is not None:
                said += (f"; first on canary pod {on_canary.pod}, judged against {', '.join(on_canary.controls)} "
                         "over the same window")
            note(decision_entry(now, "Apply" if apply else "Recommend", said,
                                cause=rnd.diagnosis.cause, restart=restart,
                                before={k: getattr(d.current, k) for k in d.changes}, after=d.changes,
                                predicted=quoted_prediction({**window_figures(d.predicted), **(d.confidence or {})}
                                                            if d.predicted else None)), "Normal")
        started = on_canary
        if on_canary is not None and restart:  # status.engine stays: the pods keep the old knobs
            phase = "Canary"
            message = (f"canary Deployment {on_canary.deployment} starts a pod with {camel(d.changes)}; judged "
                       "against the other pods over a whole window once it is Ready")
        elif on_canary is not None:  # status.engine stays: the other pods keep the old knobs
            phase, out.canary_call = "Canary", (on_canary.url, dict(d.changes))
            message = (f"canary pod {on_canary.pod} runs {camel(d.changes)}; judged against "
                       f"{', '.join(on_canary.controls)} over the next window")
        elif apply:
            target, phase = d.config, "Verifying"
            message = f"applied {camel(d.changes)}; verifying over the next window"
        else:
            phase, message = "Recommended", f"recommends {camel(d.changes)} (" + (
                f"not applied: {rnd.unreliable}" if rnd.unreliable else "Recommend mode: not applied") + ")"
    elif d is not None and rnd.verdict is None:
        message = d.reason
    scale = _scale_decision(spec, status, plan, rnd, autoscaler, now) if rnd.replicas is not None else None
    if scale is not None:
        out.scale, why = scale
        note(decision_entry(now, "Scale", why, cause=rnd.diagnosis.cause), "Normal")
        phase, message = "Observing", why
    changes = knob_changes(current, target)
    if changes and mode == AutotuneMode.APPLY:
        out.status_update.update(tuned_status(spec, current, changes))
        out.applied = changes
    tuning.update(mode=mode.value, phase=phase, message=message or "", history=history[-TUNING_HISTORY_LIMIT:],
                  traceSource="synthesized" if gathered.trace_synthesized else "recorded", **state_status(state))
    if started is not None:
        tuning["pending"] = {**tuning["pending"], "canary": canary_run(started, now, restart=restart)}
    out.status_update["tuning"] = replacing(old_tuning, TuningStatus.checked(tuning))
    out.conditions.append(c.predictions_condition(rnd.unreliable, state.prediction_error))
    if gathered.drift is not None:
        out.conditions.append(c.engine_drift(gathered.drift))
    settled = rnd.diagnosis.cause == "Healthy" or phase in ("Settled",)
    out.conditions.append(c.Cond("Tuned", "True" if settled else "False", phase, message or rnd.diagnosis.message))
    return out


def roll_back_failed_rollout(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus, plan: AutotunePlan,
                             failure: str, now: float, *, what: str = "the new engine pods did not start",
                             canary: bool = False) -> TickResult:
    """The pending restart change's pods never came up (or, ``what``, the engines refused a live
    change): restore the knobs that ran before it (the old pods still serve: maxUnavailable 0), bar
    the candidate, and say why in the engine's own words. No window is judged: the change never ran.
    ``canary``: only the canary Deployment's pod tried it (no rollout to undo)."""
    out = TickResult()
    objectives = tuner_settings(spec, plan).objectives
    state = state_from_status(status.tuning)
    current = effective_engine(spec, status, plan.mode).config
    restored = state.fail(now, f"{what}: {failure}", objectives, rollout=not canary)
    undo = knob_changes(current, restored)
    old_tuning = status.tuning.dump() if status.tuning else {}
    tuning = dict(old_tuning)
    history = list(tuning.get("history") or [])
    message = (f"{what}: {failure}; " + (f"rolled back to {camel({k: getattr(restored, k) for k in undo})}"
                                         if undo else "no other pod ever ran it") + ", the candidate is barred")
    record(out, tuning, history, decision_entry(
        now, "RollBack", message, cause=status.diagnosis.cause if status.diagnosis else None,
        restart=bool(RESTART_KNOBS & undo.keys()), before={k: getattr(current, k) for k in undo}, after=undo),
        "Warning")
    if undo:
        out.status_update.update(tuned_status(spec, current, undo))
        out.applied = undo
    tuning.update(mode=plan.mode.value, phase="RolledBack", message=message,
                  history=history[-TUNING_HISTORY_LIMIT:], **state_status(state))
    out.status_update["tuning"] = replacing(old_tuning, TuningStatus.checked(tuning))
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
    # a canary's Keep is when every pod began running the change (promoted to status.engine)
    if last is None or not (last.action in ("Apply", "RollBack") or (last.action == "Keep" and last.canary)):
        return None
    t = dt.datetime.fromisoformat(str(last.time).replace("Z", "+00:00")).timestamp()
    rolled_out = status.tuning.pending.rolled_out_at if status.tuning.pending else None
    if rolled_out is not None:
        t = max(t, rolled_out.timestamp())
    return max(0.0, now - t)


def _canary_running(infd: InferenceDeployment) -> bool:
    """Whether status.tuning.pending names a canary (the one round Off mode still runs sets it back)."""
    pending = infd.status.tuning.pending if infd.status and infd.status.tuning else None
    return pending is not None and pending.canary is not None


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
            if not _canary_running(infd):
                if queue is not None:
                    queue.withdraw((namespace, name))
                return None
            due_at = now  # one more round, now: it sets the canary back
        else:
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
        if plan.mode == AutotuneMode.OFF and not _canary_running(infd):
            return None  # turned off since kopf's copy: no round (only a canary is set back)
        result = self._round(namespace, name, infd, plan, now)
        error = (result.status_update.get("tuning") or {}).get("predictionError")
        if error is not None:
            operator_metrics.PREDICTION_ERROR.labels(namespace, name).set(error)
        result.conditions.append(c.rounds_late(admission.lag_s, plan.interval_s,
                                               queue.capacity if queue is not None else 1, now))
        # several replicas: recorded only if no other round wrote the tuner's state since this read
        outcome = self.reconciler.reconcile(namespace, name, status_update=result.status_update,
                                            conditions=result.conditions, events=result.events,
                                            basis=(raw.get("status") or {}).get("tuning") or {})
        if result.canary_call is not None and outcome.written:  # recorded first: the canary round keeps it so
            url, knobs = result.canary_call
            own = self._own_ips(self.reconciler.kube.list_pods(namespace, selector_string(name)))
            try:
                self._engine(url, engine_admin_key(self.reconciler.kube, namespace, name, infd.metadata.uid),
                             own).set_config(knobs)
            except EngineError as e:  # the next round sees the canary without the change and sends it again
                log.warning("%s/%s: canary %s did not take %s yet: %s", namespace, name, url, knobs, e)
        return result

    def _round(self, namespace: str, name: str, infd: InferenceDeployment, plan: AutotunePlan,
               now: float) -> TickResult:
        status, tuning = infd.status, infd.status.tuning
        pending = tuning.pending if tuning else None
        if pending is not None and pending.canary is not None:
            return self._canary_round(namespace, name, infd, plan, now)
        if pending is not None and pending.restart and plan.mode == AutotuneMode.APPLY:
            deployment = self.reconciler.kube.get("apps/v1", "Deployment", namespace, name)
            pods = self.reconciler.kube.list_pods(namespace, selector_string(name))
            failure = rollout_failure(pods, deployment, pending.restart_hash, now)
            if failure:
                return roll_back_failed_rollout(infd.spec, status, plan, failure, now)
            rolling = rollout_pending(deployment, pending.restart_hash, pods)
            if rolling:  # a window now could be the old pods' (vLLM's metrics do not tell its knobs)
                return TickResult(status_update={"tuning": TuningStatus.checked({
                    **tuning.dump(), "phase": "Applying",
                    "message": f"waiting for the rollout: {rolling}{placement_note(pods, now)}"})})
            if pending.rolled_out_at is None:  # the verdict's window starts now (_since_last_change)
                done = pending.model_copy(update={"rolled_out_at": dt.datetime.fromtimestamp(now, dt.timezone.utc)})
                return TickResult(status_update={"tuning": TuningStatus.checked({
                    **tuning.dump(), "pending": done.dump(), "phase": "Verifying",
                    "message": f"rolled out; the verdict comes after a whole {plan.window_s:.0f}s window of the "
                               "new pods"})})
            if now - pending.rolled_out_at.timestamp() < plan.window_s:
                return TickResult()
        pods = self.reconciler.kube.list_pods(namespace, selector_string(name))
        own_pods = self._own_ips(pods)
        admin_key = engine_admin_key(self.reconciler.kube, namespace, name, infd.metadata.uid)
        try:
            gathered = gather(plan, namespace, name, infd.spec, _since_last_change(status, now),
                              allowed=self.settings.prometheus_allowlist, pods=own_pods, admin_key=admin_key,
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
        target = choose_target(ready_pods(p for p in pods if not is_canary_pod(p)), gathered.instances) \
            if plan.mode == AutotuneMode.APPLY else None
        if target is not None:  # a restart change (every change on vLLM) runs on a canary Deployment
            target = replace(target, deployment=canary_free(self.reconciler.kube, infd))
        result = tick(infd.spec, status, plan, gathered, now, trial=trial, autoscaler=autoscaler, canary=target)
        if result.scale is not None:  # the scale subresource, as an autoscaler would (spec.replicas)
            self.reconciler.kube.patch_infd_scale(namespace, name, result.scale)
        # each value is tried once: applied to every pod, or begun on a canary (status.engine stays)
        began = pending is None and \
            ((result.status_update.get("tuning") or {}).get("pending") or {}).get("source") == "Annotation"
        if invalid is not None or (trial is not None and (result.applied or began)):
            result.status_update.setdefault("tuning", {})["triedAnnotation"] = tried_key(raw)
        result.events[:0] = [invalid] if invalid else []
        return result

    def _own_ips(self, pods: list[dict[str, Any]]) -> set[str]:
        """The IPs of this deployment's pods: the only addresses that get its admin key."""
        own = pod_ips(pods)
        if getattr(self.settings, "allow_loopback_engines", False):  # a test harness' local engines
            own |= {"127.0.0.1", "::1"}
        return own

    @staticmethod
    def _engine(url: str, admin_key: str | None, own: set[str]) -> EngineClient:
        return EngineClient(url, admin_key=admin_key, key_only_to=own, deadline_s=QUERY_DEADLINE_S)

    def _canary_round(self, namespace: str, name: str, infd: InferenceDeployment, plan: AutotunePlan,
                      now: float) -> TickResult:
        """A round while a canary runs the pending change (tuning_canary.py): keep it running the
        change, and once a whole window has passed judge it against its controls, then promote it
        (status.engine) or set it back and roll back. A live change's canary is one of the pods (its
        admin API took the change); a restart change's is the canary Deployment's pod, every other
        pod its control, and setting it back is the canary Deployment going to zero (the reconcile
        does so once the change is no longer pending)."""
        spec, status = infd.spec, infd.status
        run = status.tuning.pending.canary
        pending = state_from_status(status.tuning).pending
        changes = dict(pending.changes)
        undo = {k: pending.before[k] for k in changes}
        restart = bool(run.deployment)
        gates = gates_of(spec)
        pods = self.reconciler.kube.list_pods(namespace, selector_string(name))
        own = self._own_ips(pods)
        admin_key = engine_admin_key(self.reconciler.kube, namespace, name, infd.metadata.uid)
        if plan.mode != AutotuneMode.APPLY:  # nothing is applied in Recommend or Off: no verdict, set it back
            why = f"autotune mode is {plan.mode.value}"
            if restart:
                return lost(spec, status, plan, f"{why}: canary Deployment {run.deployment} goes to zero pods", now)
            return self._stand_down(spec, status, plan, admin_key, own, now, why)
        if restart:
            early = self._canary_pod(namespace, infd, plan, pods, now)
            if early is not None:
                return early
        elif run.pod not in {(p.get("metadata") or {}).get("name") for p in pods}:
            return lost(spec, status, plan, f"canary pod {run.pod} went before its verdict (a replacement reads "
                                            "status.engine)", now)
        elapsed = now - run.started_at.timestamp()
        window = min(elapsed, gates.max_windows * plan.window_s)  # all it ran: an unsettled verdict measures on
        try:
            check_allowed(plan.prometheus_url, self.settings.prometheus_allowlist)
            if window < MIN_WINDOW_S:
                raise MetricsUnavailable("WindowTooShort", f"the canary has run the change for {elapsed:.0f}s; "
                                         f"waiting for at least {MIN_WINDOW_S:.0f}s of its metrics")
            w = read_window(plan.prometheus_url, namespace, name, window, runtime=spec.runtime)
        except MetricsUnavailable as e:
            return TickResult(conditions=[c.Cond("MetricsAvailable", "False", e.reason,
                                                 f"{e}. The canary keeps waiting for its verdict.")])
        scraped = pod_instances(w.series, own)
        if run.pod not in scraped:
            if elapsed > 2 * plan.window_s:  # what Prometheus does not scrape cannot be judged
                why = f"canary pod {run.pod} has not been in Prometheus' window for {elapsed:.0f}s"
                return lost(spec, status, plan, why, now) if restart else \
                    self._stand_down(spec, status, plan, admin_key, own, now, why)
            return waiting(status, f"canary pod {run.pod} is not in Prometheus' window; waiting for it")
        engine = None if restart else self._engine(scraped[run.pod], admin_key, own)
        try:
            running = engine.config().config if engine is not None else changes
            if any(running.get(k) != v for k, v in changes.items()):  # restarted, or its ConfigMap reloaded
                engine.set_config(changes)
                return restarted(status, now, f"canary pod {run.pod} no longer ran {camel(changes)}: sent it again; "
                                              "its window starts again")
        except EngineError as e:
            if elapsed > 2 * plan.window_s:  # a canary that cannot be reached cannot be judged, nor set back
                return lost(spec, status, plan, f"canary pod {run.pod} has not answered for {elapsed:.0f}s ({e}); it "
                                                "runs the change until it is restarted", now)
            return waiting(status, f"cannot reach canary pod {run.pod}: {e}; waiting")
        if elapsed < plan.window_s:
            return waiting(status, f"canary pod {run.pod} runs {camel(changes)}; the verdict comes after a whole "
                                   f"{plan.window_s:.0f}s window ({plan.window_s - elapsed:.0f}s left)")
        ready = ready_pods(pods)
        # a restart change's controls: every pod of the deployment's own that serves now (none runs the change)
        candidates = sorted(ready_pods(p for p in pods if not is_canary_pod(p))) if restart else run.controls
        controls = [x for x in candidates if x in scraped and x in ready]
        if not controls:
            why = (f"no control pod of {', '.join(candidates) or 'the deployment'} is left to judge canary "
                   f"{run.pod} against")
            if engine is not None:
                try:
                    engine.set_config(undo)
                except EngineError as e:
                    return waiting(status, f"no control left, and setting canary pod {run.pod} back failed: {e}; "
                                           "trying again")
            return lost(spec, status, plan, why, now)
        objectives = tuner_settings(spec, plan).objectives
        current = effective_engine(spec, status, plan.mode).config
        slo = (objectives.slo_ttft_s, objectives.slo_tpot_s)
        canary, measured = pod_figures(w.series, run.pod, window, current.with_changes(**changes), *slo,
                                       runtime=spec.runtime)
        j = judge_canary(canary, [pod_figures(w.series, x, window, current, *slo, runtime=spec.runtime)[0]
                                  for x in controls], gates, window)
        if not j.settled and elapsed < gates.max_windows * plan.window_s:
            return waiting(status, f"canary pod {run.pod} after {elapsed:.0f}s: its gates read within their sampling "
                                   f"noise ({j.reason}); measuring on, for at most {gates.max_windows} windows")
        if not j.promote and engine is not None:
            try:
                engine.set_config(undo)
            except EngineError as e:
                return waiting(status, f"the canary is reverted, but setting pod {run.pod} back failed: {e}; "
                                       "trying again")
        return judged(spec, status, plan, j, measured, now)

    def _canary_pod(self, namespace: str, infd: InferenceDeployment, plan: AutotunePlan,
                    pods: list[dict[str, Any]], now: float) -> TickResult | None:
        """A restart change's canary until its pod serves: rolled back (the candidate barred, no other
        pod ever ran it) when that pod's engine cannot start on the new knobs, waited for until its pod
        is Ready, its window started again when the pod is a new one; None once it has run the change
        since the window began."""
        spec, status = infd.spec, infd.status
        run = status.tuning.pending.canary
        mine = [p for p in pods if is_canary_pod(p) and not (p.get("metadata") or {}).get("deletionTimestamp")]
        deployment = self.reconciler.kube.get("apps/v1", "Deployment", namespace, run.deployment)
        failure = rollout_failure(mine, deployment, template_restart_hash(deployment), now)
        if failure:
            return roll_back_failed_rollout(spec, status, plan, failure, now, canary=True,
                                            what=f"canary Deployment {run.deployment} did not start")
        ready = sorted(ready_pods(mine))
        if run.pod in ready:
            return None
        if ready:  # its first pod, or one that replaced it: the window starts now
            return canary_pod_ready(status, ready[0], now)
        waited = now - run.started_at.timestamp()
        return waiting(status, f"canary Deployment {run.deployment}: waiting for its pod to be Ready ({waited:.0f}s)"
                               f"{placement_note(mine, now)}; the verdict comes a whole window after it is")

    def _stand_down(self, spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus, plan: AutotunePlan,
                    admin_key: str | None, own: set[str], now: float, why: str) -> TickResult:
        """End a canary that gets no verdict (``why``): set its knobs to what status.engine makes every
        pod run in this mode, then drop the change unjudged; a canary that cannot be set back is dropped
        once it has had two windows to answer, and runs the change until it restarts."""
        run = status.tuning.pending.canary
        current = effective_engine(spec, status, plan.mode).config
        back = {k: getattr(current, k) for k in state_from_status(status.tuning).pending.changes}
        elapsed = now - run.started_at.timestamp()
        try:
            if not run.url or pod_host(run.url) not in own:
                raise EngineError("/kvtune/v1/config", f"its address {run.url or '(not recorded)'} is not one of "
                                                      "the pods'")
            self._engine(run.url, admin_key, own).set_config(back)
        except EngineError as e:
            if elapsed <= 2 * plan.window_s:
                return waiting(status, f"{why}; setting canary pod {run.pod} back failed: {e}; trying again")
            return lost(spec, status, plan, f"{why}, and canary pod {run.pod} could not be set back ({e}); it runs "
                                            "the change until it is restarted", now)
        return lost(spec, status, plan, f"{why}: canary pod {run.pod} was set back to {camel(back)}", now)
