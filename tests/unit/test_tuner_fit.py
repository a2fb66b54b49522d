"""Cost-profile fit from step timings, and the user's bounds."""
from __future__ import annotations

import random

import pytest

from kvtune_engine.config import ConfigError, EngineConfig
from kvtune_operator.tuner.candidates import Bounds, Range
from kvtune_operator.tuner.fit import fit_step_cost
from kvtune_operator.tuner.observation import StepSample


def test_one_stall_does_not_make_every_step_expensive():
    # ~1,100 steps of a small engine (9 ms decodes of 2 sequences, 32-token prefills) and one step
    # that took 28 s (the process held up): the fit is the steps' cost, not the stall's
    r = random.Random(3)
    samples = [StepSample(28.5, 32, 0)]
    for i in range(1100):
        tok = 33 if i % 16 == 0 else 2
        samples.append(StepSample((0.0088 + 6e-5 * tok) * (1 + r.gauss(0, 0.05)), tok, r.randint(60, 120)))
    f = fit_step_cost(samples)
    assert f is not None and f.samples == 1100
    assert f.predict(2) == pytest.approx(0.0089, rel=0.1) and f.predict(33) == pytest.approx(0.0108, rel=0.1)
    assert f.rel_rmse < 0.2
    # a real cost stays: prefills twice as slow as the model's shape are fitted, not dropped
    slow = [StepSample(0.02 if s.batched_tokens == 33 else s.duration_s, s.batched_tokens, s.context_tokens)
            for s in samples[1:]]
    g = fit_step_cost(slow)
    assert g.samples == 1100 and g.predict(33) == pytest.approx(0.02, rel=0.1)


def test_fit_recovers_the_step_cost_from_noisy_steps():
    r = random.Random(7)
    true = (0.004, 2e-6, 3e-8)
    samples = []
    for _ in range(300):
        tok, ctx = r.randint(1, 4096), r.randint(0, 300_000)
        t = true[0] + true[1] * tok + true[2] * ctx
        samples.append(StepSample(t * (1 + r.gauss(0, 0.03)), tok, ctx))
    f = fit_step_cost(samples)
    assert f is not None
    assert f.c0 == pytest.approx(true[0], rel=0.1)
    assert f.c_tok == pytest.approx(true[1], rel=0.1)
    assert f.c_ctx == pytest.approx(true[2], rel=0.1)
    assert f.rel_rmse < 0.05
    assert f.predict(1000, 100_000) == pytest.approx(0.004 + 0.002 + 0.003, rel=0.05)


def test_fit_from_window_means_weighted_by_step_count():
    # one row per scrape interval: histogram _sum/_count increases (mean duration, tokens, context)
    rows = [(0.004 + 2e-6 * t + 3e-8 * c, t, c, n)
            for t, c, n in [(100, 1000, 500), (800, 50_000, 200), (2000, 20_000, 100), (300, 200_000, 50)]]
    f = fit_step_cost([StepSample(d, t, c, n) for d, t, c, n in rows])
    assert f.c0 == pytest.approx(0.004, rel=1e-3)
    assert f.c_tok == pytest.approx(2e-6, rel=1e-3)
    assert f.c_ctx == pytest.approx(3e-8, rel=1e-3)


def test_fit_never_returns_negative_coefficients():
    # durations that fall with tokens (noise, a warm-up step): clamp rather than predict negative cost
    samples = [StepSample(0.01 - 1e-6 * t, t, 0) for t in (10, 100, 1000, 5000)]
    f = fit_step_cost(samples)
    assert f is not None and f.c0 >= 0 and f.c_tok >= 0 and f.c_ctx >= 0
    assert fit_step_cost([StepSample(0.01, 10, 0)]) is None  # too few samples


def test_bounds_from_the_crd_and_the_cli_agree():
    crd = Bounds.parse({"blockSize": [16, 32], "gpuMemoryUtilization": {"min": 0.85, "max": 0.95},
                        "swapSpaceGiB": {"min": 0, "max": 32}, "maxNumSeqs": {"min": 32, "max": 512}})
    cli = Bounds.parse(["block-size=16,32", "gpu-memory-utilization=0.85:0.95", "swap-space=0:32",
                        "max-num-seqs=32:512"])
    assert crd == cli
    assert crd.block_size == (16, 32)
    assert crd.max_num_seqs == Range(32, 512)
    ok = EngineConfig(block_size=32, gpu_memory_utilization=0.9, swap_space=8, max_num_seqs=256)
    assert crd.allows(ok)
    bad = ok.with_changes(max_num_seqs=600, block_size=64)
    assert not crd.allows(bad)
    assert any("max_num_seqs" in v for v in crd.violations(bad))
    assert any("block_size" in v for v in crd.violations(bad))


def test_bounds_pin_and_freeze():
    b = Bounds.parse(["enable-chunked-prefill=true", "max-num-batched-tokens=4096"])
    assert b.enable_chunked_prefill == (True,)
    assert b.max_num_batched_tokens == Range(4096, 4096)
    f = Bounds().freeze(EngineConfig(block_size=32), ["blockSize", "swap-space"])
    assert f.block_size == (32,) and f.swap_space == Range(4.0, 4.0)


@pytest.mark.parametrize("spec, words", [
    (["max-num-seqs=512:32"], "min"),
    (["block-size=12"], "block size"),
    (["gpu-memory-utilization=0.5:1.5"], "(0, 1]"),
    (["nonsense=1"], "unknown knob"),
    (["max-num-seqs"], "KNOB=LO:HI"),
])
def test_bad_bounds_say_what_is_wrong(spec, words):
    with pytest.raises(ConfigError) as e:
        Bounds.parse(spec)
    assert words in str(e.value)


def _steps_on_a_machine(speed_of, n=3000, seed=5):
    """Engine-style step log of steps costing 4 ms + 20 us/token, run at ``speed_of(t)`` times that."""
    r = random.Random(seed)
    t, steps = 0.0, []
    for _ in range(n):
        tok = r.choice((1, 4, 8, 64, 256))
        d = (0.004 + 2e-5 * tok) * speed_of(t) * (1 + r.gauss(0, 0.2))
        steps.append({"t_s": t, "duration_s": d, "batched_tokens": tok, "num_decodes": 1})
        t += d
    return steps


def test_speed_timeline_finds_a_slow_stretch_of_the_machine():
    from kvtune_operator.tuner.fit import samples_from_engine_steps, speed_timeline
    steps = _steps_on_a_machine(lambda t: 1.6 if 6.0 <= t < 10.0 else 1.0)
    samples = samples_from_engine_steps(steps)
    fit = fit_step_cost(samples)
    tl = speed_timeline(samples, fit, window_s=2.0)
    assert tl is not None and tl.start_s == 0.0 and tl.window_s == 2.0
    # the fit charges the run's mean speed; the timeline says which stretch ran how much off it
    fast = [tl.at(t) for t in (1.0, 3.0, 5.0, 11.0, 13.0)]
    slow = [tl.at(t) for t in (7.0, 9.0)]
    assert max(fast) / min(fast) < 1.1 and max(slow) / min(slow) < 1.1
    assert sum(slow) / len(slow) / (sum(fast) / len(fast)) == pytest.approx(1.6, rel=0.08)
    assert min(fast) < 1.0 < max(slow)


def test_speed_timeline_needs_times_and_keeps_an_idle_stretch_near_the_mean():
    from kvtune_operator.tuner.fit import samples_from_engine_steps, speed_timeline
    steps = _steps_on_a_machine(lambda t: 1.0, n=1000)
    late = steps[-1]["t_s"] + 10.0   # 10 s idle, then one slow step alone in its window
    steps.append({"t_s": late, "duration_s": 0.05, "batched_tokens": 1, "num_decodes": 0})
    samples = samples_from_engine_steps(steps)
    fit = fit_step_cost(samples)
    tl = speed_timeline(samples, fit, window_s=1.0)
    assert tl.at(late - 5.0) == pytest.approx(1.0, rel=0.05)       # no steps: the mean
    assert tl.at(late) < 3.0                                        # one step of 12x: pulled to the mean
    assert speed_timeline([StepSample(0.01, 10)] * 10, fit) is None  # no times


def test_fitted_profiles_carry_the_machine_speed_when_asked():
    from kvtune_engine.sim.profiles import PROFILES
    from kvtune_operator.tuner.fit import samples_from_engine_steps
    from kvtune_operator.tuner.observation import Observation
    from kvtune_operator.tuner.predict import fitted
    steps = _steps_on_a_machine(lambda t: 1.5 if t >= 5.0 else 1.0, n=2000)
    obs = Observation(config=EngineConfig(), step_samples=tuple(samples_from_engine_steps(steps)))
    base = PROFILES["a100-llama3-8b"]
    prof, fit = fitted(obs, base, speed=True)
    assert fit is not None and prof.speed is not None and prof.speed.at(7.0) > 1.3 * prof.speed.at(1.0)
    assert fitted(obs, base, speed=False)[0].speed is None
    assert base.speed is None   # named profiles run steady
