"""Cost-profile fit from step timings, and the user's bounds."""
from __future__ import annotations

import random

import pytest

from kvtune_engine.config import ConfigError, EngineConfig
from kvtune_operator.tuner.candidates import Bounds, Range
from kvtune_operator.tuner.fit import fit_step_cost
from kvtune_operator.tuner.observation import StepSample


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
