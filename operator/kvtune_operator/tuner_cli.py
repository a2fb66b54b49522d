"""`kvtune tune` (the tuner's loop on a trace, in the simulator) and `kvtune diagnose` (a live engine).

Both print one sentence a user understands first; ``--json`` prints one JSON object instead.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, NoReturn

import click

from kvtune_engine.config import ConfigError


def _fail(msg: str) -> NoReturn:
    raise click.ClickException(msg)


# ------------------------------------------------------------------------------------------------
# kvtune diagnose --url


def _failed(url: str, e: Exception) -> NoReturn:
    """An EngineError as the command's one error line (its message never holds a response body)."""
    _fail(f"the engine at {url} answered {e}" if getattr(e, "status", None) is not None
          else f"cannot reach the engine at {url}: {e}")


def read_engine(url: str, *, window_s: float = 0.0, samples: int = 4, trace_limit: int = 2000,
                slo_ttft_s: float | None = None, slo_tpot_s: float | None = None, timeout_s: float = 10.0,
                admin_key: str | None = None, assume: Any = None):
    """Observation of a live engine: its /metrics (one scrape, or several over ``window_s``),
    /kvtune/v1/state and the recent trace. Window 0: counters since the engine started, gauges now.
    ``admin_key``: the engine's --admin-key (its admin API answers nothing else but loopback).
    A vLLM server (its /metrics has vllm: series only) is read from /metrics alone: returns a
    `VllmReading` (``.observation``, ``.assumed``) instead of an Observation; ``assume``: the
    `VllmAssumptions` for what vLLM does not export."""
    from .engine_client import EngineClient, EngineError
    from .tuner.observation import MetricFigures, Observation
    from .tuner import vllm_steps
    from .tuner.vllm_observation import VllmAssumptions, is_vllm, prompt_tokens_mean, read_vllm, samples_of_scrapes

    engine = EngineClient(url, admin_key=admin_key, deadline_s=timeout_s)
    try:
        answered: list[float] = []

        def scrape() -> MetricFigures:
            figures = MetricFigures.from_prometheus_text(engine.metrics_text())
            answered.append(time.monotonic())
            return figures
        started = time.monotonic()
        first = scrape()
        if is_vllm(first):
            # a gauge seen a few times is a poor sample of the queue: scrape each second at least
            scrapes, measured = _scrape_window(scrape, first, started, window_s,
                                               max(1, samples, int(window_s)) if window_s > 0 else 0)
            figs = MetricFigures.over_scrapes(scrapes)
            win = measured if window_s > 0 else _vllm_uptime(first)
            reading = read_vllm(figs, samples_of_scrapes(scrapes)[1:] or samples_of_scrapes(scrapes), window_s=win,
                                assume=assume or VllmAssumptions(), slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
            # its step costs and frontend time, as the operator reads them from Prometheus
            steps = vllm_steps.step_samples([vllm_steps.Scrape.of(t - answered[0], f) for t, f in zip(answered, scrapes)],
                                            reading.observation.config.max_num_batched_tokens, prompt_tokens_mean(figs))
            return dataclasses.replace(reading, observation=reading.observation.with_(
                step_samples=tuple(steps), frontend_s=vllm_steps.frontend_s(figs, steps)))
        state0 = engine.state()
        scrapes, measured = _scrape_window(scrape, first, started, window_s, max(1, samples) if window_s > 0 else 0)
        state = engine.state()
        since = state0.uptime_s if window_s > 0 and state0.uptime_s else None
        trace = engine.trace(limit=trace_limit, since_s=since).requests
    except EngineError as e:
        _failed(url, e)
    figs = MetricFigures.over_scrapes(scrapes)
    win = measured if window_s > 0 else state.uptime_s
    return Observation.from_metrics(figs, state=state.raw, trace=trace or None, window_s=win,
                                    slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)


def _scrape_window(scrape: Any, first: Any, started: float, window_s: float, n: int) -> tuple[list, float]:
    """``first`` and ``n`` more scrapes due at even times over ``window_s``, and the seconds they
    really span. A busy server answers /metrics late: sleeping a fixed interval after each answer
    stretched an 8 s window to 24 s, and its rates (counted over 8 s) came out 3x too high. A scrape's
    figures are the server's as it answered, so the span runs from the first answer to the last (from
    the first request, a slow server's rates came out a first answer's delay too low)."""
    scrapes, first_answer = [first], time.monotonic()
    for i in range(1, n + 1):
        time.sleep(max(0.0, started + window_s * i / n - time.monotonic()))
        scrapes.append(scrape())
    return scrapes, time.monotonic() - first_answer if n else 0.0


def _vllm_uptime(figs: Any) -> float:
    """Seconds since vLLM's counters started (their _created timestamps), for a one-scrape window."""
    created = [v for (n, _), v in figs.values.items() if n.startswith("vllm:") and n.endswith("_created")]
    return max(1.0, time.time() - min(created)) if created else 0.0


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
@click.option("--url", required=True, help="The engine's base URL, e.g. http://127.0.0.1:8000 (kvtune or vLLM).")
@click.option("--window", "window_s", type=float, default=10.0, show_default=True,
              help="Observe this many seconds (several scrapes; counters as increases, gauges averaged). "
                   "0: one scrape, counters since the engine started and gauges as they are now.")
@click.option("--slo-ttft", type=float, default=None, help="TTFT target (s) for the goodput estimate.")
@click.option("--slo-tpot", type=float, default=None, help="TPOT target (s) for the goodput estimate.")
@click.option("--admin-key", envvar="KVTUNE_ADMIN_KEY", default=None,
              help="The engine's admin key (default: $KVTUNE_ADMIN_KEY; in a cluster, the Secret <name>-admin-key). "
                   "Not needed on loopback when the engine has none.")
@click.option("--assume-max-num-seqs", type=click.IntRange(min=1), default=None,
              help="vLLM only: the server's --max-num-seqs (vLLM does not export it; default: inferred from "
                   "the window's running plateau while requests wait, or not enough evidence).")
@click.option("--assume-max-num-batched-tokens", type=click.IntRange(min=1), default=None,
              help="vLLM only: the server's --max-num-batched-tokens (default: inferred from the steps' tokens "
                   "when a prompt was chunked).")
@click.option("--assume-max-model-len", type=click.IntRange(min=2), default=None,
              help="vLLM only: the server's --max-model-len (default: from cache_config_info).")
@click.option("--assume-device-memory", "assume_device_gib", type=click.FloatRange(min=0, min_open=True),
              default=None, help="vLLM only: device memory, GiB (lets the diagnosis size gpu-memory-utilization).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds each answer of the engine may take (a server busy with the very queue being "
                   "diagnosed can take seconds to render /metrics).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def diagnose_cmd(url: str, window_s: float, slo_ttft: float | None, slo_tpot: float | None, admin_key: str | None,
                 assume_max_num_seqs: int | None, assume_max_num_batched_tokens: int | None,
                 assume_max_model_len: int | None, assume_device_gib: float | None, timeout_s: float,
                 as_json: bool) -> None:
    """Why do requests wait on a live engine? Reads its /metrics and /kvtune/v1/state; on vLLM, its
    /metrics alone, with what vLLM does not export taken from the --assume-* flags or inferred from the
    window (and said so, with the evidence); too little evidence is said, not guessed."""
    from .tuner.diagnose import diagnose
    from .tuner.vllm_observation import VllmAssumptions, VllmReading, assumed_text, diagnose_reading

    if window_s < 0:
        _fail("--window must be >= 0 seconds")
    assume = VllmAssumptions(max_num_seqs=assume_max_num_seqs, max_num_batched_tokens=assume_max_num_batched_tokens,
                             max_model_len=assume_max_model_len, device_memory_gib=assume_device_gib,
                             given_by="--assume flag")
    read = read_engine(url, window_s=window_s, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot, admin_key=admin_key,
                       timeout_s=timeout_s,
                       assume=assume)
    reading = read if isinstance(read, VllmReading) else None
    obs = reading.observation if reading else read
    d = diagnose_reading(reading) if reading else diagnose(obs)
    if as_json:
        out = {"url": url, "engine": "vllm" if reading else "kvtune", "diagnosis": d.to_dict(),
               "observation": observation_dict(obs)}
        if reading:
            out["assumed"] = dict(reading.assumed)
            out["unknown"] = dict(reading.unknown)
            out["unexplained_share"] = round(reading.unexplained_share, 4)
            out["lengths_from"] = "synthesized from vLLM's length histograms"
        click.echo(json.dumps(out, default=_json_default))
        return
    click.echo(f"{d.cause}: {d.message}")
    share = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(obs.waiting_cause_share.items(), key=lambda kv: -kv[1])
                      if v > 0) or "none"
    click.echo(f"  KV usage {100 * obs.kv_usage_mean:.0f}% of {obs.num_blocks} blocks, "
               f"running {obs.running_mean:.0f} / max {obs.config.max_num_seqs}, waiting {obs.waiting_mean:.0f}")
    if reading:
        if reading.unexplained_share > 0:
            share += f"; unexplained {100 * reading.unexplained_share:.0f}%"
        click.echo(f"  queue head blocked by (share of samples, from vLLM's gauges): {share}")
        click.echo(f"  preemptions (recompute): {obs.preemptions_recompute}; p50/p99 queue time "
                   f"{obs.queue_time_p50_s:.2f}/{obs.queue_time_p99_s:.2f}s; prefix hit rate "
                   + ("n/a" if obs.prefix_cache_hit_rate is None else f"{100 * obs.prefix_cache_hit_rate:.0f}%"))
        click.echo(f"  vLLM does not export these; inferred or assumed: {assumed_text(reading.assumed)}")
        return
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


# ------------------------------------------------------------------------------------------------
# kvtune tune


#: the rows of `kvtune tune`'s comparison, named as vLLM's benchmarks name them (ttft, tpot, request goodput)
_ROW_KEYS = (("req goodput", "goodput_requests_per_s", "{:.3g} req/s"),
             ("throughput", "output_tokens_per_s", "{:.0f} tok/s"),
             ("ttft p99", "ttft_p99_s", "{:.3g} s"),
             ("tpot p99", "tpot_p99_s", "{:.3g} s"),
             ("queue p99", "queue_time_p99_s", "{:.3g} s"),
             ("KV usage", "kv_usage_mean", "{:.0%}"))


def _pre(s: dict) -> str:
    p = s.get("preemptions") or {}
    return f"{p.get('swap', 0)} swap, {p.get('recompute', 0)} recompute ({p.get('swap_full', 0)} swap full)"


def _camel_flags(changes: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')}" if v is True else f"--no-{k.replace('_', '-')}" if v is False
                    else f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
                    for k, v in changes.items())


def _tune_options(f):
    from kvtune_engine.flags import engine_options

    f = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")(f)
    f = click.option("--report", "report_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
                     help="Also write DIR/report.html, report.png, inferencedeployment.yaml: the predicted "
                          "candidates, the chosen config's effect and margins, and the YAML that applies it.")(f)
    f = click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True,
                     help="Most restart-requiring changes (block size, memory, swap) in all.")(f)
    f = click.option("--rounds", type=click.IntRange(min=1, max=20), default=5, show_default=True,
                     help="Rounds of the loop (each replays the trace under the config in force).")(f)
    f = click.option("--bounds", "bounds", multiple=True, metavar="KNOB=LO:HI|V1,V2",
                     help="Limit a knob, e.g. max-num-seqs=32:512, block-size=16,32, "
                          "gpu-memory-utilization=0.85:0.95, enable-chunked-prefill=true (repeatable).")(f)
    f = click.option("--slo-tpot", type=float, default=None, metavar="S", help="SLO on time per output token, s.")(f)
    f = click.option("--slo-ttft", type=float, default=None, metavar="S", help="SLO on time to first token, s.")(f)
    f = engine_options(f)
    f = click.option("--profile", "profile_name", required=True, metavar="NAME|FILE",
                     help="Cost profile: h200-qwen3-0.6b, a100-llama3-8b, l20-qwen3-8b, cpu-tiny, or a JSON file.")(f)
    f = click.option("--trace", "trace_file", required=True, metavar="FILE",
                     help="JSONL request trace (e.g. the engine's /kvtune/v1/trace?format=jsonl).")(f)
    return f


def tune_trace(trace: list, start: Any, profile: Any, *, slo_ttft: float | None = None, slo_tpot: float | None = None,
               bounds: Any = None, rounds: int = 5, max_restarts: int = 3) -> dict[str, Any]:
    """The tuner's loop on one trace in the simulator (each round replays the whole trace under the
    config in force, as the operator would over successive windows). Returns the JSON result."""
    from kvtune_engine.sim.simulator import SLO, simulate

    from .tuner.candidates import Bounds
    from .tuner.decide import Objectives, knob_changes
    from .tuner.diagnose import diagnose
    from .tuner.loop import TunerSettings, simulate_loop
    from .tuner.observation import Observation

    b = bounds or Bounds()
    objectives = Objectives(slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot, cooldown_s=0.0, max_restarts=max_restarts)
    settings = TunerSettings(bounds=b, objectives=objectives)
    run = simulate_loop([trace] * rounds, start, profile, settings, window_s=60.0, fit_costs=False)
    slo = SLO(slo_ttft, slo_tpot)
    baseline = run.windows[0].measured if run.windows else simulate(trace, start, profile, slo)
    final = run.final
    predicted = simulate(trace, final, profile, slo) if final != start else baseline
    diag = run.windows[0].round.diagnosis if run.windows else diagnose(
        Observation.from_sim_summary(baseline, trace=trace), bounds=b)
    changes = knob_changes(start, final)
    steps = []
    for w in run.windows:
        r = w.round
        e: dict[str, Any] = {"round": w.index, "cause": r.diagnosis.cause, "message": r.diagnosis.message,
                             "measured_goodput_requests_per_s": w.measured.get("goodput_requests_per_s")}
        if r.verdict is not None:
            e["verdict"] = {"keep": r.verdict.keep, "reason": r.verdict.reason}
        if r.decision is not None:
            e["decision"] = {"action": r.decision.action, "changes": {k.replace("_", "-"): v for k, v in
                                                                     r.decision.changes.items()},
                             "restart": r.decision.restart, "reason": r.decision.reason,
                             "candidates": r.decision.considered}
        if r.note:
            e["note"] = r.note
        steps.append(e)
    return {
        "recommended": {k.replace("_", "-"): v for k, v in changes.items()},
        "restart_required": bool(start.restart_changes(final)),
        "config": final.as_flags(),
        "current": start.as_flags(),
        "diagnosis": diag.to_dict(),
        "baseline": baseline,
        "predicted": predicted,
        "restarts": run.restarts,
        "rounds": steps,
        "bounds": b.to_dict(),
        "profile": profile.name,
    }


def _report(report_dir: str, out: dict[str, Any], trace: list, start: Any, profile: Any, slo_ttft: float | None,
            slo_tpot: float | None, bounds: Any) -> None:
    """`--report DIR` (tuner_report.py): the files, then one stderr line naming them."""
    from kvtune_engine.config import EngineConfig
    from kvtune_engine.sim.simulator import SLO

    from .tuner_report import write_report

    chosen = EngineConfig.model_validate({k.replace("-", "_"): v for k, v in out["config"].items()})
    try:
        files = write_report(report_dir, out, trace, start, chosen, profile, SLO(slo_ttft, slo_tpot), bounds)
    except ImportError as e:
        _fail(f"--report needs matplotlib (pip install 'kvtune[engine]'): {e}")
    except OSError as e:
        _fail(f"--report {report_dir}: {e.strerror or e}")
    click.echo(f"report: {files['html']} ({files['png'].name}, {files['yaml'].name})", err=True)


@click.command("tune", context_settings={"help_option_names": ["-h", "--help"]})
@_tune_options
def tune_cmd(trace_file: str, profile_name: str, slo_ttft: float | None, slo_tpot: float | None,
             bounds: tuple[str, ...], rounds: int, max_restarts: int, as_json: bool, report_dir: str | None,
             **flags: Any) -> None:
    """Recommend engine flags for a request trace: diagnose, predict candidates in the simulator,
    choose, and repeat as the operator would (same loop), within --bounds."""
    from kvtune_engine.flags import engine_config
    from kvtune_engine.sim.cli import sim_inputs

    from .tuner.candidates import Bounds

    start = engine_config(flags)
    try:
        b = Bounds.parse(list(bounds)) if bounds else Bounds()
    except ConfigError as e:
        raise click.UsageError(f"--bounds: {str(e).removeprefix('bounds: ')}") from None
    profile, trace = sim_inputs(trace_file, profile_name, slo_ttft, slo_tpot)
    try:
        profile.kv_cache_size(start)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    out = tune_trace(trace, start, profile, slo_ttft=slo_ttft, slo_tpot=slo_tpot, bounds=b, rounds=rounds,
                     max_restarts=max_restarts)
    if report_dir is not None:
        _report(report_dir, out, trace, start, profile, slo_ttft, slo_tpot, b)
    if as_json:
        click.echo(json.dumps(out, default=_json_default))
        return
    d = out["diagnosis"]
    click.echo(f"{d['cause']}: {d['message']}")
    for e in out["rounds"]:
        dec = e.get("decision")
        if e.get("verdict") and not e["verdict"]["keep"]:
            click.echo(f"  round {e['round']}: {e['verdict']['reason']}")
        if dec and dec["action"] == "change":
            ch = ", ".join(f"{k} {v}" for k, v in dec["changes"].items())
            click.echo(f"  round {e['round']}: {e['cause']} -> set {ch} ({dec['reason']})")
        elif dec:
            click.echo(f"  round {e['round']}: {e['cause']}: keep ({dec['reason']})")
        elif e.get("note"):
            click.echo(f"  round {e['round']}: {e['cause']}: {e['note']}")
    rec = out["recommended"]
    if not rec:
        click.echo("Recommended: keep the current flags (nothing predicted to be clearly better).")
        return
    click.echo("Recommended: " + _camel_flags({k.replace("-", "_"): v for k, v in rec.items()})
               + ("  (needs a restart)" if out["restart_required"] else "  (live: no restart needed)"))
    base, pred = out["baseline"], out["predicted"]
    click.echo(f"  {'':12} {'now':>16} {'predicted':>16}")
    for label, key, fmt in _ROW_KEYS:
        a, b2 = base.get(key), pred.get(key)
        fa = fmt.format(a) if a is not None else "-"
        fb = fmt.format(b2) if b2 is not None else "-"
        click.echo(f"  {label:12} {fa:>16} {fb:>16}")
    click.echo(f"  {'preemptions':12} {_pre(base):>16}  ->  {_pre(pred)}")
