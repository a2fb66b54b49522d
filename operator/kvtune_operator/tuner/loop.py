"""The tuner's loop: observe -> (verify) -> diagnose -> candidates -> predict -> decide.

``Tuner.round(obs, trace, now)`` is one tick of the loop; the operator's timer and ``kvtune tune``
both call it. What happens with the result (apply it, only record it) is the caller's business:
``Tuner.round(..., apply=False)`` (Recommend mode) decides without starting a verification.

``simulate_loop`` runs the loop against the simulator standing in for the engine, window after
window (``kvtune tune`` and ``bench/tuner_vs_oracle.py``): each window is measured by simulating it
under the config in force (with the *true* profile, its steps recorded like the engine's step log),
and the tuner predicts with the profile it fits from those measurements, exactly as it would in a
cluster.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from kvtune_engine.config import RESTART_KNOBS, EngineConfig
from kvtune_engine.sim.profile import Profile
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_engine.sim.trace import TraceRequest

from .backlog import in_engine
from .candidates import Bounds, CandidateSet, Safety, combine, propose, restart_lookahead
from .confidence import assess, speed_spread, trust
from .decide import (Decision, Objectives, Score, TunerState, Verdict, choose, config_key, knob_changes,
                     window_figures)
from .diagnose import Diagnosis, Thresholds, diagnose
from .fit import StepCostFit
from .observation import Observation
from .predict import Predictor, RecordingProfile, as_trace, fitted
from .replicas import ReplicaPrediction, predict_replicas


@dataclass(frozen=True)
class TunerSettings:
    bounds: Bounds = field(default_factory=Bounds)
    objectives: Objectives = field(default_factory=Objectives)
    safety: Safety = field(default_factory=Safety)
    thresholds: Thresholds = field(default_factory=Thresholds)
    #: search: single-knob moves, then combinations of the improving ones
    combine: bool = True
    #: a healthy window whose goodput share is at least this is left alone (and the share a replica
    #: count must reach to count as meeting the objectives)
    healthy_goodput_share: float = 0.95
    #: most replicas a compute-bound prediction tries (spec.autotune.bounds.replicas.max in a cluster)
    max_replicas: int = 8
    #: the engine is vLLM (spec.runtime): predictions replay its scheduling policy
    vllm: bool = False

    @property
    def slo(self) -> SLO:
        return SLO(self.objectives.slo_ttft_s, self.objectives.slo_tpot_s)


@dataclass
class Round:
    """What one tick of the loop saw and decided."""
    now: float
    observation: Observation
    diagnosis: Diagnosis
    config: EngineConfig                  # the config to run from now on
    verdict: Verdict | None = None        # the verification of the previous change, if one was pending
    decision: Decision | None = None      # None: no decision this round (rolled back, or nothing to do)
    fit: StepCostFit | None = None
    predictions: int = 0
    note: str = ""
    #: compute-bound: the replicas one engine's share of the load needs (None: not predicted)
    replicas: ReplicaPrediction | None = None
    #: why this round only recommends although it may apply: predictions found unreliable
    #: (TunerState.unreliable_message); "" when they are trusted
    unreliable: str = ""

    @property
    def changed(self) -> bool:
        return self.decision is not None and self.decision.action == "change"


def measured_figures(obs: Observation) -> dict[str, float]:
    """The figures a verification compares, from one observed window."""
    s = obs.summary or {
        "goodput_requests_per_s": obs.goodput_requests_per_s, "output_tokens_per_s": obs.output_tokens_per_s,
        "requests_per_s": obs.requests_per_s, "queue_time_p95_s": obs.queue_time_p95_s,
        "queue_time_p99_s": obs.queue_time_p99_s, "ttft_p95_s": obs.ttft_p95_s, "tpot_p95_s": obs.tpot_p95_s,
        "preemptions": {"swap": obs.preemptions_swap, "recompute": obs.preemptions_recompute},
        "duration_s": obs.window_s,
    }
    return window_figures(s, quantiles=obs.quantiles)


class Tuner:
    """One tuner per deployment: settings, the memory between rounds (``state``) and the profile the
    predictions start from (a named profile, or None to build it from the window's figures).
    ``fit_costs`` False: predict with the base profile's costs as they are; the window's step timings
    still serve the diagnosis (without them a missed TPOT is never traced to its mixed steps)."""

    def __init__(self, settings: TunerSettings | None = None, *, base_profile: Profile | None = None,
                 state: TunerState | None = None, fit_costs: bool = True) -> None:
        self.settings = settings or TunerSettings()
        self.base_profile = base_profile
        self.state = state or TunerState()
        self.fit_costs = fit_costs

    def _fitted(self, obs: Observation) -> tuple[Profile, Any]:
        return fitted(obs if self.fit_costs else obs.with_(step_samples=()), self.base_profile)

    def round(self, obs: Observation, trace: Sequence[Any], now: float, *, apply: bool = True,
              decide: bool = True, lead: Sequence[Any] = (), window_start: float | None = None) -> Round:
        """One tick: verify the pending change (if any) on this window, then diagnose and, unless
        ``decide`` is False, predict and choose. ``apply=False`` (Recommend mode) chooses without
        starting a verification."""
        st, s = self.state, self.settings
        st.forget_expired(now)
        verdict = None
        cfg = obs.config
        tr = as_trace(trace)
        profile = fit = None
        if st.phase == "Verifying":
            counterfactual = None
            if tr and st.pending is not None:
                profile, fit = self._fitted(obs)
                before = EngineConfig.model_validate(st.pending.before)
                # the old config on this window, with the backlog the window inherited when the
                # trace before it is known (``lead``, in the records' clock, up to ``window_start``)
                old = Predictor(profile, s.slo, vllm=s.vllm).predict_window(lead, trace, before, window_start) \
                    if lead and window_start is not None else Predictor(profile, s.slo, vllm=s.vllm).predict(tr, before)
                counterfactual = window_figures(old) if old is not None else None
            verdict, nxt = st.verify(measured_figures(obs), now, s.objectives, counterfactual)
            st.track_prediction(verdict.prediction_error_ratio, now, s.thresholds, s.objectives.bad_memory_s)
            if not verdict.keep:
                diag = diagnose(obs, s.thresholds, s.safety, s.bounds, s.slo)
                return Round(now, obs, diag, nxt, verdict=verdict, fit=fit, note="rolled back; no new decision "
                             "on a window measured under the rolled-back config")
        diag = diagnose(obs, s.thresholds, s.safety, s.bounds, s.slo)
        if not decide:
            return Round(now, obs, diag, cfg, verdict=verdict, fit=fit, note="verification only")
        share = obs.goodput_requests_per_s / obs.requests_per_s if obs.requests_per_s > 0 else 0.0
        if diag.cause == "Healthy" and share >= s.healthy_goodput_share:
            return Round(now, obs, diag, cfg, verdict=verdict, note="nothing to change")
        if not tr:
            return Round(now, obs, diag, cfg, verdict=verdict, note="no trace: nothing to predict with")
        if profile is None:
            profile, fit = self._fitted(obs)
        # every config is scored on the next window: the requests in the engine now, then arrivals
        # like this window's (``Predictor``)
        pred = Predictor(profile, s.slo, backlog=in_engine([*lead, *trace]), vllm=s.vllm, running=cfg)
        baseline = pred.predict(tr, cfg)
        if baseline is None:
            return Round(now, obs, diag, cfg, verdict=verdict, fit=fit,
                         note="the current config does not fit the fitted memory picture")
        cands = self.candidates(obs, diag)
        preds = pred.predict_many(tr, cands.configs)
        if s.combine:
            base_score = _score(baseline, s.objectives)
            improving = sorted((p for p in preds if _score(p[1], s.objectives).beats(base_score, 0.0)
                                and not st.is_bad(p[0], now)),
                               key=lambda p: _key(p[1], s.objectives), reverse=True)
            combos = runnable(obs, combine(cfg, [c for c, _ in improving], s.bounds), s.bounds)
            preds += pred.predict_many(tr, combos)
        decision = choose(cfg, baseline, preds, s.objectives, state=st, now=now)
        if s.combine and decision.action == "change" and decision.restart:
            # a restart costs capacity: before spending one, see whether the restart candidates as
            # good as the chosen one make room for live gains (more memory -> more sequences), and
            # take those together, in this one restart
            extra = self._restart_lookahead(cfg, decision, preds, pred, tr)
            if extra:
                preds += extra
                decision = choose(cfg, baseline, preds, s.objectives, state=st, now=now)
        if decision.action == "change" and decision.predicted is not None:
            decision = self._trusted(decision, baseline, pred, tr, fit)
        out = Round(now, obs, diag, cfg, verdict=verdict, decision=decision, fit=fit, predictions=pred.runs)
        if apply and st.predictions_unreliable(now):
            apply, out.unreliable = False, st.unreliable_message(s.thresholds)
        if diag.cause == "ComputeBound" and decision.action != "change":
            # no knob helps one saturated engine: how many engines would meet the objectives
            out.replicas = predict_replicas(tr, cfg, profile, s.slo, target_share=s.healthy_goodput_share,
                                            max_replicas=s.max_replicas)
        if decision.action == "change" and apply:
            st.begin(decision, measured_figures(obs), now)
            out.config = decision.config
        return out

    def _trusted(self, decision: Decision, baseline: Mapping[str, Any], pred: Predictor,
                 tr: Sequence[TraceRequest], fit: StepCostFit | None) -> Decision:
        """The decision with its prediction's utilization and range (confidence.py); near saturation a
        candidate that does not win across the range is declined, and the reason says so."""
        s = self.settings
        spread = speed_spread(fit, s.thresholds)
        cand = assess(pred, tr, decision.config, decision.predicted or {}, spread)
        cur = assess(pred, tr, decision.current, baseline, spread)
        figures = {**cand.figures(), **{f"current_{k}": v for k, v in cur.figures().items()}}
        why = trust(cand, cur, s.thresholds, s.objectives.min_gain)
        if why is None:
            decision.confidence = figures
            decision.reason += (f"; predicted utilization {cand.utilization:.2f}" if cand.utilization is not None
                                else "") + f", goodput range {cand.goodput_low:.3g}..{cand.goodput_high:.3g} req/s"
            return decision
        return Decision("none", why, decision.current, decision.current, baseline=baseline, predicted=baseline,
                        considered=decision.considered, barred=decision.barred, confidence=figures)

    def _restart_lookahead(self, cfg: EngineConfig, decision: Decision, preds: list, pred: Predictor,
                           tr: Sequence[TraceRequest]) -> list:
        s = self.settings
        restarts = [(c, sm) for c, sm in preds if RESTART_KNOBS & knob_changes(cfg, c).keys()
                    and not self.state.is_bad(c, 0.0)]
        restarts.sort(key=lambda p: _key(p[1], s.objectives), reverse=True)
        settings, moves = restart_lookahead(cfg, [c for c, _ in restarts], s.bounds)
        predicted = [p[0] for p in preds]
        return pred.predict_many(tr, [c for c in settings if c not in predicted] + moves)

    def candidates(self, obs: Observation, diag: Diagnosis) -> CandidateSet:
        s = self.settings
        cands = propose(obs, s.bounds, safety=s.safety, cause=diag.cause, slo_tpot_s=s.objectives.slo_tpot_s,
                        slo_ttft_s=s.objectives.slo_ttft_s,
                        suggestion=diag.suggestion, thresholds=s.thresholds)
        cands.configs = runnable(obs, cands.configs, s.bounds)
        return cands


def engine_takes(obs: Observation, cfg: EngineConfig) -> bool:
    """Whether the engine can run ``cfg``: a live change must stay within the step its start-up
    memory profile covered (past it the engine refuses: a bigger step may not fit in device memory);
    a change with a restart knob rolls the pods, and the new engine profiles ``cfg`` itself."""
    p = obs.activation_profile
    if p is None or any(getattr(obs.config, k) != getattr(cfg, k) for k in RESTART_KNOBS):
        return True
    return not p.exceeded(cfg.max_num_batched_tokens, cfg.max_num_seqs)


def runnable(obs: Observation, cfgs: Sequence[EngineConfig], bounds: Any) -> list[EngineConfig]:
    """``cfgs`` as the engine can run them: a live raise past the engine's start-up profile becomes
    a restart that profiles the new step (``profile_batched_tokens`` at the new budget: the long
    prompt's budget raise is worth a rollout); dropped where that knob is frozen or bounded below it."""
    out = []
    for c in cfgs:
        if not engine_takes(obs, c):
            c = c.with_changes(profile_batched_tokens=max(c.max_num_batched_tokens, obs.config.profiled_batched_tokens))
            if c.profile_batched_tokens == obs.config.profile_batched_tokens \
                    or bounds.profile_batched_tokens is None or c.profile_batched_tokens not in bounds.profile_batched_tokens:
                continue
        if c not in out:
            out.append(c)
    return out


def tune_round(settings: TunerSettings, state: TunerState, obs: Observation, trace: Sequence[Any], now: float, *,
               base_profile: Profile | None = None, apply: bool = True, decide: bool = True,
               lead: Sequence[Any] = (), window_start: float | None = None) -> tuple[Round, TunerState]:
    """One round as a pure function: (settings, state, window, trace, now) -> (round, new state).
    ``state`` is left as it was (the operator keeps both in status; see Tuner.round for the rest)."""
    tuner = Tuner(settings, base_profile=base_profile, state=copy.deepcopy(state))
    return tuner.round(obs, trace, now, apply=apply, decide=decide, lead=lead, window_start=window_start), \
        tuner.state


def _score(summary: Mapping[str, Any], objectives: Objectives) -> Score:
    return Score.of(summary, objectives)


def _key(summary: Mapping[str, Any], objectives: Objectives) -> tuple:
    sc = _score(summary, objectives)
    return (sc.feasible, sc.goodput, sc.throughput, sc.neg_recompute)


# ------------------------------------------------------------------------------------------------
# The loop against the simulator


@dataclass
class WindowResult:
    index: int
    config: EngineConfig          # the config the window ran under
    measured: Mapping[str, Any]   # simulator summary of the window (the "engine" measurement)
    round: Round


@dataclass
class SimRun:
    start: EngineConfig
    final: EngineConfig
    windows: list[WindowResult]
    state: TunerState

    @property
    def restarts(self) -> int:
        return self.state.restarts

    @property
    def applied(self) -> int:
        return sum(1 for w in self.windows if w.round.changed)

    @property
    def rolled_back(self) -> int:
        return sum(1 for w in self.windows if w.round.verdict is not None and not w.round.verdict.keep)


def measure(trace: Sequence[TraceRequest], cfg: EngineConfig, truth: Profile, slo: SLO,
            *, window_s: float | None = None) -> Observation:
    """Run ``trace`` under ``cfg`` on the true profile, as the engine would have: the window's summary,
    its trace and its step timings, as one observation."""
    rec = RecordingProfile.of(truth)
    summary = simulate(list(trace), cfg, rec, slo)
    return Observation.from_sim_summary(summary, trace=trace, step_samples=rec.take_steps(), window_s=window_s,
                                        config=cfg)


def simulate_loop(windows: Sequence[Sequence[TraceRequest]], start: EngineConfig, truth: Profile,
                  settings: TunerSettings, *, base_profile: Profile | None = None, window_s: float = 300.0,
                  fit_costs: bool = True, stop_when_settled: bool = True, verify_last: bool = False,
                  on_round: Callable[[WindowResult], None] | None = None) -> SimRun:
    """The operator's loop with the simulator as the engine: window i runs under the config in force,
    the tuner looks at it (verifying the last change first) and may change the config for window
    i + 1. ``now`` advances ``window_s`` per window (cooldowns and memories are in the same seconds).

    ``base_profile``: what the tuner knows before fitting (default: the truth's memory picture with
    its costs refitted from the recorded steps when ``fit_costs``; the truth itself otherwise).
    ``stop_when_settled``: stop after a window that neither verified nor decided a change.
    ``verify_last``: the last window only verifies the pending change (no new decision), so the run
    never ends on an unverified change.
    """
    tuner = Tuner(settings, base_profile=base_profile if base_profile is not None else truth, fit_costs=fit_costs)
    cfg = start
    results: list[WindowResult] = []
    for i, w in enumerate(windows):
        obs = measure(w, cfg, truth, settings.slo, window_s=None)
        last = verify_last and i == len(windows) - 1
        r = tuner.round(obs, w, now=i * window_s, decide=not last)
        wr = WindowResult(i, cfg, obs.summary or {}, r)
        results.append(wr)
        if on_round is not None:
            on_round(wr)
        cfg = r.config
        if stop_when_settled and r.verdict is None and not r.changed and (r.decision is None or not r.decision.barred):
            break
    return SimRun(start, cfg, results, tuner.state)


def split_windows(trace: Sequence[TraceRequest], n: int) -> list[list[TraceRequest]]:
    """``n`` consecutive windows of a trace (equal request counts), each re-based to start at 0."""
    tr = sorted(trace, key=lambda r: r.arrival_s)
    size = max(1, len(tr) // n)
    out = []
    for i in range(n):
        part = tr[i * size:(i + 1) * size] if i < n - 1 else tr[i * size:]
        if part:
            out.append(as_trace(part))
    return out


__all__ = ["Round", "SimRun", "Tuner", "TunerSettings", "WindowResult", "config_key", "measure",
           "measured_figures", "simulate_loop", "split_windows", "tune_round"]
