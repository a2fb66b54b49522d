"""Which children the operator may write, and in which order: pure functions of what it read.

A child is ours when it does not exist yet or when its controller ownerReference names this
InferenceDeployment's uid. Anything else of the same name (a user's NetworkPolicy, Service,
ConfigMap or Secret; an orphan of a deleted resource) is never written: server-side apply with
``force`` would take its fields and a controller reference, and deleting the InferenceDeployment
would then delete the user's object.

Apply order: the admin key's Secret and the NetworkPolicy first, then the ConfigMap, and only then
the Deployment, which needs all three (its pods read the key, must never run without their policy,
and mount the ConfigMap). The Service and the PodMonitor come after it and need nothing: a quota on
Services must not hold back a Deployment whose policy is in place, nor leave pods without one.
A child of our name that is somebody else's holds back the Deployment whatever its kind.
"""
from __future__ import annotations

from typing import Any, Iterable

#: The order children are applied in (kinds not listed come last, in render order).
APPLY_ORDER = ("Secret", "NetworkPolicy", "ConfigMap", "Deployment", "Service", "PodMonitor")

#: kind -> the kinds that must be applied (ours, and the apply succeeded) before it is.
NEEDS: dict[str, tuple[str, ...]] = {"Deployment": ("Secret", "NetworkPolicy", "ConfigMap")}


def controller_uid(obj: dict[str, Any] | None) -> str | None:
    """The uid of `obj`'s controller ownerReference (None: no object, or no controller)."""
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def owned_by(obj: dict[str, Any] | None, uid: str | None) -> bool:
    """Whether an existing object is controlled by the resource with `uid`."""
    return bool(uid) and controller_uid(obj) == uid


def may_write(existing: dict[str, Any] | None, uid: str | None) -> bool:
    """A child may be applied when it does not exist yet, or is ours already."""
    return existing is None or owned_by(existing, uid)


def label(obj: dict[str, Any]) -> str:
    return f"{obj['kind']} {obj['metadata']['name']}"


def apply_order(objs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """`objs` in apply order (stable for kinds of equal rank)."""
    rank = {k: i for i, k in enumerate(APPLY_ORDER)}
    return sorted(objs, key=lambda o: rank.get(o["kind"], len(APPLY_ORDER)))


def blockers(kind: str, *, failed: Iterable[str], refused: Iterable[str]) -> list[str]:
    """The kinds that hold `kind` back: those it needs that are not in place (their apply failed or
    was held back: `failed`; they are somebody else's: `refused`). The Deployment also waits for
    every refused child: engine pods whose Service or PodMonitor is another object would run, on
    GPUs, unreachable or unwatched, and the clash is the user's to resolve first."""
    failed, refused = list(failed), list(refused)
    out = [k for k in NEEDS.get(kind, ()) if k in failed or k in refused]
    if kind == "Deployment":
        out += [k for k in refused if k not in out and k != kind]
    return out


def not_owned_message(labels: list[str], held_back: list[str]) -> str:
    """Condition/event text for children that exist and are not ours."""
    them = ", ".join(labels)
    verb = "exists" if len(labels) == 1 else "exist"
    msg = (f"{them} already {verb} and {'is' if len(labels) == 1 else 'are'} not owned by this InferenceDeployment "
           "(no controller ownerReference to it): left untouched")
    if held_back:
        msg += (f"; not applied until {'it is' if len(labels) == 1 else 'they are'} deleted or the "
                f"InferenceDeployment renamed: {', '.join(held_back)}")
    return msg
