"""Step costs and frontend time from what vLLM exports: it times no step, so both come from the
increases of its counters between two scrapes of one engine. The operator (Prometheus' range of each
pod) and ``bench/sim_vs_vllm.py`` (its own scrapes) read them here, so the bench measures the
predictions the tuner makes.

* **Interval samples**: between two scrapes with requests running throughout, the steps
  (``iteration_tokens_total``'s count) shared the interval: one sample is (interval / steps,
  tokens / steps), weighted by the steps. vLLM leaves the recompute of preempted requests out of
  the token count (`recomputed_tokens` adds it back).
* **Prefill samples**: those means hide the prefill steps among the decodes (one 256-token prefill
  among 40 decode steps of 10 tokens), so the per-request prefill time (first scheduling to first
  token, engine-core clock) is sampled too, over the chunks of the tokens it computed
  (``request_prefill_kv_computed_tokens``: cached tokens excluded), at the chunk's tokens, the
  decodes running beside it, its causal attention pairs, and the prefills that arrived while the
  step before it ran and so share its step (`landing_step_s`): counted as the request's alone, a
  step that two prompts shared charged each prompt token for both, and the simulator, which
  co-schedules them itself, then ran prefills ~13% slow.
* **Frontend**: vLLM's latencies start and end in its API server, its queue and inference times in
  the engine core; a request's time outside the engine core (e2e less queue less inference) is the
  wait for the step in progress when it reached the engine core (half the landing step, which the
  simulator replays itself) plus the API server's hops, which it does not: ``frontend_s``.

Invariant: every figure here is an increase of one engine's own counters between two of its
scrapes, or a mean of vLLM's own histograms; nothing is assumed of the machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .observation import MetricFigures
from .step_sample import StepSample

STEPS = "vllm:iteration_tokens_total"
PREFILL = "vllm:request_prefill_time_seconds"
COMPUTED = "vllm:request_prefill_kv_computed_tokens"
PROMPT = "vllm:request_prompt_tokens"
RUNNING = "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions_total"
HISTOGRAMS = (STEPS, PREFILL, COMPUTED, PROMPT)
#: the series a scrape keeps: the histograms' _count and _sum, and two gauges/counters
NAMES = frozenset([f"{h}{s}" for h in HISTOGRAMS for s in ("_count", "_sum")] + [RUNNING, PREEMPTIONS])


@dataclass(frozen=True)
class Scrape:
    """One scrape of one vLLM engine: the values of `NAMES` it had (a missing one is absent)."""
    t_s: float
    values: Mapping[str, float]

    def delta(self, before: "Scrape", name: str) -> float:
        """The increase of ``name`` since ``before``; 0 when either scrape lacks it (never a whole
        counter read as one interval's increase)."""
        if name not in self.values or name not in before.values:
            return 0.0
        return self.values[name] - before.values[name]

    @classmethod
    def of(cls, t_s: float, figures: MetricFigures) -> "Scrape":
        """From one /metrics text's figures (the bench's own scrapes)."""
        values = {n: figures.get(n) for n in (RUNNING, PREEMPTIONS)}
        for h in HISTOGRAMS:
            values[f"{h}_count"], values[f"{h}_sum"] = figures.hist_count(h), figures.hist_sum(h)
        return cls(t_s, {k: float(v) for k, v in values.items() if v is not None})


def scrapes_of_series(series: Iterable[Mapping]) -> list[list[Scrape]]:
    """Prometheus range-query results -> each engine's (instance's) scrapes in time order."""
    per: dict[str, dict[float, dict[str, float]]] = {}
    for s in series:
        m = s["metric"]
        if m.get("__name__") in NAMES:
            by_t = per.setdefault(m.get("instance", ""), {})
            for t, v in s["values"]:
                by_t.setdefault(float(t), {})[m["__name__"]] = float(v)
    return [[Scrape(t, v) for t, v in sorted(by_t.items())] for _, by_t in sorted(per.items())]


def recomputed_tokens(preemptions: float, prompt_tokens_mean: float) -> float:
    """The tokens vLLM computed again for ``preemptions`` that ``iteration_tokens_total`` leaves out.

    vLLM counts a step's tokens as the prompts that reached their first token in it plus the tokens it
    generated: a preempted request's recompute is not counted (on a preemption-heavy run the
    histogram's sum was exactly ``prompt_tokens_total + generation_tokens_total``, 269 preemptions
    later). A step cost fitted on those counts charges each counted token for the uncounted ones
    (1.31x per token on that run), and a replay that recomputes preempted requests then runs slower
    than vLLM. vLLM preempts the request it scheduled last, whose context is about its prompt: each
    preemption is counted as a window's mean prompt recomputed (within 3% of the simulator's own
    recompute on that run)."""
    return max(0.0, preemptions) * max(0.0, prompt_tokens_mean)


def interval_samples(scrapes: Sequence[Scrape], prompt_tokens_mean: float = 0.0) -> list[StepSample]:
    """One sample per interval with requests running at both ends (module docstring)."""
    out = []
    for a, b in zip(scrapes, scrapes[1:]):
        n = b.delta(a, f"{STEPS}_count")
        if n >= 1 and a.values.get(RUNNING, 0.0) > 0 and b.values.get(RUNNING, 0.0) > 0:
            tok = b.delta(a, f"{STEPS}_sum") + recomputed_tokens(b.delta(a, PREEMPTIONS), prompt_tokens_mean)
            out.append(StepSample(duration_s=(b.t_s - a.t_s) / n, batched_tokens=tok / n, weight=n,
                                  t_s=(a.t_s + b.t_s) / 2))
    return out


@dataclass(frozen=True)
class _Prefills:
    """One interval's finished requests' prefills: their mean time, computed and cached tokens."""
    a: Scrape
    b: Scrape
    n: float
    step_s: float
    computed: float
    cached: float
    chunks: int


def _prefills(scrapes: Sequence[Scrape], budget: int) -> list[_Prefills]:
    out = []
    for a, b in zip(scrapes, scrapes[1:]):
        n, nc, npr = (b.delta(a, f"{h}_count") for h in (PREFILL, COMPUTED, PROMPT))
        if n < 1 or nc < 1 or npr < 1:
            continue
        computed = b.delta(a, f"{COMPUTED}_sum") / nc
        if computed < 1:
            continue
        chunks = max(1, math.ceil(computed / max(1, budget)))
        out.append(_Prefills(a, b, n, b.delta(a, f"{PREFILL}_sum") / n / chunks, computed,
                             max(0.0, b.delta(a, f"{PROMPT}_sum") / npr - computed), chunks))
    return out


def landing_step_s(samples: Iterable[StepSample]) -> float:
    """The mean length of the step an arrival lands in, E[T^2] / E[T] over the steps (a long step
    catches more arrivals than a short one); 0 without samples."""
    w = [(s.weight, s.duration_s) for s in samples if s.weight > 0 and math.isfinite(s.duration_s)]
    first = sum(n * d for n, d in w)
    return sum(n * d * d for n, d in w) / first if first > 0 else 0.0


def prefill_samples(scrapes: Sequence[Scrape], budget: int, landing_s: float) -> list[StepSample]:
    """One sample per interval in which requests finished (the prefill histograms count at the
    finish), weighted by its prefill steps; ``landing_s``: `landing_step_s` of the steps (the
    prefills that arrived during it share the step)."""
    out = []
    for p in _prefills(scrapes, budget):
        running = (p.a.values.get(RUNNING, 0.0) + p.b.values.get(RUNNING, 0.0)) / 2
        shared = 1 + p.n / (p.b.t_s - p.a.t_s) * landing_s
        q = p.computed / p.chunks
        pairs = (p.computed * p.cached + p.computed * (p.computed + 1) / 2) / p.chunks
        out.append(StepSample(duration_s=p.step_s, batched_tokens=q * shared + max(0.0, running - 1),
                              prefill_pairs=pairs * shared, weight=p.n * p.chunks, t_s=(p.a.t_s + p.b.t_s) / 2))
    return out


def step_samples(scrapes: Sequence[Scrape], budget: int, prompt_tokens_mean: float = 0.0) -> list[StepSample]:
    """Interval and prefill samples of one engine (module docstring), for ``tuner.fit``."""
    steps = interval_samples(scrapes, prompt_tokens_mean)
    raw = [StepSample(p.step_s, 0.0, weight=p.n * p.chunks) for p in _prefills(scrapes, budget)]
    return steps + prefill_samples(scrapes, budget, landing_step_s(steps + raw))


def frontend_s(figures: MetricFigures, samples: Sequence[StepSample]) -> float:
    """The API server's time per request outside the engine core that the simulator does not replay:
    the mean of e2e less queue less inference (vLLM's own histograms over the window) less half the
    landing step (the wait for the step in progress, which it does). 0 without finished requests."""
    def mean(name: str) -> float | None:
        n = figures.hist_count(name)
        return (figures.hist_sum(name) or 0.0) / n if n else None
    e2e, queue, inference = (mean(f"vllm:{n}") for n in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                                                           "request_inference_time_seconds"))
    if e2e is None or queue is None or inference is None:
        return 0.0
    return max(0.0, e2e - queue - inference - landing_step_s(samples) / 2)
