"""A request trace synthesized from an engine's metrics, for engines that record no trace (vLLM).

vLLM exposes no per-request log, only distributions: the request count over a window (arrival
rate), the prompt and output length histograms, and the prefix-cache hit rate. The simulator needs
requests, so this draws them: Poisson arrivals at the window's rate, lengths sampled from the
histograms (uniform inside a bucket, the open last bucket capped at its lower bound times two),
and a shared prefix for a share of requests sized so the expected hit rate matches the observed one.
Seeded, so one window always gives the same trace. Every consumer must say the trace is synthesized.
"""
from __future__ import annotations

import math
import random
from typing import Any

from .observation import MetricFigures

#: vLLM's names for the length histograms and the request counter
PROMPT_HIST = "vllm:request_prompt_tokens"
OUTPUT_HIST = "vllm:request_generation_tokens"


def _sampler(buckets: list[tuple[float, float]], rng: random.Random, cap: int):
    """Inverse-CDF draw from cumulative buckets [(le, count)], linear inside a bucket."""
    bs = [(le, c) for le, c in buckets]
    total = bs[-1][1] if bs else 0.0
    if total <= 0:
        return None
    finite = [le for le, _ in bs if not math.isinf(le)]
    top = (finite[-1] * 2 if finite else 1.0)

    def draw() -> int:
        u = rng.random() * total
        lo, prev = 0.0, 0.0
        for le, c in bs:
            hi = top if math.isinf(le) else le
            if u <= c and c > prev:
                x = lo + (hi - lo) * (u - prev) / (c - prev)
                return max(1, min(cap, int(math.ceil(x))))
            lo, prev = hi, c
        return max(1, min(cap, int(top)))
    return draw


def synthesize_trace(figures: MetricFigures, window_s: float, *, seed: int = 0, max_requests: int = 4000,
                     max_model_len: int | None = None, prefix_tokens_hint: int | None = None,
                     in_system: tuple[float, float] = (0.0, 0.0)) -> list[dict[str, Any]]:
    """Requests of one window drawn from its metrics (see the module docstring); [] when the window
    finished no request or has no length histograms.

    ``in_system``: the requests running or waiting at the window's start and at its end (the gauges'
    first and last samples). The histograms count finished requests only, which under a deep queue
    arrive at the rate the engine served: the requests in the engine at the start join the trace at
    time 0 (``backlog``: the queue the window inherited), and the window's arrivals are the finished
    ones plus the growth of that number (requests are conserved)."""
    n = figures.hist_count(PROMPT_HIST) or 0.0
    if window_s <= 0 or n < 1:
        return []
    rng = random.Random(seed)
    cap = max_model_len or 1 << 20
    prompt = _sampler(figures.buckets(PROMPT_HIST), rng, cap)
    output = _sampler(figures.buckets(OUTPUT_HIST), rng, cap)
    if prompt is None or output is None:
        return []
    start, end = (max(0, int(round(x))) for x in in_system)
    count = int(min(max_requests, max(1, round(n - start + end))))
    rate = count / window_s
    hits = figures.get("vllm:prefix_cache_hits_total")
    queries = figures.get("vllm:prefix_cache_queries_total")
    hit_rate = (hits / queries) if hits is not None and queries else 0.0
    # a shared prefix of P tokens on a share s of the requests hits about s * P / mean_prompt of the tokens
    mean_prompt = (figures.hist_sum(PROMPT_HIST) or 0.0) / n or 1.0
    p_tokens = int(prefix_tokens_hint or max(1, round(0.5 * mean_prompt)))
    share = min(1.0, hit_rate * mean_prompt / p_tokens) if hit_rate > 0 else 0.0
    t, out = 0.0, []
    held = min(start, max_requests)
    for i in range(held + count):
        if i >= held:
            t += rng.expovariate(rate)
        p, o = prompt(), output()
        if max_model_len:
            o = max(1, min(o, max_model_len - p)) if p < max_model_len else 1
            p = min(p, max_model_len - 1)
        r: dict[str, Any] = {"arrival_s": round(t, 6), "prompt_tokens": p, "output_tokens": o}
        if share > 0 and rng.random() < share:
            r["prefix_group"] = "synth-0"
            r["prefix_tokens"] = min(p, p_tokens)
        if i < held:
            r["backlog"] = True
        out.append(r)
    return out
