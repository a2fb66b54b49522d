"""The canary Deployment of a restart change (tuning_canary.py judges it): one pod that runs
status.engine plus the pending change, beside the deployment's own pods, which never move.

Invariant: the canary Deployment runs one pod exactly while status.tuning.pending names it (a
restart change in Apply mode), and none otherwise. It is created and applied like every child, and
set to zero replicas, never deleted (the operator has no delete verb): it waits at zero for the next
restart change. Only a Deployment and ConfigMap of the canary's names that are ours (controlled by
this InferenceDeployment) are ever written.
"""
from __future__ import annotations

from typing import Any, Iterable

from kvtune_engine.config import EngineConfig

from .applied_memo import AppliedMemo
from .kube import KubeError
from .model import InferenceDeployment, PendingChange, TuningStatus, to_engine_dict
from .ownership import label, may_write, owned_by
from .render import LABEL_CANARY, canary_names, render_canary
from .tuner.decide import knob_changes


def restart_canary(tuning: TuningStatus | None) -> PendingChange | None:
    """The pending change when it runs on a canary Deployment, else None."""
    p = tuning.pending if tuning is not None else None
    return p if p is not None and p.canary is not None and p.canary.deployment else None


def canary_config(config: EngineConfig, pending: PendingChange) -> EngineConfig:
    """What the canary runs: ``config`` (status.engine, every other pod's) with the pending change."""
    before = EngineConfig.model_validate(to_engine_dict(pending.before.dump()))
    after = EngineConfig.model_validate(to_engine_dict(pending.after.dump()))
    return config.with_changes(**knob_changes(before, after))


def is_canary_pod(pod: dict[str, Any]) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_CANARY) == "true"


def has_canary_pod(pods: Iterable[dict[str, Any]]) -> bool:
    return any(is_canary_pod(p) for p in pods)


def canary_free(kube: Any, infd: InferenceDeployment) -> str:
    """The canary Deployment's name when a restart change may run there (no object of that name, or
    ours), else "" (somebody else's, or unreadable: restart changes are judged before/after)."""
    name = canary_names(infd.metadata.name).deployment
    try:
        existing = kube.get("apps/v1", "Deployment", infd.metadata.namespace, name)
    except KubeError:
        return ""
    return name if may_write(existing, infd.metadata.uid) else ""


def sync_canary(kube: Any, infd: InferenceDeployment, config: EngineConfig, *, running: bool, image: str,
                admin_key: str | None, applied: AppliedMemo) -> str | None:
    """Give the canary Deployment one pod of status.engine plus the pending change (``running``: one
    is pending in Apply mode), or none (a canary that exists, is ours and still has pods is set to
    zero). ``applied``: what was applied before, so an unchanged object is not sent again. Returns
    what went wrong, or None."""
    pending = restart_canary(infd.status.tuning if infd.status else None) if running else None
    names = canary_names(infd.metadata.name)
    uid = infd.metadata.uid
    try:
        existing = kube.get("apps/v1", "Deployment", infd.metadata.namespace, names.deployment)
        if pending is None:
            if existing is None or not owned_by(existing, uid) or not (existing.get("spec") or {}).get("replicas"):
                return None
            objs = render_canary(infd, config, image=image, admin_key=admin_key, replicas=0)
        else:
            objs = render_canary(infd, canary_config(config, pending), image=image, admin_key=admin_key, replicas=1)
        have = {"Deployment": existing, "ConfigMap": kube.get("v1", "ConfigMap", infd.metadata.namespace,
                                                             names.configmap)}
        theirs = [label(o) for o in objs if not may_write(have[o["kind"]], uid)]
        if theirs:  # neither is written: half a canary is none
            return f"not this InferenceDeployment's, so no canary is run: {' and '.join(theirs)}"
        for obj in objs:  # the ConfigMap first: the pod mounts it
            applied.apply(infd.metadata.name, obj, have[obj["kind"]], kube.apply)
    except KubeError as e:  # said, and tried again at the next reconcile
        return f"the canary Deployment {names.deployment} could not be {'applied' if pending else 'scaled to 0'}: {e}"
    return None
