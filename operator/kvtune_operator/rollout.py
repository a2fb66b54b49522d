"""Did a restart change's new pods fail to come up? Read as a kubelet and the Deployment controller
report it, so that the tuner can roll the change back without a human.

A restart change rolls the pods to a template whose ``kvtune.io/restart-hash`` names the new
restart-only knobs. It has failed when one of the pods of that template has had its engine exit with
an error ``FAILED_STARTS`` times (the engine says why in its last log line: the pod's termination
message), when the scheduler could not place one of them for ``UNSCHEDULABLE_S`` (no room in the
cluster for the extra pod a rollout or a canary needs: in a shared cluster, often no spare GPU), or when
the Deployment controller gave up on that template (ProgressDeadlineExceeded, which allows for slow
model loads). Pods of the old template, and pods being deleted, are not the change's.
"""
from __future__ import annotations

from typing import Any, Iterable

from .conditions import unschedulable
from .render import ANNOTATION_RESTART_HASH

#: an engine that failed to start this many times on the new knobs will not start on them
FAILED_STARTS = 2
#: a new pod the scheduler has not placed for this long gets no room (a cluster autoscaler adds a node
#: well within it); the Deployment's own deadline (progressDeadlineSeconds 1800) allows for model loads
UNSCHEDULABLE_S = 600.0


def _failed_starts(cs: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(error exits so far, the latest termination) of one container status."""
    state = cs.get("state") or {}
    now = state.get("terminated") or {}
    last = (cs.get("lastState") or {}).get("terminated") or {}
    latest = now if now else last
    if int(latest.get("exitCode") or 0) == 0:
        return 0, latest
    return int(cs.get("restartCount") or 0) + (1 if now else 0), latest


def template_restart_hash(deployment: dict[str, Any] | None) -> str | None:
    """The restart hash of the pods ``deployment`` makes now (its pod template's annotation)."""
    template = (((deployment or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}
    return (template.get("annotations") or {}).get(ANNOTATION_RESTART_HASH)


def rollout_failure(pods: Iterable[dict[str, Any]], deployment: dict[str, Any] | None, restart_hash: str | None,
                    now: float, *, failed_starts: int = FAILED_STARTS) -> str | None:
    """Why the rollout to ``restart_hash`` failed, in the engine's (or the scheduler's) words; None while
    it may still succeed. ``now``: epoch seconds."""
    if not restart_hash:
        return None
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp") or (meta.get("annotations") or {}).get(ANNOTATION_RESTART_HASH) != restart_hash:
            continue
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            n, term = _failed_starts(cs)
            if n >= failed_starts:
                waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
                why = (term.get("message") or "").strip().splitlines()
                return (f"pod {meta.get('name')}: the engine exited with code {term.get('exitCode')} "
                        f"{n} times{f' ({waiting})' if waiting else ''}"
                        + (f": {why[-1][-1000:]}" if why else ""))
        placing = unschedulable(pod)
        if placing and placing[1] is not None and now - placing[1] >= UNSCHEDULABLE_S:
            return (f"pod {meta.get('name')}: the scheduler could not place it for {now - placing[1]:.0f}s: "
                    f"{placing[0][:1000]}")
    if deployment:
        if template_restart_hash(deployment) == restart_hash:
            for cond in (deployment.get("status") or {}).get("conditions") or []:
                if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
                    return f"Deployment {deployment['metadata'].get('name')}: {cond.get('message') or 'ProgressDeadlineExceeded'}"
    return None


def placement_note(pods: Iterable[dict[str, Any]], now: float) -> str:
    """'; the scheduler has not placed pod P (for Ns): why' for the first live pod it cannot place, else
    '': a rollout or canary that waits for room says so while it waits, not only when it gives up."""
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        placing = None if (pod.get("metadata") or {}).get("deletionTimestamp") else unschedulable(pod)
        if placing:
            since = f" for {now - placing[1]:.0f}s" if placing[1] is not None else ""
            return (f"; the scheduler has not placed pod {(pod.get('metadata') or {}).get('name')}{since} "
                    f"(a failure after {UNSCHEDULABLE_S:.0f}s): {placing[0][:300]}")
    return ""


def rollout_pending(deployment: dict[str, Any] | None, restart_hash: str | None,
                    pods: Iterable[dict[str, Any]] = ()) -> str | None:
    """Why the rollout to ``restart_hash`` is not complete yet (as ``kubectl rollout status`` reads the
    Deployment), or None once every replica runs that template and is available. Until then the pods
    Prometheus scrapes may be the old template's, and only an engine that reports its own knobs (ours)
    could tell; vLLM's metrics do not show max_num_seqs, so no window is judged before this is None.
    ``pods`` (the deployment's): a terminating old pod still finishes its requests on the node (and a
    new pod sharing it ran at a fraction of its speed next to it: a raised cap was rolled back)."""
    if not restart_hash:
        return None
    if not deployment:
        return "the Deployment is not there yet"
    meta, spec, st = deployment.get("metadata") or {}, deployment.get("spec") or {}, deployment.get("status") or {}
    # (not matched on the template's restart hash: the Deployment is rendered from the status the change
    # was written in, in the same round, so by the next round its generation is the change's)
    want = int(spec.get("replicas", 1) or 0)
    if int(st.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return "the Deployment controller has not seen the new pod template yet"
    updated, total, available = (int(st.get(k) or 0) for k in ("updatedReplicas", "replicas", "availableReplicas"))
    if updated < want:
        return f"{updated} of {want} pods run the new template"
    if total > updated:
        return f"{total - updated} old pods are still running"
    if available < want:
        return f"{available} of {want} new pods are available"
    leaving = sum(1 for p in pods if (p.get("metadata") or {}).get("deletionTimestamp"))
    if leaving:
        return f"{leaving} old pods are still terminating"
    return None
