"""What vLLM does not export, inferred from what it does, each value with its evidence or the reason
there is none.

vLLM 0.30+ exports neither ``max_num_seqs`` nor ``max_num_batched_tokens``; ``max_model_len`` only
through ``cache_config_info``. A diagnosis that fills the gap with vLLM's defaults names the wrong
cause (a cap of 2 read as 256 puts every wait down to the token budget), so each value is inferred
from the window's own figures, or left unknown:

* the sequence cap: the plateau of ``num_requests_running`` while requests wait for capacity with KV
  free. vLLM admits a waiting request whenever running is under the cap, the step has tokens left and
  blocks can be allocated; running that stays at one value R over most such samples, and never above
  it, is the cap, unless the steps of those samples spent the token budget (a budget plateau);
* the token budget: the largest ``iteration_tokens_total`` bucket the steps reached, when a prompt
  longer than that bucket was served (it was chunked, and a chunk is the step's budget); with no
  chunked prompt the steps give only a lower bound, and the budget stays unknown. So it does when
  the KV cache was full or preempting in the window (a prefill is then cut by the free blocks, not
  by the budget: a real vLLM under a 15-block cache took steps of at most 8 tokens while 100-token
  prompts were served, a budget of 2048), and when the steps were fewer tokens than the sequences
  known to run at once (vLLM's budget is never below its cap);
* the model length: ``kv_cache_size_tokens / kv_cache_max_concurrency`` of ``cache_config_info``
  (vLLM's max concurrency is the cache's tokens over the model length).

Invariant (`check`): an inferred value is one the window's samples cannot contradict: no sample ran
more sequences than an inferred cap, no step took more tokens than an inferred budget, and no budget
is inferred from a window whose KV cache cut the steps.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

#: samples with requests waiting (KV free) that a plateau needs: fewer say too little to name a cap
MIN_WAIT_SAMPLES = 5
#: share of those samples that must sit on the plateau's value (a finished request leaves a gap
#: until the next is admitted, so not all of them do)
PLATEAU_SHARE = 0.75
#: a sample's steps spent the token budget when their mean is at least this share of it
BUDGET_FULL = 0.5
#: KV usage from which a capacity wait is put down to KV blocks (shared with vllm_observation)
KV_FULL = 0.90


@dataclass(frozen=True)
class Inferred:
    """One knob's value (None: unknown) and the evidence for it, or why there is none, in words."""
    value: int | None
    evidence: str

    @property
    def known(self) -> bool:
        return self.value is not None


@dataclass(frozen=True)
class StepFigures:
    """The steps between two scrapes: how many, their mean tokens, the upper edge of the largest
    ``iteration_tokens_total`` bucket that grew (None: no step, or no histogram)."""
    steps: float
    tokens_mean: float
    tokens_max: float | None


def steps_between(buckets_now: Sequence[tuple[float, float]], buckets_before: Sequence[tuple[float, float]],
                  count: float, total: float) -> StepFigures:
    """StepFigures from two readings of the iteration-tokens histogram (cumulative (le, count) pairs)
    and the increases of its count and sum."""
    before = dict(buckets_before)
    grown = [le for le, c in buckets_now if c - before.get(le, 0.0) > 0]
    # the largest step lies in the first bucket that holds every step of the interval
    full = [le for le, c in buckets_now if c - before.get(le, 0.0) >= count > 0]
    top = min(full) if full else (max(grown) if grown else None)
    return StepFigures(count, total / count if count > 0 else 0.0, top)


def _lower_edge(buckets: Sequence[tuple[float, float]], le: float) -> float:
    edges = [b for b, _ in buckets if b < le]
    return max(edges) if edges else 0.0


def infer_token_budget(step_buckets: Sequence[tuple[float, float]],
                       prompt_buckets: Sequence[tuple[float, float]], cached_tokens: float = 0.0, *,
                       kv_pressed: bool = False, least: int = 1) -> Inferred:
    """The budget from the window's step and prompt histograms (module docstring); ``cached_tokens``
    the window's prefix-cache hits (a hit prefills less than its prompt, so proves no chunking);
    ``kv_pressed``: the KV cache was full or preempting in the window; ``least``: the fewest tokens
    the budget can be (the sequence cap, when known)."""
    steps = [(le, c) for le, c in step_buckets]
    if not steps or steps[-1][1] <= 0:
        return Inferred(None, "no step in the window (iteration_tokens_total did not grow)")
    total = steps[-1][1]
    top = min(le for le, c in steps if c >= total)
    if math.isinf(top):
        return Inferred(None, "steps reached the histogram's open last bucket")
    lo = _lower_edge(steps, top)
    if cached_tokens > 0:
        return Inferred(None, f"steps took at most {top:g} tokens, and prefix-cache hits ({cached_tokens:g} tokens) "
                              "hide how much of each prompt was prefilled: the budget is at least "
                              f"{lo:g}, how much more the window does not show")
    prompts = [(le, c) for le, c in prompt_buckets]
    served = prompts[-1][1] if prompts else 0.0
    # prompts surely longer than the largest step: those above the first prompt edge at or past it
    edge = min((le for le, _ in prompts if le >= top), default=math.inf)
    longer = served - dict(prompts)[edge] if prompts and not math.isinf(edge) else 0.0
    if longer <= 0:
        return Inferred(None, f"steps took at most {top:g} tokens and no served prompt was longer, so none was "
                              f"chunked: the budget is at least {lo:g}, how much more the window does not show")
    if kv_pressed:
        return Inferred(None, f"steps took at most {top:g} tokens while the KV cache was full or preempting: a "
                              "prefill is then cut by the free blocks, not only by the budget; the budget is at "
                              f"least {lo:g}, how much more the window does not show")
    if top < least:
        return Inferred(None, f"steps took at most {top:g} tokens, fewer than the {least} sequences running at "
                              f"once (vLLM's budget is never below its cap): the steps did not reach the budget")
    return Inferred(int(top), f"inferred: the largest steps took {lo:g}-{top:g} tokens while {longer:g} served "
                              f"prompts were longer than {top:g}, so they were chunked at the budget")


@dataclass(frozen=True)
class GaugeSample:
    """One moment of a vLLM engine: the gauges, the preemption counter's increase since the last
    sample, and the steps taken since it (None where the source has no per-sample histogram)."""
    running: float
    waiting: float            # waiting for capacity (all waiting when the split is not exported)
    kv_usage: float
    preempted: float = 0.0
    replica: str = ""          # which engine (samples come oldest first per replica)
    steps: StepFigures | None = None


def kv_bound(s: GaugeSample) -> bool:
    """The sample's KV cache was full, or it preempted."""
    return s.kv_usage >= KV_FULL or s.preempted > 0


def infer_max_num_seqs(samples: Sequence[GaugeSample], running_peak: float = 0.0,
                       token_budget: int | None = None) -> Inferred:
    """The cap from the plateau of running while requests wait with KV free (module docstring);
    ``running_peak`` the window's gauge maximum where it saw more than the samples."""
    by_replica: dict[str, list[GaugeSample]] = {}
    for s in samples:
        by_replica.setdefault(s.replica, []).append(s)
    found = [_plateau(ss, running_peak if len(by_replica) == 1 else 0.0, token_budget) for ss in by_replica.values()]
    values = {f.value for f in found}
    if len(found) > 1 and len(values) > 1:
        return Inferred(None, "the replicas disagree: " + "; ".join(f"{r or '?'}: {f.evidence}" for r, f in
                                                                   zip(by_replica, found)))
    return found[0] if found else Inferred(None, "no sample of the gauges")


def _plateau(samples: Sequence[GaugeSample], running_peak: float, token_budget: int | None) -> Inferred:
    waits = [s for s in samples if s.waiting >= 1 and not kv_bound(s)]
    if len(waits) < MIN_WAIT_SAMPLES:
        why = "no sample had requests waiting" if not any(s.waiting >= 1 for s in samples) else \
            f"only {len(waits)} of {len(samples)} samples had requests waiting with KV free ({MIN_WAIT_SAMPLES} needed)"
        return Inferred(None, f"not inferred: {why}")
    level, on = Counter(round(s.running) for s in waits).most_common(1)[0]
    if on < PLATEAU_SHARE * len(waits):
        seen = ", ".join(f"{v}" for v in sorted({round(s.running) for s in waits}))
        return Inferred(None, f"not inferred: running varied while requests waited ({seen}; {level} in only "
                              f"{on} of {len(waits)} samples)")
    peak = max([s.running for s in samples] + [running_peak])
    if level < 1 or peak > level + 0.5:
        return Inferred(None, f"not inferred: running stayed at {level} while requests waited but reached "
                              f"{peak:g} in the window, so {level} is not the cap")
    flat = [s for s in waits if round(s.running) == level]
    if token_budget:
        full = [s for s in flat if s.steps is not None and s.steps.steps > 0
                and s.steps.tokens_mean >= BUDGET_FULL * token_budget]
        if len(full) >= PLATEAU_SHARE * len(flat):
            return Inferred(None, f"not inferred: running stayed at {level} while requests waited, but the "
                                  f"steps spent the token budget ({token_budget}) then: the budget, not a cap, "
                                  "may hold them")
    waited = max(s.waiting for s in flat)
    return Inferred(level, f"inferred: running stayed at {level} over {on} of {len(waits)} samples while "
                           f"{waited:g} waited, KV free")


def infer_max_model_len(info: dict[str, str]) -> Inferred:
    """The model length from cache_config_info's cache size in tokens and its max concurrency."""
    try:
        tokens = float(info.get("kv_cache_size_tokens") or "nan")
        conc = float(info.get("kv_cache_max_concurrency") or "nan")
    except ValueError:
        return Inferred(None, "cache_config_info's kv_cache_size_tokens / kv_cache_max_concurrency unreadable")
    if not (tokens > 0 and conc > 0) or math.isnan(tokens + conc):
        return Inferred(None, "cache_config_info gives no kv_cache_size_tokens and kv_cache_max_concurrency")
    return Inferred(int(round(tokens / conc)), f"inferred: cache_config_info's kv_cache_size_tokens {tokens:.0f} / "
                                               f"kv_cache_max_concurrency {conc:g}")


def check(samples: Sequence[GaugeSample], cap: Inferred, budget: Inferred) -> None:
    """The module's invariant: no sample contradicts an inferred value."""
    if cap.known:
        assert all(s.running <= cap.value + 0.5 for s in samples), (cap, [s.running for s in samples])
    if budget.known:
        assert all(s.steps is None or s.steps.tokens_max is None or s.steps.tokens_mean <= budget.value
                   for s in samples), budget
        assert not any(kv_bound(s) for s in samples), budget
