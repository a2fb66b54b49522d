"""The scheduler's snapshot in the shape the state API and /metrics share (one set of names)."""
from __future__ import annotations

from typing import Any


def scheduler_view(sched: Any) -> dict[str, Any]:
    snap = sched.snapshot()
    blocks = dict(snap["blocks"])
    blocks["total"] = snap["num_blocks"]
    n_swap = snap["num_swap_blocks"]
    free_swap = sched.kv.num_free_swap_blocks if n_swap else 0
    pc = snap.get("prefix_cache", {})
    q, h = pc.get("query_tokens", 0), pc.get("hit_tokens", 0)
    head = snap.get("head")
    if head is not None:
        head = {**head, "cause": snap.get("waiting_cause"),
                "allocatable_blocks": snap.get("allocatable_blocks")}
        head.pop("waited_steps_cause", None)
    recent = dict(snap.get("recent_waiting_cause_steps", {}))
    return {
        "num_blocks": snap["num_blocks"],
        "num_swap_blocks": n_swap,
        "blocks": blocks,
        "allocatable_blocks": snap.get("allocatable_blocks"),
        "shared_blocks": snap["shared_blocks"],
        "swap": {"total": n_swap, "used": n_swap - free_swap, "free": free_swap},
        "queues": dict(snap["queues"]),
        "head": head,
        "waiting_cause": snap.get("waiting_cause"),
        "waiting_reason_steps": dict(snap.get("waiting_cause_steps", {})),
        "recent_waiting_reasons": {"window_steps": sum(recent.values()), **recent},
        "kv_usage_ratio": snap["kv_usage_ratio"],
        "kv_internal_fragmentation_ratio": snap["internal_fragmentation_ratio"],
        "swap_usage_ratio": snap["swap_usage_ratio"],
        "preemptions": dict(snap.get("preemptions", {})),
        "prefix_cache": {"queries_tokens": q, "hits_tokens": h, "hit_ratio": (h / q) if q else None},
        "scheduler_steps": snap.get("steps"),
        "rejected": snap.get("rejected", 0),
        "cache_limit_finishes": snap.get("cache_limit_finishes", 0),
    }
