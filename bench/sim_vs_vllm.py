"""Does the simulator predict real vLLM? One trace replayed on a real vLLM (CPU build) and in the
simulator with step costs fitted from that same vLLM run; prints the error in throughput and in
median / p99 queue time.

    .venv/bin/python bench/sim_vs_vllm.py [--requests 240] [--rate 12] [--max-num-seqs 16] [--json] [--keep DIR]
    .venv/bin/python bench/sim_vs_vllm.py --replay DIR     # re-evaluate a kept run, no vLLM

Needs ``bash tests/vllm/setup.sh``. What is compared, and why so:

* throughput: output tokens over the span from the first arrival to the last completion, at the
  client for vLLM, in virtual time for the simulator;
* queue time: vLLM's own ``vllm:request_queue_time_seconds`` histogram (vLLM exports no per-request
  figure); the simulator's per-request queue times are put in the same buckets and both quantiles
  are read with the same interpolation, plus the exact means (histogram sum / count);
* step costs: vLLM times no step, so between two scrapes (every 1 s) with requests running the
  whole time, the interval divided by the steps taken (``iteration_tokens_total``'s count) is one
  sample of the step time at that interval's tokens per step; the simulator's cost model is fitted
  to those samples (``tuner.fit``), and its memory picture to vLLM's ``cache_config_info``;
* the scheduler policy: vLLM V1 (always-chunked prefill, recompute-only preemption, no watermark,
  FCFS with running requests first) is `kvtune_engine.sim.vllm_policy.vllm_v1_config`;
* the machine's speed over the run: the fitted profile's speed timeline (``fit.speed_timeline``, 2 s
  windows of the scrape intervals' measured step time over the fit's), as the tuner's fitted profiles
  carry it; the "steady" column is the same prediction without it;
* vLLM's queue clock: its engine core stamps a request queued when it takes it in between two steps
  (``vllm/v1/core/sched/scheduler.py``, ``EngineCoreEventType.QUEUED``), so the wait for the step
  running at its arrival is not in ``request_queue_time_seconds``; the simulator counts the same way
  (``vllm_policy.QUEUE_CLOCK``). On one kept run the simulated mean queue time was +68% without it
  and the timeline, +18% with the timeline alone, -3% with both.

How to read the median: vLLM's first queue-time bucket is 0.3 s, so at 12/s, where nearly every
request waits less than that, the median read through the buckets is 0.15 s / (share <= 0.3 s) on
both sides: it says how many requests waited over 0.3 s, not what the typical wait was. At 30/s the
queue is long (p50 ~2.3 s) and the median is a real one.

Measured here (2 cores, 240 requests, max_num_seqs 16, budget 512, 1 s scrapes; the runs in
the commit log): at 12/s throughput -0.2% / +3.9%, queue p50 0.0% / 0.0% (every request in the first
bucket on both sides), p99 0.0% / 0.0%; at 30/s throughput +2.9% / -1.5%, queue p50 +1.2% / -8.7%
(steady: -3.6% / -9.2%), p99 0.0% / -0.2%, mean +1.6% / +1.7%. Earlier, without the timeline and the queue clock: p50 -12% / +43%. Still off:
at 12/s vLLM queues ~0.1 ms a request on average and the simulator 1-7 ms: it reaches the sequence
cap in ~1.6% of its steps where vLLM did not (vLLM ran at most 10 at once), its cost model linear
in tokens per step (interval means cannot show a knee) charging large batches more than vLLM takes.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtune_engine.quantile import bucket_counts, bucket_quantile  # noqa: E402
from kvtune_engine.sim.profile import Profile  # noqa: E402
from kvtune_engine.sim.simulator import simulate  # noqa: E402
from kvtune_engine.sim.trace import TraceRequest  # noqa: E402
from kvtune_engine.sim.vllm_policy import QUEUE_CLOCK, vllm_v1_config  # noqa: E402
from kvtune_operator.tuner.fit import fit_step_cost, speed_timeline  # noqa: E402
from kvtune_operator.tuner.observation import MetricFigures  # noqa: E402
from kvtune_operator.tuner.predict import profile_for  # noqa: E402
from kvtune_operator.tuner.vllm_observation import VllmAssumptions, read_vllm, samples_of_scrapes  # noqa: E402
from tests.vllm.load import replay  # noqa: E402
from tests.vllm.server import VllmServer, vllm_bin  # noqa: E402

QUEUE = "vllm:request_queue_time_seconds"


def make_trace(n: int, rate: float, seed: int) -> list[dict]:
    """Poisson arrivals, lognormal prompt (median ~160) and output (median ~64) lengths."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        p = max(8, min(900, int(rng.lognormvariate(math.log(160), 0.6))))
        o = max(4, min(400, int(rng.lognormvariate(math.log(64), 0.6))))
        out.append({"arrival_s": round(t, 4), "prompt_tokens": p, "output_tokens": o})
    return out


class Scraper(threading.Thread):
    """/metrics every ``every`` seconds, each text kept with its wall time."""

    def __init__(self, srv: VllmServer, every: float = 0.25):
        super().__init__(daemon=True)
        self.srv, self.every, self.scrapes, self.stop = srv, every, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            self.scrapes.append((t, self.srv.metrics()))
            self.stop.wait(max(0.0, self.every - (time.monotonic() - t)))


def step_samples(scrapes: list[tuple[float, MetricFigures]]):
    from kvtune_operator.tuner.observation import StepSample

    out = []
    for (ta, a), (tb, b) in zip(scrapes, scrapes[1:]):
        n = (b.hist_count("vllm:iteration_tokens_total") or 0) - (a.hist_count("vllm:iteration_tokens_total") or 0)
        busy = (a.get("vllm:num_requests_running") or 0) > 0 and (b.get("vllm:num_requests_running") or 0) > 0
        if n >= 1 and busy:
            tok = (b.hist_sum("vllm:iteration_tokens_total") or 0) - (a.hist_sum("vllm:iteration_tokens_total") or 0)
            out.append(StepSample(duration_s=(tb - ta) / n, batched_tokens=tok / n, weight=n, t_s=(ta + tb) / 2))
    return out


def bucketed_quantile(values: list[float], bounds: list[float], q: float) -> float:
    """``q`` of ``values`` read through the histogram buckets ``bounds``, as Prometheus would (an estimate)."""
    return bucket_quantile(bucket_counts(values, sorted(bounds)), q)


def err(pred: float, real: float) -> float:
    return (pred - real) / real if real else (0.0 if pred == 0 else math.inf)


def measure(args: argparse.Namespace, work: Path) -> dict:
    """One replay of the trace on a real vLLM: the trace, the client's records, and the /metrics
    texts scraped during it (times relative to the replay's start, the trace's clock)."""
    vllm_bin()
    model = work / "model"
    subprocess.run([str(Path(sys.executable).with_name("kvtune")), "make-tiny-model", str(model), "--layers", "4",
                    "--hidden", "256", "--heads", "8", "--kv-heads", "4", "--head-dim", "32", "--intermediate", "512",
                    "--vocab", "2048"], check=True, capture_output=True)
    trace = make_trace(args.requests, args.rate, args.seed)
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-model-len", "2048", "--no-enable-prefix-caching"]
    with VllmServer(model, work / "run", kv_cache_gib=1, args=flags) as srv:
        # warm-up on the trace's own shapes (another seed), all at once: vLLM compiles and warms its
        # kernels per batch shape, which would otherwise slow the first part of the measured run
        replay(srv.url, str(model), [{**r, "arrival_s": 0.0} for r in make_trace(args.warmup, args.rate, args.seed + 1)])
        scraper = Scraper(srv, args.scrape_every)
        scraper.start()
        time.sleep(0.6)
        t0 = time.monotonic()
        results = replay(srv.url, str(model), trace)
        time.sleep(0.6)
        scraper.stop.set()
        scraper.join()
    return {"args": {k: getattr(args, k) for k in ("requests", "rate", "max_num_seqs", "max_num_batched_tokens",
                                                   "seed", "warmup", "scrape_every")},
            "trace": trace, "results": results, "scrapes": [(t - t0, text) for t, text in scraper.scrapes],
            "replay_s": time.monotonic() - t0}


def evaluate(raw: dict) -> dict:
    """vLLM's figures from one measured run, and the simulator's prediction from the same run."""
    a = raw["args"]
    trace, results = raw["trace"], raw["results"]
    scrapes = [(t, MetricFigures.from_prometheus_text(text)) for t, text in raw["scrapes"]]
    first = min(r["sent_s"] for r in results)
    span = max(r["done_s"] for r in results) - first
    real_tput = sum(r["completion_tokens"] for r in results) / span
    window = MetricFigures.over_scrapes([s for _, s in scrapes])
    bounds = sorted(le for le, _ in window.buckets(QUEUE) if math.isfinite(le))
    real_q50, real_q99 = window.hist_quantile(QUEUE, 0.5), window.hist_quantile(QUEUE, 0.99)
    real_qmean = (window.hist_sum(QUEUE) or 0) / max(1, window.hist_count(QUEUE) or 1)

    reading = read_vllm(window, samples_of_scrapes([s for _, s in scrapes]), window_s=scrapes[-1][0] - scrapes[0][0],
                        assume=VllmAssumptions(max_num_seqs=a["max_num_seqs"],
                                               max_num_batched_tokens=a["max_num_batched_tokens"], max_model_len=2048))
    samples = step_samples(scrapes)
    fit = fit_step_cost(samples)
    speed = speed_timeline(samples, fit) if fit is not None else None
    profile: Profile = profile_for(reading.observation, None, fit, speed)
    cfg = vllm_v1_config(reading.observation.config)
    reqs = [TraceRequest(r["arrival_s"], r["prompt_tokens"], r["output_tokens"]) for r in trace]
    sim = simulate(reqs, cfg, profile, per_request=True, queue_clock=QUEUE_CLOCK)
    sim_q = [r["queue_s"] for r in sim["per_request"]]
    sim_q50, sim_q99 = bucketed_quantile(sim_q, bounds, 0.5), bucketed_quantile(sim_q, bounds, 0.99)
    sim_qmean = sum(sim_q) / len(sim_q)
    # the same on a steady machine (no speed timeline), to show what the timeline changes
    steady = simulate(reqs, cfg, profile.model_copy(update={"speed": None}), per_request=True,
                      queue_clock=QUEUE_CLOCK)
    steady_q = [r["queue_s"] for r in steady["per_request"]]
    return {
        "requests": len(trace), "rate_per_s": a["rate"], "max_num_seqs": a["max_num_seqs"],
        "max_num_batched_tokens": a["max_num_batched_tokens"], "vllm_blocks": reading.observation.num_blocks,
        "vllm_block_size": cfg.block_size, "step_samples": len(samples),
        "fit": None if fit is None else {"c0_s": fit.c0, "per_token_s": fit.c_tok, "rel_rmse": fit.rel_rmse},
        "throughput_tok_s": {"vllm": real_tput, "sim": sim["output_tokens_per_s"],
                             "error": err(sim["output_tokens_per_s"], real_tput)},
        "queue_p50_s": {"vllm": real_q50, "sim": sim_q50, "error": err(sim_q50, real_q50)},
        "queue_p99_s": {"vllm": real_q99, "sim": sim_q99, "error": err(sim_q99, real_q99)},
        "queue_mean_s": {"vllm": real_qmean, "sim": sim_qmean, "error": err(sim_qmean, real_qmean)},
        "steady": {"throughput_tok_s": steady["output_tokens_per_s"],
                   "queue_p50_s": bucketed_quantile(steady_q, bounds, 0.5),
                   "queue_p99_s": bucketed_quantile(steady_q, bounds, 0.99),
                   "queue_mean_s": sum(steady_q) / len(steady_q)},
        "preemptions": {"vllm": reading.observation.preemptions_recompute,
                        "sim": sim["preemptions"]["recompute"] + sim["preemptions"]["swap"]},
        "replay_s": raw.get("replay_s"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=12.0, help="requests/s (Poisson)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=64, help="warm-up requests before the measured run")
    ap.add_argument("--scrape-every", type=float, default=1.0,
                    help="seconds between /metrics scrapes (shorter: more samples, each blurred more by where "
                         "the scrape falls inside a step)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="write the raw run (trace, client records, scraped /metrics texts) to DIR/run.json")
    ap.add_argument("--replay", type=Path, default=None,
                    help="re-evaluate the raw run kept in DIR/run.json (no vLLM; for working on the simulator)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    t_all = time.monotonic()
    if args.replay:
        raw = json.loads((args.replay / "run.json").read_text())
    else:
        raw = measure(args, Path(tempfile.mkdtemp(prefix="sim-vs-vllm-")))
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / "run.json").write_text(json.dumps(raw))
    out = evaluate(raw)
    out["wall_s"] = time.monotonic() - t_all
    if args.json:
        print(json.dumps(out))
        return 0
    fit = out["fit"]
    print(f"trace: {out['requests']} requests at {out['rate_per_s']:g}/s; vLLM 0.32 CPU, max_num_seqs "
          f"{out['max_num_seqs']}, max_num_batched_tokens {out['max_num_batched_tokens']}, {out['vllm_blocks']} blocks "
          f"of {out['vllm_block_size']}")
    if fit is not None:
        print(f"step cost fitted from {out['step_samples']} scrape intervals: {1000 * fit['c0_s']:.2f} ms + "
              f"{1e6 * fit['per_token_s']:.1f} us/token (rel. RMSE {fit['rel_rmse']:.0%})")
    print(f"{'figure':<18}{'vLLM':>12}{'sim':>12}{'error':>9}   {'steady':>9}")
    for k in ("throughput_tok_s", "queue_p50_s", "queue_p99_s", "queue_mean_s"):
        v = out[k]
        print(f"{k:<18}{v['vllm']:>12.3f}{v['sim']:>12.3f}{100 * v['error']:>8.1f}%"
              f"   {100 * err(out['steady'][k], v['vllm']):>8.1f}%")
    print(f"preemptions        {out['preemptions']['vllm']:>12}{out['preemptions']['sim']:>12}")
    print(f"took {out['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
