"""Read one InferenceDeployment's engine metrics over a window from Prometheus.

One range query fetches the raw samples of every `kvtune_*` series of the deployment (selected by the
`namespace` and `inference_deployment` labels its PodMonitor gives); the window figures are computed
here: counters and histogram series by their increase (resets tolerated), gauges by mean and max. The
replicas are averaged, so the figures describe one typical engine, which is what the simulator
replays. The scrape addresses found on the way are the engines whose trace the tuner reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .tuner.observation import MetricFigures

COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")
#: least share of the window that scrapes must cover before the tuner judges it (a Prometheus that
#: was down, or an engine it could not reach, leaves gaps: a decision on the rest is a guess)
MIN_COVERAGE = 0.75
#: a gap between two scrapes longer than this many scrape intervals is missing data
MAX_GAP_INTERVALS = 3.0
PER_REPLICA_LABELS = ("pod", "instance", "job", "namespace", "inference_deployment", "container",
                      "endpoint", "service")


class MetricsUnavailable(RuntimeError):
    """No decision without metrics: `reason` becomes the MetricsAvailable condition's reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Window:
    figures: MetricFigures
    instances: list[str]  # host:port of each engine replica Prometheus scraped in the window
    window_s: float
    #: the raw range-query result (runtime vllm reads its gauges sample by sample)
    series: list[dict[str, Any]] | None = None


#: per runtime: the series the window reads, and the one whose scrapes tell the window's coverage
RUNTIME_SERIES = {"kvtune": ("kvtune_.+", "kvtune_steps_total"),
                  "vllm": ("vllm:.+|process_start_time_seconds", "vllm:num_requests_running")}


def _increase(values: list[float]) -> float:
    inc = 0.0
    for prev, cur in zip(values, values[1:]):
        inc += cur - prev if cur >= prev else cur  # a reset starts again from zero
    return inc


def _new_series_after(series: list[dict[str, Any]], window_s: float | None) -> float | None:
    """The time after which a series' first sample means the series began inside the window: two
    scrape intervals (the median gap between samples) after the window's start. None when unknown."""
    if not window_s:
        return None
    stamps = [[float(t) for t, _ in s["values"]] for s in series if s.get("values")]
    gaps = sorted(b - a for ts in stamps for a, b in zip(ts, ts[1:]) if b > a)
    if not gaps:
        return None
    end = max(ts[-1] for ts in stamps)
    return end - window_s + 2 * gaps[len(gaps) // 2]


def window_figures(series: list[dict[str, Any]], window_s: float | None = None,
                   new_instances: Iterable[str] = ()) -> tuple[MetricFigures, list[str]]:
    """Raw range-query results -> per-replica-averaged window figures, and the replicas' addresses.

    The counters of a process that started inside the window (a restart change rolled the pods, a new
    replica) started from zero there: its first sample is part of the increase (the requests it served
    before Prometheus first scraped it). Such are the series of ``new_instances`` (engines known to
    have started inside the window) and, with ``window_s`` (the range of the query), any counter
    series whose first sample comes more than two scrape intervals after the window's start."""
    sums: dict[tuple, list[float]] = {}
    maxima: dict[tuple, list[float]] = {}
    instances: set[str] = set()
    new_after = _new_series_after(series, window_s)
    new_instances = set(new_instances)
    for s in series:
        labels = dict(s["metric"])
        name = labels.pop("__name__")
        if "instance" in labels:
            instances.add(labels["instance"])
        values = [float(v) for _, v in s["values"]]
        if not values:
            continue
        key = MetricFigures.key(name, **{k: v for k, v in labels.items() if k not in PER_REPLICA_LABELS})
        if name.endswith(COUNTER_SUFFIXES):
            if labels.get("instance") in new_instances or (
                    new_after is not None and float(s["values"][0][0]) > new_after):
                values = [0.0, *values]  # began inside the window: counted from zero
            sums.setdefault(key, []).append(_increase(values))
        else:
            sums.setdefault(key, []).append(sum(values) / len(values))
            maxima.setdefault(key, []).append(max(values))
    mean = {k: sum(v) / len(v) for k, v in sums.items()}
    peak = {k: max(v) for k, v in maxima.items()}
    return MetricFigures(mean, peak), sorted(instances)


def coverage(series: list[dict[str, Any]], window_s: float, new_instances: Iterable[str] = (),
             name: str = "kvtune_steps_total") -> float:
    """Share of the window covered by scrapes of the best-covered replica's ``name`` series.

    Each scrape covers the interval before it, up to ``MAX_GAP_INTERVALS`` scrape intervals (the
    median gap): a longer gap covers one interval only. An engine that started inside the window
    (``new_instances``) is judged on the time since its first scrape."""
    new_instances, best = set(new_instances), 0.0
    for s in series:
        if s["metric"].get("__name__") != name:
            continue
        ts = sorted(float(t) for t, _ in s.get("values") or [])
        gaps = [b - a for a, b in zip(ts, ts[1:]) if b > a]
        if not gaps:
            continue
        g = sorted(gaps)[len(gaps) // 2]
        covered = g + sum(d if d <= MAX_GAP_INTERVALS * g else g for d in gaps)
        span = window_s
        if s["metric"].get("instance") in new_instances:
            span = min(window_s, ts[-1] - ts[0] + g)
        best = max(best, min(1.0, covered / span) if span > 0 else 0.0)
    return best


def read_window(url: str, namespace: str, name: str, window_s: float, *, timeout_s: float = 10.0,
                new_instances: Iterable[str] = (), runtime: str = "kvtune") -> Window:
    """Raises MetricsUnavailable (with a reason for the condition) when Prometheus or the series are
    missing. ``new_instances``: engines (host:port) that started inside the window. ``runtime``
    vllm reads vLLM's own series (``vllm:*``) instead of kvtune's."""
    from prometheus_api_client import PrometheusConnect

    pattern, anchor = RUNTIME_SERIES[runtime]
    family = "vllm:*" if runtime == "vllm" else "kvtune_*"
    selector = f'{{__name__=~"{pattern}",namespace="{namespace}",inference_deployment="{name}"}}'
    try:
        prom = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout_s)
        series = prom.custom_query(query=f"{selector}[{max(1, int(window_s))}s]")
    except Exception as e:  # connection refused, timeout, HTTP error: all mean "no metrics now"
        raise MetricsUnavailable("PrometheusUnreachable", f"cannot query Prometheus at {url}: {e}") from None
    if not series:
        raise MetricsUnavailable(
            "NoSeries", f"Prometheus at {url} has no {family} series for {namespace}/{name} "
            f"in the last {int(window_s)}s: is the engine scraped (PodMonitor) and running?")
    figures, instances = window_figures(series, max(1, int(window_s)), new_instances)
    if figures.get(anchor) is None:
        raise MetricsUnavailable("IncompleteSeries", f"the series of {namespace}/{name} lack {anchor}")
    share = coverage(series, max(1, int(window_s)), new_instances, name=anchor)
    if share < MIN_COVERAGE:
        raise MetricsUnavailable(
            "IncompleteWindow", f"Prometheus scraped the engines of {namespace}/{name} for only {share:.0%} of the "
            f"last {int(window_s)}s (at least {MIN_COVERAGE:.0%} is needed to judge a window): no decision and no "
            "verdict on partial data; waiting for a fuller window")
    return Window(figures, instances, window_s, series)
