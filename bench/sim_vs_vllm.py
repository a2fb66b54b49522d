"""Does the simulator predict real vLLM? Each workload's trace replayed on a real vLLM (CPU build) and
in the simulator with step costs fitted from that same vLLM run; prints the error in throughput, mean
TTFT, mean TPOT, the client's mean end-to-end latency, and median / p99 / mean queue time.

    .venv/bin/python bench/sim_vs_vllm.py [--workload base|shared-prefix|preemption|all] [--keep DIR] [--work DIR]
    .venv/bin/python bench/sim_vs_vllm.py --replay DIR     # re-evaluate the kept runs, no vLLM

Workloads (`WORKLOADS`): ``base`` (lognormal prompts ~160, outputs ~64, no prefix caching),
``shared-prefix`` (4 system prompts of 640 tokens + own suffixes ~48, prefix caching on in both),
``preemption`` (prompts ~256, outputs ~192 in a 20 MiB cache of 40 blocks: vLLM preempts). Each is
sized from a measurement: the warm-up (32 requests of the workload's shapes, sent at once) gives the
rate the server serves them at; the trace arrives at the workload's share of it for 40 s.

Needs ``bash tests/vllm/setup.sh``. What is compared, and why so:

* throughput: output tokens over the span from the first arrival to the last completion, at the
  client for vLLM, in virtual time for the simulator;
* mean TTFT and TPOT: the exact means (sum / count) of vLLM's ``time_to_first_token_seconds`` and
  ``request_time_per_output_token_seconds`` (per request, (last token - first) / (outputs - 1), as
  the simulator's TPOT), against the simulator's per-request means; the client's own figure is the
  end-to-end latency (its requests are not streamed, so it sees no first token);
* queue time: vLLM's own ``vllm:request_queue_time_seconds`` histogram (vLLM exports no per-request
  figure); the simulator's per-request queue times are put in the same buckets and both quantiles
  are read with the same interpolation, plus the exact means (histogram sum / count);
* step costs and frontend time: vLLM times no step, so both come from its counters between two
  scrapes (``tuner.vllm_steps``, which the operator's vLLM rounds and ``kvtune tune --url`` read too):
  interval samples (the interval over the steps taken), prefill samples (vLLM's per-request prefill
  time over the chunks of the tokens it computed, with the prompts that arrived during the step
  before and so share its step), and the API server's time outside the engine core that the
  simulator does not step (``Profile.frontend_s``: e2e less queue less inference, less half the
  step an arrival lands in). The simulator's cost model is fitted to the samples (``tuner.fit``),
  its memory picture to vLLM's ``cache_config_info``. From interval means alone the fit charged a
  256-token prefill step 169 ms where vLLM took 80 ms (TTFT +100% on the preemption workload's first
  run); counting each prefill's step as its own charged a step two prompts shared to one (prefill
  +18.7% on the base run below), and without the frontend the simulated TTFT was short by the API
  server's ~4 ms (shared-prefix -10.9%);
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

Measured here (2 shared cores at load average 18-29 from other work, max_num_seqs 16, budget 512,
1 s scrapes; ``--keep`` runs re-evaluated with ``--replay``), error of the simulator in throughput /
mean TTFT / mean TPOT / client mean e2e:

* base, as sized by default (449 requests at 11.2/s, the machine quiet by then: TPOT 9 ms):
  -0.2% / -11.3% / -0.5% / -7.3%. The TTFT gap is vLLM's frontend, which the simulator does not
  model: of vLLM's 24.7 ms, queue 1.2 and prefill 15.9 ms are engine-core times, the other 7.6 ms
  the wait for the step in progress (~4.5 ms at 8.9 ms a step; the simulator has it) plus ~3 ms
  from the API server to the engine core and back; the client's e2e is 56 ms over vLLM's own
  (an unstreamed HTTP response on the same two cores): against vLLM's e2e the simulator is +0.2%;
* base, 240 requests at 12/s on the machine at its busiest (it served ~0.8/s: a queue of minutes,
  TTFT ~197 s): -5.1% / -0.6% / +6.0% / 0.0% (interval means alone: +1.4% / -5.4% / -2.9% / -5.1%);
* shared-prefix, 40 requests at 0.32/s (0.7 of the warm-up's rate; prefix hit rate 0.831 on both
  sides): +1.1% / +6.5% / +1.9% / +1.5% (interval means alone: +2.7% / -20.8% / -3.9% / -4.6%);
* preemption at 1.0 of the warm-up's rate (40 requests at 0.71/s; ~4 running, no preemption on
  either side): -0.1% / +5.1% / -0.1% / -0.6% (interval means alone: TTFT +100%);
* preemption at 3.0 of it (the default now), before vLLM's admission rule was read (560 requests
  at 14/s, KV usage 92%): vLLM preempted 307 times, the simulator 1010: -31.6% / +58.1% / +41.2% /
  +57.3%. The cause: vLLM 0.32 admits a waiting request only when blocks for its whole sequence are
  free (``scheduler_reserve_full_isl``, on by default; it still allocates just the chunk's), where
  the simulator admitted it into its next chunk's blocks, so a resumed or long request got in and
  took its next blocks back from its neighbours a step later (``vllm_policy.ADMISSION``);
* preemption at 3.0, with that rule (1091 requests at 27.3/s, another helper's tests running
  beside it; ``--keep`` run): vLLM 581 preemptions, the simulator 597: -8.3% / +12.5% / +9.1% /
  +12.4% (the old rule on the same run: throughput -26.7%, 1982 preemptions). TTFT is still just
  over 10%: both queues are minutes long at this rate (mean TTFT 60 s), and the simulated queue's
  tail (p99 +93%) is the last arrivals waiting longer.

All three on a quiet machine (2026-12-07, nothing else running, one run each, default sizing; throughput /
mean TTFT / mean TPOT / client mean e2e):

* base, 537 requests at 13.4/s: -1.1% / -4.4% / -6.6% / -6.1%;
* shared-prefix, 522 requests at 13.1/s (prefix hit rate 0.910 on both sides): -0.1% / +1.8% / -2.5% / -2.4%;
* preemption, 680 requests at 17.0/s (vLLM 366 preemptions, the simulator 361; mean TTFT 48 s):
  -1.0% / +1.9% / +1.1% / +1.8%. The +12.5% above was the same workload with other tests beside it.

Right after, ``--workload all`` once more: base -0.8% / +1.0% / -4.9% / -5.2%; shared-prefix +0.2% / -1.5% / -9.2% /
-9.0%; preemption (868 requests at 21.7/s, 447 and 450 preemptions) -1.2% / +2.0% / +0.2% / +1.9%.

With ``tuner.vllm_steps`` (shared prefills, frontend), the kept runs of the quiet machine below
(307 / 332 / 713 requests; ``--replay``), throughput / mean TTFT / mean TPOT / client mean e2e:
base -0.3% / +4.6% / -2.9% / -3.1% (its prefill +10.8%, was +18.7%), shared-prefix -0.6% /
+1.1% / -2.5% / -3.6% (TTFT was -10.9%), preemption -1.4% / +6.1% / +1.2% / +5.8% (its prefill,
+54% (was +65%), is a small part of a TTFT of 54 s spent queueing). Before, on the
same runs: -0.3% / +0.1% / -2.9% / -3.4%, -0.6% / -10.9% / -2.0% / -3.8%, -1.2% / +6.1% / +0.8% /
+5.8%: base's TTFT was right because its prefill, 18.7% slow, hid its missing frontend. A new run
of all three (``--keep``, the machine quiet; 678 / 790 / 711 requests at 17.0 / 19.8 / 17.8 per
second): base +0.3% / -25.2% / -9.0% / -10.2%, shared-prefix -0.1% / -0.7% / -6.9% / -9.2%,
preemption +1.4% / -3.3% / -2.9% / -5.1%. Base's TTFT miss is its queue, not a step cost: vLLM's
mean queue time was 10.9 ms against the simulator's 1.5 (its prefill +8.3%, the rest of TTFT -0.5
ms): a stall of vLLM's, as in the shared-prefix run of the quiet machine below, queued a burst.

Measured again on a quiet machine (1 s scrapes, the default sizing; ``--keep`` runs re-evaluated with
``--replay``), throughput / mean TTFT / mean TPOT / client mean e2e:

* base (471 requests at 11.8/s): -1.6% / -5.2% / -7.3% / -9.4%;
* shared-prefix (429 requests at 10.7/s, hit rate 0.909 on both sides): +1.9% / -55.5% / -8.2% /
  -24.5%. vLLM stalled for about a second at 34 s (its running gauge at 0, then 16 running and 7
  waiting at the next scrape): the queue of that burst is most of its TTFT (mean queue 22 ms against
  1.4 ms on a run without a stall). Run again: -0.4% / -11.5% / -4.7% / -7.4%; the 2.9 ms left is
  about vLLM's frontend (its TTFT less its own queue, prefill and half a step is 5-6 ms on every run
  here), which the simulator does not model;
* preemption (505 requests, 269 preemptions on both sides): -6.7% / +12.1% / +7.0% / +11.7% with the
  step costs fitted on vLLM's counts. vLLM's ``iteration_tokens_total`` leaves out the recompute of
  preempted requests (its sum was exactly ``prompt_tokens_total + generation_tokens_total``), so the
  fit charged each counted token for the uncounted ones (96.6 us/token against the base run's 73.8,
  1.31x: the simulator recomputed 31% more tokens than vLLM counted). Counting each preemption as a
  mean prompt recomputed (``vllm_steps.recomputed_tokens``, the operator's fit does the same):
  -1.2% / +2.1% / +0.1% / +2.0%.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtune_engine.quantile import bucket_counts, bucket_quantile  # noqa: E402
from kvtune_engine.sim.profile import Profile  # noqa: E402
from kvtune_engine.sim.simulator import simulate  # noqa: E402
from kvtune_engine.sim.trace import TraceRequest  # noqa: E402
from kvtune_engine.sim.vllm_policy import ADMISSION, QUEUE_CLOCK, vllm_v1_config  # noqa: E402
from kvtune_operator.tuner.fit import fit_step_cost, speed_timeline  # noqa: E402
from kvtune_operator.tuner.observation import MetricFigures  # noqa: E402
from kvtune_operator.tuner.predict import profile_for  # noqa: E402
from kvtune_operator.tuner.vllm_observation import (  # noqa: E402
    VllmAssumptions, prompt_tokens_mean, read_vllm, samples_of_scrapes)
from kvtune_operator.tuner.vllm_steps import PREFILL, Scrape, frontend_s, step_samples  # noqa: E402
from tests.vllm.load import replay  # noqa: E402
from tests.vllm.server import VllmServer, vllm_bin  # noqa: E402

QUEUE = "vllm:request_queue_time_seconds"
TTFT = "vllm:time_to_first_token_seconds"
#: per request, (last token - first token) / (outputs - 1): the simulator's TPOT, request-weighted
TPOT = "vllm:request_time_per_output_token_seconds"


def _lengths_trace(n: int, rate: float, seed: int, prompt: tuple[float, float, int, int],
                   output: tuple[float, float, int, int], prefixed: bool = False) -> list[dict]:
    """Poisson arrivals; prompt and output lengths lognormal, each (median, sigma, low, high); prefixed:
    each prompt is one of PREFIXES system prompts of PREFIX_TOKENS plus its own suffix of that length."""
    rng = random.Random(seed)
    t, out = 0.0, []

    def draw(median: float, sigma: float, low: int, high: int) -> int:
        return max(low, min(high, int(rng.lognormvariate(math.log(median), sigma))))
    for _ in range(n):
        t += rng.expovariate(rate)
        p, o = draw(*prompt), draw(*output)
        r = {"arrival_s": round(t, 4), "prompt_tokens": p, "output_tokens": o}
        if prefixed:
            r.update(prompt_tokens=PREFIX_TOKENS + p, prefix_group=f"system-{rng.randrange(PREFIXES)}",
                     prefix_tokens=PREFIX_TOKENS)
        out.append(r)
    return out


def make_trace(n: int, rate: float, seed: int) -> list[dict]:
    """Lognormal prompt (median ~160) and output (median ~64) lengths."""
    return _lengths_trace(n, rate, seed, (160, 0.6, 8, 900), (64, 0.6, 4, 400))


#: the shared-prefix workload's system prompts: this many, of this many tokens (5 blocks of vLLM's 128)
PREFIXES, PREFIX_TOKENS = 4, 640


def make_shared_prefix_trace(n: int, rate: float, seed: int) -> list[dict]:
    """Each prompt one of PREFIXES long system prompts and a short own suffix (median ~48 tokens),
    outputs median ~48: what a few assistants behind one endpoint send."""
    return _lengths_trace(n, rate, seed, (48, 0.6, 4, 200), (48, 0.6, 4, 300), prefixed=True)


def make_long_trace(n: int, rate: float, seed: int) -> list[dict]:
    """Prompts median ~256 and outputs median ~192 tokens: each request grows to 3-4 blocks of 128, so
    16 running need more blocks than the preemption workload's cache holds."""
    return _lengths_trace(n, rate, seed, (256, 0.5, 16, 900), (192, 0.5, 16, 400))


@dataclass(frozen=True)
class Workload:
    """One comparison: its trace, its vLLM flags beyond the common ones, its KV cache size."""
    name: str
    trace: Callable[[int, float, int], list[dict]]
    #: arrival rate as a share of what the server served in the warm-up (all sent at once), measured
    #: first: the same regime on a quiet or a busy machine
    load: float
    prefix_caching: bool = False
    kv_cache_gib: float = 1.0
    about: str = ""


#: the workloads; the preemption one's cache: the bench model's K/V take 4 KiB a token (4 layers x
#: 4 KV heads x head_dim 32 x fp32 x K and V), 512 KiB a block of 128, so 20 MiB hold 40 blocks
WORKLOADS = {w.name: w for w in (
    Workload("base", make_trace, 0.7, about="lognormal prompts ~160 / outputs ~64, no prefix caching"),
    Workload("shared-prefix", make_shared_prefix_trace, 0.7, prefix_caching=True,
             about=f"{PREFIXES} system prompts of {PREFIX_TOKENS} tokens + suffixes ~48, prefix caching on"),
    Workload("preemption", make_long_trace, 3.0, kv_cache_gib=20 / 1024,
             about="prompts ~256 / outputs ~192 in a 20 MiB KV cache (40 blocks of 128): vLLM preempts"),
)}


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


def hist_mean(window: MetricFigures, name: str) -> float:
    """The exact mean of a vLLM histogram over the window: its sum over its count."""
    return (window.hist_sum(name) or 0.0) / max(1.0, window.hist_count(name) or 0.0)


def latency_means(rows: list[dict]) -> tuple[float, float, float]:
    """Mean TTFT, TPOT ((e2e - TTFT) / (outputs - 1), requests with two tokens or more) and e2e of
    the simulator's per-request rows."""
    tpots = [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in rows if r["output_tokens"] > 1]
    return (sum(r["ttft_s"] for r in rows) / len(rows), sum(tpots) / max(1, len(tpots)),
            sum(r["e2e_s"] for r in rows) / len(rows))


def bucketed_quantile(values: list[float], bounds: list[float], q: float) -> float:
    """``q`` of ``values`` read through the histogram buckets ``bounds``, as Prometheus would (an estimate)."""
    return bucket_quantile(bucket_counts(values, sorted(bounds)), q)


def err(pred: float, real: float) -> float:
    return (pred - real) / real if real else (0.0 if pred == 0 else math.inf)


def measure(args: argparse.Namespace, w: Workload, work: Path) -> dict:
    """One replay of the workload's trace on a real vLLM: the trace, the client's records, and the
    /metrics texts scraped during it (times relative to the replay's start, the trace's clock)."""
    vllm_bin()
    model = work / "model"
    if not model.exists():
        subprocess.run([str(Path(sys.executable).with_name("kvtune")), "make-tiny-model", str(model), "--layers", "4",
                        "--hidden", "256", "--heads", "8", "--kv-heads", "4", "--head-dim", "32", "--intermediate",
                        "512", "--vocab", "2048"], check=True, capture_output=True)
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-model-len", "2048", "--enable-prefix-caching" if w.prefix_caching else "--no-enable-prefix-caching"]
    # one run dir for every workload: vLLM's torch.compile cache under it is reused (start-up on a
    # busy two-core machine took over 7 minutes without it)
    srv = VllmServer(model, work / "run", kv_cache_gib=w.kv_cache_gib, args=flags)
    srv.start(timeout_s=args.start_timeout)
    with srv:
        # warm-up on the trace's own shapes (another seed, other prefixes), all at once: vLLM compiles
        # and warms its kernels per batch shape, which would otherwise slow the first part of the run
        warm = [{**r, "arrival_s": 0.0, **({"prefix_group": "warm-" + r["prefix_group"]} if "prefix_group" in r else {})}
                for r in w.trace(args.warmup, 1.0, args.seed + 1)]
        began = time.monotonic()
        replay(srv.url, str(model), warm)
        served = args.warmup / (time.monotonic() - began)   # requests/s of this shape, all at once
        rate = args.rate or round(w.load * served, 2)
        requests = args.requests or max(40, int(rate * args.arrivals_s))
        trace = w.trace(requests, rate, args.seed)
        scraper = Scraper(srv, args.scrape_every)
        scraper.start()
        time.sleep(0.6)
        t0 = time.monotonic()
        results = replay(srv.url, str(model), trace)
        time.sleep(0.6)
        scraper.stop.set()
        scraper.join()
    return {"workload": w.name,
            "args": {"requests": requests, "rate": rate, "warmup_served_per_s": served,
                     "prefix_caching": w.prefix_caching,
                     "kv_cache_gib": w.kv_cache_gib,
                     **{k: getattr(args, k) for k in ("max_num_seqs", "max_num_batched_tokens", "seed", "warmup",
                                                      "scrape_every")}},
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
    samples = step_samples([Scrape.of(t, s) for t, s in scrapes], a["max_num_batched_tokens"], prompt_tokens_mean(window))
    fit = fit_step_cost(samples)
    speed = speed_timeline(samples, fit) if fit is not None else None
    frontend = frontend_s(window, samples)
    profile: Profile = profile_for(reading.observation.with_(frontend_s=frontend), None, fit, speed)
    cfg = vllm_v1_config(reading.observation.config)
    reqs = [TraceRequest(r["arrival_s"], r["prompt_tokens"], r["output_tokens"], r.get("prefix_group"),
                         int(r.get("prefix_tokens", 0))) for r in trace]
    sim = simulate(reqs, cfg, profile, per_request=True, queue_clock=QUEUE_CLOCK, admission=ADMISSION)
    # admitting by the next chunk's blocks (our engine's rule, the simulator's before vLLM's was read)
    by_chunk = simulate(reqs, cfg, profile, queue_clock=QUEUE_CLOCK, admission="chunk")
    rows = sim["per_request"]
    sim_q = [r["queue_s"] for r in rows]
    sim_q50, sim_q99 = bucketed_quantile(sim_q, bounds, 0.5), bucketed_quantile(sim_q, bounds, 0.99)
    sim_qmean = sum(sim_q) / len(sim_q)
    # the same on a steady machine (no speed timeline), to show what the timeline changes
    steady = simulate(reqs, cfg, profile.model_copy(update={"speed": None}), per_request=True,
                      queue_clock=QUEUE_CLOCK, admission=ADMISSION)
    steady_q = [r["queue_s"] for r in steady["per_request"]]
    real_ttft, real_tpot = hist_mean(window, TTFT), hist_mean(window, TPOT)
    sim_ttft, sim_tpot, sim_e2e = latency_means(rows)
    real_prefill, sim_prefill = hist_mean(window, PREFILL), sum(r["prefill_s"] for r in rows) / len(rows)
    real_e2e = sum(r["latency_s"] for r in results) / len(results)
    st_ttft, st_tpot, st_e2e = latency_means(steady["per_request"])
    hits, queries = window.get("vllm:prefix_cache_hits_total") or 0.0, window.get("vllm:prefix_cache_queries_total") or 0.0
    return {
        "workload": raw.get("workload", "base"),
        "ttft_mean_s": {"vllm": real_ttft, "sim": sim_ttft, "error": err(sim_ttft, real_ttft)},
        "tpot_mean_s": {"vllm": real_tpot, "sim": sim_tpot, "error": err(sim_tpot, real_tpot)},
        "prefill_mean_s": {"vllm": real_prefill, "sim": sim_prefill, "error": err(sim_prefill, real_prefill)},
        # TTFT less the engine core's queue and prefill: the wait for the step in progress at intake
        # (both sides) and the API server's hops to the engine core and back (vLLM only)
        "ttft_rest_mean_s": {"vllm": real_ttft - real_qmean - real_prefill, "sim": sim_ttft - sim_qmean - sim_prefill},
        "e2e_mean_s": {"vllm": real_e2e, "sim": sim_e2e, "error": err(sim_e2e, real_e2e)},
        "prefix_hit_rate": {"vllm": hits / queries if queries else None, "sim": sim["prefix_cache"]["hit_rate"]},
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
                   "queue_mean_s": sum(steady_q) / len(steady_q),
                   "ttft_mean_s": st_ttft, "tpot_mean_s": st_tpot, "e2e_mean_s": st_e2e},
        "preemptions": {"vllm": reading.observation.preemptions_recompute,
                        "sim": sim["preemptions"]["recompute"] + sim["preemptions"]["swap"]},
        "chunk_admission": {"throughput_tok_s": by_chunk["output_tokens_per_s"],
                            "preemptions": by_chunk["preemptions"]["recompute"]},
        "replay_s": raw.get("replay_s"),
    }


FIGURES = ("throughput_tok_s", "ttft_mean_s", "tpot_mean_s", "e2e_mean_s", "queue_p50_s", "queue_p99_s",
           "queue_mean_s")


def report(out: dict) -> None:
    fit = out["fit"]
    print(f"[{out['workload']}] {WORKLOADS[out['workload']].about}")
    print(f"trace: {out['requests']} requests at {out['rate_per_s']:g}/s; vLLM 0.32 CPU, max_num_seqs "
          f"{out['max_num_seqs']}, max_num_batched_tokens {out['max_num_batched_tokens']}, {out['vllm_blocks']} blocks "
          f"of {out['vllm_block_size']}")
    if fit is not None:
        print(f"step cost fitted from {out['step_samples']} scrape intervals: {1000 * fit['c0_s']:.2f} ms + "
              f"{1e6 * fit['per_token_s']:.1f} us/token (rel. RMSE {fit['rel_rmse']:.0%})")
    print(f"{'figure':<18}{'vLLM':>12}{'sim':>12}{'error':>9}   {'steady':>9}")
    for k in FIGURES:
        v = out[k]
        steady = out["steady"].get(k)
        print(f"{k:<18}{v['vllm']:>12.4f}{v['sim']:>12.4f}{100 * v['error']:>8.1f}%"
              + (f"   {100 * err(steady, v['vllm']):>8.1f}%" if steady is not None else ""))
    if "prefill_mean_s" in out:
        p, rest = out["prefill_mean_s"], out["ttft_rest_mean_s"]
        print(f"TTFT = queue + prefill + rest: prefill {1000 * p['vllm']:.2f} / {1000 * p['sim']:.2f} ms "
              f"({100 * p['error']:+.1f}%), rest {1000 * rest['vllm']:.2f} / {1000 * rest['sim']:.2f} ms")
    h = out["prefix_hit_rate"]
    if h["vllm"] is not None:
        print(f"prefix hit rate    {h['vllm']:>12.3f}{h['sim']:>12.3f}")
    print(f"preemptions        {out['preemptions']['vllm']:>12}{out['preemptions']['sim']:>12}")
    if "chunk_admission" in out:  # the simulator admitting by the next chunk's blocks, not the whole sequence's
        c = out["chunk_admission"]
        print(f"by chunk admission: throughput {100 * err(c['throughput_tok_s'], out['throughput_tok_s']['vllm']):+.1f}%, "
              f"{c['preemptions']} preemptions")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--requests", type=int, default=None, help="default: --arrivals-s of arrivals at the rate")
    ap.add_argument("--rate", type=float, default=None,
                    help="requests/s (Poisson); default: the workload's share of the rate the warm-up was served at")
    ap.add_argument("--arrivals-s", type=float, default=40.0, help="seconds of arrivals when --requests is not given")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=32,
                    help="warm-up requests before the measured run, sent at once; they also measure the server's speed")
    ap.add_argument("--scrape-every", type=float, default=1.0,
                    help="seconds between /metrics scrapes (shorter: more samples, each blurred more by where "
                         "the scrape falls inside a step)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="write each raw run (trace, client records, scraped /metrics texts) to DIR/WORKLOAD.json")
    ap.add_argument("--replay", type=Path, default=None,
                    help="re-evaluate the raw runs kept in DIR (no vLLM; for working on the simulator)")
    ap.add_argument("--work", type=Path, default=None,
                    help="the model and vLLM's caches (default: a new temporary dir; reuse one to skip compiling)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds vLLM may take to start")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    work = args.work or Path(tempfile.mkdtemp(prefix="sim-vs-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    outs = []
    for name in names:
        t0 = time.monotonic()
        if args.replay:
            path = args.replay / f"{name}.json"
            if not path.exists() and name == "base" and (args.replay / "run.json").exists():
                path = args.replay / "run.json"   # a run kept before there were workloads
            if not path.exists():
                continue
            raw = json.loads(path.read_text())
        else:
            raw = measure(args, WORKLOADS[name], work)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                (args.keep / f"{name}.json").write_text(json.dumps(raw))
        out = evaluate(raw)
        out["wall_s"] = time.monotonic() - t0
        outs.append(out)
        if not args.json:
            report(out)
            print(f"took {out['wall_s']:.0f}s\n", flush=True)
    if args.json:
        print(json.dumps(outs))
        return 0
    print(f"{'error':<16}" + "".join(f"{o['workload']:>15}" for o in outs))
    for k in ("throughput_tok_s", "ttft_mean_s", "tpot_mean_s", "e2e_mean_s"):
        print(f"{k:<16}" + "".join(f"{100 * o[k]['error']:>14.1f}%" for o in outs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
