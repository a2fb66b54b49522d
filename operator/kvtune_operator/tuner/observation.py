"""One observation window: what the engine reported about itself, in one flat, typed record.

Two sources build the same record:

* ``Observation.from_sim_summary`` -- a ``kvtune sim --json`` summary (the local loop, benchmarks, tests);
* ``Observation.from_metrics`` -- Prometheus-style figures over a window (counter increases, gauge
  averages, histogram buckets) plus the engine's ``/kvtune/v1/state`` snapshot.  ``kvtune diagnose
  --url`` feeds it a parsed ``/metrics`` scrape; the in-cluster reader feeds it the same keys from PromQL
  (``increase(...[window])`` for counters and buckets, ``avg_over_time`` / ``max_over_time`` for
  gauges) -- see ``MetricFigures``.

Every ratio is in [0, 1], every time in seconds, every memory figure in bytes. Percentiles: the
record says which statistic it holds (``quantiles``): "exact", ``kvtune_engine.quantile.percentile``
of the requests' own figures (a simulator summary, the request lengths), or "histogram", estimates
from the engine's buckets (``MetricFigures.hist_quantile``), all that ``/metrics`` allow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from kvtune_engine.config import EngineConfig
from kvtune_engine.core.stats import CAUSES
from kvtune_engine.knobs import knob
from kvtune_engine.kv.sizing import ActivationProfile
from kvtune_engine.quantile import bucket_quantile, percentile
from kvtune_engine.sim.summary import SimSummary
from kvtune_engine.sim.trace import HASH_BLOCK, chain_sharing

from .fit import samples_from_engine_steps
from .step_sample import StepSample

#: The limits that can stop the head of the waiting queue: the engine scheduler's own list, less "none".
WAITING_CAUSES = tuple(c for c in CAUSES if c != "none")
GiB = 1024 ** 3
#: memory by kind, as the engine exports it (kvtune_memory_bytes{kind}) and the simulator sums it
MEMORY_KINDS = ("weights", "activations_peak", "kv_cache", "swap", "device_total")


def _field(r: Any, name: str, default: Any = None) -> Any:
    if isinstance(r, Mapping):
        return r.get(name, default)
    return getattr(r, name, default)


@dataclass(frozen=True)
class LengthStats:
    """Request-length distribution of the window's trace (shapes only, never text)."""
    count: int
    duration_s: float
    prompt_p50: float
    prompt_p95: float
    prompt_max: int
    output_p50: float
    output_p95: float
    output_max: int
    total_mean: float
    prefix_share: float            # fraction of requests that carry a shared prefix
    prefix_tokens_mean: float      # mean shared-prefix length among those
    prefix_groups: int
    #: final lengths (prompt + output) of up to 4096 requests, for block-size waste estimates
    totals: tuple[int, ...] = field(default=(), repr=False)

    @property
    def arrival_rate_per_s(self) -> float:
        return self.count / self.duration_s if self.duration_s > 0 else 0.0

    def tail_waste(self, block_size: int) -> float:
        """Share of the allocated token slots left empty in the last block, at the final lengths."""
        if not self.totals:
            return 0.0
        alloc = sum(-(-t // block_size) * block_size for t in self.totals)
        used = sum(self.totals)
        return (alloc - used) / alloc if alloc else 0.0

    @classmethod
    def from_trace(cls, records: Iterable[Any]) -> "LengthStats":
        """From trace records: dicts of the JSONL trace format or objects with the same attributes."""
        prompts, outputs, arrivals, prefix_lens, groups = [], [], [], [], set()
        chains: list[tuple[tuple[int, ...], int, int]] = []
        for r in records:
            p = int(_field(r, "prompt_tokens", 0))
            o = int(_field(r, "output_tokens", 0))
            prompts.append(p)
            outputs.append(o)
            arrivals.append(float(_field(r, "arrival_s", 0.0)))
            g = _field(r, "prefix_group")
            if g is not None and int(_field(r, "prefix_tokens", 0) or 0) > 0:
                groups.add(g)
                prefix_lens.append(int(_field(r, "prefix_tokens", 0)))
            if _field(r, "hash_ids"):
                chains.append((tuple(_field(r, "hash_ids")), int(_field(r, "hash_block") or HASH_BLOCK), p))
        # a chain carries a shared prefix when an earlier request's chain covers its first blocks
        for (ids, _, _), k in zip(chains, chain_sharing(chains)):
            if k > 0:
                groups.add(("chain", ids[0]))
                prefix_lens.append(k)
        n = len(prompts)
        if n == 0:
            return cls(0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0)
        sp, so = sorted(prompts), sorted(outputs)
        totals = [p + o for p, o in zip(prompts, outputs)]
        step = max(1, n // 4096)
        span = max(arrivals) - min(arrivals)
        # n arrivals span n-1 gaps: scale so the rate of a Poisson trace comes out right
        duration = span * n / (n - 1) if n > 1 and span > 0 else 0.0
        return cls(
            count=n, duration_s=duration,
            prompt_p50=percentile(sp, 0.5), prompt_p95=percentile(sp, 0.95), prompt_max=sp[-1],
            output_p50=percentile(so, 0.5), output_p95=percentile(so, 0.95), output_max=so[-1],
            total_mean=sum(totals) / n,
            prefix_share=len(prefix_lens) / n,
            prefix_tokens_mean=sum(prefix_lens) / len(prefix_lens) if prefix_lens else 0.0,
            prefix_groups=len(groups),
            totals=tuple(totals[::step]),
        )


@dataclass(frozen=True)
class Observation:
    """What one window showed. Built by the constructors below; the tuner never reads raw metrics."""
    config: EngineConfig
    source: str = "sim"                     # "sim" | "engine"
    window_s: float = 0.0
    # why the head of the waiting queue waited: share of *steps* blocked by each cause
    waiting_cause_share: Mapping[str, float] = field(default_factory=dict)
    # KV cache
    num_blocks: int = 0
    kv_usage_mean: float = 0.0
    kv_usage_peak: float | None = None
    internal_fragmentation_mean: float = 0.0
    cached_blocks_share: float | None = None     # idle prefix-cached blocks / total (mean)
    shared_blocks_share: float | None = None     # blocks referenced by more than one request / total (mean)
    prefix_cache_hit_rate: float | None = None   # hit tokens / queried tokens
    # preemptions (counts in the window) and swap
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    swap_full: int = 0                           # swap wanted, pool full -> recompute
    swap_usage_peak: float = 0.0
    swap_blocks: int | None = None
    # memory by kind, bytes: weights, activations_peak, kv_cache, swap, device_total
    memory: Mapping[str, float] = field(default_factory=dict)
    # latency and throughput; the percentiles are ``quantiles``: "exact" or "histogram" (module docstring)
    quantiles: str = "exact"
    queue_time_p50_s: float = 0.0
    queue_time_p95_s: float = 0.0
    queue_time_p99_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p95_s: float = 0.0
    ttft_p99_s: float = 0.0
    tpot_p50_s: float = 0.0
    tpot_p95_s: float = 0.0
    tpot_p99_s: float = 0.0
    output_tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    goodput_requests_per_s: float = 0.0
    requests_finished: int = 0
    requests_rejected: int = 0
    # queues: mean over the window's steps and peak
    running_mean: float = 0.0
    running_peak: float = 0.0
    waiting_mean: float = 0.0
    waiting_peak: float = 0.0
    # the request-length distribution of the window's trace
    lengths: LengthStats | None = None
    step_samples: tuple[StepSample, ...] = ()
    #: vLLM: its API server's time per request outside the engine core, which a replay adds to TTFT and
    #: e2e (`vllm_steps.frontend_s`); 0 for our engine, whose latencies the simulator replays whole
    frontend_s: float = 0.0
    summary: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    #: the step shape the engine's start-up memory profile covered (state ``activation_profile``): a
    #: live raise past it is refused by the engine (it needs a restart); None: not bounded
    activation_profile: ActivationProfile | None = None

    # ---- derived figures ----
    @property
    def preemptions(self) -> int:
        return self.preemptions_swap + self.preemptions_recompute

    @property
    def blocked_share(self) -> float:
        return sum(self.waiting_cause_share.values())

    def dominant_cause(self) -> tuple[str | None, float]:
        if not self.waiting_cause_share:
            return None, 0.0
        name, share = max(self.waiting_cause_share.items(), key=lambda kv: kv[1])
        return (name, share) if share > 0 else (None, 0.0)

    @property
    def non_kv_memory(self) -> float:
        """Measured peak memory the engine uses besides the KV cache (weights + activation peak)."""
        return float(self.memory.get("weights", 0.0)) + float(self.memory.get("activations_peak", 0.0))

    def with_(self, **changes: Any) -> "Observation":
        return replace(self, **changes)

    def with_engine_steps(self, steps: Iterable[Mapping[str, Any]]) -> "Observation":
        """This observation with the engine's step log (``GET /kvtune/v1/steps``) as its step samples,
        so that predictions run on step costs fitted from this very engine."""
        kv = float(self.memory.get("kv_cache", 0) or 0)
        block_bytes = kv / self.num_blocks if kv > 0 and self.num_blocks else None
        samples = samples_from_engine_steps(steps, block_bytes)
        return replace(self, step_samples=tuple(samples)) if samples else self

    # ---- constructors ----
    @classmethod
    def from_sim_summary(cls, summary: Mapping[str, Any], *, trace: Iterable[Any] | None = None,
                         step_samples: Iterable[StepSample] = (), window_s: float | None = None,
                         config: EngineConfig | None = None) -> "Observation":
        """From one ``kvtune sim --json`` summary, read by field (`SimSummary`: a missing field is an
        error, never a silent 0)."""
        s = SimSummary.of(summary)
        if config is None:
            config = EngineConfig.model_validate(_config_fields(s.config))
        pre, pc = s.preemptions, s.prefix_cache
        hit = None
        if config.enable_prefix_caching and pc.get("query_tokens"):
            hit = float(pc["hit_rate"])
        return cls(
            config=config, source="sim",
            window_s=float(window_s if window_s is not None else s.duration_s),
            waiting_cause_share={k: float(v) for k, v in s.waiting_cause_share.items() if k != "none"},
            num_blocks=int(s.num_blocks),
            kv_usage_mean=float(s.kv_usage_mean),
            kv_usage_peak=float(s.kv_usage_peak),
            internal_fragmentation_mean=float(s.internal_fragmentation_mean),
            cached_blocks_share=float(s.kv_blocks_mean_share["cached"]),
            shared_blocks_share=float(s.shared_blocks_mean_share),
            prefix_cache_hit_rate=hit,
            preemptions_swap=int(pre["swap"]),
            preemptions_recompute=int(pre["recompute"]),
            swap_full=int(pre["swap_full"]),
            swap_usage_peak=float(s.swap_usage_peak),
            swap_blocks=int(s.num_swap_blocks),
            memory={k: float(v) for k, v in s.memory_bytes.items() if k in MEMORY_KINDS},
            queue_time_p50_s=_or0(s.queue_time_p50_s), queue_time_p95_s=_or0(s.queue_time_p95_s),
            queue_time_p99_s=_or0(s.queue_time_p99_s),
            ttft_p50_s=_or0(s.ttft_p50_s), ttft_p95_s=_or0(s.ttft_p95_s), ttft_p99_s=_or0(s.ttft_p99_s),
            tpot_p50_s=_or0(s.tpot_p50_s), tpot_p95_s=_or0(s.tpot_p95_s), tpot_p99_s=_or0(s.tpot_p99_s),
            output_tokens_per_s=float(s.output_tokens_per_s),
            requests_per_s=float(s.requests_per_s),
            goodput_requests_per_s=float(s.goodput_requests_per_s),
            requests_finished=int(s.requests["finished"]),
            requests_rejected=int(s.requests["rejected"]),
            running_mean=float(s.running_mean),
            running_peak=float(s.running_max),
            waiting_mean=float(s.queued_mean),
            waiting_peak=float(s.queued_max),
            lengths=LengthStats.from_trace(trace) if trace is not None else None,
            step_samples=tuple(step_samples),
            summary=dict(summary),
        )

    @classmethod
    def from_metrics(cls, figures: "MetricFigures", *, state: Mapping[str, Any] | None = None,
                     trace: Iterable[Any] | None = None, window_s: float | None = None,
                     config: EngineConfig | None = None, slo_ttft_s: float | None = None,
                     slo_tpot_s: float | None = None) -> "Observation":
        """From Prometheus-style figures over a window plus the engine's state snapshot.

        ``figures`` holds, per series, the window's value: the increase of counters and histogram
        buckets/sums/counts, the mean of gauges (``kvtune diagnose --url`` passes one scrape: the
        counters since start and the gauges now). ``state`` is ``/kvtune/v1/state``: it gives the
        effective config and the current queue snapshot when the metrics lack them.
        """
        f = figures
        st = dict(state or {})
        if config is None:
            cfg = st.get("config")
            if cfg is None:
                cfg = f.info_labels("kvtune_engine_config_info")
            config = EngineConfig.model_validate(_config_fields(cfg or {}))
        steps = {c: f.get("kvtune_scheduler_waiting_reason_steps_total", reason=c) for c in WAITING_CAUSES}
        total_steps = f.get("kvtune_steps_total") or f.hist_count("kvtune_step_duration_seconds")
        share = {c: (v / total_steps if total_steps else 0.0) for c, v in steps.items() if v is not None}
        blocks = {s_: f.get("kvtune_kv_blocks", state=s_) or 0.0 for s_ in ("free", "used", "cached", "reserved")}
        num_blocks = int(f.get("kvtune_kv_num_blocks") or 0) or int(_dig(st, "blocks", "total", default=0) or 0) \
            or int(round(sum(blocks.values())))
        mem = {k: f.get("kvtune_memory_bytes", kind=k) for k in MEMORY_KINDS}
        mem = {k: v for k, v in mem.items() if v is not None}
        win = float(window_s or 0.0)
        finished = (f.hist_count("kvtune_e2e_request_latency_seconds")
                    or f.hist_count("kvtune_time_to_first_token_seconds") or 0.0)
        rps = finished / win if win > 0 else 0.0
        out_tokens = f.hist_sum("kvtune_request_output_tokens") or f.get("kvtune_generation_tokens_total") or 0.0
        goodput = rps
        if slo_ttft_s is not None:
            goodput = min(goodput, rps * f.hist_cdf("kvtune_time_to_first_token_seconds", slo_ttft_s, default=1.0))
        if slo_tpot_s is not None:
            goodput = min(goodput, rps * f.hist_cdf("kvtune_inter_token_latency_seconds", slo_tpot_s, default=1.0))
        samples: list[StepSample] = []
        n = f.hist_count("kvtune_step_duration_seconds")
        if n:
            ctx = f.hist_sum("kvtune_step_context_tokens")
            samples.append(StepSample(
                duration_s=(f.hist_sum("kvtune_step_duration_seconds") or 0.0) / n,
                batched_tokens=(f.hist_sum("kvtune_step_batched_tokens") or 0.0) / n,
                context_tokens=(ctx or 0.0) / n, weight=n))
        running = f.get("kvtune_requests", state="running")
        waiting = f.get("kvtune_requests", state="waiting")
        if running is None:
            running = float(_dig(st, "queues", "running", default=0) or 0)
        if waiting is None:
            waiting = float(_dig(st, "queues", "waiting", default=0) or 0)
        shared = f.get("kvtune_kv_shared_blocks")
        hits = f.get("kvtune_prefix_cache_hits_tokens_total")
        queries = f.get("kvtune_prefix_cache_queries_tokens_total")
        return cls(
            config=config, source="engine", window_s=win,
            waiting_cause_share=share,
            num_blocks=num_blocks,
            kv_usage_mean=float(f.get("kvtune_kv_usage_ratio") or 0.0),
            kv_usage_peak=f.get("kvtune_kv_usage_ratio", agg="max"),
            internal_fragmentation_mean=float(f.get("kvtune_kv_internal_fragmentation_ratio") or 0.0),
            cached_blocks_share=(blocks["cached"] / num_blocks) if num_blocks else None,
            shared_blocks_share=(shared / num_blocks) if shared is not None and num_blocks else None,
            prefix_cache_hit_rate=(hits / queries) if hits is not None and queries else None,
            preemptions_swap=int(f.get("kvtune_preemptions_total", mode="swap") or 0),
            preemptions_recompute=int(f.get("kvtune_preemptions_total", mode="recompute") or 0),
            swap_full=int(f.get("kvtune_swap_full_total") or 0),
            swap_blocks=_opt_int(f.get("kvtune_swap_num_blocks", agg="max") or _dig(st, "swap", "total")),
            swap_usage_peak=float(f.get("kvtune_swap_usage_ratio", agg="max") or 0.0),
            memory=mem,
            quantiles="histogram",
            queue_time_p50_s=f.hist_quantile("kvtune_request_queue_time_seconds", 0.5),
            queue_time_p95_s=f.hist_quantile("kvtune_request_queue_time_seconds", 0.95),
            queue_time_p99_s=f.hist_quantile("kvtune_request_queue_time_seconds", 0.99),
            ttft_p50_s=f.hist_quantile("kvtune_time_to_first_token_seconds", 0.5),
            ttft_p95_s=f.hist_quantile("kvtune_time_to_first_token_seconds", 0.95),
            ttft_p99_s=f.hist_quantile("kvtune_time_to_first_token_seconds", 0.99),
            tpot_p50_s=f.hist_quantile("kvtune_inter_token_latency_seconds", 0.5),
            tpot_p95_s=f.hist_quantile("kvtune_inter_token_latency_seconds", 0.95),
            tpot_p99_s=f.hist_quantile("kvtune_inter_token_latency_seconds", 0.99),
            output_tokens_per_s=out_tokens / win if win > 0 else 0.0,
            requests_per_s=rps, goodput_requests_per_s=goodput,
            requests_finished=int(finished),
            running_mean=float(running), running_peak=float(f.get("kvtune_requests", state="running", agg="max") or running),
            waiting_mean=float(waiting), waiting_peak=float(f.get("kvtune_requests", state="waiting", agg="max") or waiting),
            lengths=LengthStats.from_trace(trace) if trace is not None else None,
            step_samples=tuple(samples),
            summary=None,
            activation_profile=_activation_profile(st.get("activation_profile")),
        )


def _activation_profile(d: Any) -> ActivationProfile | None:
    """State's ``activation_profile``; None when absent or unreadable (an older engine)."""
    try:
        return ActivationProfile(int(d["max_num_batched_tokens"]), int(d["max_num_seqs"]))  # as covered
    except (TypeError, KeyError, ValueError):
        return None


def _or0(v: float | None) -> float:
    """A percentile of no requests (the simulator's None) reads as 0 s."""
    return 0.0 if v is None else float(v)


def _opt(v: Any) -> float | None:
    return None if v is None else float(v)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _dig(d: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if not isinstance(d, Mapping) or k not in d:
            return default
        d = d[k]
    return d


def _config_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Engine config from a dict keyed by any name the knob table knows (snake_case, vLLM dashed, CRD
    camelCase); strings coerced; other keys (the engine's own figures) left out."""
    out: dict[str, Any] = {}
    for k, v in dict(cfg).items():
        try:
            key = knob(k).name
        except KeyError:
            continue
        if v is not None and v != "":
            if isinstance(v, str) and v.lower() in ("true", "false"):
                v = v.lower() == "true"
            elif isinstance(v, str) and v.lower() in ("none", "null"):
                continue
            out[key] = v
    return out


# --------------------------------------------------------------------------------------------------
# Prometheus-style figures


LabelKey = tuple[tuple[str, str], ...]
_COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created")


class MetricFigures:
    """Window figures keyed by (metric name, labels).

    ``values[(name, labels)]`` is the window's figure: for counters and histogram series the increase
    over the window, for gauges the mean. ``maxima`` optionally holds gauge maxima
    (``max_over_time``). ``info`` holds the label sets of ``*_info`` series.
    """

    def __init__(self, values: Mapping[tuple[str, LabelKey], float] | None = None,
                 maxima: Mapping[tuple[str, LabelKey], float] | None = None) -> None:
        self.values: dict[tuple[str, LabelKey], float] = dict(values or {})
        self.maxima: dict[tuple[str, LabelKey], float] = dict(maxima or {})

    @staticmethod
    def key(name: str, **labels: str) -> tuple[str, LabelKey]:
        return name, tuple(sorted(labels.items()))

    def set(self, name: str, value: float, **labels: str) -> None:
        self.values[self.key(name, **labels)] = float(value)

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(dict(lk), v) for (n, lk), v in self.values.items() if n == name]

    def get(self, name: str, agg: str = "mean", **labels: str) -> float | None:
        """Sum of the series of ``name`` whose labels include ``labels`` (None when there is none)."""
        src = self.maxima if agg == "max" else self.values
        found = [v for (n, lk), v in src.items() if n == name and all(dict(lk).get(k) == w for k, w in labels.items())]
        if not found and agg == "max":
            return None
        return sum(found) if found else None

    def info_labels(self, name: str) -> dict[str, str] | None:
        for (n, lk), _ in self.values.items():
            if n == name:
                return dict(lk)
        return None

    def hist_count(self, name: str) -> float | None:
        return self.get(name + "_count")

    def hist_sum(self, name: str) -> float | None:
        return self.get(name + "_sum")

    def buckets(self, name: str) -> list[tuple[float, float]]:
        acc: dict[float, float] = {}
        for labels, v in self.series(name + "_bucket"):
            le = labels.get("le")
            if le is None:
                continue
            b = math.inf if le in ("+Inf", "inf", "Inf") else float(le)
            acc[b] = acc.get(b, 0.0) + v
        return sorted(acc.items())

    def hist_quantile(self, name: str, q: float) -> float:
        """An *estimate* of the q-quantile from the histogram's buckets (Prometheus' histogram_quantile,
        ``kvtune_engine.quantile.bucket_quantile``; 0 when empty), not the exact ``percentile``."""
        return bucket_quantile(self.buckets(name), q)

    def hist_cdf(self, name: str, x: float, default: float = 1.0) -> float:
        """Share of observations <= x (interpolated inside the bucket)."""
        bs = self.buckets(name)
        if not bs or bs[-1][1] <= 0:
            return default
        total = bs[-1][1]
        prev_le, prev_c = 0.0, 0.0
        for le, c in bs:
            if x <= le:
                if math.isinf(le):
                    return prev_c / total
                frac = (x - prev_le) / (le - prev_le) if le > prev_le else 1.0
                return (prev_c + (c - prev_c) * frac) / total
            prev_le, prev_c = le, c
        return 1.0

    # ---- sources ----
    @classmethod
    def from_prometheus_text(cls, text: str) -> "MetricFigures":
        """One scrape of ``/metrics``: counters since start, gauges now (their max is the value now)."""
        from prometheus_client.parser import text_string_to_metric_families

        values: dict[tuple[str, LabelKey], float] = {}
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                values[smp.name, tuple(sorted(smp.labels.items()))] = float(smp.value)
        return cls(values, maxima=dict(values))

    @classmethod
    def over_scrapes(cls, scrapes: list["MetricFigures"]) -> "MetricFigures":
        """Window figures from several scrapes of one engine, oldest first: counters and histogram
        series increase from the first to the last, gauges averaged, gauge maxima kept."""
        if not scrapes:
            return cls()
        if len(scrapes) == 1:
            return scrapes[0]
        last = scrapes[-1].delta(scrapes[0])
        for k in list(last.values):
            if not k[0].endswith(_COUNTER_SUFFIXES):
                vals = [s.values[k] for s in scrapes if k in s.values]
                last.values[k] = sum(vals) / len(vals)
        last.maxima = {}
        for s in scrapes:
            for k, v in s.values.items():
                if not k[0].endswith(_COUNTER_SUFFIXES):
                    last.maxima[k] = max(v, last.maxima.get(k, v))
        return last

    def delta(self, earlier: "MetricFigures") -> "MetricFigures":
        """Window figures between two scrapes: counters and histogram series subtracted, gauges kept."""
        out: dict[tuple[str, LabelKey], float] = {}
        for k, v in self.values.items():
            name = k[0]
            if name.endswith(_COUNTER_SUFFIXES) and k in earlier.values:
                out[k] = max(0.0, v - earlier.values[k])
            else:
                out[k] = v
        maxima = {k: max(v, earlier.maxima.get(k, v)) for k, v in self.maxima.items()}
        return MetricFigures(out, maxima)
