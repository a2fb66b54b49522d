"""The simulator's summary as a typed record: what a reader of `simulate()` may rely on.

`simulate()` returns the JSON object `kvtune sim --json` prints (README, "kvtune sim output");
`SimSummary.of(summary)` reads it by field and refuses one that lacks a field, naming it, so that a
consumer (the tuner's Observation) never reads a missing figure as 0 or None in silence.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping


@dataclass(frozen=True)
class SimSummary:
    output_tokens_per_s: float
    requests_per_s: float
    goodput_requests_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p95_s: float | None
    tpot_p99_s: float | None
    queue_time_p50_s: float | None
    queue_time_p95_s: float | None
    queue_time_p99_s: float | None
    preemptions: Mapping[str, int]            # swap, recompute, swap_full
    waiting_cause_share: Mapping[str, float]  # every cause of core.stats.CAUSES
    kv_usage_mean: float
    kv_usage_peak: float
    internal_fragmentation_mean: float
    kv_blocks_mean_share: Mapping[str, float]  # free, reserved, used, cached
    shared_blocks_mean_share: float
    swap_usage_peak: float
    running_mean: float
    running_max: int
    queued_mean: float
    queued_max: int
    prefix_cache: Mapping[str, float]          # query_tokens, hit_tokens, hit_rate
    num_blocks: int
    num_swap_blocks: int
    memory_bytes: Mapping[str, float]          # device_total, weights, activations_peak, kv_cache, unused, swap
    requests: Mapping[str, int]                # total, finished, rejected, meeting_slo, cut_by_cache
    duration_s: float
    config: Mapping[str, Any]

    @classmethod
    def of(cls, summary: Mapping[str, Any]) -> "SimSummary":
        missing = [f.name for f in fields(cls) if f.name not in summary]
        if missing:
            raise ValueError(f"not a simulator summary: it lacks {', '.join(missing)} (see `kvtune sim --json`)")
        return cls(**{f.name: summary[f.name] for f in fields(cls)})
