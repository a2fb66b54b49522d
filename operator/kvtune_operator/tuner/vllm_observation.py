"""An Observation from vLLM's own metrics (vLLM 0.30 and later), for `kvtune diagnose` and the operator.

vLLM tells less than our engine, and this module is where the gap is bridged, each time saying how:

* the waiting split: vLLM's ``num_requests_waiting_by_reason`` only says "capacity" (or "deferred"),
  not which limit. Each sample (a scrape, or a Prometheus sample) with requests waiting for capacity
  is put down to the limit its figures show: running at the sequence cap -> ``max_num_seqs``; KV
  nearly full or a preemption since the last sample -> ``kv_blocks``; otherwise -> ``token_budget``
  (vLLM V1 stops admitting when the step's tokens are spent). Shares are of samples, not of steps;
* the config: ``cache_config_info`` gives block size, blocks, memory utilization, prefix caching;
  ``max_num_seqs``, ``max_num_batched_tokens`` and ``max_model_len`` are not exported, so they come
  from what the caller knows (flags, the pod's command line) or are inferred from the window
  (`vllm_inference`, each with its evidence); every such value is listed in ``assumed``. A value
  neither given nor inferred is vLLM's default in the config only: no wait is put down to a limit
  whose value is unknown (it is "unexplained"), and when unexplained waits are what the window shows,
  `diagnose_reading` says "not enough evidence" and which ``--assume-*`` flag settles it;
* a wait is never put down to the token budget against the steps' own evidence: with the
  ``iteration_tokens_total`` histogram per sample, only a sample whose steps reached the budget is;
* memory: vLLM exports no device total; with one given, the non-KV memory is what the utilization
  leaves after the KV cache;
* the trace: synthesized from the histograms (`synth_trace`), marked as such.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kvtune_engine.config import EngineConfig
from kvtune_engine.knobs import BLOCK_SIZES, BY_NAME

from .diagnose import Diagnosis, Thresholds, diagnose
from .observation import GiB, LengthStats, MetricFigures, Observation
from .synth_trace import synthesize_trace
from .vllm_inference import (KV_FULL, GaugeSample, Inferred, infer_max_model_len, infer_max_num_seqs,
                             infer_token_budget, kv_bound, steps_between)

#: vLLM's defaults (the knob table's) for the knobs it does not export (vllm serve, V1)
VLLM_DEFAULTS = {k: BY_NAME[k].vllm_value for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")}
#: the `kvtune diagnose` flag that gives each knob vLLM does not export
ASSUME_FLAGS = {"max_num_seqs": "--assume-max-num-seqs", "max_num_batched_tokens": "--assume-max-num-batched-tokens",
                "max_model_len": "--assume-max-model-len"}
#: a capacity wait that no known limit explains (a limit whose value is unknown, or figures that fit none)
UNEXPLAINED = "unexplained"


def is_vllm(figures: MetricFigures) -> bool:
    """True for a vLLM /metrics (vllm: series and none of kvtune's own)."""
    names = {n for n, _ in figures.values}
    return any(n.startswith("vllm:") for n in names) and not any(n.startswith("kvtune_") for n in names)


def in_system(samples: Sequence[GaugeSample]) -> tuple[float, float]:
    """Requests running or waiting at the first and at the last sample, summed over replicas."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for s in samples:
        first.setdefault(s.replica, s.running + s.waiting)
        last[s.replica] = s.running + s.waiting
    return sum(first.values()), sum(last.values())


STEP_HIST = "vllm:iteration_tokens_total"


def prompt_tokens_mean(figures: MetricFigures) -> float:
    """The window's mean prompt length (``request_prompt_tokens``), 0 when no request finished."""
    n = figures.hist_count("vllm:request_prompt_tokens")
    return (figures.hist_sum("vllm:request_prompt_tokens") or 0.0) / n if n else 0.0


def samples_of_scrapes(scrapes: Sequence[MetricFigures]) -> list[GaugeSample]:
    """One sample per scrape; the preemptions and the steps (iteration-tokens histogram) since the
    previous scrape (none for the first)."""
    out, prev = [], None
    for s in scrapes:
        pre = s.get("vllm:num_preemptions_total") or 0.0
        cap = s.get("vllm:num_requests_waiting_by_reason", reason="capacity")
        steps = None
        if prev is not None and s.hist_count(STEP_HIST) is not None and prev.hist_count(STEP_HIST) is not None:
            steps = steps_between(s.buckets(STEP_HIST), prev.buckets(STEP_HIST),
                                  max(0.0, s.hist_count(STEP_HIST) - prev.hist_count(STEP_HIST)),
                                  max(0.0, (s.hist_sum(STEP_HIST) or 0.0) - (prev.hist_sum(STEP_HIST) or 0.0)))
        out.append(GaugeSample(running=s.get("vllm:num_requests_running") or 0.0,
                               waiting=cap if cap is not None else (s.get("vllm:num_requests_waiting") or 0.0),
                               kv_usage=s.get("vllm:kv_cache_usage_perc") or 0.0,
                               preempted=max(0.0, pre - (prev.get("vllm:num_preemptions_total") or 0.0))
                               if prev is not None else 0.0, steps=steps))
        prev = s
    return out


def classify(sample: GaugeSample, max_num_seqs: int | None, token_budget: int | None = None) -> str | None:
    """The limit a capacity wait is put down to (module docstring); None when nothing waits,
    UNEXPLAINED when no limit whose value is known explains it: the cap unknown, or running under it
    with KV free and the budget unknown, or the sample's steps below the budget."""
    if sample.waiting < 1:
        return None
    if max_num_seqs is not None and sample.running >= max_num_seqs:
        return "max_num_seqs"
    if sample.kv_usage >= KV_FULL or sample.preempted > 0:
        return "kv_blocks"
    if max_num_seqs is None or token_budget is None:
        return UNEXPLAINED
    st = sample.steps
    if st is not None and st.steps > 0 and (st.tokens_max or 0.0) < token_budget:
        return UNEXPLAINED  # no step of the interval reached the budget: it did not stop the head
    return "token_budget"


def waiting_shares(samples: Sequence[GaugeSample], max_num_seqs: int | None,
                   token_budget: int | None = None) -> dict[str, float]:
    """Share of samples whose capacity wait each limit explains, and the UNEXPLAINED share."""
    causes = [classify(s, max_num_seqs, token_budget) for s in samples]
    n = len(causes) or 1
    return {c: sum(1 for x in causes if x == c) / n for c in ("max_num_seqs", "token_budget", "kv_blocks", UNEXPLAINED)}


@dataclass(frozen=True)
class VllmAssumptions:
    """What the caller knows of vLLM's knobs that its metrics do not say (None: vLLM's default)."""
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    device_memory_gib: float | None = None
    #: where the given values come from, for the "assumed" notes ("flag", "pod command line" ...)
    given_by: str = "flag"


@dataclass(frozen=True)
class VllmReading:
    observation: Observation
    #: knob -> how its value was arrived at, for every value vLLM's metrics did not give
    assumed: dict[str, str] = field(default_factory=dict)
    #: the synthesized trace (marked: never a recorded one)
    trace: list[dict[str, Any]] = field(default_factory=list)
    trace_synthesized: bool = True
    #: knob -> why it is unknown (neither given nor inferred; the config holds vLLM's default)
    unknown: dict[str, str] = field(default_factory=dict)
    #: share of samples with a capacity wait that no known limit explains
    unexplained_share: float = 0.0


def _bool(v: str | None) -> bool | None:
    return None if v is None else v.strip().lower() == "true"


def _num(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "", "None") else None
    except ValueError:
        return None


def read_vllm(figures: MetricFigures, samples: Sequence[GaugeSample], *, window_s: float,
              assume: VllmAssumptions = VllmAssumptions(), slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None, seed: int = 0) -> VllmReading:
    """Observation of a vLLM window: ``figures`` as in `Observation.from_metrics` (counter increases,
    gauge means and maxima), ``samples`` the gauges over the window (at least one)."""
    f = figures
    info = f.info_labels("vllm:cache_config_info") or {}
    assumed: dict[str, str] = {}
    unknown: dict[str, str] = {}
    known: dict[str, int | None] = {}
    for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        v = getattr(assume, k)
        if v is not None:
            known[k] = int(v)
            assumed[k] = f"{int(v)} ({assume.given_by})"
    running_peak = max([s.running for s in samples] + [f.get("vllm:num_requests_running", agg="max") or 0.0])
    inferred: dict[str, Inferred] = {}
    if "max_num_batched_tokens" not in known:
        inferred["max_num_batched_tokens"] = infer_token_budget(
            f.buckets(STEP_HIST), f.buckets("vllm:request_prompt_tokens"), f.get("vllm:prefix_cache_hits_total") or 0.0,
            kv_pressed=any(kv_bound(s) for s in samples) or (f.get("vllm:num_preemptions_total") or 0.0) > 0,
            least=known.get("max_num_seqs") or 1)
    budget = known.get("max_num_batched_tokens") or inferred["max_num_batched_tokens"].value
    if "max_num_seqs" not in known:
        inferred["max_num_seqs"] = infer_max_num_seqs(samples, running_peak, budget)
    if "max_model_len" not in known:
        inferred["max_model_len"] = infer_max_model_len(info)
    for k, inf in inferred.items():
        known[k] = inf.value
        if inf.known:
            assumed[k] = f"{inf.value} ({inf.evidence})"
        else:
            unknown[k] = inf.evidence
            assumed[k] = (f"{VLLM_DEFAULTS[k]} (vLLM's default, used only where a value is needed: not exported, "
                          f"and {inf.evidence}; pass {ASSUME_FLAGS[k]})")
    cap = known["max_num_seqs"]
    if cap is not None and running_peak > cap:  # the metrics prove the cap is at least this
        cap = known["max_num_seqs"] = int(running_peak)
        assumed["max_num_seqs"] = f"{int(running_peak)} (more were running than assumed)"
    cfg = {k: (v if v is not None else VLLM_DEFAULTS[k]) for k, v in known.items()}
    bs = int(_num(info.get("block_size")) or 16)
    if bs not in BLOCK_SIZES:  # the simulator's block sizes; keep the nearest
        near = min(BLOCK_SIZES, key=lambda b: abs(b - bs))
        assumed["block_size"] = f"{near} (vLLM's {bs} is outside the simulator's sizes)"
        bs = near
    cfg["block_size"] = bs
    if cfg["max_num_batched_tokens"] < bs:  # vLLM may run it; the simulator's least step is one block
        assumed["max_num_batched_tokens"] = (f"{bs} (vLLM's {cfg['max_num_batched_tokens']} is below one {bs}-token "
                                             "block, the simulator's least step)")
        cfg["max_num_batched_tokens"] = bs
    util = _num(info.get("gpu_memory_utilization"))
    if util is not None:
        cfg["gpu_memory_utilization"] = min(max(util, 0.01), 1.0)
    epc = _bool(info.get("enable_prefix_caching"))
    if epc is not None:
        cfg["enable_prefix_caching"] = epc
    cfg["enable_chunked_prefill"] = True   # vLLM V1 always chunks prefills
    cfg["swap_space"] = 0.0                # and preempts by recompute only
    cfg["watermark"] = 0.0
    kv_bytes = _num(info.get("kv_cache_memory_bytes"))
    num_blocks = int(_num(info.get("num_gpu_blocks")) or 0)
    memory: dict[str, float] = {}
    if assume.device_memory_gib is not None and util is not None:
        total = assume.device_memory_gib * GiB
        kv = kv_bytes if kv_bytes is not None else 0.0
        if kv > 0:
            memory = {"device_total": total, "kv_cache": kv, "weights": max(0.0, util * total - kv),
                      "activations_peak": 0.0}
            assumed["device_memory"] = f"{assume.device_memory_gib:g} GiB ({assume.given_by}); non-KV memory = " \
                                       "utilization x device - KV cache"
    elif kv_bytes is not None:
        # no device total (vLLM on CPU sizes its KV cache in GiB): the cache size is the knob
        cfg["kv_cache_memory"] = round(kv_bytes / GiB, 4)
        memory = {"kv_cache": kv_bytes}
    config = EngineConfig.model_validate(cfg)

    shares = waiting_shares(samples, cap, known["max_num_batched_tokens"])
    win = float(window_s)
    finished = f.hist_count("vllm:e2e_request_latency_seconds") or 0.0
    rps = finished / win if win > 0 else 0.0
    out_tokens = f.get("vllm:generation_tokens_total") or 0.0
    goodput = rps
    if slo_ttft_s is not None:
        goodput = min(goodput, rps * f.hist_cdf("vllm:time_to_first_token_seconds", slo_ttft_s))
    if slo_tpot_s is not None:
        goodput = min(goodput, rps * f.hist_cdf("vllm:inter_token_latency_seconds", slo_tpot_s))
    hits, queries = f.get("vllm:prefix_cache_hits_total"), f.get("vllm:prefix_cache_queries_total")
    trace = synthesize_trace(f, win, seed=seed, max_model_len=config.max_model_len, in_system=in_system(samples))
    q = lambda name, p: f.hist_quantile(name, p)  # noqa: E731
    running = [s.running for s in samples] or [0.0]
    waiting = [s.waiting for s in samples] or [0.0]
    usage = [s.kv_usage for s in samples] or [0.0]
    pre = int(f.get("vllm:num_preemptions_total") or 0)
    obs = Observation(
        config=config, source="vllm", window_s=win,
        waiting_cause_share={k: v for k, v in shares.items() if k != UNEXPLAINED},
        num_blocks=num_blocks,
        kv_usage_mean=sum(usage) / len(usage), kv_usage_peak=max(usage),
        prefix_cache_hit_rate=(hits / queries) if hits is not None and queries else None,
        preemptions_recompute=pre,
        memory=memory, quantiles="histogram",
        queue_time_p50_s=q("vllm:request_queue_time_seconds", 0.5),
        queue_time_p95_s=q("vllm:request_queue_time_seconds", 0.95),
        queue_time_p99_s=q("vllm:request_queue_time_seconds", 0.99),
        ttft_p50_s=q("vllm:time_to_first_token_seconds", 0.5),
        ttft_p95_s=q("vllm:time_to_first_token_seconds", 0.95),
        ttft_p99_s=q("vllm:time_to_first_token_seconds", 0.99),
        tpot_p50_s=q("vllm:inter_token_latency_seconds", 0.5),
        tpot_p95_s=q("vllm:inter_token_latency_seconds", 0.95),
        tpot_p99_s=q("vllm:inter_token_latency_seconds", 0.99),
        output_tokens_per_s=out_tokens / win if win > 0 else 0.0,
        requests_per_s=rps, goodput_requests_per_s=goodput, requests_finished=int(finished),
        running_mean=sum(running) / len(running), running_peak=max(running),
        waiting_mean=sum(waiting) / len(waiting), waiting_peak=max(waiting),
        lengths=LengthStats.from_trace(trace) if trace else None,
    )
    return VllmReading(obs, assumed, trace, True, unknown=unknown, unexplained_share=shares[UNEXPLAINED])


def diagnose_reading(reading: VllmReading, thresholds: Thresholds = Thresholds(), **kw: Any) -> Diagnosis:
    """`diagnose` of a vLLM reading, or NotEnoughEvidence when the window's waits are mostly ones no
    known limit explains (naming a cause would guess the unknown limit's value)."""
    obs, u = reading.observation, reading.unexplained_share
    explained = max(obs.waiting_cause_share.values(), default=0.0)
    if u < thresholds.blocked_share or u < explained:
        return diagnose(obs, thresholds, **kw)
    flags = [ASSUME_FLAGS[k] for k in ("max_num_seqs", "max_num_batched_tokens") if k in reading.unknown]
    ask = (f"pass {' and '.join(flags)} with the server's values" if flags else
           "check the given max_num_seqs and max_num_batched_tokens against the server's flags")
    why = "; ".join(f"{k}: {v}" for k, v in reading.unknown.items() if k != "max_model_len") or (
        "the waits fit no given limit: running under the cap with KV free and steps under the budget")
    figs = {"unexplained_share": round(u, 4), "waiting_cause_share": dict(obs.waiting_cause_share),
            "running": round(obs.running_peak, 1), "waiting": round(obs.waiting_peak, 1),
            "kv_usage": round(obs.kv_usage_mean, 4), "unknown": dict(reading.unknown), "flags": flags}
    msg = (f"Not enough evidence to name a cause: requests waited in {100 * u:.0f}% of samples (running up to "
           f"{obs.running_peak:g}, KV usage {100 * obs.kv_usage_mean:.0f}%) and no known limit explains it ({why}); "
           f"{ask}, or observe a longer window under load.")
    return Diagnosis("NotEnoughEvidence", msg, figs, None, {})


def assumed_text(assumed: Mapping[str, str]) -> str:
    return "; ".join(f"{k} = {v}" for k, v in assumed.items())
