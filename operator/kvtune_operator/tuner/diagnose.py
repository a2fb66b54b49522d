"""Why do requests wait? One observation window in, one named cause out.

A pure function: ``diagnose(obs) -> Diagnosis(cause, figures, message, knob, suggestion)``.

Causes (the six scenarios users report, plus two outcomes):

=====================  ======================================================  =========================
cause                  what the window shows                                   knob it names
=====================  ======================================================  =========================
SwapFull               preemptions wanted swap, the swap pool was full          swapSpaceGiB
LongPromptHeadOfLine   a long prompt at the queue head stops on the token       enableChunkedPrefill /
                       budget (or blocks) while short requests wait behind it   maxNumBatchedTokens
SequenceCap            the head waits on max_num_seqs while KV is mostly free   maxNumSeqs
SharedPrefixPinning    the head waits for blocks while the gauge shows room:    enablePrefixCaching /
                       prefix-cached blocks hold the difference                 gpuMemoryUtilization
BlockWaste             waits for blocks / preemptions with a large share of     blockSize
                       empty tail slots; a smaller block wastes much less
LowKVMemory            waits for blocks / preemptions while device memory is    gpuMemoryUtilization
                       left unused under the safe line
PrefillStallsDecodes   nothing waits but TPOT misses its objective: steps       maxNumBatchedTokens
                       with a prefill chunk stall the decodes sharing them
TokenBudget            the head waits on the token budget, no long prompt       maxNumBatchedTokens
ComputeBound           requests queue but no limit stops the head: the engine   (replicas)
                       is busy computing; KV knobs will not help
Healthy                the head is rarely blocked, few preemptions, short       (none)
                       queue, and the objectives are met
=====================  ======================================================  =========================

The order of the checks is the order of the table: a full swap pool and a head-of-line prompt are
specific (their symptom cannot come from another cause), the sequence cap is unambiguous when KV is
free; among the memory causes, pinned prefix blocks and tail waste explain a shortage that more memory
would only hide, so they are named before "too little memory".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .candidates import CAMEL, Bounds, best_block_size, seq_cap_fit
from .memory import MemoryPicture, Safety, swap_needed_gib
from .observation import GiB, Observation
from .thresholds import Thresholds  # noqa: F401 - re-exported

CAUSES = ("SwapFull", "LongPromptHeadOfLine", "SequenceCap", "SharedPrefixPinning", "BlockWaste",
          "LowKVMemory", "PrefillStallsDecodes", "TokenBudget", "ComputeBound", "Healthy")


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    message: str
    figures: dict[str, Any] = field(default_factory=dict)
    knob: str | None = None                   # EngineConfig field the cause names
    suggestion: dict[str, Any] = field(default_factory=dict)   # knob -> value the figures suggest

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "message": self.message, "figures": dict(self.figures),
                "knob": self.knob, "suggestion": dict(self.suggestion)}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _secs(x: float) -> str:
    return f"{x:.2f}s" if x < 10 else f"{x:.0f}s"


def _ms(x: float) -> str:
    return f"{1000 * x:.0f}ms" if x < 10 else f"{x:.0f}s"


def _n(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 0.05 or x >= 10 else f"{x:.1f}"


@dataclass(frozen=True)
class Window:
    """What every rule reads of one observation window, computed once."""
    obs: Observation
    th: Thresholds
    safety: Safety
    bounds: Bounds
    mem: MemoryPicture | None
    seqs_share: float
    budget_share: float
    blocks_share: float
    pre_per_min: float
    common: dict[str, Any]
    slo: Any = None                 # the objectives (simulator SLO: ttft_s, tpot_s), when known

    @property
    def cfg(self):
        return self.obs.config

    @property
    def mem_pressure(self) -> bool:
        return self.blocks_share >= self.th.blocked_share or self.pre_per_min >= self.th.preemptions_per_min

    def objectives_missed(self) -> list[str]:
        """The p95 objectives this window misses, in words ("TPOT p95 55ms > 35ms")."""
        o, slo, out = self.obs, self.slo, []
        if slo is not None and slo.ttft_s is not None and o.ttft_p95_s > slo.ttft_s:
            out.append(f"TTFT p95 {_ms(o.ttft_p95_s)} > {_ms(slo.ttft_s)}")
        if slo is not None and slo.tpot_s is not None and o.tpot_p95_s > slo.tpot_s:
            out.append(f"TPOT p95 {_ms(o.tpot_p95_s)} > {_ms(slo.tpot_s)}")
        return out

    @classmethod
    def of(cls, obs: Observation, th: Thresholds, safety: Safety, bounds: Bounds, slo: Any = None) -> "Window":
        cfg, share = obs.config, dict(obs.waiting_cause_share)
        minutes = obs.window_s / 60 if obs.window_s > 0 else 0.0
        pre_per_min = obs.preemptions / minutes if minutes else (float(obs.preemptions) if obs.preemptions else 0.0)
        common = {
            "kv_usage": round(obs.kv_usage_mean, 4),
            "running": round(obs.running_peak, 1),
            "waiting": round(obs.waiting_peak, 1),
            "max_num_seqs": cfg.max_num_seqs,
            "queue_time_p99_s": round(obs.queue_time_p99_s, 4),
            "waiting_cause_share": {k: round(v, 4) for k, v in share.items()},
            "preemptions": {"swap": obs.preemptions_swap, "recompute": obs.preemptions_recompute,
                            "swap_full": obs.swap_full},
        }
        return cls(obs, th, safety, bounds, MemoryPicture.from_observation(obs), share.get("max_num_seqs", 0.0),
                   share.get("token_budget", 0.0), share.get("kv_blocks", 0.0) + share.get("watermark", 0.0),
                   pre_per_min, common, slo)


# -- one rule per cause, in the order of the table above ---------------------------------------------

def swap_full(w: Window) -> Diagnosis | None:
    obs, cfg = w.obs, w.cfg
    if not (obs.swap_full > 0 and (obs.swap_usage_peak >= w.th.swap_full_usage or cfg.swap_space == 0)):
        return None
    need = swap_needed_gib(obs, w.safety)
    target = float(math.ceil(need)) if need else max(1.0, 2 * cfg.swap_space)
    target = max(cfg.swap_space, w.bounds.swap_space.clamp(target))
    figs = {**w.common, "swap_full": obs.swap_full, "swap_usage_peak": round(obs.swap_usage_peak, 4),
            "swap_space_gib": cfg.swap_space, "swap_needed_gib": round(need or 0.0, 2)}
    msg = (f"Swap space is full: {obs.swap_full} preemptions found the {cfg.swap_space:g} GiB swap pool "
           f"{_pct(obs.swap_usage_peak)} used and fell back to recompute; raising {CAMEL['swap_space']} "
           f"to {target:g} holds the observed swap volume.")
    return Diagnosis("SwapFull", msg, figs, "swap_space", {"swap_space": target})


def long_prompt_head_of_line(w: Window) -> Diagnosis | None:
    obs, cfg, th, L = w.obs, w.cfg, w.th, w.obs.lengths
    budget_share, blocks_share = w.budget_share, w.blocks_share
    if L is None or not L.count or not (budget_share >= th.blocked_share or blocks_share >= th.blocked_share):
        return None
    long_vs_median = L.prompt_max >= th.long_prompt_ratio * max(1.0, L.prompt_p50)
    long_vs_budget = L.prompt_max >= th.long_prompt_budget_share * cfg.max_num_batched_tokens
    big_head = budget_share >= th.blocked_share or (
        not cfg.enable_chunked_prefill and blocks_share >= th.blocked_share
        and obs.kv_usage_mean < th.seq_cap_kv_usage)
    if not (long_vs_median and long_vs_budget and big_head):
        return None
    limit = "token budget" if budget_share >= blocks_share else "free KV blocks"
    stuck = max(budget_share, blocks_share)
    if not cfg.enable_chunked_prefill:
        fix = f"enabling {CAMEL['enable_chunked_prefill']} lets it in chunk by chunk while the short requests run"
        sugg: dict[str, Any] = {"enable_chunked_prefill": True}
        knob = "enable_chunked_prefill"
    else:
        v = int(2 ** math.ceil(math.log2(max(cfg.max_num_batched_tokens * 2, 1))))
        fix = f"raising {CAMEL['max_num_batched_tokens']} to {v} lets more of it in per step"
        sugg = {"max_num_batched_tokens": v}
        knob = "max_num_batched_tokens"
    figs = {**w.common, "prompt_max": L.prompt_max, "prompt_p50": L.prompt_p50,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "enable_chunked_prefill": cfg.enable_chunked_prefill, "blocked_share": round(stuck, 4)}
    msg = (f"A long prompt blocks the queue head: {L.prompt_max}-token prompts (median "
           f"{_n(L.prompt_p50)}) stop on the {limit} in {_pct(stuck)} of steps "
           f"(budget {cfg.max_num_batched_tokens} tokens/step, chunked prefill "
           f"{'on' if cfg.enable_chunked_prefill else 'off'}) while shorter requests wait behind them "
           f"(p99 queue {_secs(obs.queue_time_p99_s)}); {fix}.")
    return Diagnosis("LongPromptHeadOfLine", msg, figs, knob, sugg)


def sequence_cap(w: Window) -> Diagnosis | None:
    obs, cfg, th, seqs_share = w.obs, w.cfg, w.th, w.seqs_share
    if not (seqs_share >= th.blocked_share and seqs_share >= w.blocks_share and obs.kv_usage_mean < th.seq_cap_kv_usage):
        return None
    fit = seq_cap_fit(obs, target_usage=th.seq_fit_kv_usage) or cfg.max_num_seqs * 2
    demand = obs.running_peak + obs.waiting_peak
    if demand > cfg.max_num_seqs:  # no use raising it past what is there to run (plus a margin)
        fit = min(fit, int(demand * th.seq_demand_margin))
    fit = max(fit, cfg.max_num_seqs + 1)
    fit = int(fit if fit < 32 else fit // 16 * 16)
    fit = max(cfg.max_num_seqs, int(w.bounds.max_num_seqs.clamp(fit)))
    figs = {**w.common, "seq_cap_fit": fit, "blocked_share": round(seqs_share, 4)}
    if obs.running_peak >= th.cap_busy * cfg.max_num_seqs:
        where = f"{_n(obs.running_peak)} of {cfg.max_num_seqs} sequences running"
    else:  # the queue gauges missed the busy moments (one scrape): say what the counters saw
        where = f"the cap of {cfg.max_num_seqs} sequences stopped the queue head in {_pct(seqs_share)} of steps"
    if fit > cfg.max_num_seqs:
        fix = f"raising {CAMEL['max_num_seqs']} to {fit} fits in the free blocks"
    else:  # the cap is already at the user's bound
        fix = (f"{CAMEL['max_num_seqs']} is at its bound ({w.bounds.max_num_seqs.hi:g}): a wider "
               "autotune.bounds.maxNumSeqs or more replicas would let more requests run")
    msg = (f"Requests wait on the sequence cap: {where} while KV usage is {_pct(obs.kv_usage_mean)}; {fix}.")
    return Diagnosis("SequenceCap", msg, figs, "max_num_seqs", {"max_num_seqs": fit})


def shared_prefix_pinning(w: Window) -> Diagnosis | None:
    obs, cfg, th, L, mem, blocks_share = w.obs, w.cfg, w.th, w.obs.lengths, w.mem, w.blocks_share
    if not w.mem_pressure:
        return None
    cached = obs.cached_blocks_share or 0.0
    shared = obs.shared_blocks_share or 0.0
    hit = obs.prefix_cache_hit_rate
    prefix_heavy = (L is not None and L.prefix_share >= th.prefix_heavy_share
                    and L.prefix_tokens_mean >= th.prefix_heavy_tokens * max(1.0, L.prompt_p50))
    # Idle cached blocks are evictable, hence allocatable: only blocks that running requests share
    # pin memory. Without a shared-block figure, idle cached blocks stand in for them only when the
    # trace shows shared prefixes (otherwise they are just recently freed blocks, e.g. after a
    # recompute preemption).
    pinned = shared if obs.shared_blocks_share is not None else (cached if prefix_heavy else 0.0)
    if not (cfg.enable_prefix_caching and blocks_share >= th.blocked_share and (
            pinned >= th.cached_share or (prefix_heavy and obs.shared_blocks_share is None))):
        return None
    if hit is not None and hit < th.low_hit_rate:
        fix = f"the hit rate is only {_pct(hit)}, so turning {CAMEL['enable_prefix_caching']} off frees them"
        sugg: dict[str, Any] = {"enable_prefix_caching": False}
        knob = "enable_prefix_caching"
    else:
        fix = f"giving the cache more memory ({CAMEL['gpu_memory_utilization']}) keeps the prefix and frees room"
        sugg = {}
        knob = "gpu_memory_utilization"
        if mem is not None:
            u = math.floor(min(mem.max_utilization(w.safety), w.bounds.gpu_memory_utilization.hi) * 100) / 100
            if u > cfg.gpu_memory_utilization:
                sugg = {"gpu_memory_utilization": u}
                fix = f"raising {CAMEL['gpu_memory_utilization']} to {u:g} makes room for the prefix and the requests"
            elif hit is not None and hit < th.keep_hit_rate:
                fix = f"turning {CAMEL['enable_prefix_caching']} off frees them (hit rate {_pct(hit)})"
                sugg, knob = {"enable_prefix_caching": False}, "enable_prefix_caching"
    figs = {**w.common, "cached_blocks_share": round(cached, 4), "shared_blocks_share": round(shared, 4),
            "prefix_cache_hit_rate": None if hit is None else round(hit, 4),
            "prefix_share": round(L.prefix_share, 4) if L else None,
            "blocked_share": round(blocks_share, 4)}
    if shared >= cached and shared > 0:
        held = f"{_pct(shared)} of the blocks hold shared prefixes, pinned by the requests that use them"
    elif cached > 0:
        held = f"{_pct(cached)} of the blocks are held idle by the prefix cache"
    else:
        held = "shared-prefix blocks stay pinned in the cache"
    msg = (f"Requests wait for KV blocks while the usage gauge reads {_pct(obs.kv_usage_mean)}: {held}"
           + (f" (hit rate {_pct(hit)})" if hit is not None else "")
           + f", so fewer blocks are allocatable than the gauge suggests; {fix}.")
    return Diagnosis("SharedPrefixPinning", msg, figs, knob, sugg)


def block_waste(w: Window) -> Diagnosis | None:
    obs, cfg, L = w.obs, w.cfg, w.obs.lengths
    frag = obs.internal_fragmentation_mean
    if not (w.mem_pressure and frag >= w.th.fragmentation and L is not None and L.totals):
        return None
    smaller = [b for b in sorted(w.bounds.block_size) if b < cfg.block_size]
    bb = best_block_size(obs, smaller + [cfg.block_size]) if smaller else None
    if not bb or bb >= cfg.block_size:
        return None
    now_w, new_w = L.tail_waste(cfg.block_size), L.tail_waste(bb)
    if not (now_w > 0 and (now_w - new_w) / now_w >= w.th.waste_saving):
        return None
    more = (1 - new_w) / (1 - now_w) - 1 if now_w < 1 else 0.0
    figs = {**w.common, "internal_fragmentation": round(frag, 4), "block_size": cfg.block_size,
            "suggested_block_size": bb, "total_tokens_p50": round(_median(L.totals), 1),
            "tail_waste_now": round(now_w, 4), "tail_waste_suggested": round(new_w, 4)}
    msg = (f"KV blocks are wasted: {_pct(frag)} of the allocated token slots are empty tail slots "
           f"with {CAMEL['block_size']} {cfg.block_size} and requests of "
           f"{_n(_median(L.totals))} tokens (median); {CAMEL['block_size']} {bb} wastes "
           f"{_pct(new_w)} and fits about {_pct(more)} more tokens in the same memory.")
    return Diagnosis("BlockWaste", msg, figs, "block_size", {"block_size": bb})


def low_kv_memory(w: Window) -> Diagnosis | None:
    obs, cfg, mem = w.obs, w.cfg, w.mem
    if not w.mem_pressure or mem is None:
        return None
    umax = min(mem.max_utilization(w.safety), w.bounds.gpu_memory_utilization.hi)
    unused = max(0.0, (umax - cfg.gpu_memory_utilization) * mem.device_total)
    if unused < w.th.unused_memory_share * mem.device_total:
        return None
    u = round(math.floor(umax * 100) / 100, 2)
    new_blocks = mem.num_blocks(cfg.with_changes(gpu_memory_utilization=u)) if u > 0 else 0
    gain = new_blocks / obs.num_blocks - 1 if obs.num_blocks else 0.0
    figs = {**w.common, "preemptions_per_min": round(w.pre_per_min, 2), "blocked_share": round(w.blocks_share, 4),
            "unused_bytes": unused, "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "safe_max_utilization": round(umax, 4), "num_blocks": obs.num_blocks,
            "suggested_num_blocks": new_blocks}
    what = (f"{obs.preemptions} preemptions ({w.pre_per_min:.1f}/min)" if obs.preemptions
            else f"the queue head waits for KV blocks in {_pct(w.blocks_share)} of steps")
    msg = (f"Too little KV memory: {what} while {unused / GiB:.1f} GiB of device memory is unused; "
           f"raising {CAMEL['gpu_memory_utilization']} from {cfg.gpu_memory_utilization:g} to {u:g} "
           f"adds {new_blocks - obs.num_blocks} blocks (+{_pct(gain)}) and stays under the measured "
           f"peak non-KV memory plus the safety margin.")
    return Diagnosis("LowKVMemory", msg, figs, "gpu_memory_utilization", {"gpu_memory_utilization": u})


def _is_mixed(s: Any, decodes: float) -> bool:
    """A step that carries a prefill chunk (its decodes wait for it)."""
    return s.prefill_pairs > 0 or s.batched_tokens > 1.5 * decodes + 8


def _p95(samples: list[Any]) -> float:
    xs = sorted((s.duration_s, s.weight) for s in samples)
    total, acc = sum(w for _, w in xs), 0.0
    for d, wt in xs:
        acc += wt
        if acc >= 0.95 * total:
            return d
    return xs[-1][0] if xs else 0.0


def prefill_stalls_decodes(w: Window) -> Diagnosis | None:
    """TPOT misses its objective while nothing waits: the decodes that share a step with a long
    prefill chunk wait for it. Smaller chunks (the token budget) bound the mixed step."""
    obs, cfg, slo = w.obs, w.cfg, w.slo
    if slo is None or slo.tpot_s is None or obs.tpot_p95_s <= slo.tpot_s or obs.blocked_share >= w.th.blocked_share:
        return None
    # ... and the queue is short: a long queue is an engine out of capacity (ComputeBound), where
    # smaller prefill chunks only trade TPOT for queueing
    if obs.queue_time_p95_s > w.th.short_queue_s(slo.ttft_s):
        return None
    decodes = max(1.0, obs.running_mean)
    mixed = [s for s in obs.step_samples if _is_mixed(s, decodes)]
    pure = [s for s in obs.step_samples if not _is_mixed(s, decodes)]
    if not mixed or not pure:
        return None
    mixed95, pure95 = _p95(mixed), _p95(pure)
    if pure95 > slo.tpot_s or mixed95 <= slo.tpot_s:
        return None  # decode-only steps are slow too (or mixed steps are not): not this cause
    # time per batched token from a line through the steps; the budget whose mixed step fits the objective
    n = sum(s.weight for s in obs.step_samples)
    mx = sum(s.batched_tokens * s.weight for s in obs.step_samples) / n
    my = sum(s.duration_s * s.weight for s in obs.step_samples) / n
    var = sum(s.weight * (s.batched_tokens - mx) ** 2 for s in obs.step_samples)
    slope = sum(s.weight * (s.batched_tokens - mx) * (s.duration_s - my) for s in obs.step_samples) / var if var else 0.0
    if slope <= 0:
        return None
    fits = (w.th.tpot_headroom * slo.tpot_s - (my - slope * mx)) / slope
    budget = 2 ** int(math.floor(math.log2(fits))) if fits >= 1 else 0
    budget = int(w.bounds.max_num_batched_tokens.clamp(max(budget, 2 * cfg.block_size)))
    if budget >= cfg.max_num_batched_tokens:
        return None
    sugg: dict[str, Any] = {"max_num_batched_tokens": budget}
    if not cfg.enable_chunked_prefill:
        sugg["enable_chunked_prefill"] = True
    figs = {**w.common, "tpot_p95_s": round(obs.tpot_p95_s, 4), "tpot_objective_s": slo.tpot_s,
            "mixed_step_p95_s": round(mixed95, 4), "decode_step_p95_s": round(pure95, 4),
            "mixed_step_share": round(sum(s.weight for s in mixed) / n, 4), "suggested_budget": budget}
    msg = (f"TPOT p95 {_ms(obs.tpot_p95_s)} misses the {_ms(slo.tpot_s)} objective by "
           f"{_pct(obs.tpot_p95_s / slo.tpot_s - 1)} while nothing waits: steps that carry a prefill chunk "
           f"(up to {cfg.max_num_batched_tokens} tokens) take {_ms(mixed95)} at p95, decode-only steps "
           f"{_ms(pure95)}, and the decodes in a mixed step wait for its prefill; "
           f"{CAMEL['max_num_batched_tokens']} {budget}"
           + (f" with {CAMEL['enable_chunked_prefill']}" if not cfg.enable_chunked_prefill else "")
           + " keeps a mixed step within the objective.")
    return Diagnosis("PrefillStallsDecodes", msg, figs, "max_num_batched_tokens", sugg)


def healthy(w: Window) -> Diagnosis | None:
    obs, th = w.obs, w.th
    if not (obs.blocked_share < th.blocked_share and w.pre_per_min < th.preemptions_per_min
            and obs.queue_time_p99_s <= th.healthy_queue_p99_s) or w.objectives_missed():
        return None
    msg = (f"Nothing holds requests back: the queue head was blocked in {_pct(obs.blocked_share)} of steps, KV usage "
           f"{_pct(obs.kv_usage_mean)}, {obs.preemptions} preemptions, p99 queue time "
           f"{_secs(obs.queue_time_p99_s)}.")
    return Diagnosis("Healthy", msg, w.common, None, {})


def compute_bound(w: Window) -> Diagnosis | None:
    obs = w.obs
    dom, dshare = obs.dominant_cause()
    if dom is not None and dshare >= w.th.blocked_share:
        return None
    missed = w.objectives_missed()
    msg = ((f"The objectives are missed ({'; '.join(missed)}) and " if missed else "Requests queue and ")
           + f"no limit stops the queue head (p99 queue {_secs(obs.queue_time_p99_s)}): the engine is "
           f"compute-bound at {obs.output_tokens_per_s:.0f} output tokens/s; more replicas help, KV knobs will not.")
    return Diagnosis("ComputeBound", msg, {**w.common, "output_tokens_per_s": round(obs.output_tokens_per_s, 1)},
                     None, {})


def binding_limit(w: Window) -> Diagnosis:
    """A limit binds but the figures fit no named scenario: name the limit itself."""
    obs, cfg = w.obs, w.cfg
    dom, dshare = obs.dominant_cause()
    if dom == "max_num_seqs":
        fit = seq_cap_fit(obs, target_usage=w.th.seq_fit_kv_usage) or cfg.max_num_seqs
        msg = (f"Requests wait on the sequence cap ({_pct(dshare)} of steps) with KV usage "
               f"{_pct(obs.kv_usage_mean)}: the cache is nearly as full as the cap allows; raising "
               f"{CAMEL['max_num_seqs']} needs more KV memory too.")
        return Diagnosis("SequenceCap", msg, {**w.common, "seq_cap_fit": fit}, "max_num_seqs", {})
    if dom == "token_budget":
        v = cfg.max_num_batched_tokens * 2
        msg = (f"The queue head waits on the token budget in {_pct(dshare)} of steps "
               f"({cfg.max_num_batched_tokens} tokens/step); raising {CAMEL['max_num_batched_tokens']} to {v} "
               "admits prefills sooner.")
        return Diagnosis("TokenBudget", msg, w.common, "max_num_batched_tokens", {"max_num_batched_tokens": v})
    if w.mem is None and cfg.kv_cache_memory is not None:  # a cache sized in GiB (vLLM on CPU, --kv-cache-memory)
        msg = (f"Too little KV memory: the queue head waits for KV blocks in {_pct(dshare)} of "
               f"{'samples' if obs.source == 'vllm' else 'steps'} with {obs.preemptions} preemptions; the KV cache "
               f"is a fixed {cfg.kv_cache_memory:g} GiB ({obs.num_blocks} blocks, usage peak "
               f"{_pct(obs.kv_usage_peak or obs.kv_usage_mean)}): a larger cache ({CAMEL['kv_cache_memory']}) "
               f"or a smaller {CAMEL['max_num_seqs']} avoids the preemptions.")
        return Diagnosis("LowKVMemory", msg, w.common, "kv_cache_memory", {})
    msg = (f"Too little KV memory: the queue head waits for KV blocks in {_pct(dshare)} of steps with "
           f"{obs.preemptions} preemptions, and the device has no safe headroom left "
           f"({CAMEL['gpu_memory_utilization']} {cfg.gpu_memory_utilization:g}); a smaller {CAMEL['max_num_seqs']} "
           "avoids preemptions, more replicas add capacity.")
    return Diagnosis("LowKVMemory", msg, w.common, "gpu_memory_utilization", {})


#: The rules in the order they are tried: the first that names a cause wins.
RULES = (swap_full, long_prompt_head_of_line, sequence_cap, shared_prefix_pinning, block_waste, low_kv_memory,
         prefill_stalls_decodes, healthy, compute_bound)


def diagnose(obs: Observation, thresholds: Thresholds = Thresholds(), safety: Safety = Safety(),
             bounds: Bounds | None = None, slo: Any = None) -> Diagnosis:
    """Name why requests wait in ``obs`` (or, with ``slo``, why its objectives are missed while nothing
    waits). Suggested values respect ``bounds`` when given."""
    w = Window.of(obs, thresholds, safety, bounds or Bounds(), slo)
    for rule in RULES:
        d = rule(w)
        if d is not None:
            return d
    return binding_limit(w)


def _median(xs: tuple[int, ...] | list[int]) -> float:
    s = sorted(xs)
    if not s:
        return 0.0
    m = len(s) // 2
    return float(s[m]) if len(s) % 2 else (s[m - 1] + s[m]) / 2
