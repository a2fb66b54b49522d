"""Simulator fidelity: predicted vs measured, the real engine on CPU against the simulator.

For each case (an engine config and a trace):

* measured: a real ``kvtune serve`` (the demo's tiny random Llama on CPU, standing in for a device
  of 0.25 GiB as the demo does) replays the trace over HTTP in real time (arrival times honoured;
  token-id prompts with ``ignore_eos``, so every request has exactly the trace's shape; requests of
  a prefix group share their first ``prefix_tokens`` tokens). Throughput is the output tokens over
  the span from the first arrival to the end of the last step (the engine's trace and step log);
  queue time comes from the engine's ``/metrics`` histogram (median by Prometheus'
  ``histogram_quantile``, mean exact from ``_sum / _count``);
* predicted: what the tuner does. The engine's own trace (``/kvtune/v1/trace``), memory figures
  (``/metrics``, ``/kvtune/v1/state``) and step log (``/kvtune/v1/steps``, polled during the run so
  no step falls out of its ring) make an ``Observation``; ``predict.fitted`` fits the step costs and
  builds the profile; ``simulate`` replays the trace under the same config. The simulated queue
  times are put in the engine's histogram buckets and read back the same way, so both medians are
  the figure the tuner compares.

Prints predicted, measured and the relative error per case, then the median error of each figure.
Goal (issue 5 section 6): <= 10% error on throughput and on median queue time. A median queue
time below 10 ms (an engine that is not queueing) has no meaningful relative error: the table
shows both values and leaves it out of the median.

Before the window the engine is warmed up (a few requests of assorted lengths: a fresh process's
first forwards are several times slower); the window's figures are the /metrics difference, the trace
and the steps after it. The warm-up's second pass also gives the machine's "speed" (1.0: usual), printed
per case: the box is shared and its speed swings by 2x over minutes.

What the simulator needed (see the commit log): the step's wall time, not only its `duration_s` -- the
gap between steps (the loop handing outputs to the server, new requests, the server's threads and
other processes taking the CPU) is 10-20% of the busy time on 2 cores (`fit.samples_from_engine_steps`
now adds it); and, for queue time, the engine's server stamping a request's arrival when the HTTP
request arrives, not when the engine loop next takes it in (fixed in the engine); and the machine's speed
over the run. With one fitted cost model the residual is not per-step noise that cancels: windows of
2 s ran at 0.84-1.24x the fit within one run (RMS 7-8% over ~65 windows a run, where a window's own
noise from ~300 steps is ~2%; seqs2-short in one run: 0.81-0.95 for its first 6 s, 1.1-1.3 near its
end). It follows nothing visible inside the machine: in two runs where other processes took 0.01
cores on average (the "others' CPU" figure per case, from /proc), the window factors correlated with
neither the arrivals per second, the client's CPU, the other processes' CPU nor the engine's own CPU
(|r| <= 0.21 over 42 windows); the machine (a VM on a shared host) just runs faster and slower. A slow
stretch builds a queue that a simulator stepping at the fitted mean does not have, and a fast one the
reverse, which moved the queue-time error by 10-40% either way from run to run. The fitted
profile now carries that speed, window by window, measured from the same step log
(`fit.speed_timeline`, `Profile.speed`): the tuner replays a window on the machine as it was. What the
step log says the machine did is an input; the queue times are not (they come from the histogram), so
the scheduler still has to produce them. The "steady" column is the same prediction without the
timeline. What is left unmodelled: steps in which a request arrives run 15-25% longer than the fit
(the server parsing it, ~1 ms a request), 1-3% of the busy time while requests arrive.

Runtime: ~15-30 s per case (engine start, warm-up, the trace, the drain); about 3 minutes on 2 cores.
`--fit-profile` also fits one step-cost model to all cases' steps pooled (how `cpu-tiny` was made).

    python bench/sim_fidelity.py [--only NAME[,NAME]] [--json out.json] [--keep DIR] [--fit-details]
                                 [--fit-profile] [--replay]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvtune_engine.config import EngineConfig
from kvtune_engine.metrics import QUEUE_TIME_BUCKETS
from kvtune_engine.quantile import bucket_counts, bucket_quantile
from kvtune_engine.sim.scenarios import mix
from kvtune_engine.sim.simulator import simulate
from kvtune_engine.sim.trace import TraceRequest
from kvtune_operator.demo import ensure_model
from kvtune_operator.demo.engine import EngineProcess
from kvtune_operator.demo.load import LoadGenerator
from kvtune_operator.demo.session import DEVICE_MEMORY_GIB, MODEL_SHAPE
from kvtune_operator.tuner.fit import fit_step_cost, samples_from_engine_steps
from kvtune_operator.tuner.observation import MetricFigures, Observation
from kvtune_operator.tuner.predict import as_trace, fitted

#: the warm-up's second pass on the 2-core dev box at its usual speed: "speed" in the log is this over
#: the pass's wall time now (the machine is shared; its speed swings by 2x over minutes)
REFERENCE_WARM_S = 0.60
QUEUE_FLOOR_S = 0.010   # below this a median queue time is "not queueing": no relative error

BASE = dict(max_model_len=1024, max_num_batched_tokens=1024, swap_space=0.0, gpu_memory_utilization=0.9)

TRACES: dict[str, dict[str, Any]] = {
    # short prompts and outputs, a steady stream
    "short": dict(rate=10.0, prompt_mean=64, output_mean=48),
    # longer prompts: prefill matters, the KV cache fills
    "long": dict(rate=3.5, prompt_mean=256, output_mean=64),
    # 70% of the requests carry one of 3 shared system prompts of 192 tokens
    "prefix": dict(rate=8.0, prompt_mean=48, output_mean=32, prefix_groups=3,
                   prefix_tokens=192, prefix_share=0.7),
}


@dataclass
class Case:
    name: str
    flags: dict[str, Any]       # engine flags over BASE (EngineConfig fields)
    trace: str                  # one of TRACES
    rate: float | None = None   # requests/s instead of the trace's
    seconds: float = 18.0       # of arrivals: requests = rate * seconds


CASES = [
    # the sequence cap binds: a long queue
    Case("seqs2-short", dict(max_num_seqs=2), "short", rate=15.0, seconds=12.0),
    Case("seqs8-short", dict(max_num_seqs=8), "short", rate=30.0, seconds=10.0),
    Case("seqs32-long", dict(max_num_seqs=32), "long"),
    # ~50 KV blocks: the KV cache binds, preemptions
    Case("seqs32-lowkv-long", dict(max_num_seqs=32, gpu_memory_utilization=0.09), "long", rate=7.0,
         seconds=14.0),
    Case("seqs8-chunk256-long", dict(max_num_seqs=8, max_num_batched_tokens=256, enable_chunked_prefill=True),
         "long", rate=5.0),
    Case("seqs8-nochunk-long", dict(max_num_seqs=8, enable_chunked_prefill=False), "long", rate=5.0),
    # shared system prompts, prefix caching on
    Case("seqs4-prefix", dict(max_num_seqs=4, enable_prefix_caching=True), "prefix", rate=12.0, seconds=15.0),
]


def make_trace(case: Case) -> list[TraceRequest]:
    spec = dict(TRACES[case.trace])
    if case.rate is not None:
        spec["rate"] = case.rate
    spec["requests"] = max(2, int(round(spec["rate"] * case.seconds)))
    return mix(prompt_sigma=0.5, output_sigma=0.5, max_tokens=600, seed=11, **spec)


def prompts_for(trace: list[TraceRequest], vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the trace's lengths; a prefix group's requests share its first tokens."""
    rng = random.Random(seed)
    groups: dict[str, list[int]] = {}
    out = []
    for r in trace:
        k = r.prefix_tokens if r.prefix_group is not None else 0
        if k:
            g = groups.setdefault(r.prefix_group, [rng.randrange(16, vocab) for _ in range(1024)])
            head = g[:k]
        else:
            head = []
        out.append(head + [rng.randrange(16, vocab) for _ in range(r.prompt_tokens - k)])
    return out


class OnePassLoad(LoadGenerator):
    """The demo's load generator, replaying the trace once (the demo loops it) with given prompts,
    and waiting for every answer."""

    def __init__(self, url: str, trace: list[TraceRequest], prompts: list[list[int]], model: str):
        super().__init__(lambda: url, trace, vocab=MODEL_SHAPE["vocab"], model=model, max_in_flight=1024)
        self.prompts = dict(zip(map(id, trace), prompts))
        self.done = threading.Event()

    def _prompt(self, n: int) -> list[int]:  # pragma: no cover - _one is overridden
        raise AssertionError

    async def _one(self, client: httpx.AsyncClient, req: TraceRequest, sem: asyncio.Semaphore) -> None:
        body = {"model": self.model, "prompt": self.prompts[id(req)], "max_tokens": req.output_tokens,
                "ignore_eos": True, "temperature": 0.0}
        async with sem:
            self.stats.sent += 1
            r = await client.post(f"{self.url()}/v1/completions", json=body)
            if r.status_code == 200:
                self.stats.ok += 1
            else:
                self.stats.failed += 1
                self.stats.errors.append(f"{r.status_code}: {r.text[:200]}")

    async def _run(self) -> None:
        # the client shares the engine's 2 cores: let the engine have them first (a real client runs
        # elsewhere), so that the engine's speed does not depend on how many requests are in flight
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass
        limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=64)
        sem = asyncio.Semaphore(self.max_in_flight)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), limits=limits) as client:
            tasks = []
            t0 = time.monotonic()
            for req in self.trace:
                delay = t0 + req.arrival_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._one(client, req, sem)))
            await asyncio.gather(*tasks, return_exceptions=True)
        self.done.set()


def bucket_median(values: list[float], bounds=QUEUE_TIME_BUCKETS) -> float:
    """The median as Prometheus' histogram_quantile reads it from the engine's buckets (an estimate)."""
    return bucket_quantile(bucket_counts(values, bounds), 0.5)


def warm_up(url: str, model: str) -> float:
    """A few requests of assorted lengths before the measured window: the first forwards of a fresh
    process (lazy imports, first allocations of each shape) are several times slower than the rest.
    Returns the machine's speed now: REFERENCE_WARM_S / the second pass's wall time."""
    rng = random.Random(1)
    with httpx.Client(timeout=120) as http:
        for rep in range(2):
            t = time.monotonic()
            for n in (8, 40, 100, 200, 300, 500):
                body = {"model": model, "prompt": [rng.randrange(16, MODEL_SHAPE["vocab"]) for _ in range(n)],
                        "max_tokens": 16, "ignore_eos": True, "temperature": 0.0}
                http.post(f"{url}/v1/completions", json=body).raise_for_status()
    return REFERENCE_WARM_S / (time.monotonic() - t)


class CpuMonitor(threading.Thread):
    """Every 0.5 s: CPU seconds used so far by the whole machine, the engine process and this one
    (Linux /proc), so a run shows how much of the 2 cores other processes took while it ran: the
    machine's speed over the run, which the fitted profile's speed timeline follows."""

    def __init__(self, pid: int, clock_offset: float):
        super().__init__(daemon=True)
        self.pid, self.offset, self.rows, self.stop = pid, clock_offset, [], threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")

    def read(self) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                v = [float(x) for x in f.readline().split()[1:]]
            with open(f"/proc/{self.pid}/stat") as f:
                e = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        busy = sum(v) - v[3] - (v[4] if len(v) > 4 else 0.0)   # all but idle and iowait
        own = os.times()
        return busy / self.tick, (float(e[11]) + float(e[12])) / self.tick, own.user + own.system

    def run(self) -> None:
        while not self.stop.wait(0.5):
            r = self.read()
            if r is not None:   # time in the engine's clock (its step log's t_s)
                self.rows.append((time.monotonic() + self.offset, *r))


def others_cpu(rows: list) -> list[tuple[float, float]]:
    """(mid-time, cores that other processes used) per monitor interval."""
    out = []
    for (ta, ma, ea, sa), (tb, mb, eb, sb) in zip(rows, rows[1:]):
        if tb > ta:
            out.append(((ta + tb) / 2, max(0.0, (mb - ma) - (eb - ea) - (sb - sa)) / (tb - ta)))
    return out


def run_engine(case: Case, model: Path, logdir: Path) -> dict[str, Any]:
    flags = {**BASE, **case.flags}
    eng = EngineProcess(model, flags, device_memory_gib=DEVICE_MEMORY_GIB, log_path=logdir / f"{case.name}.log")
    eng.start()
    steps: dict[float, dict] = {}
    try:
        with httpx.Client(timeout=30) as http:
            speed = warm_up(eng.url, model.name)
            trace = make_trace(case)
            prompts = prompts_for(trace, MODEL_SHAPE["vocab"])
            since = http.get(f"{eng.url}/kvtune/v1/state").json()["uptime_s"]
            mon = CpuMonitor(eng.proc.pid, since - time.monotonic())
            mon.start()
            metrics0 = http.get(f"{eng.url}/metrics").text

            def poll_steps() -> None:
                for s in http.get(f"{eng.url}/kvtune/v1/steps").json()["steps"]:
                    if s["t_s"] >= since:
                        steps[s["t_s"]] = s
            load = OnePassLoad(eng.url, trace, prompts, model.name)
            cpu0 = time.process_time()
            load.start()
            while not load.done.wait(4.0):  # the ring holds 4096 steps: ~10 s here
                poll_steps()
            load.stop()
            mon.stop.set()
            client_cpu = time.process_time() - cpu0
            poll_steps()
            state = http.get(f"{eng.url}/kvtune/v1/state").json()
            metrics = http.get(f"{eng.url}/metrics").text
            etrace = http.get(f"{eng.url}/kvtune/v1/trace", params={"since_s": since}).json()["requests"]
    finally:
        eng.stop()
    if load.stats.failed:
        raise RuntimeError(f"{case.name}: {load.stats.failed} requests failed: {load.stats.errors[:3]}")
    if len(etrace) != len(trace):
        raise RuntimeError(f"{case.name}: the engine traced {len(etrace)} of {len(trace)} requests")
    return {"flags": flags, "speed": speed, "client_cpu_s": client_cpu, "state": state, "metrics0": metrics0, "metrics": metrics, "trace": etrace,
            "steps": [steps[k] for k in sorted(steps)], "cpu": mon.rows}


def evaluate(case: Case, run: dict[str, Any]) -> dict[str, Any]:
    """Measured figures from the engine's own records, and the simulator's prediction."""
    steps, etrace, state = run["steps"], run["trace"], run["state"]
    figs = MetricFigures.from_prometheus_text(run["metrics"])
    if run.get("metrics0"):  # the window after the warm-up
        figs = figs.delta(MetricFigures.from_prometheus_text(run["metrics0"]))
    t_first = min(r["arrival_s"] for r in etrace)
    t_end = max(s["t_s"] + s["duration_s"] for s in steps)
    out_tokens = sum(r["output_tokens"] for r in etrace)
    q_count = figs.hist_count("kvtune_request_queue_time_seconds") or 0.0
    measured = {
        "output_tokens_per_s": out_tokens / (t_end - t_first),
        "queue_time_p50_s": figs.hist_quantile("kvtune_request_queue_time_seconds", 0.5),
        "queue_time_mean_s": (figs.hist_sum("kvtune_request_queue_time_seconds") or 0.0) / q_count if q_count else 0.0,
        "duration_s": t_end - t_first,
        "requests": len(etrace),
        "preemptions": sum(v for _, v in figs.series("kvtune_preemptions_total")),
        "num_blocks": state["num_blocks"],
    }
    # the tuner's path: observation -> fitted profile -> simulate the engine's trace
    obs = Observation.from_metrics(figs, state=state, trace=etrace, window_s=t_end - t_first).with_engine_steps(steps)
    profile, fit = fitted(obs, None, speed=True)  # no named profile, all from the window, with its speed
    cfg = EngineConfig.build(**run["flags"])
    summary = simulate(as_trace(etrace, rebase=False), cfg, profile, per_request=True)
    queues = [r["queue_s"] for r in summary["per_request"]]
    # the same without the machine's speed over the window: what a steady machine would have done
    steady = simulate(as_trace(etrace, rebase=False), cfg, fitted(obs, None, speed=False)[0], per_request=True)
    predicted = {
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "queue_time_p50_s": bucket_median(queues),
        "queue_time_p50_exact_s": summary["queue_time_p50_s"],
        "queue_time_p50_steady_s": bucket_median([r["queue_s"] for r in steady["per_request"]]),
        "output_tokens_per_s_steady": steady["output_tokens_per_s"],
        "queue_time_mean_s": sum(queues) / len(queues) if queues else 0.0,
        "duration_s": summary["duration_s"],
        "requests": summary["requests"]["finished"],
        "preemptions": sum(summary["preemptions"][k] for k in ("swap", "recompute")),
        "num_blocks": summary["num_blocks"],
    }
    return {"case": case.name, "trace": case.trace, "flags": run["flags"], "speed": run.get("speed"),
            "measured": measured,
            "predicted": predicted,
            "fit": None if fit is None else {"c0": fit.c0, "c_tok": fit.c_tok, "c_ctx": fit.c_ctx,
                                             "c_pair": fit.c_pair, "knee": fit.knee_tokens,
                                             "rel_rmse": fit.rel_rmse, "samples": fit.samples}}


def rel(p: float, m: float) -> float:
    return (p - m) / m if m else float("inf")


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    hdr = (f"{'case':<22} {'tok/s pred':>10} {'meas':>8} {'err':>7}   {'queue p50 pred':>14} {'meas':>8} {'err':>7}"
           f" {'steady':>7}   {'q mean pred':>11} {'meas':>8}   {'preempt p/m':>11} {'blocks':>6}")
    print(hdr)
    print("-" * len(hdr))
    tok_err, q_err, q_steady = [], [], []
    for r in results:
        p, m = r["predicted"], r["measured"]
        te = rel(p["output_tokens_per_s"], m["output_tokens_per_s"])
        tok_err.append(abs(te))
        if m["queue_time_p50_s"] >= QUEUE_FLOOR_S or p["queue_time_p50_s"] >= QUEUE_FLOOR_S:
            qe = rel(p["queue_time_p50_s"], m["queue_time_p50_s"])
            q_err.append(abs(qe))
            qs = f"{qe:+7.1%}"
            if "queue_time_p50_steady_s" in p:
                q_steady.append(rel(p["queue_time_p50_steady_s"], m["queue_time_p50_s"]))
                qs += f" {q_steady[-1]:+7.1%}"
            else:
                qs += " " * 8
        else:
            qs = f"{'(<10ms)':>7}" + " " * 8
        r["error"] = {"output_tokens_per_s": te, "queue_time_p50_s": None if qs.strip() == "(<10ms)" else qe}
        blocks = f"{m['num_blocks']}" if m["num_blocks"] == p["num_blocks"] else f"{p['num_blocks']}!={m['num_blocks']}"
        print(f"{r['case']:<22} {p['output_tokens_per_s']:>10.1f} {m['output_tokens_per_s']:>8.1f} {te:+7.1%}   "
              f"{p['queue_time_p50_s']:>13.4f}s {m['queue_time_p50_s']:>7.4f}s {qs}   "
              f"{p['queue_time_mean_s']:>10.4f}s {m['queue_time_mean_s']:>7.4f}s   "
              f"{p['preemptions']:>5.0f}/{m['preemptions']:<5.0f} {blocks:>6}")
    med = {"output_tokens_per_s": statistics.median(tok_err) if tok_err else None,
           "queue_time_p50_s": statistics.median(q_err) if q_err else None}
    print("-" * len(hdr))
    print(f"median |error|: throughput {med['output_tokens_per_s']:.1%} ({len(tok_err)} cases), "
          f"median queue time {med['queue_time_p50_s']:.1%} ({len(q_err)} cases with queueing)"
          if q_err else f"median |error|: throughput {med['output_tokens_per_s']:.1%}")
    print(f"max |error|:    throughput {max(tok_err):.1%}"
          + (f", median queue time {max(q_err):.1%}" if q_err else ""))
    if q_steady:
        print("steady: the median queue time's error of the same prediction on a steady machine (no speed timeline): "
              + ", ".join(f"{e:+.1%}" for e in q_steady))
    print("goal (issue 5 section 6): <= 10% on throughput and on median queue time")
    return med


def print_profile_fit(samples: list, results: list[dict[str, Any]]) -> None:
    """One step-cost fit over every case's steps (wall time, gaps included), as cpu-tiny's fields."""
    fit = fit_step_cost(samples, max_rows=len(samples))
    speeds = [r.get("speed") for r in results if r.get("speed")]
    print(f"\npooled step-cost fit ({fit.samples} steps of {len(results)} cases, rel. RMS residual {fit.rel_rmse:.2f}"
          + (f", machine speed {min(speeds):.2f}-{max(speeds):.2f}" if speeds else "") + "):")
    print(json.dumps({"step_overhead_s": round(fit.c0, 7), "weights_read_s": round(fit.weights_read_s, 7),
                      "per_token_s": round(fit.c_tok, 9), "per_context_token_s": round(fit.c_ctx, 11),
                      "per_prefill_pair_s": round(fit.c_pair, 12), "knee_tokens": round(fit.knee_tokens, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--json", type=Path, default=None, help="write every figure (and the fits) here")
    ap.add_argument("--keep", type=Path, default=None, help="keep the model, engine logs and raw runs here")
    ap.add_argument("--fit-details", action="store_true", help="print each case's fitted step costs")
    ap.add_argument("--fit-profile", action="store_true",
                    help="also fit one step-cost model to the step logs of all the cases pooled (how the cpu-tiny "
                         "profile's costs were made) and print it")
    ap.add_argument("--replay", action="store_true",
                    help="re-evaluate the raw runs kept in --keep DIR (no engine runs; for working on the simulator)")
    a = ap.parse_args()
    cases = [c for c in CASES if not a.only or c.name in a.only.split(",")]
    if not cases:
        sys.exit(f"no case named {a.only!r}; cases: {', '.join(c.name for c in CASES)}")
    work = a.keep or Path(tempfile.mkdtemp(prefix="kvtune-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.replay and not a.keep:
        sys.exit("--replay needs --keep DIR")
    if a.replay:
        cases = [c for c in cases if (work / f"{c.name}.run.json").is_file()]
    model = ensure_model(work)
    results = []
    pooled: list = []
    t0 = time.monotonic()
    for c in cases:
        t = time.monotonic()
        if a.replay:
            run = json.loads((work / f"{c.name}.run.json").read_text())
        else:
            run = run_engine(c, model, work)
        if a.keep and not a.replay:
            (work / f"{c.name}.run.json").write_text(json.dumps(run))
        res = evaluate(c, run)
        pooled += samples_from_engine_steps(run["steps"])
        results.append(res)
        m, p = res["measured"], res["predicted"]
        others = [x for _, x in others_cpu(run.get("cpu", []))]
        print(f"[{time.monotonic() - t0:5.0f}s] {c.name}: speed {run.get('speed', 1):.2f}, "
              + (f"others' CPU {statistics.mean(others):.2f} cores (max {max(others):.2f}), " if others else "") +
              f"client CPU {run.get('client_cpu_s', 0):.1f}s, "
              f"{m['requests']} requests in {m['duration_s']:.1f}s "
              f"(simulated {p['duration_s']:.1f}s), {time.monotonic() - t:.0f}s", file=sys.stderr, flush=True)
        if a.fit_details and res["fit"]:
            f = res["fit"]
            print(f"    fit: c0 {f['c0'] * 1e3:.3f} ms, c_tok {f['c_tok'] * 1e6:.2f} us, c_ctx {f['c_ctx'] * 1e9:.2f} ns, "
                  f"knee {f['knee']:.0f}, rel_rmse {f['rel_rmse']:.2f}, {f['samples']} steps", file=sys.stderr)
    med = report(results)
    if a.fit_profile:
        print_profile_fit(pooled, results)
    print(f"total {time.monotonic() - t0:.0f}s")
    if a.json:
        a.json.write_text(json.dumps({"cases": results, "median_abs_error": med}, indent=2))


if __name__ == "__main__":
    main()
