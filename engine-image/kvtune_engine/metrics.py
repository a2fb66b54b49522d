"""Prometheus metrics of one engine: kvtune's names (DESIGN.md's table) and vLLM's standard subset.

Gauges and counters are read at scrape time from the engine's snapshot (a custom collector), so a
scrape always sees the scheduler as it is now, never a value cached from some earlier step.
Histograms are observed by the engine loop into the small lock-free :class:`Histogram` below (one
observation feeds both the ``kvtune_`` and the ``vllm:`` series) and exported by the same collector.

Each engine gets its own ``CollectorRegistry``: two engines in one process (tests) never mix.
No torch here.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .core.stats import CAUSES
from .quantile import bucket_quantile

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Waiting causes the scheduler can name (pre-initialised to 0 so every series exists from the start).
WAITING_REASONS = CAUSES
BLOCK_STATES = ("free", "used", "cached", "reserved")
REQUEST_STATES = ("running", "waiting", "swapped")
PREEMPTION_MODES = ("swap", "recompute")
MEMORY_KINDS = ("weights", "activations_peak", "kv_cache", "swap", "device_total")
FINISH_REASONS = ("stop", "length", "abort", "rejected", "error")

# Buckets: vLLM's for the latency histograms (so vLLM dashboards' quantiles mean the same thing).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                      40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)
STEP_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25,
                         0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
STEP_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
STEP_CONTEXT_BUCKETS = (0, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
REQUEST_TOKENS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                          50000, 100000)


class Histogram:
    """Cumulative-bucket histogram observed by one thread (the engine loop), read by scrapes.

    A scrape reads the counts without a lock; at worst it sees one observation half-applied
    (bucket counted, sum not yet), which Prometheus tolerates.
    """

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def observe_many(self, values: Iterable[float]) -> None:
        for v in values:
            self.observe(v)

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        counts = list(self.counts)
        for b, c in zip(self.bounds, counts):
            acc += c
            out.append((_fmt_bound(b), acc))
        out.append(("+Inf", acc + counts[-1]))
        return out

    def quantile_estimate(self, q: float) -> float | None:
        """The q-quantile estimated from the buckets (``kvtune_engine.quantile.bucket_quantile``, what
        Prometheus' histogram_quantile gives), not an exact percentile; None when empty."""
        if self.count == 0:
            return None
        return bucket_quantile(list(zip((*self.bounds, math.inf), itertools.accumulate(self.counts))), q)


def _fmt_bound(b: float) -> str:
    return floatToGoString(b)


#: Histograms the engine keeps: attribute name -> (bucket bounds, kvtune name, vLLM name or None, help).
HISTOGRAMS: dict[str, tuple[tuple[float, ...], str, str | None, str]] = {
    "ttft": (TTFT_BUCKETS, "kvtune_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
             "Time from arrival to the first output token."),
    "itl": (ITL_BUCKETS, "kvtune_inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
            "Time between consecutive output tokens of a request."),
    "e2e": (REQUEST_LATENCY_BUCKETS, "kvtune_e2e_request_latency_seconds",
            "vllm:e2e_request_latency_seconds", "Time from arrival to the last output token."),
    "queue": (QUEUE_TIME_BUCKETS, "kvtune_request_queue_time_seconds", "vllm:request_queue_time_seconds",
              "Time from arrival to first being scheduled."),
    "prompt_tokens": (REQUEST_TOKENS_BUCKETS, "kvtune_request_prompt_tokens", "vllm:request_prompt_tokens",
                      "Prompt length of finished requests, in tokens."),
    "output_tokens": (REQUEST_TOKENS_BUCKETS, "kvtune_request_output_tokens", "vllm:request_generation_tokens",
                      "Output length of finished requests, in tokens."),
    "step_duration": (STEP_DURATION_BUCKETS, "kvtune_step_duration_seconds", None,
                      "Wall time of one engine step (schedule, forward, sample, bookkeeping)."),
    "step_tokens": (STEP_TOKENS_BUCKETS, "kvtune_step_batched_tokens", "vllm:iteration_tokens_total",
                    "Tokens computed in one engine step (prefill chunks plus decodes)."),
    "step_context": (STEP_CONTEXT_BUCKETS, "kvtune_step_context_tokens", None,
                     "Sum of the context lengths of the decodes in one engine step (attention cost)."),
}


def new_histograms() -> dict[str, Histogram]:
    return {k: Histogram(v[0]) for k, v in HISTOGRAMS.items()}


class EngineCollector(Collector):
    """Builds every metric family from ``snapshot()`` (the engine's state dict) at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], histograms: dict[str, Histogram],
                 model_name: str):
        self._snapshot = snapshot
        self._hist = histograms
        self._model = model_name

    def describe(self):  # no eager collect at registration
        return []

    def collect(self):
        s = self._snapshot()
        yield from kvtune_families(s, self._hist)
        yield from vllm_families(s, self._hist, self._model)


def _gauge(name: str, doc: str, value: float | None = None, labels: Sequence[str] | None = None):
    return GaugeMetricFamily(name, doc, value=value, labels=labels)


def kvtune_families(s: dict[str, Any], hist: dict[str, Histogram]):
    blocks = s["blocks"]
    g = _gauge("kvtune_kv_blocks", "KV blocks by state (reserved: kept free by the watermark).",
               labels=["state"])
    for st in BLOCK_STATES:
        g.add_metric([st], blocks.get(st, 0))
    yield g
    yield _gauge("kvtune_kv_num_blocks", "KV blocks in the device pool.", blocks.get("total", 0))
    yield _gauge("kvtune_kv_shared_blocks", "KV blocks referenced by more than one request (shared prefixes: "
                 "pinned while any of them runs).", s.get("shared_blocks", 0))
    yield _gauge("kvtune_swap_num_blocks", "Blocks in the CPU swap pool.", s["swap"].get("total", 0))
    yield _gauge("kvtune_kv_usage_ratio", "Used KV blocks / total KV blocks.", s["kv_usage_ratio"])
    yield _gauge("kvtune_kv_internal_fragmentation_ratio",
                 "Empty token slots in allocated blocks / allocated token slots.",
                 s["kv_internal_fragmentation_ratio"])
    yield _gauge("kvtune_swap_usage_ratio", "CPU swap pool blocks in use / swap pool blocks.",
                 s["swap_usage_ratio"])
    g = _gauge("kvtune_requests", "Requests by queue.", labels=["state"])
    for st in REQUEST_STATES:
        g.add_metric([st], s["queues"].get(st, 0))
    yield g

    c = CounterMetricFamily("kvtune_scheduler_waiting_reason_steps",
                            "Steps in which the head of the waiting queue was stopped by a reason.",
                            labels=["reason"])
    reasons = dict.fromkeys(WAITING_REASONS, 0)
    reasons.update(s["waiting_reason_steps"])
    for r, n in reasons.items():
        c.add_metric([r], n)
    yield c
    c = CounterMetricFamily("kvtune_preemptions", "Preemptions by mode.", labels=["mode"])
    for m in PREEMPTION_MODES:
        c.add_metric([m], s["preemptions"].get(m, 0))
    yield c
    yield CounterMetricFamily("kvtune_swap_full", "Times a preemption wanted swap but the swap pool was "
                              "full (it fell back to recompute).", s["preemptions"].get("swap_full", 0))
    yield CounterMetricFamily("kvtune_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix "
                              "cache.", s["prefix_cache"]["queries_tokens"])
    yield CounterMetricFamily("kvtune_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache.",
                              s["prefix_cache"]["hits_tokens"])
    cnt = s["counters"]
    yield CounterMetricFamily("kvtune_prompt_tokens", "Prompt tokens of admitted requests.",
                              cnt["prompt_tokens"])
    yield CounterMetricFamily("kvtune_generation_tokens", "Output tokens generated.",
                              cnt["generation_tokens"])
    yield CounterMetricFamily("kvtune_steps", "Engine steps run.", cnt["steps"])
    c = CounterMetricFamily("kvtune_requests_finished", "Finished requests by reason.",
                            labels=["finish_reason"])
    fin = dict.fromkeys(FINISH_REASONS, 0)
    fin.update(cnt["requests_finished"])
    for r, n in fin.items():
        c.add_metric([r], n)
    yield c

    g = _gauge("kvtune_memory_bytes", "Memory picture of the runner, bytes.", labels=["kind"])
    mem = s.get("memory") or {}
    for k in MEMORY_KINDS:
        if mem.get(k) is not None:  # not measured (activation peak on CPU): no series rather than a 0
            g.add_metric([k], float(mem[k]))
    yield g

    cfg = s["config"]
    labels = sorted(cfg)
    g = _gauge("kvtune_engine_config_info", "The effective engine config (value 1, config in labels).",
               labels=labels + ["num_gpu_blocks", "num_cpu_blocks"])
    g.add_metric([_label(cfg[k]) for k in labels] + [str(blocks.get("total", 0)), str(s["swap"].get("total", 0))],
                 1)
    yield g

    for key, (_, name, _vname, doc) in HISTOGRAMS.items():
        yield _histogram(name, doc, hist[key], [], [])


def vllm_families(s: dict[str, Any], hist: dict[str, Histogram], model: str):
    """The series of vLLM 0.32 whose concepts our engine shares, with vLLM's names, types and labels
    (``tests/unit/test_metrics_vllm_names.py`` checks them against a real vLLM's /metrics text).

    Where the concepts differ it says so: every waiting request of ours waits for scheduling capacity
    (no LoRA budget, no KV transfer), so ``reason="deferred"`` is always 0; we have no queue limits,
    so ``admission_rejections_total`` stays 0 (a request that can never fit is a 400, counted as
    ``request_success{finished_reason="error"}`` like vLLM's input errors). Swapped requests (vLLM V1
    has no swap) count as waiting."""
    L, V = ["engine", "model_name"], ["0", model]
    q = s["queues"]
    waiting = q.get("waiting", 0) + q.get("swapped", 0)
    g = _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels=L)
    g.add_metric(V, q.get("running", 0))
    yield g
    g = _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=L)
    g.add_metric(V, waiting)
    yield g
    g = _gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason: 'capacity' = "
               "waiting for scheduling capacity; 'deferred' = deferred by transient constraints (none here).",
               labels=L + ["reason"])
    g.add_metric(V + ["capacity"], waiting)
    g.add_metric(V + ["deferred"], 0)
    yield g
    g = _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=L)
    g.add_metric(V, s["kv_usage_ratio"])
    yield g
    pre = s["preemptions"]
    pc = s["prefix_cache"]
    for name, doc, value in (
        ("vllm:num_preemptions", "Cumulative number of preemptions (swap and recompute).",
         pre.get("swap", 0) + pre.get("recompute", 0)),
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
         pc["queries_tokens"]),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", pc["hits_tokens"]),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", s["counters"]["prompt_tokens"]),
        ("vllm:prompt_tokens_cached", "Number of cached prompt tokens.", pc["hits_tokens"]),
        ("vllm:generation_tokens", "Number of generation tokens processed.",
         s["counters"]["generation_tokens"]),
    ):
        c = CounterMetricFamily(name, doc, labels=L)
        c.add_metric(V, value)
        yield c
    fin = s["counters"]["requests_finished"]
    c = CounterMetricFamily("vllm:request_success", "Count of processed requests by finish reason.",
                            labels=L + ["finished_reason"])
    for r in ("stop", "length", "abort"):
        c.add_metric(V + [r], fin.get(r, 0))
    c.add_metric(V + ["error"], fin.get("error", 0) + fin.get("rejected", 0))
    yield c
    c = CounterMetricFamily("vllm:admission_rejections", "Admission attempts rejected by a queue limit, by "
                            "reason (this engine has no queue limits: always 0).", labels=["model_name", "reason"])
    for r in ("max_num_queued_reqs", "max_num_queued_tokens"):
        c.add_metric([model, r], 0)
    yield c
    cfg = s["config"]
    info = {
        "block_size": str(cfg["block_size"]),
        "num_gpu_blocks": str(s["blocks"].get("total", 0)),
        "num_cpu_blocks": str(s["swap"].get("total", 0)) if s["swap"].get("total") else "None",
        "gpu_memory_utilization": str(cfg["gpu_memory_utilization"]),
        "enable_prefix_caching": str(bool(cfg["enable_prefix_caching"])),
        "cache_dtype": str(s.get("kv_cache_dtype", "auto")),
        "user_specified_block_size": "True",
    }
    kv_bytes = (s.get("memory") or {}).get("kv_cache")
    if kv_bytes:
        info["kv_cache_memory_bytes"] = str(int(kv_bytes))
    g = _gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.",
               labels=["engine"] + sorted(info))
    g.add_metric(["0"] + [info[k] for k in sorted(info)], 1)
    yield g
    for key, (_, _name, vname, doc) in HISTOGRAMS.items():
        if vname:
            yield _histogram(vname, doc, hist[key], L, V)


def _histogram(name: str, doc: str, h: Histogram, labels: list[str], values: list[str]):
    fam = HistogramMetricFamily(name, doc, labels=labels)
    buckets = h.cumulative()
    # sum and +Inf count read together from one pass, so `_count` == the +Inf bucket
    fam.add_metric(values, buckets, h.sum)
    return fam


def _label(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return ""
    return str(v)


class EngineMetrics:
    """The registry of one engine; ``render()`` is the body of ``GET /metrics``."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], histograms: dict[str, Histogram],
                 model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = EngineCollector(snapshot, histograms, model_name)
        self.registry.register(self.collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)
