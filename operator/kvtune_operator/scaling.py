"""Scaling out when tuning cannot help: how many replicas, and whether the tuner may set them.

When one engine is compute-bound no KV knob helps; the tuner predicts the replica count that meets
the objectives (tuner/replicas.py: the window's trace split across N simulated engines). The trace
is one engine's, so the prediction is for one engine's share of the load: a deployment running R
replicas needs about R x that count. The tuner scales only in Apply mode, inside
``autotune.bounds.replicas``, and never against another autoscaler: a HorizontalPodAutoscaler or a
KEDA ScaledObject that targets the InferenceDeployment or its Deployment owns the replica count, and
the tuner then only recommends.
"""
from __future__ import annotations

import math
from typing import Any, Iterable


def autoscaler_of(autoscalers: Iterable[dict[str, Any]], name: str) -> str | None:
    """``Kind/name`` of the first HPA or ScaledObject whose scale target is this deployment."""
    for a in autoscalers:
        ref = (a.get("spec") or {}).get("scaleTargetRef") or {}
        kind = ref.get("kind") or "Deployment"   # KEDA's default target kind
        if ref.get("name") == name and kind in ("InferenceDeployment", "Deployment"):
            return f"{a.get('kind') or 'HorizontalPodAutoscaler'}/{(a.get('metadata') or {}).get('name')}"
    return None


def replicas_needed(per_engine: int, running: int) -> int:
    """Replicas for the whole load, from the count one engine's share needs."""
    return max(1, math.ceil(per_engine * max(1, running)))


def replica_target(needed: int | None, current: int, lo: int | None, hi: int | None) -> int | None:
    """The replica count to scale to inside [lo, hi] (None: no change). ``needed`` None: not reachable
    within the prediction's range, so the most the bounds allow."""
    top = hi if hi is not None else current
    want = top if needed is None else needed
    target = max(lo or 1, min(top, want))
    return target if target != current else None
