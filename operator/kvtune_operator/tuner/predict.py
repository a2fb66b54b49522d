"""Predict a candidate config: replay the window's trace through the simulator.

The profile the prediction runs on is the engine's own picture: memory from the observation's
``memory`` figures (device total, weights, activation peak; K/V bytes per token from the KV cache
bytes and block count), step costs fitted from the engine's step timings (``fit.fit_step_cost``).
A named profile, when known, fills what the window did not measure (activation bytes per batched
token, host memory, swap bandwidth, and every cost when there are no step samples).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from pydantic import PrivateAttr

from kvtune_engine.config import ConfigError, EngineConfig
from kvtune_engine.sim.profile import Profile, SpeedTimeline
from kvtune_engine.quantile import percentile
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_engine.sim.trace import TraceRequest, parse_request
from kvtune_engine.sim.vllm_policy import ADMISSION, QUEUE_CLOCK, vllm_v1_config

from .fit import StepCostFit, fit_step_cost, speed_timeline
from .observation import GiB, Observation, StepSample


class RecordingProfile(Profile):
    """A profile that also logs every step the simulated runner charges (the simulator's "engine
    step timings", as the real engine's ``/kvtune/v1/steps`` would give them)."""

    _steps: list = PrivateAttr(default_factory=list)

    def step_time(self, batched_tokens: int, decode_context_tokens: int, prefill_pairs: float = 0.0,
                  swapped_bytes: int = 0) -> float:
        t = super().step_time(batched_tokens, decode_context_tokens, prefill_pairs, swapped_bytes)
        self._steps.append(StepSample(t, batched_tokens, decode_context_tokens, 1.0, prefill_pairs, swapped_bytes))
        return t

    def take_steps(self) -> list[StepSample]:
        s, self._steps = self._steps, []
        return s

    @classmethod
    def of(cls, profile: Profile) -> "RecordingProfile":
        return cls.model_validate(profile.model_dump())


def as_trace(records: Iterable[Any], *, rebase: bool = True) -> list[TraceRequest]:
    """Trace records (TraceRequest, or dicts in the JSONL format, e.g. the engine's /kvtune/v1/trace),
    in arrival order, ``rebase``d to start at 0, or (``rebase=False``) in the records' own clock (the
    one a fitted profile's speed timeline and a window's start are in)."""
    out = []
    for r in records:
        if isinstance(r, TraceRequest):
            out.append(r)
        else:
            d = dict(r)
            if not d.get("output_tokens"):
                continue  # an unfinished request in the engine's log: its length is not known yet
            out.append(parse_request({k: v for k, v in d.items() if v is not None}))
    out.sort(key=lambda r: r.arrival_s)
    if rebase and out and out[0].arrival_s > 0:
        t0 = out[0].arrival_s
        out = [replace(r, arrival_s=r.arrival_s - t0) for r in out]   # the prefix (group or chain) kept
    return out


def profile_for(obs: Observation | None, base: Profile | None = None, fit: StepCostFit | None = None,
                speed: SpeedTimeline | None = None) -> Profile:
    """The profile predictions run on: ``base`` with the window's memory figures, fitted costs and the
    machine's speed over the window (``fit.speed_timeline``)."""
    upd: dict[str, Any] = {}
    if speed is not None:
        upd["speed"] = speed
    if obs is not None:
        m = obs.memory
        total = float(m.get("device_total", 0) or 0)
        kv = float(m.get("kv_cache", 0) or 0)
        if total > 0 and obs.config.kv_cache_memory is None:
            upd["device_total_bytes"] = int(total)
            if "weights" in m:
                upd["weights_bytes"] = int(m["weights"])
            if "activations_peak" in m:
                per_tok = (base.activation_bytes_per_batched_token if base is not None
                           else float(m["activations_peak"]) / max(1, obs.config.profiled_batched_tokens))
                upd["activation_bytes_per_batched_token"] = per_tok
                upd["activation_base_bytes"] = max(
                    0, int(float(m["activations_peak"]) - per_tok * obs.config.profiled_batched_tokens))
        if base is None:
            if kv <= 0 or obs.num_blocks <= 0:
                raise ValueError("no profile: the window has no KV memory figures and no named profile was given")
            kv_per_tok = kv / (obs.num_blocks * obs.config.block_size)
            # any (layers, heads, head_dim, dtype) with the measured K/V bytes per token will do
            upd.update(num_layers=1, num_kv_heads=1, head_dim=max(1, int(round(kv_per_tok / 2))), kv_dtype_bytes=1)
    if obs is not None and obs.frontend_s > 0:
        upd["frontend_s"] = obs.frontend_s
    if fit is not None:
        upd.update(step_overhead_s=fit.c0, per_token_s=fit.c_tok, weights_read_s=fit.weights_read_s,
                   per_context_token_s=fit.c_ctx, per_prefill_pair_s=fit.c_pair)
    if base is None:
        defaults = dict(name="fitted", description="fitted from the engine's own figures",
                        device_total_bytes=upd.pop("device_total_bytes", 80 * GiB), weights_bytes=0,
                        activation_base_bytes=0, activation_bytes_per_batched_token=0.0, num_layers=1,
                        num_kv_heads=1, head_dim=64, kv_dtype_bytes=2, host_bytes=64 * GiB,
                        swap_bandwidth_bytes_per_s=12e9, step_overhead_s=0.005, weights_read_s=0.0,
                        per_token_s=1e-5, per_context_token_s=1e-8, per_prefill_pair_s=0.0)
        defaults.update(upd)
        return Profile(**defaults)
    if upd:
        upd.setdefault("name", base.name + "+fitted" if fit is not None else base.name)
        return Profile.model_validate({**base.model_dump(), **upd})
    return base


@dataclass
class Predictor:
    """Simulator runs of one trace under candidate configs, cached by config. Two questions:

    * *what the next window would be* under a config changed now (``backlog``): the requests in the
      engine now (``backlog.in_engine``, all at time 0) run first, then the trace (the window's
      arrivals, rebased: the forecast); goodput and latencies count the trace's requests (the
      backlog's have waited already), throughput everything. Without the backlog a replay starts
      with an empty engine: under a deep queue the window's own arrivals (the rate the engine
      served) are no load at all, no candidate looks better, and one that just keeps up with the
      arrivals looks as good as one that also drains the queue.
    * *what a window would have been* under another config (``window_start``: a verdict's
      counterfactual): the trace is the window (in the records' own clock) and ``lead`` the requests
      that arrived before it; the lead runs first and the figures count the requests that finish
      inside the window, as the engine's histograms do (``window_summary``).

    ``vllm``: the engine is vLLM V1, replayed under its policy (``sim.vllm_policy``: always-chunked
    prefill, recompute-only preemption, queue time from intake).

    ``running``: the engine's config now. A candidate that changes only live knobs runs on the engine's
    KV cache as it is: the cache was sized at start-up for the step budget it profiled, and a live
    budget cut frees none of that memory (replayed with the smaller budget's larger cache, a cut from
    8192 to 2048 at a tight gpuMemoryUtilization looked like 4x the blocks, was applied as a memory
    fix and rolled back: issue 18)."""
    profile: Profile
    slo: SLO = field(default_factory=SLO)
    lead: Sequence[TraceRequest] = ()
    window_start: float | None = None
    backlog: Sequence[TraceRequest] = ()
    vllm: bool = False
    running: EngineConfig | None = None
    runs: int = 0
    _cache: dict[str, Mapping[str, Any] | None] = field(default_factory=dict, repr=False)
    _trace_id: int | None = field(default=None, repr=False)

    @classmethod
    def for_window(cls, profile: Profile, slo: SLO, lead: Sequence[Any], window_start: float, *,
                   vllm: bool = False) -> "Predictor":
        return cls(profile, slo, as_trace(lead, rebase=False), window_start, vllm=vllm)

    def as_run(self, cfg: EngineConfig) -> EngineConfig:
        """``cfg`` as the engine would run it: a live change keeps the running engine's profiled step,
        so its KV cache (see ``running``). vLLM changes nothing live: each change is a new start."""
        r = self.running
        if r is None or self.vllm or cfg.restart_changes(r) or cfg.profiled_batched_tokens >= r.profiled_batched_tokens:
            return cfg
        return cfg.with_changes(profile_batched_tokens=r.profiled_batched_tokens)

    def _simulate(self, trace: list[TraceRequest], cfg: EngineConfig, per_request: bool = False) -> dict:
        cfg = self.as_run(cfg)
        if self.vllm:
            return simulate(trace, vllm_v1_config(cfg), self.profile, self.slo, per_request=per_request,
                            queue_clock=QUEUE_CLOCK, admission=ADMISSION)
        return simulate(trace, cfg, self.profile, self.slo, per_request=per_request)

    def predict(self, trace: Sequence[TraceRequest], cfg: EngineConfig) -> Mapping[str, Any] | None:
        """The simulator summary, or None when the config does not fit the device (no KV block fits,
        swap beyond host memory) or nothing is left to replay."""
        if self._trace_id != id(trace):
            self._cache.clear()
            self._trace_id = id(trace)
        key = cfg.model_dump_json()
        if key not in self._cache:
            try:
                self.profile.kv_cache_size(self.as_run(cfg))
            except ConfigError:
                self._cache[key] = None
                return None
            self.runs += 1
            if self.window_start is not None:
                full = self._simulate([*self.lead, *trace], cfg, per_request=True) if trace or self.lead else None
                self._cache[key] = full and window_summary(full, self.window_start, self.slo)
            elif self.backlog:
                n = len(self.backlog)
                full = self._simulate([*self.backlog, *trace], cfg, per_request=True)
                self._cache[key] = window_summary(full, 0.0, self.slo, scored=lambda r: int(r["id"][1:]) >= n)
            else:
                self._cache[key] = self._simulate(list(trace), cfg)
        return self._cache[key]

    def predict_window(self, lead: Sequence[Any], window: Sequence[Any], cfg: EngineConfig,
                       window_start: float) -> Mapping[str, Any] | None:
        """``cfg`` replayed on the ``window`` records with the backlog ``lead`` it inherited (see the
        class docstring), without this predictor's cache."""
        p = Predictor.for_window(self.profile, self.slo, lead, window_start, vllm=self.vllm)
        return p.predict(as_trace(window, rebase=False), cfg)

    def capacity(self, trace: Sequence[TraceRequest], cfg: EngineConfig) -> tuple[float, float] | None:
        """(work, rate): the tokens the engine computes for the backlog and the trace under ``cfg``, and
        the tokens per second it computes them at with a full queue. Both from one replay with every
        request arriving at once, its steps recorded: the rate over the first half of its time (the
        queue is still full there; the tail, with fewer sequences left than the engine runs, would
        read as less capacity than the engine has). Work counts what the steps batched, so prefix
        hits and recomputes are counted as this config computes them. None when the config does not
        fit the device or there is nothing to replay."""
        reqs = [replace(r, arrival_s=0.0) for r in (*self.backlog, *trace)]
        if not reqs:
            return None
        try:
            self.profile.kv_cache_size(self.as_run(cfg))
        except ConfigError:
            return None
        self.runs += 1
        rec = RecordingProfile.of(self.profile)
        self.with_profile(rec)._simulate(reqs, cfg)
        steps = rec.take_steps()
        total = sum(st.duration_s for st in steps)
        if total <= 0:
            return None
        t = tok = 0.0
        for st in steps:
            if t >= total / 2:
                break
            t += st.duration_s
            tok += st.batched_tokens
        return float(sum(st.batched_tokens for st in steps)), tok / t

    def with_profile(self, profile: Profile) -> "Predictor":
        """The same question (backlog, window, lead, policy) on another profile, with its own cache."""
        return Predictor(profile, self.slo, self.lead, self.window_start, self.backlog, self.vllm, self.running)

    def predict_many(self, trace: Sequence[TraceRequest], cfgs: Iterable[EngineConfig]
                     ) -> list[tuple[EngineConfig, Mapping[str, Any]]]:
        out = []
        for c in cfgs:
            s = self.predict(trace, c)
            if s is not None:
                out.append((c, s))
        return out


def fitted(obs: Observation, base: Profile | None, *, min_samples: int = 50,
           speed: bool = False) -> tuple[Profile, StepCostFit | None]:
    """``profile_for`` with costs fitted from the observation's step samples when there are enough
    (``min_samples`` single steps, or 3 means of several: scrape intervals), and (``speed``) the
    machine's speed over the window from the same samples when they carry times."""
    fit = timeline = None
    if len(obs.step_samples) >= min_samples or sum(s.weight > 1 for s in obs.step_samples) >= 3:
        bw = base.swap_bandwidth_bytes_per_s if base is not None else None
        fit = fit_step_cost(obs.step_samples, swap_bandwidth=bw)
        if fit is not None and speed:
            timeline = speed_timeline(obs.step_samples, fit)
    return profile_for(obs, base, fit, timeline), fit


def window_summary(full: Mapping[str, Any], start: float, slo: SLO,
                   scored: Callable[[Mapping[str, Any]], bool] | None = None) -> dict[str, Any]:
    """A replay's summary (``simulate(..., per_request=True)``) over the requests that finished at or
    after ``start``: throughput over the window, per second of it, and goodput and the latency
    percentiles over those of them that are ``scored`` (default all) -- what a verdict compares and
    what candidates are scored on. The memory and queue figures stay the whole replay's; its
    preemptions count pro rata of the window's share of its time."""
    rows = full["per_request"]
    finished = [r for r in rows if r["arrival_s"] + r["e2e_s"] >= start]
    done = finished if scored is None else [r for r in finished if scored(r)]
    end = max((r["arrival_s"] + r["e2e_s"] for r in finished), default=start)
    dur = max(end - start, 1e-9)
    first = min((r["arrival_s"] for r in rows), default=start)
    share = min(1.0, dur / max(end - first, 1e-9))

    def tpot(r: Mapping[str, Any]) -> float | None:
        n = r["output_tokens"]
        return (r["e2e_s"] - r["ttft_s"]) / (n - 1) if n > 1 else None

    out = {k: v for k, v in full.items() if k != "per_request"}
    figs = {"ttft": sorted(r["ttft_s"] for r in done), "queue_time": sorted(r["queue_s"] for r in done),
            "tpot": sorted(t for t in map(tpot, done) if t is not None)}
    out.update({f"{name}_p{round(q * 100)}_s": percentile(v, q) for name, v in figs.items() for q in (0.5, 0.95, 0.99)})
    out.update(goodput_requests_per_s=sum(slo.met(r["ttft_s"], tpot(r)) for r in done) / dur,
               goodput_tokens_per_s=sum(r["output_tokens"] for r in done if slo.met(r["ttft_s"], tpot(r))) / dur,
               e2el_p95_s=percentile(sorted(r["e2e_s"] for r in done), 0.95),
               output_tokens_per_s=sum(r["output_tokens"] for r in finished) / dur,
               requests_per_s=len(done) / dur, duration_s=dur, requests_finished=len(done),
               preemptions={k: round(v * share) for k, v in (full.get("preemptions") or {}).items()})
    out["queue_time_p95_s"] = out["queue_time_p95_s"] or 0.0
    out["queue_time_p99_s"] = out["queue_time_p99_s"] or 0.0
    return out
