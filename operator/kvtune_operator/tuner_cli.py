"""`kvtune tune` (the tuner's loop on a trace, in the simulator) and `kvtune diagnose` (a live engine).

Both print one sentence a user understands first; ``--json`` prints one JSON object instead.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from kvtune_engine.config import ConfigError


def _fail(msg: str) -> None:
    raise click.ClickException(msg)


# ------------------------------------------------------------------------------------------------
# kvtune diagnose --url


def _get(client: Any, url: str, path: str, **params: Any) -> Any:
    import httpx

    try:
        r = client.get(url.rstrip("/") + path, params=params or None)
    except httpx.HTTPError as e:
        _fail(f"cannot reach the engine at {url}: {e}")
    if r.status_code != 200:
        _fail(f"{url}{path} answered HTTP {r.status_code}: {r.text[:200]}")
    return r


def read_engine(url: str, *, window_s: float = 0.0, samples: int = 4, trace_limit: int = 2000,
                slo_ttft_s: float | None = None, slo_tpot_s: float | None = None, timeout_s: float = 10.0):
    """Observation of a live engine: its /metrics (one scrape, or several over ``window_s``),
    /kvtune/v1/state and the recent trace. Window 0: counters since the engine started, gauges now."""
    import httpx

    from .tuner.observation import MetricFigures, Observation

    with httpx.Client(timeout=timeout_s) as client:
        scrapes = [MetricFigures.from_prometheus_text(_get(client, url, "/metrics").text)]
        state0 = _get(client, url, "/kvtune/v1/state").json()
        if window_s > 0:
            n = max(1, samples)
            for _ in range(n):
                time.sleep(window_s / n)
                scrapes.append(MetricFigures.from_prometheus_text(_get(client, url, "/metrics").text))
        state = _get(client, url, "/kvtune/v1/state").json()
        since = None
        if window_s > 0:
            since = float(state0.get("uptime_s", 0.0) or 0.0)
        tr = _get(client, url, "/kvtune/v1/trace", limit=trace_limit, **({"since_s": since} if since else {}))
        trace = tr.json().get("requests", [])
    figs = MetricFigures.over_scrapes(scrapes)
    win = window_s if window_s > 0 else float(state.get("uptime_s", 0.0) or 0.0)
    return Observation.from_metrics(figs, state=state, trace=trace or None, window_s=win,
                                    slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)


def observation_dict(obs: Any) -> dict[str, Any]:
    """The observation's figures as plain JSON (config in vLLM flag names)."""
    from dataclasses import asdict

    d = {k: v for k, v in asdict(obs).items() if k not in ("summary", "step_samples", "config", "lengths")}
    d["config"] = obs.config.as_flags()
    if obs.lengths is not None:
        ld = asdict(obs.lengths)
        ld.pop("totals", None)
        d["lengths"] = ld
    return d


@click.command("diagnose")
@click.option("--url", required=True, help="The engine's base URL, e.g. http://127.0.0.1:8000.")
@click.option("--window", "window_s", type=float, default=0.0, show_default=True,
              help="Observe this many seconds (several scrapes; counters as increases, gauges averaged). "
                   "0: one scrape, counters since the engine started.")
@click.option("--slo-ttft", type=float, default=None, help="TTFT target (s) for the goodput estimate.")
@click.option("--slo-tpot", type=float, default=None, help="TPOT target (s) for the goodput estimate.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def diagnose_cmd(url: str, window_s: float, slo_ttft: float | None, slo_tpot: float | None, as_json: bool) -> None:
    """Why do requests wait on a live engine? Reads its /metrics and /kvtune/v1/state."""
    from .tuner.diagnose import diagnose

    if window_s < 0:
        _fail("--window must be >= 0 seconds")
    obs = read_engine(url, window_s=window_s, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot)
    d = diagnose(obs)
    if as_json:
        click.echo(json.dumps({"url": url, "diagnosis": d.to_dict(), "observation": observation_dict(obs)},
                              default=_json_default))
        return
    click.echo(f"{d.cause}: {d.message}")
    share = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(obs.waiting_cause_share.items(), key=lambda kv: -kv[1])
                      if v > 0) or "none"
    click.echo(f"  KV usage {100 * obs.kv_usage_mean:.0f}% of {obs.num_blocks} blocks, "
               f"running {obs.running_mean:.0f} / max {obs.config.max_num_seqs}, waiting {obs.waiting_mean:.0f}")
    click.echo(f"  queue head blocked by: {share}")
    click.echo(f"  preemptions: swap {obs.preemptions_swap}, recompute {obs.preemptions_recompute}, "
               f"swap full {obs.swap_full}; internal fragmentation {100 * obs.internal_fragmentation_mean:.0f}%")


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if hasattr(x, "model_dump"):
        return x.model_dump()
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    return str(x)
