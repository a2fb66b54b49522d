"""Whether a persistentVolumeClaim model volume may be mounted: a pure function of what was read.

The operator refuses `spec.model.volume.hostPath` unless its setting allowHostPath is on (a node
directory in the engine pod). A claim reaches the node just as well when the PersistentVolume it is
bound to is of type `hostPath` or `local` (both mount a directory of the node, chosen by whoever made
the PersistentVolume; a claim can name any Available PersistentVolume in spec.volumeName). So, unless
allowHostPath is on, the engine pods are created only once the claim exists, names its
PersistentVolume, and that PersistentVolume was read and is neither. Anything short of that is a
refusal (fail closed): a claim that is missing or not bound yet, a PersistentVolume that is gone or
that the operator may not read (its chart grants `get` on persistentvolumes, the one cluster-wide
grant of a default install).

Model weights are written to the claim before they are served, so the claim is bound by the time
the engine needs it; a claim of a WaitForFirstConsumer StorageClass that nothing has used yet stays
unbound, and the condition says how to bind it.
"""
from __future__ import annotations

from typing import Any

from kvtune_operator.conditions import DEGRADED, Cond

#: PersistentVolume sources that mount a directory of the node.
NODE_PATH_SOURCES = ("hostPath", "local")

HOST_PATH_VOLUME = "HostPathVolume"
MODEL_VOLUME_MISSING = "ModelVolumeMissing"
MODEL_VOLUME_UNBOUND = "ModelVolumeUnbound"
MODEL_VOLUME_UNVERIFIED = "ModelVolumeUnverified"

_ALLOWED = ("a PersistentVolume of any other type (csi, nfs, a cloud disk, ...) is allowed; hostPath and "
            "local PersistentVolumes only when the operator's setting allowHostPath (KVTUNE_ALLOW_HOST_PATH) is on")


def bound_volume_name(pvc: dict[str, Any]) -> str | None:
    """The PersistentVolume a claim is bound (or pre-bound, spec.volumeName) to; None when unbound."""
    return (pvc.get("spec") or {}).get("volumeName") or None


def node_path_source(pv: dict[str, Any]) -> str | None:
    """'hostPath' or 'local' when the PersistentVolume mounts a directory of the node, else None."""
    spec = pv.get("spec") or {}
    return next((s for s in NODE_PATH_SOURCES if spec.get(s) is not None), None)


def claim_refusal(claim: str, pvc: dict[str, Any] | None, pv: dict[str, Any] | None, *,
                  pvc_error: str | None = None, pv_error: str | None = None) -> Cond | None:
    """The Degraded condition that keeps the engine pods from being created with claim `claim`, or
    None when its volume may be mounted. `pvc`: the claim as read (None: it does not exist); `pv`: its
    PersistentVolume as read (None: not found, or not read); `pvc_error`, `pv_error`: why reading
    them failed."""
    what = f"PersistentVolumeClaim {claim} (spec.model.volume)"
    hold = "the engine pods are not created until it is"
    if pvc_error is not None:
        return Cond(DEGRADED, "True", MODEL_VOLUME_UNVERIFIED,
                    f"the operator cannot read {what} ({pvc_error}), so it cannot verify that its volume is not "
                    f"a node directory; {hold} verified")
    if pvc is None:
        return Cond(DEGRADED, "True", MODEL_VOLUME_MISSING,
                    f"{what} does not exist; the engine pods cannot start until it does and is bound to a "
                    "PersistentVolume the operator has checked")
    volume = bound_volume_name(pvc)
    if volume is None:
        return Cond(DEGRADED, "True", MODEL_VOLUME_UNBOUND,
                    f"{what} is not bound to a PersistentVolume yet: the operator checks the volume before it "
                    f"mounts it, and {hold} (a claim of a WaitForFirstConsumer StorageClass binds when a pod "
                    "uses it: fill it with the model first, e.g. with a Job)")
    if pv_error is not None:
        return Cond(DEGRADED, "True", MODEL_VOLUME_UNVERIFIED,
                    f"{what} is bound to PersistentVolume {volume}, which the operator cannot read ({pv_error}), "
                    f"so it cannot verify that it is not a node directory; {hold} verified (grant the operator "
                    "get on persistentvolumes: the chart's ClusterRole does)")
    if pv is None:
        return Cond(DEGRADED, "True", MODEL_VOLUME_UNVERIFIED,
                    f"{what} is bound to PersistentVolume {volume}, which does not exist; {hold} bound to one "
                    "that does")
    source = node_path_source(pv)
    if source is not None:
        return Cond(DEGRADED, "True", HOST_PATH_VOLUME,
                    f"{what} is bound to PersistentVolume {volume} of type {source}, a directory of the node: "
                    f"not mounted, the engine pods are not created; {_ALLOWED}")
    return None
