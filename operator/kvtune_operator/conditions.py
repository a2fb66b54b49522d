"""Status conditions and the observed replica state, as pure functions of what the operator saw.

Ownership: the reconciler owns Ready, Progressing and Degraded. The tuner (a later issue) owns
MetricsAvailable and Tuned, and the tuning loop RoundsLate (`rounds_late`, from round_queue.py's lag) and PredictionsUnreliable (`predictions_condition`); the reconciler only initialises them (Unknown) and sets Tuned=False
when autotune is Off. `set_condition` keeps lastTransitionTime while the status does not change.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any, Iterable

from kvtune_operator.model import AutotuneMode, ConditionType

ORDER = [t.value for t in ConditionType]

READY = ConditionType.READY.value
PROGRESSING = ConditionType.PROGRESSING.value
METRICS_AVAILABLE = ConditionType.METRICS_AVAILABLE.value
TUNED = ConditionType.TUNED.value
DEGRADED = ConditionType.DEGRADED.value
ROUNDS_LATE = ConditionType.ROUNDS_LATE.value
PREDICTIONS_UNRELIABLE = ConditionType.PREDICTIONS_UNRELIABLE.value
ENGINE_DRIFT = ConditionType.ENGINE_DRIFT.value

#: Container waiting reasons that mean the engine cannot start (not merely "starting").
FAILING_WAITING_REASONS = {
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
    "CreateContainerError", "RunContainerError", "ErrImageNeverPull",
}


@dataclasses.dataclass(frozen=True)
class Cond:
    """A condition's content (without the bookkeeping fields)."""

    type: str
    status: str
    reason: str
    message: str = ""


def rounds_late(lag_s: float, interval_s: float, capacity: int, started_at: float) -> Cond:
    """RoundsLate of a round that started at ``started_at`` (epoch s), ``lag_s`` after it was due: True
    past one interval (a round skipped in effect), False again as soon as a round starts within it.
    The message says when the last round ran, which is what a user checks first."""
    when = dt.datetime.fromtimestamp(started_at, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if lag_s > interval_s:
        return Cond(ROUNDS_LATE, "True", "BehindSchedule",
                    f"the last tuning round started at {when}, {lag_s:.0f}s after it was due (interval "
                    f"{interval_s:.0f}s): the operator runs at most {capacity} rounds at once and has more due than "
                    "it can run in their intervals; raise its rounds at once (KVTUNE_TUNING_ROUNDS_AT_ONCE), add "
                    "operator replicas, or lengthen autotune.interval")
    return Cond(ROUNDS_LATE, "False", "OnSchedule",
                f"the last tuning round started at {when}, {lag_s:.1f}s after it was due (interval {interval_s:.0f}s)")


def predictions_condition(unreliable: str, error: float | None) -> Cond:
    """PredictionsUnreliable of a tuning round: True while the tuner only recommends because its
    predictions missed (``unreliable``: TunerState.unreliable_message, with the figures), False
    otherwise, quoting the running prediction error when there is one."""
    if unreliable:
        return Cond(PREDICTIONS_UNRELIABLE, "True", "PredictionErrorHigh", unreliable)
    said = f"running prediction error {error:.0%}" if error is not None else "no verdict has measured a prediction yet"
    return Cond(PREDICTIONS_UNRELIABLE, "False", "PredictionsTrusted", said)


def engine_drift(findings: Iterable[str]) -> Cond:
    """EngineDrift of a vLLM round: True when the engines' cache_config_info contradicts the knobs the
    operator gave them (`tuner.vllm_drift`, each figure said), False when it agrees."""
    found = list(findings)
    if found:
        return Cond(ENGINE_DRIFT, "True", "CacheConfigDiffers",
                    ("; ".join(found) + ". The tuner's predictions assume the command line's values.")[:4096])
    return Cond(ENGINE_DRIFT, "False", "CacheConfigMatches",
                "vLLM's cache_config_info agrees with the knobs on the pods' command line")


def set_condition(conditions: Iterable[dict[str, Any]], cond: Cond, *, generation: int | None,
                  now: str) -> list[dict[str, Any]]:
    """A new conditions list with `cond` set; lastTransitionTime changes only when the status does."""
    out = {c["type"]: dict(c) for c in conditions}
    old = out.get(cond.type)
    entry = {"type": cond.type, "status": cond.status, "reason": cond.reason, "message": cond.message,
             "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == cond.status
             and old.get("lastTransitionTime") else now}
    if generation is not None:
        entry["observedGeneration"] = generation
    out[cond.type] = entry
    return sorted(out.values(), key=lambda c: ORDER.index(c["type"]) if c["type"] in ORDER else len(ORDER))


def get_condition(conditions: Iterable[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)


def unschedulable(pod: dict[str, Any]) -> tuple[str, float | None] | None:
    """(the scheduler's message, since when in epoch seconds if it says) while the scheduler cannot
    place ``pod`` (no node with room for it: a GPU, memory, a taint it does not tolerate); else None."""
    sched = get_condition((pod.get("status") or {}).get("conditions"), "PodScheduled")
    if not sched or sched.get("status") != "False" or sched.get("reason") != "Unschedulable":
        return None
    since = sched.get("lastTransitionTime")
    try:
        t = dt.datetime.fromisoformat(str(since).replace("Z", "+00:00")).timestamp() if since else None
    except ValueError:
        t = None
    return sched.get("message") or "unschedulable", t


@dataclasses.dataclass(frozen=True)
class Replicas:
    desired: int
    current: int
    ready: int
    updated: int
    available: int

    @property
    def summary(self) -> str:
        return f"{self.ready}/{self.desired}"


def replicas_of(desired: int, deployment: dict[str, Any] | None) -> Replicas:
    st = (deployment or {}).get("status") or {}
    return Replicas(desired=desired, current=int(st.get("replicas") or 0), ready=int(st.get("readyReplicas") or 0),
                    updated=int(st.get("updatedReplicas") or 0), available=int(st.get("availableReplicas") or 0))


def _deployment_condition(deployment: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return get_condition(((deployment or {}).get("status") or {}).get("conditions"), type_)


def ready_condition(desired: int, deployment: dict[str, Any] | None, *, not_owned: str | None = None) -> Cond:
    r = replicas_of(desired, deployment)
    if deployment is None and not_owned:
        return Cond(READY, "False", "ChildNotOwned", not_owned)
    if deployment is None:
        return Cond(READY, "False", "DeploymentMissing", "the engine Deployment does not exist yet")
    if desired == 0:
        return Cond(READY, "False", "ScaledToZero", "spec.replicas is 0: no engine pod serves")
    if r.ready >= desired:
        return Cond(READY, "True", "AllReplicasReady", f"{r.ready}/{desired} engine pods ready")
    return Cond(READY, "False", "ReplicasNotReady", f"{r.ready}/{desired} engine pods ready")


def progressing_condition(desired: int, deployment: dict[str, Any] | None, restart_knobs: list[str], *,
                          not_owned: str | None = None) -> Cond:
    if deployment is None and not_owned:
        return Cond(PROGRESSING, "False", "ChildNotOwned", not_owned)
    if deployment is None:
        return Cond(PROGRESSING, "True", "Creating", "creating the engine Deployment")
    r = replicas_of(desired, deployment)
    dep_progress = _deployment_condition(deployment, "Progressing")
    if dep_progress and dep_progress.get("reason") == "ProgressDeadlineExceeded":
        return Cond(PROGRESSING, "False", "ProgressDeadlineExceeded",
                    dep_progress.get("message") or "the rollout made no progress")
    meta, st = deployment.get("metadata") or {}, deployment.get("status") or {}
    why = f" ({', '.join(restart_knobs)} changed)" if restart_knobs else ""
    if int(st.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return Cond(PROGRESSING, "True", "RolloutPending", f"the Deployment controller has not seen the new pod template yet{why}")
    if r.updated < desired or r.current > r.updated or r.available < desired:
        return Cond(PROGRESSING, "True", "RollingOut",
                    f"{r.updated} of {desired} engine pods updated, {r.available} available{why}")
    return Cond(PROGRESSING, "False", "RolloutComplete", f"all {desired} engine pods run the current pod template")


def pod_problem(pods: Iterable[dict[str, Any]]) -> Cond | None:
    """The first reason an engine pod cannot serve: a failing container or an unschedulable pod."""
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        name = (pod.get("metadata") or {}).get("name", "?")
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            last = ((cs.get("lastState") or {}).get("terminated")) or {}
            detail = (last.get("message") or "").strip()
            if waiting.get("reason") in FAILING_WAITING_REASONS:
                msg = f"pod {name}: {waiting['reason']}"
                if waiting.get("message"):
                    msg += f": {waiting['message']}"
                if detail:
                    msg += f"; last exit {last.get('exitCode')}: {detail[-600:]}"
                reason = "ImagePullFailed" if "Image" in waiting["reason"] else "EngineFailing"
                return Cond(DEGRADED, "True", reason, msg)
            term = (cs.get("state") or {}).get("terminated") or {}
            if term and term.get("exitCode", 0) != 0:
                msg = f"pod {name}: engine exited with code {term.get('exitCode')}"
                if term.get("message"):
                    msg += f": {term['message'].strip()[-600:]}"
                return Cond(DEGRADED, "True", "EngineFailing", msg)
        placing = unschedulable(pod)
        if placing:
            return Cond(DEGRADED, "True", "Unschedulable", f"pod {name}: {placing[0]}")
    return None


def degraded_condition(*, config_error: str | None, apply_error: str | None, missing_pvc: str | None,
                       deployment: dict[str, Any] | None, pods: Iterable[dict[str, Any]],
                       not_owned: str | None = None, volume_refusal: Cond | None = None) -> Cond:
    """Degraded=True with the most basic problem first; False (AsExpected) when none. `not_owned`:
    children of our names that exist and belong to somebody else (left untouched); `volume_refusal`:
    why the model volume's claim is not mounted (volume_policy.claim_refusal)."""
    if config_error:
        return Cond(DEGRADED, "True", "InvalidSpec", config_error)
    if volume_refusal is not None:
        return volume_refusal
    if not_owned:
        return Cond(DEGRADED, "True", "ChildNotOwned", not_owned + (f"; {apply_error}" if apply_error else ""))
    if apply_error:
        return Cond(DEGRADED, "True", "ApplyFailed", apply_error)
    if missing_pvc:
        return Cond(DEGRADED, "True", "ModelVolumeMissing",
                    f"PersistentVolumeClaim {missing_pvc} (spec.model.volume) does not exist; the engine pods "
                    "cannot start until it does")
    problem = pod_problem(pods)
    if problem:
        return problem
    dep_progress = _deployment_condition(deployment, "Progressing")
    if dep_progress and dep_progress.get("reason") == "ProgressDeadlineExceeded":
        return Cond(DEGRADED, "True", "RolloutStuck", dep_progress.get("message") or "the rollout made no progress")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    if failure and failure.get("status") == "True":
        return Cond(DEGRADED, "True", "ReplicaFailure", failure.get("message") or "pods could not be created")
    return Cond(DEGRADED, "False", "AsExpected", "no problem seen")


def tuner_conditions(existing: Iterable[dict[str, Any]] | None, mode: AutotuneMode | str) -> list[Cond]:
    """Initial MetricsAvailable/Tuned (the tuner owns them once it has written them)."""
    out = []
    if get_condition(existing, METRICS_AVAILABLE) is None:
        out.append(Cond(METRICS_AVAILABLE, "Unknown", "NotChecked", "the tuner has not read the engine's metrics yet"))
    tuned = get_condition(existing, TUNED)
    if AutotuneMode(mode) == AutotuneMode.OFF:
        out.append(Cond(TUNED, "False", "AutotuneOff", "autotune mode is Off: the engine runs spec.engine as written"))
    elif tuned is None or tuned.get("reason") == "AutotuneOff":
        out.append(Cond(TUNED, "Unknown", "Pending", f"autotune mode is {AutotuneMode(mode).value}; no decision yet"))
    return out


def transition_event(old: dict[str, Any] | None, new: dict[str, Any], *,
                     progressing: bool = False) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event for a condition change worth telling, else None.

    Ready turning False during a rollout or a scale-up (`progressing`) is expected: a Normal event."""
    if old is not None and old.get("status") == new["status"] and old.get("reason") == new["reason"]:
        return None
    t, s = new["type"], new["status"]
    if t == DEGRADED:
        if s == "True":
            return "Warning", new["reason"], new["message"]
        if old is not None and old.get("status") == "True":
            return "Normal", "Recovered", f"no longer degraded (was {old.get('reason')})"
    if t == READY and (old is None or old.get("status") != s):
        if s == "True":
            return "Normal", "Ready", new["message"]
        if old is not None and old.get("status") == "True":
            return ("Normal" if progressing else "Warning"), "NotReady", new["message"]
    if t == ENGINE_DRIFT and s == "True":  # what the engine runs is not what the operator believes
        return "Warning", new["reason"], new["message"]
    if t == PROGRESSING and new["reason"] in ("RolloutComplete", "ProgressDeadlineExceeded") \
            and old is not None and old.get("status") == "True":
        return ("Normal" if new["reason"] == "RolloutComplete" else "Warning"), new["reason"], new["message"]
    return None
