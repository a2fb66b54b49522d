"""Read one InferenceDeployment's engine metrics over a window from Prometheus.

One range query fetches the raw samples of every `kvtune_*` series of the deployment (selected by the
`namespace` and `inference_deployment` labels its PodMonitor gives); the window figures are computed
here: counters and histogram series by their increase (resets tolerated), gauges by mean and max. The
replicas are averaged, so the figures describe one typical engine, which is what the simulator
replays. The scrape addresses found on the way are the engines whose trace the tuner reads.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import ipaddress
import json
import ssl
from dataclasses import dataclass
from typing import Any, Iterable, Mapping
from urllib.parse import urlsplit

import httpx

from .tuner.observation import MetricFigures

#: every query: a total wall-clock deadline (connect, headers, body: not per read) and a byte cap on the
#: (decoded) response; a Prometheus, or whatever answers at a URL, that drips or floods is cut off
QUERY_DEADLINE_S = 10.0
MAX_RESPONSE_BYTES = 64 << 20

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


class QueryFailed(RuntimeError):
    """A bounded GET failed; the message is a short fixed reason (a status code, never a response body)."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


def base_url(url: str) -> str:
    """A Prometheus base URL, normalized for the allowlist: ``scheme://host:port/path`` (lower-case
    scheme and host, explicit port, no trailing slash). ValueError for anything but http(s), and for a
    query, a fragment or userinfo (``?x=`` would swallow the API path; ``user@`` hides the host)."""
    if not isinstance(url, str) or any(ch in url for ch in "?#@\\ \t\r\n") or any(ord(ch) < 32 for ch in url):
        raise ValueError("a Prometheus URL has no query, fragment, userinfo or whitespace")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError("not a valid URL") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("a Prometheus URL is http:// or https:// with a host")
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port or (443 if scheme == 'https' else 80)}{parts.path.rstrip('/')}"


def check_allowed(url: str, allowlist: Iterable[str]) -> str:
    """The normalized `url` if the operator may query it, else MetricsUnavailable naming the allowlist."""
    allowed = tuple(allowlist)
    try:
        base = base_url(url)
    except ValueError as e:
        raise MetricsUnavailable("PrometheusUrlInvalid", f"spec.metrics.prometheusUrl is refused: {e}") from None
    if base not in allowed:
        raise MetricsUnavailable(
            "PrometheusUrlNotAllowed", "spec.metrics.prometheusUrl is not a Prometheus this operator may query; "
            f"allowed: {', '.join(allowed)} (chart values prometheusUrl and prometheusAllowedUrls, "
            "KVTUNE_PROMETHEUS_ALLOWED_URLS)")
    return base


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default verifying TLS context (its CA bundle, SSL_CERT_FILE / SSL_CERT_DIR honoured), built
    once per process: building one loads the whole CA bundle, ~20 ms of CPU, and every query and engine
    call used to build its own (a third of the operator's busy time in the fleet test's 30 deployments)."""
    return httpx.create_ssl_context()


def _run(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from inside an event loop
        return pool.submit(asyncio.run, coro).result()


def bounded_fetch(url: str, params: Mapping[str, Any] | None = None, *, headers: Mapping[str, str] | None = None,
                  deadline_s: float = QUERY_DEADLINE_S, max_bytes: int = MAX_RESPONSE_BYTES, method: str = "GET",
                  json_body: Any = None) -> bytes:
    """One request (``method``, with ``json_body`` as its JSON body if given) and its whole answer's
    body, all of it within `deadline_s` of wall-clock time and at most `max_bytes` of body; no redirect
    is followed. Raises QueryFailed with a short fixed reason (``status``: the HTTP status, if one came)."""
    async def fetch() -> bytes:
        async with httpx.AsyncClient(timeout=deadline_s, follow_redirects=False, verify=tls_context(),
                                     headers={"Accept-Encoding": "identity", **(headers or {})}) as client:
            extra = {} if json_body is None else {"json": json_body}
            async with client.stream(method, url, params=params, **extra) as r:
                if r.status_code != 200:
                    raise QueryFailed(f"HTTP {r.status_code}", status=r.status_code)
                if int(r.headers.get("content-length") or 0) > max_bytes:
                    raise QueryFailed(f"the response is larger than {max_bytes} bytes")
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        raise QueryFailed(f"the response is larger than {max_bytes} bytes")
                return bytes(body)

    try:
        return _run(asyncio.wait_for(fetch(), deadline_s))
    except TimeoutError:
        raise QueryFailed(f"no complete answer within {deadline_s:g}s") from None
    except httpx.HTTPError as e:
        raise QueryFailed(f"{type(e).__name__}") from None


def bounded_get_json(url: str, params: Mapping[str, Any] | None = None, *, headers: Mapping[str, str] | None = None,
                     deadline_s: float = QUERY_DEADLINE_S, max_bytes: int = MAX_RESPONSE_BYTES) -> Any:
    """GET `url` and parse its JSON, within `bounded_fetch`'s limits. Raises QueryFailed with a short
    fixed reason."""
    body = bounded_fetch(url, params, headers=headers, deadline_s=deadline_s, max_bytes=max_bytes)
    try:
        return json.loads(body)
    except ValueError:
        raise QueryFailed("the response is not JSON") from None


def pod_host(address: str) -> str | None:
    """The host of a scrape address (``host:port`` or a URL), normalized as an IP (None: not an IP)."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    try:
        host = urlsplit(address if "//" in address else f"http://{address}").hostname
        return str(ipaddress.ip_address(host or ""))
    except ValueError:
        return None


def pod_ips(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    """The IPs of these pods, from the API (status.podIP and status.podIPs)."""
    out: set[str] = set()
    for p in pods:
        st = p.get("status") or {}
        for ip in [st.get("podIP"), *[x.get("ip") for x in st.get("podIPs") or []]]:
            if ip and pod_host(ip):
                out.add(pod_host(ip))  # type: ignore[arg-type]
    return out


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


def query(url: str, promql: str, *, timeout_s: float = QUERY_DEADLINE_S,
          max_bytes: int = MAX_RESPONSE_BYTES) -> list[dict[str, Any]]:
    """One instant query's result (``/api/v1/query``), within a total deadline and a byte cap.
    Raises QueryFailed with a short fixed reason: no part of a response body reaches a status or an event."""
    answer = bounded_get_json(f"{base_url(url)}/api/v1/query", {"query": promql}, deadline_s=timeout_s,
                              max_bytes=max_bytes)
    if not isinstance(answer, dict) or answer.get("status") != "success":
        raise QueryFailed("the answer is not a successful Prometheus query result")
    result = (answer.get("data") or {}).get("result") if isinstance(answer.get("data"), dict) else None
    if not isinstance(result, list):
        raise QueryFailed("the answer is not a successful Prometheus query result")
    return result


def read_window(url: str, namespace: str, name: str, window_s: float, *, timeout_s: float = QUERY_DEADLINE_S,
                new_instances: Iterable[str] = (), runtime: str = "kvtune",
                max_bytes: int = MAX_RESPONSE_BYTES) -> Window:
    """Raises MetricsUnavailable (with a reason for the condition) when Prometheus or the series are
    missing. ``new_instances``: engines (host:port) that started inside the window. ``runtime``
    vllm reads vLLM's own series (``vllm:*``) instead of kvtune's. ``timeout_s`` is the query's total
    deadline, ``max_bytes`` its response's cap."""
    pattern, anchor = RUNTIME_SERIES[runtime]
    family = "vllm:*" if runtime == "vllm" else "kvtune_*"
    selector = f'{{__name__=~"{pattern}",namespace="{namespace}",inference_deployment="{name}"}}'
    try:
        series = query(url, f"{selector}[{max(1, int(window_s))}s]", timeout_s=timeout_s, max_bytes=max_bytes)
    except (QueryFailed, ValueError) as e:  # refused, timed out, HTTP error: all mean "no metrics now"
        raise MetricsUnavailable("PrometheusUnreachable", f"cannot query Prometheus at {url}: {e}") from None
    if not series:
        raise MetricsUnavailable(
            "NoSeries", f"Prometheus at {url} has no {family} series for {namespace}/{name} "
            f"in the last {int(window_s)}s: is the engine scraped (PodMonitor) and running?")
    try:
        figures, instances = window_figures(series, max(1, int(window_s)), new_instances)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise MetricsUnavailable("PrometheusUnreachable", f"cannot query Prometheus at {url}: the answer is not "
                                 "a range of samples") from None
    if figures.get(anchor) is None:
        raise MetricsUnavailable("IncompleteSeries", f"the series of {namespace}/{name} lack {anchor}")
    share = coverage(series, max(1, int(window_s)), new_instances, name=anchor)
    if share < MIN_COVERAGE:
        raise MetricsUnavailable(
            "IncompleteWindow", f"Prometheus scraped the engines of {namespace}/{name} for only {share:.0%} of the "
            f"last {int(window_s)}s (at least {MIN_COVERAGE:.0%} is needed to judge a window): no decision and no "
            "verdict on partial data; waiting for a fuller window")
    return Window(figures, instances, window_s, series)
