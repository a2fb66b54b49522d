"""How far a prediction can be trusted: the utilization it implies and the range its speed error spans.

A replay is only as good as the cost model's speed. Far from saturation a few percent of speed error
moves goodput by a few percent; near it (the offered load close to what the config can serve) the
same error decides whether the queue stays short or grows without end, and a simulator then
predicts TTFT orders of magnitude too low. So each prediction the tuner acts on carries:

* ``utilization``: the work offered over the window (the tokens the engine computes for the backlog
  and the window's arrivals, over the time the arrivals span) over the rate the config computes
  tokens at with a full queue (``Predictor.capacity``);
* a goodput range: the same replay with every step cost scaled by ``1 +- spread``, ``spread`` the
  step fit's relative residual (``StepCostFit.rel_rmse``) within ``Thresholds.speed_spread_min``
  and ``speed_spread_max``.

Invariant (``trust``): a change whose candidate is near saturation (utilization at or above
``Thresholds.saturated_utilization``) is taken only when it beats the current config by the least
gain at both ends of the range (the engine slower by the spread, and faster: the same error for
both); otherwise the tuner declines and says why, with the figures. Pure: replays and arithmetic, nothing read or written outside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profile import Profile
from kvtune_engine.sim.trace import TraceRequest

from .fit import StepCostFit
from .predict import Predictor
from .thresholds import Thresholds

#: the Profile fields that are step costs (seconds): scaled together for a slower or faster engine
COST_FIELDS = ("step_overhead_s", "weights_read_s", "per_token_s", "per_context_token_s", "per_prefill_pair_s")


@dataclass(frozen=True)
class Confidence:
    """One config's prediction with what makes it (un)reliable."""
    utilization: float | None          # offered work / capacity (None: no capacity to compare)
    capacity_tokens_per_s: float | None  # computed (batched) tokens per second with a full queue
    goodput: float                     # the point prediction (request goodput, req/s)
    goodput_low: float                 # the engine ``spread`` slower
    goodput_high: float                # the engine ``spread`` faster
    spread: float

    def saturated(self, th: Thresholds) -> bool:
        return self.utilization is not None and self.utilization >= th.saturated_utilization

    def figures(self) -> dict[str, float]:
        """The figures a history entry and status quote (snake_case, window-figure style)."""
        out = {"goodput_low_requests_per_s": self.goodput_low, "goodput_high_requests_per_s": self.goodput_high,
               "speed_spread": self.spread}
        if self.utilization is not None:
            out["utilization"] = self.utilization
        return out


def speed_spread(fit: StepCostFit | None, th: Thresholds) -> float:
    """The relative speed error a range assumes: the fit's residual spread, within the thresholds."""
    rel = fit.rel_rmse if fit is not None else 0.0
    return min(th.speed_spread_max, max(th.speed_spread_min, rel))


def scaled_costs(profile: Profile, factor: float) -> Profile:
    """``profile`` with every step cost times ``factor`` (> 1: a slower engine)."""
    if factor <= 0:
        raise ValueError(f"a cost factor must be positive, got {factor}")
    return profile.model_copy(update={k: getattr(profile, k) * factor for k in COST_FIELDS})


def arrival_span_s(trace: Sequence[TraceRequest]) -> float | None:
    """The time the window's arrivals span (None: too few to tell a rate)."""
    if len(trace) < 2:
        return None
    span = max(r.arrival_s for r in trace) - min(r.arrival_s for r in trace)
    return span if span > 0 else None


def assess(pred: Predictor, trace: Sequence[TraceRequest], cfg: EngineConfig, summary: Mapping[str, Any],
           spread: float) -> Confidence:
    """The utilization and goodput range of ``cfg``'s prediction ``summary`` (three more replays)."""
    cap = pred.capacity(trace, cfg)
    span = arrival_span_s(trace)
    util = cap[0] / span / cap[1] if cap is not None and span is not None and cap[1] > 0 else None

    def goodput(s: Mapping[str, Any] | None) -> float:
        return float((s or {}).get("goodput_requests_per_s", 0.0) or 0.0)

    slow = pred.with_profile(scaled_costs(pred.profile, 1 + spread)).predict(trace, cfg)
    fast = pred.with_profile(scaled_costs(pred.profile, 1 / (1 + spread))).predict(trace, cfg)
    point = goodput(summary)
    lo, hi = goodput(slow), goodput(fast)
    return Confidence(util, cap[1] if cap is not None else None, point, min(lo, point), max(hi, point), spread)


def trust(candidate: Confidence, current: Confidence, th: Thresholds, min_gain: float) -> str | None:
    """Why a change to ``candidate`` is not to be taken on its prediction, or None to take it.

    Near saturation the change must win across the range: with the engine slower by the spread and
    with it faster (the same error for both configs: it is the machine's), the candidate's goodput
    must beat the current config's by ``min_gain``. A choice made on throughput alone (no goodput
    predicted) is not judged here."""
    if not candidate.saturated(th) or candidate.goodput <= 0:
        return None
    ends = (("slower", candidate.goodput_low, current.goodput_low), ("faster", candidate.goodput_high, current.goodput_high))
    lost = [(end, c, b) for end, c, b in ends if not (c > b * (1 + min_gain) and c > 0)]
    if not lost:
        return None
    return (f"declined: the candidate's predicted utilization is {candidate.utilization:.2f} (at or above "
            f"{th.saturated_utilization:.2f}: near saturation a {candidate.spread:.0%} speed error in the cost "
            "model decides whether the queue grows), and it does not beat the current config by "
            f"{min_gain:.0%} across that range: " + "; ".join(
                f"with the engine {candidate.spread:.0%} {end}, goodput {c:.3g} vs {b:.3g} req/s" for end, c, b in lost))
