"""Replay a trace through the engine's own Scheduler and a SimulatedRunner, in virtual time.

`simulate(trace, config, profile, slo)` returns the summary that `kvtune sim --json` prints; the
keys are documented in README.md ("kvtune sim output"). Deterministic: the same inputs give the
same summary.

Arrival: a request's latencies (queue time, TTFT, e2e) start at its trace arrival, what its client
sees; the engine's server stamps them the same way (when the HTTP request arrives). vLLM's queue time
starts later: its engine core stamps a request queued when the loop takes it in between two steps, so
the wait for the step running at its arrival is not in it (``queue_clock="intake"``; see
``vllm_policy.QUEUE_CLOCK``). TTFT and e2e start at the arrival either way.

The requests, the steps and their cost are ``stepper``'s (``SimEngine``, stepped by ``Replay``): the
replica prediction and the real-time simulated engine step the same engine. What this module owns
is the summary: the cache state integrated over each step's duration, the latencies per request,
their percentiles (``kvtune_engine.quantile.percentile``, the one every figure uses).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig
from ..core.scheduler import Scheduler
from ..core.stats import CAUSES
from ..quantile import percentile
from ..request import Request
from .profile import Profile
from .stepper import Replay, SimEngine
from .trace import TraceRequest


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft: float, tpot: float | None) -> bool:
        if self.ttft_s is not None and ttft > self.ttft_s:
            return False
        if self.tpot_s is not None and tpot is not None and tpot > self.tpot_s:
            return False
        return True


class _Acc:
    """Time-weighted integrals of the cache state and per-request latencies."""

    def __init__(self, slo: SLO, per_request: bool = False, intake: dict[str, float] | None = None,
                 frontend_s: float = 0.0) -> None:
        self.slo = slo
        self.frontend_s = frontend_s  # outside the stepped engine: in TTFT and e2e (Profile.frontend_s)
        self.intake = intake   # request id -> when the loop took it in (queue_clock "intake")
        self.rows: list[dict] | None = [] if per_request else None
        self.busy_s = 0.0
        self.usage = self.frag = self.running = self.shared = self.queued = 0.0
        self.used_max = 0
        self.states = dict.fromkeys(("free", "reserved", "used", "cached"), 0.0)
        self.swap_peak = 0.0
        self.running_max = self.queued_max = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.queue: list[float] = []
        self.e2e: list[float] = []
        self.finished = self.out_tokens = self.good = self.cut = 0

    def requests(self, done: list[Request]) -> None:
        for req in done:
            self.finished += 1
            n_out = len(req.output_token_ids)
            self.out_tokens += n_out
            if req.error:
                self.cut += 1
            if req.first_token_s is None:     # finished before its first token: not good
                continue
            t1 = req.first_token_s - req.arrival_s + self.frontend_s
            self.ttft.append(t1)
            t0 = req.arrival_s if self.intake is None else self.intake.pop(req.request_id, req.arrival_s)
            self.queue.append(req.first_scheduled_s - t0)
            self.e2e.append(req.finished_s - req.arrival_s + self.frontend_s)
            t2 = (req.finished_s - req.first_token_s) / (n_out - 1) if n_out > 1 else None
            if t2 is not None:
                self.tpot.append(t2)
            if self.slo.met(t1, t2):
                self.good += 1
            if self.rows is not None:
                self.rows.append({"id": req.request_id, "arrival_s": req.arrival_s, "queue_s": self.queue[-1],
                                  "prefill_s": req.first_token_s - req.first_scheduled_s,
                                  "ttft_s": t1, "e2e_s": self.e2e[-1], "output_tokens": n_out})


def simulate(trace: list[TraceRequest], config: EngineConfig, profile: Profile,
             slo: SLO | None = None, *, per_request: bool = False, queue_clock: str = "arrival",
             admission: str = "chunk") -> dict:
    """Replay `trace` under `config` on `profile`; the summary dict of `kvtune sim --json`.

    `per_request`: also a `per_request` list (finish order) of each started request's `queue_s`,
    `prefill_s` (first scheduled to first token), `ttft_s`, `e2e_s`, `output_tokens` (bench/sim_fidelity.py buckets them as the engine would).
    `queue_clock`: where queue time starts, "arrival" (ours) or "intake" (vLLM's; module docstring).
    `admission`: the scheduler's admission rule, "chunk" (ours) or "whole" (vLLM's; core/scheduler.py)."""
    if not trace:
        raise ValueError("empty trace")
    if queue_clock not in ("arrival", "intake"):
        raise ValueError(f"queue_clock is 'arrival' or 'intake', not {queue_clock!r}")
    eng = SimEngine(config, profile, admission=admission)
    size, sched = eng.size, eng.sched
    intake: dict[str, float] | None = {} if queue_clock == "intake" else None
    acc = _Acc(slo or SLO(), per_request, intake, profile.frontend_s)
    kv = sched.kv
    nb, bs, reserve = size.num_blocks, config.block_size, sched.reserve_blocks
    waiting, swapped = sched.waiting, sched.swapped
    busy = usage = frag = shared = running = queued = free_t = reserved_t = cached_t = 0.0
    running_max = queued_max = used_max = 0
    swap_low = size.num_swap_blocks
    rejected = 0

    def observe(batch, dt: float) -> None:
        # the cache as it is during this step (blocks for the tokens being computed included),
        # weighted by the step's duration: what averaging a scraped gauge over time gives
        nonlocal busy, usage, frag, shared, running, queued, free_t, reserved_t, cached_t
        nonlocal running_max, queued_max, used_max, swap_low
        n_free, n_idle = kv.num_free, kv.num_cached_idle
        used = nb - n_free - n_idle
        busy += dt
        usage += used * dt
        if used > used_max:
            used_max = used
        if used:
            frag += (kv.num_table_blocks * bs - sched.computed_tokens - batch.num_batched_tokens) / (used * bs) * dt
        shared += kv.num_shared * dt
        nr = sched.num_running
        running += nr * dt
        if nr > running_max:
            running_max = nr
        nq = len(waiting) + len(swapped)
        queued += nq * dt
        if nq > queued_max:
            queued_max = nq
        held = n_free if n_free < reserve else reserve
        free_t += (n_free - held) * dt
        reserved_t += held * dt
        cached_t += n_idle * dt
        n_swap_free = kv.num_free_swap_blocks
        if n_swap_free < swap_low:
            swap_low = n_swap_free

    def reject(i: int, r: TraceRequest) -> None:
        nonlocal rejected
        rejected += 1

    def admit(req: Request, now: float) -> None:
        intake[req.request_id] = now

    replay = Replay(eng, observe=observe, on_done=lambda done, _end: acc.requests(done), on_reject=reject,
                    on_admit=admit if intake is not None else None)
    for j in sorted(range(len(trace)), key=lambda j: trace[j].arrival_s):
        replay.feed(j, trace[j])
    replay.advance()
    n_total, now, start = len(trace), replay.now, replay.start
    acc.busy_s, acc.usage, acc.frag, acc.shared, acc.running = busy, usage, frag, shared, running
    acc.queued, acc.used_max = queued, used_max
    acc.running_max, acc.queued_max = running_max, queued_max
    acc.states.update(free=free_t, reserved=reserved_t, used=usage, cached=cached_t)
    acc.swap_peak = 1.0 - swap_low / size.num_swap_blocks if size.num_swap_blocks else 0.0
    out = _summary(acc, sched, size, config, profile, now - start, n_total, rejected)
    if acc.rows is not None:
        out["per_request"] = acc.rows
    return out


def _summary(acc: _Acc, sched: Scheduler, size, config: EngineConfig, profile: Profile,
             duration: float, n_total: int, rejected: int) -> dict:
    duration = max(duration, 1e-12)
    busy = acc.busy_s or 1e-12
    nb = size.num_blocks
    st = sched.stats
    share = {c: st.cause_steps[c] / st.steps if st.steps else 0.0 for c in CAUSES}
    dominant = max(CAUSES[1:], key=lambda c: st.cause_steps[c])
    if st.cause_steps[dominant] == 0:
        dominant = "none"
    for v in (acc.ttft, acc.tpot, acc.queue, acc.e2e):
        v.sort()
    act = profile.activation_peak_bytes(config.profiled_batched_tokens)
    mem = {"device_total": profile.device_total_bytes, "weights": profile.weights_bytes,
           "activations_peak": act, "kv_cache": size.kv_cache_bytes,
           "unused": max(0, profile.device_total_bytes - profile.weights_bytes - act - size.kv_cache_bytes),
           "swap": size.swap_bytes}
    q, h = st.prefix_query_tokens, st.prefix_hit_tokens
    return {
        "output_tokens_per_s": acc.out_tokens / duration,
        "requests_per_s": acc.finished / duration,
        "goodput_requests_per_s": acc.good / duration,
        **{f"{name}_p{round(q * 100)}_s": percentile(values, q)
           for name, values in (("ttft", acc.ttft), ("tpot", acc.tpot), ("queue_time", acc.queue))
           for q in (0.5, 0.95, 0.99)},
        "e2e_p50_s": percentile(acc.e2e, 0.5), "e2e_p99_s": percentile(acc.e2e, 0.99),
        "preemptions": {**st.preemptions, "swap_full": st.swap_full},
        "waiting_cause_share": share,
        "dominant_waiting_cause": dominant,
        "kv_usage_mean": acc.usage / busy / nb,
        "kv_usage_peak": acc.used_max / nb,
        "internal_fragmentation_mean": acc.frag / busy,
        "kv_blocks_mean_share": {k: v / busy / nb for k, v in acc.states.items()},
        "shared_blocks_mean_share": acc.shared / busy / nb,
        "swap_usage_peak": acc.swap_peak,
        "running_mean": acc.running / busy,
        "running_max": acc.running_max,
        "queued_mean": acc.queued / busy,
        "queued_max": acc.queued_max,
        "prefix_cache": {"query_tokens": q, "hit_tokens": h, "hit_rate": h / q if q else 0.0},
        "num_blocks": nb,
        "num_swap_blocks": size.num_swap_blocks,
        "block_bytes": size.block_bytes,
        "memory_bytes": mem,
        "requests": {"total": n_total, "finished": acc.finished, "rejected": rejected,
                     "meeting_slo": acc.good, "cut_by_cache": acc.cut},
        "output_tokens": acc.out_tokens,
        "duration_s": duration,
        "busy_s": acc.busy_s,
        "steps": st.steps,
        "slo": {"ttft_s": acc.slo.ttft_s, "tpot_s": acc.slo.tpot_s},
        "profile": profile.name,
        "config": config.model_dump(),
    }
