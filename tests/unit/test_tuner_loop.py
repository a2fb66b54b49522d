"""The operator's loop in the simulator: fitted costs, verification, rollback and the bad-candidate memory."""
from __future__ import annotations

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS, mix
from kvtune_operator.tuner.decide import Decision, Objectives, TunerState, config_key
from kvtune_operator.tuner.loop import Tuner, TunerSettings, measure, measured_figures, simulate_loop
from kvtune_operator.tuner.predict import fitted

SC = SCENARIOS["seq-cap"]
PROFILE = load_profile(SC.profile)
SETTINGS = TunerSettings(objectives=Objectives(slo_ttft_s=SC.slo_ttft_s, slo_tpot_s=SC.slo_tpot_s,
                                               cooldown_s=600, bad_memory_s=3600))


def window(seed: int, n: int = 300):
    return SC.trace(seed)[:n]


def test_costs_fitted_from_the_recorded_steps_match_the_engine():
    obs = measure(window(1), EngineConfig.build(**SC.baseline), PROFILE, SETTINGS.slo)
    assert len(obs.step_samples) > 100
    profile, fit = fitted(obs, PROFILE)
    assert fit is not None and fit.rel_rmse < 0.05
    assert fit.c_tok == pytest.approx(PROFILE.per_token_s, rel=0.15)
    assert fit.weights_read_s == pytest.approx(PROFILE.weights_read_s, rel=0.15)
    assert profile.per_context_token_s == fit.c_ctx


def test_loop_fixes_the_sequence_cap_with_a_live_change_and_keeps_it():
    run = simulate_loop([window(s) for s in (1, 2, 3, 4)], EngineConfig.build(**SC.baseline), PROFILE,
                        SETTINGS, verify_last=True)
    first = run.windows[0].round
    assert first.diagnosis.cause == "SequenceCap"
    assert first.changed and "max_num_seqs" in first.decision.changes and not first.decision.restart
    assert run.final.max_num_seqs > 64
    assert run.restarts == 0 and run.rolled_back == 0
    kept = [w.round.verdict for w in run.windows if w.round.verdict is not None]
    assert kept and all(v.keep for v in kept)
    after = run.windows[1].measured["goodput_requests_per_s"]
    assert after > 2 * run.windows[0].measured["goodput_requests_per_s"]


def _force(tuner: Tuner, cur: EngineConfig, bad: EngineConfig, obs, now: float) -> None:
    """Apply a deliberately bad change, as if the tuner had chosen it (a test-only move)."""
    d = Decision("change", "forced by the test", cur, bad, changes={"max_num_seqs": bad.max_num_seqs})
    tuner.state.begin(d, measured_figures(obs), now)


def test_a_regressing_change_is_rolled_back_and_remembered():
    cur = EngineConfig(max_num_seqs=64)
    tuner = Tuner(SETTINGS, base_profile=PROFILE)
    obs0 = measure(window(1), cur, PROFILE, SETTINGS.slo)
    bad = cur.with_changes(max_num_seqs=8)
    _force(tuner, cur, bad, obs0, now=0.0)
    # the next window runs under the bad config
    obs1 = measure(window(2), bad, PROFILE, SETTINGS.slo)
    r = tuner.round(obs1, window(2), now=300.0)
    assert r.verdict is not None and not r.verdict.keep
    assert "rolled back" in r.verdict.reason and "below the old config replayed on this window" in r.verdict.reason
    assert r.config == cur                      # back to the config before the change
    assert r.decision is None                   # no decision on a window measured under the bad config
    assert tuner.state.is_bad(bad, now=301.0)
    assert tuner.state.history[-1]["event"] == "rolled_back"

    # while remembered, the bad candidate is never chosen again, even when proposed
    class Proposing(Tuner):
        def candidates(self, obs, diag):
            cs = super().candidates(obs, diag)
            cs.add(bad, "the bad one again")
            return cs

    again = Proposing(SETTINGS, base_profile=PROFILE, state=tuner.state)
    obs2 = measure(window(3), cur, PROFILE, SETTINGS.slo)
    r2 = again.round(obs2, window(3), now=600.0)
    assert r2.decision is not None and r2.decision.barred >= 1
    assert r2.config != bad
    # the memory expires
    assert not tuner.state.is_bad(bad, now=300.0 + 3601.0)
    tuner.state.forget_expired(now=300.0 + 3601.0)
    assert config_key(bad) not in tuner.state.bad


def test_a_burst_after_a_good_change_is_not_blamed_on_the_change():
    # the window after the change is twice as busy: goodput share falls under any config, and the
    # counterfactual (the old config replayed on that window) shows it, so the change is kept
    light = mix(requests=250, rate=6.0, prompt_mean=300, prompt_sigma=0.6, output_mean=400, output_sigma=0.5,
                max_tokens=4096, seed=5)
    heavy = mix(requests=500, rate=16.0, prompt_mean=300, prompt_sigma=0.6, output_mean=400, output_sigma=0.5,
                max_tokens=4096, seed=6)
    cur = EngineConfig(max_num_seqs=64)
    good = cur.with_changes(max_num_seqs=128)
    tuner = Tuner(SETTINGS, base_profile=PROFILE)
    obs0 = measure(light, cur, PROFILE, SETTINGS.slo)
    _force(tuner, cur, good, obs0, now=0.0)
    obs1 = measure(heavy, good, PROFILE, SETTINGS.slo)
    before = measured_figures(obs0)["goodput_share"]
    assert measured_figures(obs1)["goodput_share"] < before * 0.9      # worse than the window before ...
    r = tuner.round(obs1, heavy, now=300.0)
    assert r.verdict.keep, r.verdict.reason                           # ... but not because of the change
    assert "the load changed" in r.verdict.reason
    assert r.config.max_num_seqs >= 128


def test_recommend_mode_decides_without_verifying():
    tuner = Tuner(SETTINGS, base_profile=PROFILE)
    obs = measure(window(1), EngineConfig.build(**SC.baseline), PROFILE, SETTINGS.slo)
    r = tuner.round(obs, window(1), now=0.0, apply=False)
    assert r.changed and r.decision.config.max_num_seqs > 64
    assert r.config == obs.config                # nothing applied
    assert tuner.state.phase == "Idle" and tuner.state.pending is None


def test_state_survives_a_round_trip_between_rounds():
    tuner = Tuner(SETTINGS, base_profile=PROFILE)
    cfg = EngineConfig.build(**SC.baseline)
    obs = measure(window(1), cfg, PROFILE, SETTINGS.slo)
    r = tuner.round(obs, window(1), now=0.0)
    assert r.changed and tuner.state.phase == "Verifying"
    # the operator keeps the state in status.tuning between timer ticks
    restored = Tuner(SETTINGS, base_profile=PROFILE, state=TunerState.from_dict(tuner.state.to_dict()))
    obs = measure(window(2), r.config, PROFILE, SETTINGS.slo)
    r2 = restored.round(obs, window(2), now=300.0)
    assert r2.verdict is not None and r2.verdict.keep
