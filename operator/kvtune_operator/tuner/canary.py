"""The canary verdict: one engine runs the change, its siblings do not, and the same window judges both.

A before/after verdict compares the window after a change with the one before it; when the traffic
moves between windows (bursts, a diurnal swing) a good change can read as bad and a bad one as good.
With two or more replicas behind one balancer the canary and its controls share every minute of the
window and the arrivals' mix, so the load cancels out of the comparison: the verdict is canary vs
controls, per pod, over the same window.

Gates are data (``Gates``, from ``spec.autotune.canary.gates``): the canary's slo attainment over the
controls' at least ``goodput_ratio_min`` (default ``1 - Objectives.regression_threshold``: today's
before/after rule, a fall of more than 10% is a regression), and, when set, its p99 ttft at most
``ttft_p99_ratio_max`` times the controls' and its error rate at most ``error_rate_max``. As in the
before/after rule, when neither side has any goodput (deep overload) output throughput per request
offered stands in for attainment.

A pod's attainment counts the requests it finished and, as misses, the growth of its waiting queue
over the window (``PodFigures.unserved``: requests offered in the window that it had not begun to
serve at its end). Finished requests alone are the survivors: a canary that serves too few sequences
finishes the requests it admits in time while the rest queue, and read 0.57 against its controls'
0.47 (the controls' queues short) with its queue at 18 s, promoted, in a CI run.

The canary serves only its share of the window's requests, so its slo attainment carries a sampling
noise of its own (a few percent on a few hundred requests): a change whose true ratio is near the
gate often reads as just beyond it. The goodput gate therefore allows for it: its margin from the
limit is measured in standard errors of the two attainments (binomial), and a gate within ``Z`` of
its limit is not settled. An unsettled verdict measures on, the window growing, up to
``Gates.max_windows`` windows; at the last the point estimate decides.

Invariant: ``judge_canary`` is pure (figures in, verdict out) and promotes only when every gate
passes; one replica has no control, so it keeps the before/after verdict (``canary_applies``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .decide import Objectives, judge

#: the before/after rule's regression threshold (decide.Objectives.regression_threshold), as a ratio
DEFAULT_GOODPUT_RATIO_MIN = 1 - Objectives().regression_threshold
#: under this slo attainment on both sides goodput says nothing: throughput decides (as decide._compare)
NO_GOODPUT = 0.01
#: standard errors a gate's figure must be from its limit to settle the verdict (one-sided 95%)
Z = 1.645
#: windows a canary may run while its goodput gate stays within its sampling noise
DEFAULT_MAX_WINDOWS = 3


def canary_applies(replicas: int) -> bool:
    """Whether a change is judged as a canary: only with a control, i.e. two or more replicas."""
    return replicas >= 2


@dataclass(frozen=True)
class Gates:
    goodput_ratio_min: float = DEFAULT_GOODPUT_RATIO_MIN
    ttft_p99_ratio_max: float | None = None
    error_rate_max: float | None = None
    max_windows: int = DEFAULT_MAX_WINDOWS

    def __post_init__(self) -> None:
        if self.max_windows < 1:
            raise ValueError(f"maxWindows must be >= 1, got {self.max_windows}")
        if self.goodput_ratio_min < 0:
            raise ValueError(f"goodputRatioMin must be >= 0, got {self.goodput_ratio_min}")
        if self.ttft_p99_ratio_max is not None and self.ttft_p99_ratio_max <= 0:
            raise ValueError(f"ttftP99RatioMax must be > 0, got {self.ttft_p99_ratio_max}")
        if self.error_rate_max is not None and not 0 <= self.error_rate_max <= 1:
            raise ValueError(f"errorRateMax must be within 0..1, got {self.error_rate_max}")


@dataclass(frozen=True)
class PodFigures:
    """One engine pod over the window (per-pod series from Prometheus, or a simulator replay)."""
    pod: str
    requests: float                 # requests finished (or offered) in the window
    good: float                     # of them, meeting the objectives (ttft and tpot)
    output_tokens: float = 0.0
    errors: float = 0.0             # failed requests (aborted, rejected)
    ttft_p99_s: float | None = None
    unserved: float = 0.0           # the waiting queue's growth over the window: offered, not yet begun

    @property
    def offered(self) -> float:
        return self.requests + self.unserved

    @property
    def slo_attainment(self) -> float:
        return self.good / self.offered if self.offered > 0 else 0.0

    @property
    def tokens_per_request(self) -> float:
        return self.output_tokens / self.offered if self.offered > 0 else 0.0

    @property
    def error_rate(self) -> float:
        n = self.requests + self.errors
        return self.errors / n if n > 0 else 0.0


@dataclass(frozen=True)
class GateResult:
    name: str                       # goodputRatioMin | ttftP99RatioMax | errorRateMax (the spec's names)
    canary: float
    control: float | None           # None: a gate on the canary alone (errorRateMax)
    value: float                    # the figure the limit applies to (a ratio, or the canary's rate)
    limit: float
    passed: bool
    note: str = ""
    settled: bool = True            # False: within the sampling noise of its limit (``Z``)


@dataclass(frozen=True)
class CanaryJudgement:
    promote: bool
    canary: str
    controls: tuple[str, ...]
    gates: tuple[GateResult, ...]
    reason: str
    window_s: float | None = None

    @property
    def verdict(self) -> str:
        return "Promote" if self.promote else "Revert"

    @property
    def settled(self) -> bool:
        """Whether every gate read clear of its sampling noise (else a longer window may say otherwise)."""
        return all(g.settled for g in self.gates)


def pooled(controls: Sequence[PodFigures]) -> PodFigures:
    """The controls as one: counts summed; p99 ttft as the request-weighted mean of theirs (a
    percentile does not add up; each control saw the same mix of arrivals)."""
    if not controls:
        raise ValueError("a canary needs at least one control pod")
    req = sum(c.requests for c in controls)
    p99s = [(c.ttft_p99_s, c.requests) for c in controls if c.ttft_p99_s is not None]
    w = sum(n for _, n in p99s)
    p99 = sum(v * n for v, n in p99s) / w if w > 0 else (p99s[0][0] if p99s else None)
    return PodFigures("+".join(c.pod for c in controls), req, sum(c.good for c in controls),
                      sum(c.output_tokens for c in controls), sum(c.errors for c in controls), p99,
                      sum(c.unserved for c in controls))


def judge_canary(canary: PodFigures, controls: Sequence[PodFigures], gates: Gates = Gates(),
                 window_s: float | None = None) -> CanaryJudgement:
    """Promote or revert the change the ``canary`` runs, against ``controls`` over the same window."""
    ctl = pooled(controls)
    results: list[GateResult] = []
    r = gates.goodput_ratio_min
    if canary.slo_attainment < NO_GOODPUT and ctl.slo_attainment < NO_GOODPUT:
        c, k, note = canary.tokens_per_request, ctl.tokens_per_request, "output tokens per request: no goodput on either side"
        settled = True  # no sampling model for token counts: the point estimate decides
    else:
        c, k, note = canary.slo_attainment, ctl.slo_attainment, "slo attainment"
        margin = attainment_margin(canary, ctl, r)
        settled = abs(margin) >= Z
        note += "" if settled else f", within sampling noise ({abs(margin):.1f} standard errors of the limit)"
    ratio = c / k if k > 0 else (1.0 if c <= 0 else float("inf"))
    results.append(GateResult("goodputRatioMin", c, k, ratio, r, ratio >= r, note, settled))
    if gates.ttft_p99_ratio_max is not None:
        if canary.ttft_p99_s is None or ctl.ttft_p99_s is None:
            results.append(GateResult("ttftP99RatioMax", canary.ttft_p99_s or 0.0, ctl.ttft_p99_s, 0.0,
                                      gates.ttft_p99_ratio_max, False, "no p99 ttft measured: the gate cannot pass"))
        else:
            r = canary.ttft_p99_s / ctl.ttft_p99_s if ctl.ttft_p99_s > 0 else (1.0 if canary.ttft_p99_s <= 0 else float("inf"))
            results.append(GateResult("ttftP99RatioMax", canary.ttft_p99_s, ctl.ttft_p99_s, r,
                                      gates.ttft_p99_ratio_max, r <= gates.ttft_p99_ratio_max, "p99 ttft (s)"))
    if gates.error_rate_max is not None:
        results.append(GateResult("errorRateMax", canary.error_rate, ctl.error_rate, canary.error_rate,
                                  gates.error_rate_max, canary.error_rate <= gates.error_rate_max, "error rate"))
    promote = all(g.passed for g in results)
    said = "; ".join(f"{g.name} {'passed' if g.passed else 'FAILED'}: {g.note} {_fmt(g.canary)} vs "
                     f"{_fmt(g.control) if g.control is not None else '-'} "
                     f"({_fmt(g.value)} {'>=' if g.name == 'goodputRatioMin' else '<='} {g.limit:g})" for g in results)
    reason = (f"canary {canary.pod} vs {len(controls)} control(s) over the same window: "
              f"{'promoted' if promote else 'reverted'}; {said}")
    return CanaryJudgement(promote, canary.pod, tuple(c.pod for c in controls), tuple(results), reason, window_s)


def attainment_margin(canary: PodFigures, ctl: PodFigures, ratio_min: float) -> float:
    """How many standard errors the canary's slo attainment is above ``ratio_min`` times the
    controls' (negative: below): each attainment a binomial share of its own requests, its variance
    taken at (good + 1) / (offered + 2) so that a share of 0 or 1 still has some."""
    def var(p: PodFigures) -> float:
        q = (p.good + 1) / (p.offered + 2)
        return q * (1 - q) / max(p.offered, 1.0)
    se = math.sqrt(var(canary) + ratio_min ** 2 * var(ctl))
    return (canary.slo_attainment - ratio_min * ctl.slo_attainment) / se


def _fmt(v: float) -> str:
    return "inf" if v == float("inf") else f"{v:.3g}"


def check() -> None:
    """The invariant: the default gates give the before/after rule's verdict on the same figures
    (decide.judge), and a canary is promoted only when every gate passed."""
    controls = [PodFigures("control", 200, 160, 20000)]
    for ratio in (0.5, 0.85, 0.95, 1.0, 1.2):
        j = judge_canary(PodFigures("canary", 200, 160 * ratio, 20000), controls)
        kept = judge({"goodput_share": 0.8}, {"goodput_share": 0.8 * ratio}, None,
                     Objectives().regression_threshold).keep
        if j.promote != kept or j.promote != all(g.passed for g in j.gates):
            raise AssertionError(f"canary verdict at ratio {ratio} disagrees with the before/after rule")
