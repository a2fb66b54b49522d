"""The I/O half of a tuning round for ``spec.runtime: vllm``: vLLM's own series from Prometheus.

vLLM has no admin API, no recorded trace and no step log, so the round reads only what Prometheus
scraped: the window figures, the gauges sample by sample (to put each capacity wait down to a limit,
see `tuner.vllm_observation`), and a trace synthesized from the length histograms and the request
rate. The knobs vLLM does not export come from the config the operator put on its command line;
the knobs it does export (cache_config_info: block size, memory utilization, prefix caching) are
read back, so a window of pods still running older knobs is seen as such.
"""
from __future__ import annotations

import time
from typing import Any

from kvtune_engine.config import EngineConfig

from .prometheus import QUERY_DEADLINE_S, MetricsUnavailable, read_window, window_figures
from .tuner.observation import Observation, StepSample
from .tuner.vllm_drift import drift
from .tuner import vllm_steps
from .tuner.vllm_observation import GaugeSample, VllmAssumptions, prompt_tokens_mean, read_vllm
from .tuner.vllm_steps import scrapes_of_series

#: the knobs vLLM's metrics show (cache_config_info); the others are the rendered command line's
READ_BACK = ("block_size", "gpu_memory_utilization", "enable_prefix_caching")


def gauge_samples(series: list[dict[str, Any]]) -> list[GaugeSample]:
    """Per replica and scrape: running, waiting for capacity, KV usage, preemptions since the last."""
    per: dict[str, dict[str, dict[float, float]]] = {}
    for s in series:
        m = s["metric"]
        name = m.get("__name__")
        if name == "vllm:num_requests_waiting_by_reason" and m.get("reason") != "capacity":
            continue
        inst = m.get("instance", "")
        per.setdefault(inst, {}).setdefault(name, {}).update({float(t): float(v) for t, v in s["values"]})
    out: list[GaugeSample] = []
    for inst, by in per.items():
        running = by.get("vllm:num_requests_running", {})
        waiting = by.get("vllm:num_requests_waiting_by_reason") or by.get("vllm:num_requests_waiting", {})
        usage = by.get("vllm:kv_cache_usage_perc", {})
        pre = by.get("vllm:num_preemptions_total", {})
        prev = None
        for t in sorted(running):
            p = pre.get(t)
            out.append(GaugeSample(running=running[t], waiting=waiting.get(t, 0.0), kv_usage=usage.get(t, 0.0),
                                   preempted=max(0.0, p - prev) if p is not None and prev is not None else 0.0,
                                   replica=inst))
            prev = p if p is not None else prev
    return out


def step_samples(series: list[dict[str, Any]], budget: int, prompt_tokens_mean: float = 0.0) -> list[StepSample]:
    """Each engine's interval and prefill samples from its scrapes in Prometheus (`tuner.vllm_steps`)."""
    return [x for scrapes in scrapes_of_series(series) for x in vllm_steps.step_samples(scrapes, budget, prompt_tokens_mean)]


def _engines_changed(series: list[dict[str, Any]], window: float, now: float) -> tuple[float | None, list[str]]:
    """(when, engines new since): the last change inside the window of the vLLM engines Prometheus
    scrapes, as a new engine's first scrape (it serves from then on: vLLM answers /metrics once ready,
    a minute or more after its process started) or a gone engine's last (the old pods of a rollout);
    None when the same engines were scraped all along. No earlier window is the running engines'."""
    spans: dict[str, tuple[float, float]] = {}
    gaps: list[float] = []
    for s in series:
        if s["metric"].get("__name__") == "vllm:num_requests_running" and s.get("values"):
            ts = [float(t) for t, _ in s["values"]]
            gaps += [b - a for a, b in zip(ts, ts[1:]) if b > a]
            a, b = spans.get(s["metric"].get("instance", ""), (ts[0], ts[-1]))
            spans[s["metric"].get("instance", "")] = (min(a, ts[0]), max(b, ts[-1]))
    if not gaps:
        return None, []
    slack = 2 * sorted(gaps)[len(gaps) // 2]  # two scrape intervals
    marks = [a for a, _ in spans.values() if a > now - window + slack] + [b for _, b in spans.values() if b < now - slack]
    if not marks:
        return None, []
    at = max(marks)
    return at, sorted(i for i, (a, b) in spans.items() if a >= at - slack and b >= now - slack)


def command_line(config: EngineConfig) -> VllmAssumptions:
    """What vLLM does not export, from the config the operator put on its pods' command line."""
    return VllmAssumptions(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                           max_model_len=config.max_model_len, given_by="the pods' command line")


def pod_reading(series: list[dict[str, Any]], window_s: float, config: EngineConfig, slo_ttft_s: float | None,
                slo_tpot_s: float | None) -> tuple[Observation, float]:
    """One vLLM pod's window from its own series (a canary's, or a control's): the deployment's reading
    of a window, and the requests that ended in an abort or an error."""
    f, _ = window_figures(series, window_s)
    obs = read_vllm(f, gauge_samples(series), window_s=window_s, assume=command_line(config),
                    slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s).observation
    return obs, sum(f.get("vllm:request_success_total", finished_reason=r) or 0.0 for r in ("abort", "error"))


def gather_vllm(plan: Any, namespace: str, name: str, config: EngineConfig, window: float, *,
                slo_ttft_s: float | None = None, slo_tpot_s: float | None = None, timeout_s: float = QUERY_DEADLINE_S,
                now: float | None = None, left_to_engine: frozenset[str] = frozenset()):
    """(Observation, synthesized trace, window, series, drift) of the vLLM pods of one
    InferenceDeployment: ``series`` the window's as Prometheus returned them (per pod), ``drift`` the
    findings where their cache_config_info contradicts ``config``, the knobs on their command line
    (``left_to_engine``: the knobs not on it), see `tuner.vllm_drift`.

    No window that spans a change of the engines is judged: after a rollout the tuner waits for a
    whole window of the new engines alone. A new vLLM's first seconds of serving (its first batches,
    the queue that waited for the rollout arriving at once) are no measure of its knobs: judged on
    the 10-15 s after it came up, a change that raised goodput 6x in its steady state was rolled back
    as "goodput fell 92%"."""
    w = read_window(plan.prometheus_url, namespace, name, window, timeout_s=timeout_s, runtime="vllm")
    now = time.time() if now is None else now
    at, new = _engines_changed(w.series or [], window, now)
    if at is not None and now - at < window:
        raise MetricsUnavailable("WindowTooShort", f"the vLLM engines changed {now - at:.0f}s ago "
                                 f"({', '.join(new) or 'an engine left'}); waiting for a whole {window:.0f}s "
                                 "window of theirs")
    reading = read_vllm(w.figures, gauge_samples(w.series or []), window_s=window, assume=command_line(config),
                        slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
    seen = reading.observation.config
    obs_config = config.with_changes(**{k: getattr(seen, k) for k in READ_BACK})
    samples = step_samples(w.series or [], seen.max_num_batched_tokens, prompt_tokens_mean(w.figures))
    obs = reading.observation.with_(config=obs_config, step_samples=tuple(samples),
                                    frontend_s=vllm_steps.frontend_s(w.figures, samples))
    infos = {tuple(sorted(s["metric"].items())) for s in w.series or []
             if s["metric"].get("__name__") == "vllm:cache_config_info"}
    return obs, reading.trace, window, w.series or [], drift([dict(i) for i in sorted(infos)], config, left_to_engine)
