"""Canary rounds: a change goes to one engine pod first, is judged against its untouched siblings over
the same window (``tuner/canary.py``'s pure verdict), then promoted to every pod or reverted.

Which changes: Apply mode, two or more Ready engine pods Prometheus scrapes. A live change goes to
one of them through its admin API (``PATCH /kvtune/v1/config``); a revert sets it back through the
same API. A restart change, and every change on vLLM (no admin API, no live knob), runs on one extra
pod, the canary Deployment's (``canary_children.py``), every other pod its control; a revert is that
Deployment going to zero pods. The siblings keep their knobs (ConfigMap, command line), which change
only on Promote (status.engine). One replica, and a canary Deployment name taken by somebody else's
object, keep the before/after verdict.

Invariant: status.engine is what every engine pod runs but the one ``status.tuning.pending.canary``
names; the canary runs status.engine plus the pending change, and the window that judges it starts
when it last began running the change (a restarted live canary loses it: it is sent again and its
window starts again; a canary Deployment's new pod starts its window when it is Ready).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from kvtune_engine.config import EngineConfig

from . import conditions as c
from .effective import AutotunePlan, effective_engine, tuned_status, tuner_settings
from .model import (TUNING_HISTORY_LIMIT, CanaryRun, CanaryStatus, InferenceDeploymentSpec,
                    InferenceDeploymentStatus, TuningStatus)
from .prometheus import pod_host, window_figures
from .tuner.canary import CanaryJudgement, Gates, PodFigures
from .tuner.decide import Verdict, knob_changes, prediction_error_ratio
from .tuner.loop import measured_figures
from .tuner.observation import Observation
from .tuning_record import TickResult, camel, decision_entry, quoted_figures, quoted_prediction, record, replacing, stamp
from .tuning_state import state_from_status, state_status
from .tuning_vllm import pod_reading


@dataclass(frozen=True)
class CanaryTarget:
    """The pod a new live change goes to first (``url``: where Prometheus scrapes it, its admin API),
    and the siblings it is judged against; ``deployment``: the canary Deployment a restart change
    runs in first, all of ``pod`` and ``controls`` its controls (empty: the name is somebody else's,
    and a restart change is judged before/after)."""
    pod: str
    url: str
    controls: tuple[str, ...]
    deployment: str = ""


def ready_pods(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    """Names of the pods whose Ready condition is True (the ones a Service sends requests to)."""
    out = set()
    for p in pods:
        conds = (p.get("status") or {}).get("conditions") or []
        if any(x.get("type") == "Ready" and x.get("status") == "True" for x in conds) \
                and not (p.get("metadata") or {}).get("deletionTimestamp"):
            out.add((p.get("metadata") or {}).get("name"))
    return out


def pod_instances(series: Iterable[Mapping[str, Any]], own_ips: set[str]) -> dict[str, str]:
    """pod name -> the address Prometheus scrapes it at (its metrics and admin API), for this
    deployment's own pods only (an address that is not one of their IPs is never contacted)."""
    out: dict[str, str] = {}
    for s in series:
        m = s.get("metric") or {}
        pod, inst = m.get("pod"), m.get("instance")
        if pod and inst and pod_host(inst) in own_ips:
            out[pod] = inst if inst.startswith("http") else f"http://{inst}"
    return out


def choose_target(ready: set[str], scraped: Mapping[str, str]) -> CanaryTarget | None:
    """The first Ready, scraped pod by name as the canary, the other such pods as its controls; None
    with fewer than two (no control: the change is judged before/after)."""
    pods = sorted(p for p in ready if p in scraped)
    return CanaryTarget(pods[0], scraped[pods[0]], tuple(pods[1:])) if len(pods) >= 2 else None


def pod_figures(series: Iterable[Mapping[str, Any]], pod: str, window_s: float, config: EngineConfig,
                slo_ttft_s: float | None, slo_tpot_s: float | None,
                runtime: str = "kvtune") -> tuple[PodFigures, dict[str, float]]:
    """One pod's window from the deployment's series: the canary gates' figures and the figures a
    verdict quotes (the same reading of the histograms as the deployment's own window)."""
    mine = [s for s in series if (s.get("metric") or {}).get("pod") == pod]
    if runtime == "vllm":
        obs, errors = pod_reading(mine, window_s, config, slo_ttft_s, slo_tpot_s)
    else:
        f, _ = window_figures(mine, window_s)
        obs = Observation.from_metrics(f, window_s=window_s, config=config, slo_ttft_s=slo_ttft_s,
                                       slo_tpot_s=slo_tpot_s)
        errors = sum(f.get("kvtune_requests_finished_total", finish_reason=r) or 0.0 for r in ("error", "rejected"))
    return (PodFigures(pod, float(obs.requests_finished), obs.goodput_requests_per_s * window_s,
                       obs.output_tokens_per_s * window_s, errors, obs.ttft_p99_s or None,
                       queue_growth(mine, runtime)),
            measured_figures(obs))


#: each runtime's gauge of the requests waiting to be scheduled: (metric, its labels)
WAITING_GAUGE = {"kvtune": ("kvtune_requests", {"state": "waiting"}), "vllm": ("vllm:num_requests_waiting", {})}


def queue_growth(series: Iterable[Mapping[str, Any]], runtime: str = "kvtune") -> float:
    """How much one pod's waiting queue grew over the window (its gauge's last sample less its first;
    0 when it shrank): requests offered in the window that it had not begun to serve at its end."""
    name, labels = WAITING_GAUGE[runtime]
    for s in series:
        m, values = s.get("metric") or {}, s.get("values") or ()
        if m.get("__name__") == name and all(m.get(k) == v for k, v in labels.items()) and values:
            return max(0.0, float(values[-1][1]) - float(values[0][1]))
    return 0.0


def gates_of(spec: InferenceDeploymentSpec) -> Gates:
    canary = spec.autotune.canary if spec.autotune else None
    gates = canary.gates.gates() if canary is not None and canary.gates is not None else Gates()
    return replace(gates, max_windows=canary.max_windows) if canary is not None and canary.max_windows else gates


def canary_run(target: CanaryTarget, now: float, *, restart: bool) -> dict[str, Any]:
    """status.tuning.pending.canary for a change that starts on ``target`` now: a live change on its
    pod, a restart change on the canary Deployment's pod (named once it is Ready; every pod its control)."""
    if restart:
        return CanaryRun(controls=[target.pod, *target.controls], started_at=stamp(now),
                         deployment=target.deployment).dump()
    return CanaryRun(pod=target.pod, controls=list(target.controls), started_at=stamp(now), url=target.url).dump()


def canary_pod_ready(status: InferenceDeploymentStatus, pod: str, now: float) -> TickResult:
    """The canary Deployment's pod ``pod`` is Ready (a first one, or a replacement): its window starts now."""
    run = status.tuning.pending.canary
    changes = camel(state_from_status(status.tuning).pending.changes)
    return restarted(status, now, f"canary pod {pod} of Deployment {run.deployment} is Ready and runs {changes}; "
                                  "judged against the other pods after a whole window", pod=pod)


def restarted(status: InferenceDeploymentStatus, now: float, why: str, *, pod: str | None = None) -> TickResult:
    """The canary began running the change again at ``now`` (it had lost it, or ``pod`` is a canary
    Deployment's new pod): its window starts again."""
    tuning = status.tuning.dump()
    update: dict[str, Any] = {"started_at": stamp(now), **({"pod": pod} if pod is not None else {})}
    pending = {**tuning["pending"], "canary": status.tuning.pending.canary.model_copy(update=update).dump()}
    return TickResult(status_update={"tuning": TuningStatus.checked(
        {**tuning, "pending": pending, "phase": "Canary", "message": why})})


def waiting(status: InferenceDeploymentStatus, message: str) -> TickResult:
    return TickResult(status_update={"tuning": TuningStatus.checked(
        {**status.tuning.dump(), "phase": "Canary", "message": message})})


def _conclude(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus, plan: AutotunePlan, now: float,
              verdict: Verdict | None, message: str, canary: CanaryStatus | None,
              measured: Mapping[str, float] | None) -> TickResult:
    """End the pending canary: ``verdict`` None drops it unjudged (its pod went), else Keep promotes
    the change to status.engine (every pod) and RollBack bars it (the canary was already set back)."""
    out = TickResult()
    settings = tuner_settings(spec, plan)
    objectives = settings.objectives
    state = state_from_status(status.tuning)
    pending = state.pending
    assert pending is not None
    current = effective_engine(spec, status, plan.mode).config  # what every pod but the canary runs
    after = EngineConfig.model_validate(pending.after)
    changes = knob_changes(current, after)
    old_tuning = status.tuning.dump()
    tuning = dict(old_tuning)
    history = list(tuning.get("history") or [])
    cause = status.diagnosis.cause if status.diagnosis else None
    if verdict is None:
        state.pending, state.phase = None, "Idle"
        entry = decision_entry(now, "RollBack", message, cause=cause, before={k: getattr(after, k) for k in changes},
                               after={k: getattr(current, k) for k in changes})
        record(out, tuning, history, entry, "Warning")
        phase = "Observing"
    else:
        state.conclude(verdict, now, objectives, rollout=False)  # a canary's revert rolls no pod
        state.track_prediction(verdict.prediction_error_ratio, now, settings.thresholds, objectives.bad_memory_s)
        undo = {} if verdict.keep else {k: getattr(current, k) for k in changes}
        entry = decision_entry(now, "Keep" if verdict.keep else "RollBack", message, cause=cause,
                               before={k: getattr(after, k) for k in undo} if undo else None, after=undo or None,
                               predicted=quoted_prediction(verdict.predicted), measured=quoted_figures(measured),
                               prediction_error_ratio=verdict.prediction_error_ratio, canary=canary)
        record(out, tuning, history, entry, "Normal" if verdict.keep else "Warning")
        if verdict.keep and changes:
            out.status_update.update(tuned_status(spec, current, changes))
            out.applied = changes
        phase = "Settled" if verdict.keep else "RolledBack"
    tuning.update(mode=plan.mode.value, phase=phase, message=message, history=history[-TUNING_HISTORY_LIMIT:],
                  **state_status(state))
    out.status_update["tuning"] = replacing(old_tuning, TuningStatus.checked(tuning))
    out.conditions.append(c.predictions_condition("", state.prediction_error))
    out.conditions.append(c.Cond("Tuned", "True" if phase == "Settled" else "False", phase, message))
    return out


def judged(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus, plan: AutotunePlan,
           j: CanaryJudgement, measured: Mapping[str, float], now: float) -> TickResult:
    """The canary's verdict: Promote keeps the change and writes it to status.engine for every pod;
    Revert rolls it back (the caller has set the canary's knobs back) and bars the candidate."""
    p = state_from_status(status.tuning).pending
    assert p is not None
    predicted = dict(p.predicted_figures) or None
    v = Verdict(j.promote, j.reason, dict(measured), dict(p.before_figures), predicted, 0.0, None,
                prediction_error_ratio=prediction_error_ratio(predicted, measured))
    changes = camel(p.changes)
    message = f"{j.reason} ({'promoted to every pod' if j.promote else 'reverted'}: {changes})"
    return _conclude(spec, status, plan, now, v, message, CanaryStatus.of(j), measured)


def lost(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus, plan: AutotunePlan, why: str,
         now: float) -> TickResult:
    """The canary cannot be judged (its pod went, it does not answer, no control is left): the change
    is dropped, neither judged nor barred; status.engine stays what the pods run."""
    return _conclude(spec, status, plan, now, None, f"{why}: the change was not judged and is dropped (not barred)",
                     None, None)
