"""Every threshold of the tuner in one record: what diagnosis (diagnose.py) needs to name a cause and
what the candidate moves (candidates.py) need to try a knob. A leaf module: both import it, it
imports nothing of the tuner.

Two kinds of figure, on purpose: naming a cause needs a clear signal (a wrong name misleads the user),
while trying a move needs only a hint, since every candidate is predicted on the trace before one is
applied. So ``blocked_share`` (naming) and ``try_share`` (trying) are two facts, not one disagreeing;
where both read the same idea (pinned prefix blocks, a cache hit rate worth keeping, tail waste worth
a smaller block) they read the same field.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    # -- naming a cause (diagnose.py) ---------------------------------------------------------------
    #: a cause blocked the queue head when it stopped it in this share of steps: rarer stops are noise
    blocked_share: float = 0.10
    #: KV usage under which the cache is "mostly free", so the sequence cap, not memory, binds
    seq_cap_kv_usage: float = 0.70
    #: a prompt is "long" at this many times the median prompt ...
    long_prompt_ratio: float = 8.0
    #: ... and at least this share of the token budget: it then takes steps of the budget alone
    long_prompt_budget_share: float = 0.5
    #: prefix blocks holding this share of the pool pin enough memory to name (and to try caching off)
    cached_share: float = 0.20
    #: under this prefix hit rate caching is not worth its blocks even when memory could grow
    low_hit_rate: float = 0.30
    #: under this hit rate turning caching off is worth trying; over it the cache earns its blocks
    keep_hit_rate: float = 0.50
    #: the trace is prefix-heavy when this share of requests share a prefix ...
    prefix_heavy_share: float = 0.30
    #: ... of at least this share of the median prompt (shorter prefixes pin little)
    prefix_heavy_tokens: float = 0.30
    #: tail waste (empty slots in allocated blocks) worth a smaller block: under it the restart costs more
    fragmentation: float = 0.15
    #: ... and the relative saving the smaller block must bring
    waste_saving: float = 0.35
    #: unused device memory worth a restart for more KV (share of the device)
    unused_memory_share: float = 0.03
    #: preemptions per minute that count as memory pressure (a rare one is a burst, not a shortage)
    preemptions_per_min: float = 1.0
    #: p99 queue time (s) under which a window with no blocking is healthy
    healthy_queue_p99_s: float = 1.0
    #: swap pool usage peak that counts as full (a fallback to recompute happens just under 100%)
    swap_full_usage: float = 0.90
    #: running peak at this share of max_num_seqs counts as "the cap is reached" (gauges are sampled)
    cap_busy: float = 0.90
    #: a raised cap goes no further than the demand seen (running + waiting) times this margin
    seq_demand_margin: float = 1.25
    #: the KV usage a sequence cap sized to the cache aims at (room for the sequences to grow)
    seq_fit_kv_usage: float = 0.90
    #: prefill stalls decodes only with a short queue: under this share of the TTFT objective (a
    #: longer queue is an engine out of capacity, where smaller chunks trade TPOT for queueing)
    stall_queue_ttft_share: float = 0.5
    #: a suggested token budget aims its mixed step at this share of the TPOT objective
    tpot_headroom: float = 0.9

    # -- trying a move (candidates.py): a hint suffices, the prediction decides ------------------------
    #: a limit that stopped the queue head in this share of steps is worth moving
    try_share: float = 0.02
    #: a KV usage peak this high counts as memory pressure
    kv_full: float = 0.95
    #: max_num_seqs factors: up when the cap binds, down under memory pressure or a missed TPOT
    seq_up: tuple[float, ...] = (1.5, 2.0, 4.0)
    seq_down: tuple[float, ...] = (0.5, 0.75)
    #: max_num_batched_tokens factors: always (cheap, live), with chunked prefill (shorter stalls),
    #: and when the budget binds; a budget for the p95 prompt gets this margin
    budget_steps: tuple[float, ...] = (0.5, 2.0)
    budget_chunked_step: float = 0.25
    budget_blocked_step: float = 4.0
    #: TPOT misses its objective with chunked prefill: the budget is also halved step by step
    #: (tpot_budget_step) down to tpot_budget_floor tokens. A mixed step costs about its prefill
    #: chunk, so the budget that meets a tight TPOT can be 1/32 of vLLM's default (issue 20: 256 of
    #: 8192); factors of 2 from the current budget never reached it. Under the floor a step's fixed
    #: cost (reading the weights) dominates and smaller chunks only lengthen prefill.
    tpot_budget_step: float = 0.5
    tpot_budget_floor: int = 128

    def short_queue_s(self, slo_ttft_s: float | None) -> float:
        """p95 queue time under which a missed TPOT is the objective binding, not a queue: there
        prefill chunks stall decodes and smaller ones help; over it the engine is out of capacity and
        smaller chunks only trade TPOT for queueing (mix-1 of the oracle bench drifted down to a
        budget of 256 and lost 76% of its goodput). Diagnosis and candidates both read it."""
        return max(self.healthy_queue_p99_s, self.stall_queue_ttft_share * slo_ttft_s if slo_ttft_s is not None else 0.0)
    prompt_margin: float = 1.1
    #: (max_num_seqs, max_num_batched_tokens) factors moved together when TPOT misses its objective:
    #: either alone often moves the stall elsewhere
    smaller_batches: tuple[tuple[float, float], ...] = ((0.25, 0.25), (0.5, 0.25), (0.5, 0.5))
    #: token budgets tried when turning chunked prefill on (common kernel-friendly sizes)
    chunk_budgets: tuple[int, ...] = (2048, 4096, 8192)
    #: share of requests with a shared prefix that makes turning prefix caching on worth a try
    prefix_try_share: float = 0.10
    #: per-block cost of small blocks when choosing the least-waste size (x 16 / block size)
    block_kernel_penalty: float = 0.02
    #: gpu_memory_utilization raises tried under pressure (besides the safe line itself)
    gpu_steps: tuple[float, ...] = (0.05, 0.15)
    #: swap_space factors of the current pool (or GiB when there is none), of the observed need,
    #: and the step values are rounded up to
    swap_steps: tuple[float, ...] = (2.0, 4.0)
    swap_first_gib: tuple[float, ...] = (1.0, 4.0)
    swap_need_steps: tuple[float, ...] = (1.0, 2.0)
    swap_step_gib: float = 0.5
    #: factors tried for a numeric knob without a mover of its own (besides its range's ends)
    other_steps: tuple[float, ...] = (0.5, 2)   # 2, not 2.0: an int knob's double stays an int

    # -- trusting a prediction (confidence.py) ---------------------------------------------------------
    #: a predicted utilization (offered requests / the config's capacity) at or above this is near
    #: saturation: there a few percent of speed the cost model overestimates turns into TTFT predicted
    #: orders of magnitude too low, so the candidate must win across the whole range, not at its point
    saturated_utilization: float = 0.90
    #: the relative speed error a prediction's range assumes at least (the step fit's residual
    #: spread, rel_rmse, when larger) and at most
    speed_spread_min: float = 0.05
    speed_spread_max: float = 0.50
    #: the running prediction error (EWMA of |predicted - measured| / measured goodput share, weight
    #: prediction_error_weight on the newest verdict) above which predictions are unreliable, once it
    #: has stayed there for prediction_error_verdicts verdicts in a row: the loop then only recommends
    prediction_error_bound: float = 0.30
    prediction_error_verdicts: int = 3
    prediction_error_weight: float = 0.5
    #: a single verdict's error ratio is capped here (a measured goodput of 0 would read as infinite)
    prediction_error_cap: float = 10.0
