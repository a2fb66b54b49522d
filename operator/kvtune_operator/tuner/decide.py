"""Choose among predicted candidates, then verify the change and roll it back when it regressed.

Everything here is pure: time is an argument (seconds on any clock), nothing is read or written
outside the objects. ``TunerState`` round-trips through ``to_dict``/``from_dict`` so the operator can keep
it in ``status.tuning``.

Objective (``spec.autotune.objectives``): goodput (requests/s meeting the TTFT and TPOT SLO) first,
then output throughput; a preemption-rate target, when set, is a constraint (candidates that meet it
rank before those that do not). Predictions closer than ``close_margin`` count as equal, and then
a live change beats a restart change (a rollout costs capacity) and fewer changed knobs beat more.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from kvtune_engine.config import RESTART_KNOBS, EngineConfig
from kvtune_engine.knobs import BY_NAME, TUNED_KNOBS


@dataclass(frozen=True)
class Objectives:
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    max_preemptions_per_min: float | None = None
    #: relative difference under which two predictions count as equal
    close_margin: float = 0.03
    #: least predicted relative gain over the current config worth a change
    min_gain: float = 0.03
    #: a measured window this much worse than the one before the change is a regression
    regression_threshold: float = 0.10
    #: seconds between restart-requiring changes (rollbacks are exempt)
    cooldown_s: float = 900.0
    #: seconds a rolled-back candidate stays barred
    bad_memory_s: float = 3600.0
    #: most restart-requiring changes in all (None: no limit beyond the cooldown)
    max_restarts: int | None = None
    #: knobs the engine changes without a restart (None: the knob table's live knobs; runtime vllm:
    #: none, vLLM applies every knob at start-up only)
    live_knobs: frozenset[str] | None = None


def _f(summary: Mapping[str, Any], key: str) -> float:
    return float(summary.get(key, 0.0) or 0.0)


def preemptions_per_min(summary: Mapping[str, Any]) -> float:
    pre = summary.get("preemptions") or {}
    n = float(pre.get("swap", 0) or 0) + float(pre.get("recompute", 0) or 0)
    dur = _f(summary, "duration_s")
    if dur <= 0:
        rps = _f(summary, "requests_per_s")
        fin = _f(summary, "requests_finished") or _f(summary, "num_requests")
        dur = fin / rps if rps > 0 and fin > 0 else 0.0
    return n * 60.0 / dur if dur > 0 else 0.0


def recomputes(summary: Mapping[str, Any]) -> int:
    """Recompute preemptions: work thrown away (a swap preemption keeps its KV on the host)."""
    return int((summary.get("preemptions") or {}).get("recompute", 0) or 0)


@dataclass(frozen=True, order=True)
class Score:
    """Comparable figure of merit of one simulator summary (higher is better).

    Goodput first, then throughput (both with a relative margin: within it they tie), then fewer
    recompute preemptions (work thrown away; counts when it halves and drops by at least 3)."""
    feasible: bool
    goodput: float
    throughput: float
    neg_recompute: int = 0
    #: goodput of one request over the replay (1 / duration): differences of a few requests are noise
    unit: float = field(default=0.0, compare=False)

    @classmethod
    def of(cls, summary: Mapping[str, Any], objectives: Objectives) -> "Score":
        feasible = True
        if objectives.max_preemptions_per_min is not None:
            feasible = preemptions_per_min(summary) <= objectives.max_preemptions_per_min
        dur = _f(summary, "duration_s")
        return cls(feasible, _f(summary, "goodput_requests_per_s"), _f(summary, "output_tokens_per_s"),
                   -recomputes(summary), 1.0 / dur if dur > 0 else 0.0)

    def beats(self, other: "Score", margin: float) -> bool:
        """Better by more than ``margin`` (relative), on goodput first, throughput on a goodput tie,
        then far fewer recompute preemptions. A goodput difference counts only when it is also above
        the noise floor (in deep overload, goodput is a handful of lucky requests)."""
        if self.feasible != other.feasible:
            return self.feasible
        floor = self.noise_floor(other)
        if self.goodput > other.goodput * (1 + margin) + 1e-12 and self.goodput - other.goodput >= floor:
            return True
        if self.goodput < other.goodput * (1 - margin) - 1e-12 and other.goodput - self.goodput >= floor:
            return False
        if self.throughput > other.throughput * (1 + margin) + 1e-12:
            return True
        if self.throughput < other.throughput * (1 - margin) - 1e-12:
            return False
        mine, theirs = -self.neg_recompute, -other.neg_recompute
        return mine <= theirs / 2 and theirs - mine >= 3

    def noise_floor(self, other: "Score") -> float:
        """Least goodput difference that is not noise: one standard deviation of the count of requests
        meeting the SLO (Poisson), and at least 3 requests, over the replay."""
        unit = max(self.unit, other.unit)
        if unit <= 0:
            return 0.0
        good = max(self.goodput, other.goodput) / unit
        return max(3.0, math.sqrt(good)) * unit

    def close_to(self, other: "Score", margin: float) -> bool:
        """Goodput and throughput within ``margin`` of each other (preemptions aside)."""
        def near(a: float, b: float, floor: float = 0.0) -> bool:
            return abs(a - b) <= max(margin * max(abs(a), abs(b)), floor) + 1e-12
        return self.feasible == other.feasible and \
            near(self.goodput, other.goodput, self.noise_floor(other)) and \
            near(self.throughput, other.throughput)


def knob_changes(before: EngineConfig, after: EngineConfig) -> dict[str, Any]:
    return {k: getattr(after, k) for k in TUNED_KNOBS if getattr(before, k) != getattr(after, k)}


def config_key(cfg: EngineConfig) -> str:
    """Identity of a candidate for the bad-candidate memory (its tuned knobs)."""
    return values_key(cfg.model_dump())


def values_key(values: Mapping[str, Any]) -> str:
    """`config_key` of typed knob values (EngineConfig field names), e.g. read back from status."""
    return json.dumps({k: values.get(k) for k in TUNED_KNOBS}, sort_keys=True)


@dataclass
class Decision:
    """What the tuner chose in one round (``action == "none"`` keeps the current config)."""
    action: str                        # "change" | "none"
    reason: str
    current: EngineConfig
    config: EngineConfig               # the chosen config (== current when action is none)
    changes: dict[str, Any] = field(default_factory=dict)
    restart: bool = False
    predicted: Mapping[str, Any] | None = None   # simulator summary of the chosen config
    baseline: Mapping[str, Any] | None = None    # simulator summary of the current config
    considered: int = 0
    barred: int = 0                    # candidates skipped: remembered as bad or in cooldown
    #: the chosen prediction's utilization and goodput range (confidence.Confidence.figures)
    confidence: dict[str, float] | None = None

    @property
    def predicted_gain(self) -> float:
        if not self.predicted or not self.baseline:
            return 0.0
        b = _f(self.baseline, "goodput_requests_per_s")
        p = _f(self.predicted, "goodput_requests_per_s")
        return (p - b) / b if b > 0 else (1.0 if p > 0 else 0.0)

    def explained(self, diagnosis_message: str, suggestion: Mapping[str, Any]) -> str:
        """The diagnosis, then this change. Where the predictions chose another value than the one
        the diagnosis' figures suggest, say so, or "raising maxNumSeqs to 32 ..." is followed by
        "Changing maxNumSeqs 2 -> 64"."""
        other = [k for k, v in suggestion.items() if k in self.changes and self.changes[k] != v]
        bridge = ""
        if other:
            bridge = ("The replayed trace predicts more from " + ", ".join(
                f"{BY_NAME[k].camel} {self.changes[k]!r} than from {suggestion[k]!r}" for k in other) + ". ")
        return f"{diagnosis_message} {bridge}{self.reason}".strip()


def choose(current: EngineConfig, baseline: Mapping[str, Any],
           predictions: Sequence[tuple[EngineConfig, Mapping[str, Any]]], objectives: Objectives,
           *, state: "TunerState | None" = None, now: float = 0.0) -> Decision:
    """Pick the best predicted candidate, or none when nothing beats the current config clearly."""
    state = state or TunerState()
    base_score = Score.of(baseline, objectives)
    allowed: list[tuple[EngineConfig, Mapping[str, Any], Score, dict[str, Any], bool]] = []
    barred = 0
    restart_ok = state.restart_allowed(now, objectives)
    for cfg, summ in predictions:
        changes = knob_changes(current, cfg)
        if not changes:
            continue
        restart = bool(RESTART_KNOBS & changes.keys()) if objectives.live_knobs is None \
            else bool(changes.keys() - objectives.live_knobs)
        if state.is_bad(cfg, now) or (restart and not restart_ok):
            barred += 1
            continue
        allowed.append((cfg, summ, Score.of(summ, objectives), changes, restart))
    none = Decision("none", "", current, current, baseline=baseline, predicted=baseline,
                    considered=len(predictions), barred=barred)
    if not allowed:
        none.reason = "no candidate left to try" + (f" ({barred} barred)" if barred else "")
        return none
    best = max(allowed, key=lambda a: (a[2].feasible, a[2].goodput, a[2].throughput, a[2].neg_recompute))
    if not any(a[2].beats(base_score, objectives.min_gain) for a in allowed):
        none.reason = (f"no candidate beats the current config by {objectives.min_gain:.0%} "
                       f"(best predicted goodput {best[2].goodput:.3g} vs {base_score.goodput:.3g} req/s)")
        return none
    # Among the candidates as good as the best (within close_margin) that clearly beat the current
    # config: live before restart, then (near) the fewest recompute preemptions, then fewest knobs,
    # then the higher score.
    winners = [a for a in allowed if a[2].beats(base_score, objectives.min_gain)]
    top = max(winners, key=lambda a: (a[2].feasible, a[2].goodput, a[2].throughput, a[2].neg_recompute))
    near = [a for a in winners if a[2].close_to(top[2], objectives.close_margin)]
    least = min(-a[2].neg_recompute for a in near)

    def order(a: tuple) -> tuple:
        # goodput within close_margin of the top counts as equal; then the shorter tail latency
        # (headroom). A 1% band let window noise pick a budget of 128 over 256 at +0.9% whose TTFT
        # p99 stood 60% higher, and lost 6% on the next trace (issue 20, chat at a tight TPOT)
        rec = -a[2].neg_recompute
        good = a[2].goodput / top[2].goodput if top[2].goodput > 0 else 0.0
        good = 1.0 if good >= 1 - objectives.close_margin else good
        return (a[4], rec > least * 1.25 + 2, len(a[3]), -good, _f(a[1], "ttft_p99_s"), -a[2].throughput)

    pick = min(near, key=order)
    cfg, summ, score, changes, restart = pick
    d = Decision("change", "", current, cfg, changes=changes, restart=restart, predicted=summ,
                 baseline=baseline, considered=len(predictions), barred=barred)
    # the change itself first: the diagnosis' own suggestion (its message) may differ from the candidate
    # the predictions chose
    what = ", ".join(f"{BY_NAME[k].camel} {getattr(current, k)!r} -> {v!r}" for k, v in changes.items())
    d.reason = (f"Changing {what}: predicted goodput {base_score.goodput:.3g} -> {score.goodput:.3g} req/s "
                f"({d.predicted_gain:+.0%}), throughput {base_score.throughput:.4g} -> {score.throughput:.4g} tok/s"
                + (f", recompute preemptions {-base_score.neg_recompute} -> {-score.neg_recompute}"
                   if score.neg_recompute != base_score.neg_recompute else "")
                + ("; needs a restart" if restart else "; live change"))
    return d


# --------------------------------------------------------------------------------------------------
# Verify and roll back


#: in window figures, 1.0: their percentiles are estimates from histogram buckets, not exact
FROM_BUCKETS = "quantiles_from_buckets"
#: the latency percentiles window figures carry when the summary has them (seconds). TPOT is the
#: time per output token after the first, (e2el - ttft) / (output tokens - 1), per request; ITL
#: (inter-token latency) is the gap between two consecutive tokens of one request, whose mean over a
#: request is its TPOT
LATENCY_FIGURES = ("ttft_p95_s", "tpot_p95_s", "e2el_p95_s")


def window_figures(summary: Mapping[str, Any], arrival_rate: float | None = None, *,
                   quantiles: str = "exact") -> dict[str, float]:
    """The figures a verdict compares. Goodput is normalised by the offered load when it is known,
    so a quieter or busier window does not read as a regression or a gain. ``quantiles``: what the
    summary's percentiles are ("exact", or "histogram": then marked ``FROM_BUCKETS``)."""
    good = _f(summary, "goodput_requests_per_s")
    rps = _f(summary, "requests_per_s")
    load = arrival_rate if arrival_rate and arrival_rate > 0 else rps
    # the latencies by the field's names (vLLM's benchmarks: ttft, tpot, e2el), where the summary has them
    latencies = {k: float(summary[k]) for k in LATENCY_FIGURES if summary.get(k) is not None}
    if summary.get("goodput_tokens_per_s") is not None:
        latencies["goodput_tokens_per_s"] = float(summary["goodput_tokens_per_s"])
    return {**({FROM_BUCKETS: 1.0} if quantiles == "histogram" else {}), **latencies,
        "goodput_requests_per_s": good,
        "output_tokens_per_s": _f(summary, "output_tokens_per_s"),
        "requests_per_s": rps,
        "offered_requests_per_s": load,
        "goodput_share": good / load if load > 0 else 0.0,
        "queue_time_p95_s": _f(summary, "queue_time_p95_s"),
        "queue_time_p99_s": _f(summary, "queue_time_p99_s"),
        "preemptions_per_min": preemptions_per_min(summary),
    }


@dataclass
class Verdict:
    keep: bool
    reason: str
    measured: dict[str, float]
    before: dict[str, float]
    predicted: dict[str, float] | None
    change: float            # relative change of the compared figure vs the window before
    prediction_error: float | None   # (measured - predicted) / predicted on goodput
    #: the measured and the predicted percentiles are the same statistic (False: the measured ones
    #: are histogram estimates, the predicted ones exact; the reason says so)
    like_with_like: bool = True
    #: |predicted - measured| / measured goodput share (the load-normalised request goodput), capped
    #: (``prediction_error_ratio``); None without a prediction
    prediction_error_ratio: float | None = None


def prediction_error_ratio(predicted: Mapping[str, float] | None, measured: Mapping[str, float],
                           cap: float = 10.0) -> float | None:
    """|predicted - measured| / measured goodput share, at most ``cap`` (a measured share of 0 with
    any predicted reads as the cap); None when nothing was predicted (a kvtune.io/try candidate)."""
    if not predicted or not predicted.get("goodput_requests_per_s"):
        return None
    p, m = float(predicted.get("goodput_share", 0.0) or 0.0), float(measured.get("goodput_share", 0.0) or 0.0)
    if m <= 0:
        return cap if p > 0 else 0.0
    return min(cap, abs(p - m) / m)


def _compare(ref: Mapping[str, float], measured: Mapping[str, float]) -> tuple[str, float]:
    """(figure, relative change of ``measured`` vs ``ref``): goodput share of the load; throughput when
    both have (almost) no goodput."""
    b, m = ref.get("goodput_share", 0.0), measured.get("goodput_share", 0.0)
    what = "goodput"
    if b < 0.01 and m < 0.01:
        b, m = ref.get("output_tokens_per_s", 0.0), measured.get("output_tokens_per_s", 0.0)
        what = "throughput"
    return what, ((m - b) / b if b > 0 else (0.0 if m <= 0 else 1.0))


def judge(before: Mapping[str, float], measured: Mapping[str, float],
          predicted: Mapping[str, float] | None, threshold: float,
          counterfactual: Mapping[str, float] | None = None) -> Verdict:
    """Keep, or roll back when the measured window regressed beyond ``threshold``.

    A regression must show against the window before the change *and*, when given, against the
    counterfactual: the old config replayed by the simulator on the very window measured after the
    change. The second test tells a worse config from a heavier window (a burst after the change
    makes the window worse than the one before under any config; the counterfactual sees the same
    burst). Falling short of the prediction alone is not a regression (it is reported).

    A window before with (almost) no goodput, where the window after has some, is no reference: any
    goodput at all reads as +100% (a backlog drained by 32 sequences, then a cap of 1 that let a short
    request through in time, was kept). Then the counterfactual alone judges, when there is one.
    """
    what, change = _compare(before, measured)
    perr = None
    if predicted:
        pg = predicted.get("goodput_requests_per_s", 0.0)
        if pg > 0:
            perr = (measured.get("goodput_requests_per_s", 0.0) - pg) / pg
    cf_note, ref = "", "the window before"
    regressed = change < -threshold
    if what == "goodput" and before.get("goodput_share", 0.0) < 0.01 and counterfactual is not None:
        what, change = _compare(counterfactual, measured)
        regressed = change < -threshold
        ref = "the old config replayed on this window (the window before had almost no goodput)"
    elif regressed and counterfactual is not None:
        cwhat, cchange = _compare(counterfactual, measured)
        if cchange >= -threshold:
            regressed = False
            cf_note = (f"; the old config, replayed on this window, does no better ({cwhat} {cchange:+.0%}): "
                       "the load changed, not the config's merit")
        else:
            cf_note = f" and {-cchange:.0%} below the old config replayed on this window"
    keep = not regressed
    if not keep:
        reason = f"{what} fell {-change:.0%} (more than {threshold:.0%}) vs {ref}{cf_note}: rolled back"
    else:
        reason = f"{what} {change:+.0%} vs {ref}{cf_note}"
        if perr is not None:
            reason += f"; measured goodput {perr:+.0%} vs predicted"
    like = not predicted or bool(measured.get(FROM_BUCKETS)) == bool(predicted.get(FROM_BUCKETS))
    if not like:
        reason += ("; measured p95s (and the share within the objectives) are estimates from the engine's "
                   "histogram buckets, predicted ones exact" if measured.get(FROM_BUCKETS) else
                   "; measured p95s are exact, predicted ones estimates from histogram buckets")
    return Verdict(keep, reason, dict(measured), dict(before), dict(predicted or {}) or None, change, perr, like,
                   prediction_error_ratio(predicted, measured))


@dataclass
class PendingChange:
    before: dict[str, Any]             # config (snake_case fields) before the change
    after: dict[str, Any]
    changes: dict[str, Any]
    restart: bool
    applied_at: float
    before_figures: dict[str, float]   # measured in the window before the change
    predicted_figures: dict[str, float]
    source: str = "Tuner"              # "Tuner" | "Annotation" (kvtune.io/try)


@dataclass
class TunerState:
    """The tuner's memory between rounds: a change being verified, cooldown, bad candidates, history."""
    phase: str = "Idle"                          # "Idle" | "Verifying"
    pending: PendingChange | None = None
    last_restart_at: float | None = None
    bad: dict[str, float] = field(default_factory=dict)    # config_key -> barred until
    bad_reasons: dict[str, tuple[float, str]] = field(default_factory=dict)  # config_key -> (when, why)
    history: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    history_len: int = 10
    #: running prediction error: EWMA of the verdicts' prediction_error_ratio (``track_prediction``)
    prediction_error: float | None = None
    #: verdicts in a row with the running error above its bound
    prediction_errors_high: int = 0
    #: until when the loop only recommends: predictions were found unreliable (None: they are trusted)
    unreliable_until: float | None = None

    # ---- queries ----
    def restart_allowed(self, now: float, objectives: Objectives) -> bool:
        if objectives.max_restarts is not None and self.restarts >= objectives.max_restarts:
            return False
        return self.last_restart_at is None or now - self.last_restart_at >= objectives.cooldown_s

    def is_bad(self, cfg: EngineConfig, now: float) -> bool:
        until = self.bad.get(config_key(cfg))
        return until is not None and now < until

    def predictions_unreliable(self, now: float) -> bool:
        return self.unreliable_until is not None and now < self.unreliable_until

    def unreliable_message(self, th: Any) -> str:
        """Why the loop only recommends, with the figures (``th``: the tuner's Thresholds)."""
        return (f"predictions are unreliable: the running prediction error (EWMA of |predicted - measured| / "
                f"measured goodput share) is {self.prediction_error or 0.0:.0%}, above {th.prediction_error_bound:.0%} "
                f"for {self.prediction_errors_high} verdicts in a row (at most {th.prediction_error_verdicts}); "
                "the tuner recommends and applies nothing until "
                + (f"{self.unreliable_until:.0f} s" if self.unreliable_until is not None else "further notice"))

    def track_prediction(self, ratio: float | None, now: float, th: Any, hold_s: float) -> None:
        """One verdict's prediction error into the running error; after ``th.prediction_error_verdicts``
        verdicts in a row above ``th.prediction_error_bound`` the loop only recommends for ``hold_s``
        (then changes are applied again, and the streak starts again from 0)."""
        if self.unreliable_until is not None and now >= self.unreliable_until:
            self.unreliable_until = None
            self.prediction_errors_high = 0
        if ratio is None:
            return
        ratio = min(th.prediction_error_cap, ratio)
        w = th.prediction_error_weight
        self.prediction_error = ratio if self.prediction_error is None else w * ratio + (1 - w) * self.prediction_error
        if self.prediction_error > th.prediction_error_bound:
            self.prediction_errors_high += 1
        else:
            self.prediction_errors_high = 0
        if self.prediction_errors_high >= th.prediction_error_verdicts:
            self.unreliable_until = now + hold_s

    def forget_expired(self, now: float) -> None:
        self.bad = {k: t for k, t in self.bad.items() if t > now}
        self.bad_reasons = {k: v for k, v in self.bad_reasons.items() if k in self.bad}

    # ---- transitions ----
    def begin(self, decision: Decision, before: Mapping[str, float], now: float, *, source: str = "Tuner") -> None:
        """The decision was applied at ``now``: verify it over the next window."""
        if decision.action != "change":
            raise ValueError("only a change can be verified")
        if self.phase == "Verifying":
            raise ValueError("a change is already being verified")
        self.pending = PendingChange(
            before=decision.current.model_dump(), after=decision.config.model_dump(),
            changes=dict(decision.changes), restart=decision.restart, applied_at=now,
            before_figures=dict(before),
            predicted_figures={**window_figures(decision.predicted or {}, before.get("offered_requests_per_s")),
                               **(decision.confidence or {})},
            source=source)
        self.phase = "Verifying"
        if decision.restart:
            self.last_restart_at = now
            self.restarts += 1
        self._log({"at": now, "event": "applied", "changes": dict(decision.changes), "restart": decision.restart,
                   "reason": decision.reason, "predicted": self.pending.predicted_figures,
                   "before": dict(before)})

    def verify(self, measured: Mapping[str, float], now: float, objectives: Objectives,
               counterfactual: Mapping[str, float] | None = None) -> tuple[Verdict, EngineConfig]:
        """Judge the window measured after the change (``counterfactual``: the old config replayed on
        that window, see ``judge``). Returns the verdict and the config to run next (the new one when
        kept, the old one when rolled back; the rolled-back candidate is barred for
        ``objectives.bad_memory_s``)."""
        if self.phase != "Verifying" or self.pending is None:
            raise ValueError("nothing to verify")
        p = self.pending
        v = judge(p.before_figures, measured, p.predicted_figures, objectives.regression_threshold, counterfactual)
        return v, self.conclude(v, now, objectives)

    def conclude(self, v: Verdict, now: float, objectives: Objectives, *, rollout: bool = True) -> EngineConfig:
        """End the pending change with verdict ``v`` (``verify``'s, or a canary's judged against its
        siblings): the config to run next, the rolled-back candidate barred. ``rollout`` False: a
        rollback undoes no rollout (a canary ran the change alone)."""
        if self.phase != "Verifying" or self.pending is None:
            raise ValueError("nothing to verify")
        p = self.pending
        nxt = EngineConfig.model_validate(p.after) if v.keep else self._roll_back(now, v.reason, objectives, rollout)
        self._log({"at": now, "event": "kept" if v.keep else "rolled_back", "changes": dict(p.changes),
                   "restart": p.restart, "reason": v.reason, "predicted": p.predicted_figures,
                   "measured": dict(v.measured), "before": p.before_figures,
                   "prediction_error_ratio": v.prediction_error_ratio})
        self.pending = None
        self.phase = "Idle"
        return nxt

    def fail(self, now: float, reason: str, objectives: Objectives, *, rollout: bool = True) -> EngineConfig:
        """The pending change could not run at all (its pods never came up): roll it back without a
        window to judge, bar the candidate, and return the config to restore (``rollout`` False: only
        a canary tried it)."""
        if self.phase != "Verifying" or self.pending is None:
            raise ValueError("nothing to roll back")
        p = self.pending
        nxt = self._roll_back(now, reason, objectives, rollout)
        self._log({"at": now, "event": "failed", "changes": dict(p.changes), "restart": p.restart,
                   "reason": reason, "before": p.before_figures})
        self.pending = None
        self.phase = "Idle"
        return nxt

    def _roll_back(self, now: float, reason: str, objectives: Objectives, rollout: bool) -> EngineConfig:
        p = self.pending
        assert p is not None
        key = config_key(EngineConfig.model_validate(p.after))
        self.bad[key] = now + objectives.bad_memory_s
        self.bad_reasons[key] = (now, reason)
        if p.restart and rollout:  # undoing a restart change is itself a rollout
            self.restarts += 1
            self.last_restart_at = now
        return EngineConfig.model_validate(p.before)

    def _log(self, entry: dict[str, Any]) -> None:
        self.history.append(entry)
        del self.history[: -self.history_len]

    # ---- persistence ----
    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=str))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TunerState":
        d = dict(d)
        pend = d.pop("pending", None)
        st = cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        st.pending = PendingChange(**pend) if pend else None
        return st


def summaries_by_key(items: Iterable[tuple[EngineConfig, Mapping[str, Any]]]) -> dict[str, Mapping[str, Any]]:
    return {config_key(c): s for c, s in items}
