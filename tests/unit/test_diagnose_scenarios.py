"""The diagnosis names the cause of each scenario of the field reports, from real simulator runs.

Each scenario's own trace (shortened to keep the test fast) runs through the simulator under the
scenario's mis-tuned baseline; the diagnosis must name the scenario's cause, point at its knob, and
say it in a sentence with the figures behind it. Under the scenario's fix the cause must go away.
"""
from __future__ import annotations

import functools

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS, mix
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_operator.tuner.candidates import Bounds
from kvtune_operator.tuner.decide import Objectives
from kvtune_operator.tuner.diagnose import diagnose
from kvtune_operator.tuner.loop import TunerSettings, measure, simulate_loop, split_windows
from kvtune_operator.tuner.observation import Observation

# scenario -> (requests kept from the scenario's trace, expected cause, knob the cause names)
CASES = {
    "seq-cap": (300, "SequenceCap", "max_num_seqs"),
    "shared-prefix": (300, "SharedPrefixPinning", "gpu_memory_utilization"),
    "long-prompt": (400, "LongPromptHeadOfLine", "enable_chunked_prefill"),
    "block-waste": (4000, "BlockWaste", "block_size"),
    "low-memory": (300, "LowKVMemory", "gpu_memory_utilization"),
    "swap-full": (300, "SwapFull", "swap_space"),
}


@functools.lru_cache(maxsize=None)
def observed(name: str, fixed: bool = False) -> Observation:
    sc = SCENARIOS[name]
    n = CASES[name][0]
    trace = sc.trace(0)[:n]
    cfg = EngineConfig.build(**{**sc.baseline, **(sc.fix if fixed else {})})
    summary = simulate(trace, cfg, load_profile(sc.profile), SLO(sc.slo_ttft_s, sc.slo_tpot_s))
    return Observation.from_sim_summary(summary, trace=trace)


@pytest.mark.parametrize("name", list(CASES))
def test_names_the_scenarios_cause(name):
    _, cause, knob = CASES[name]
    d = diagnose(observed(name))
    assert d.cause == cause, d.message
    assert d.knob == knob
    assert d.message.endswith(".") and len(d.message) < 400
    assert d.figures  # the figures behind it


@pytest.mark.parametrize("name", list(CASES))
def test_the_fix_removes_the_cause(name):
    _, cause, _ = CASES[name]
    d = diagnose(observed(name, fixed=True))
    assert d.cause != cause, d.message


def test_sequence_cap_message_reads_like_the_field_report():
    obs = observed("seq-cap")
    d = diagnose(obs)
    assert d.message.startswith("Requests wait on the sequence cap: 64 of 64 sequences running while KV usage is ")
    kv = round(100 * obs.kv_usage_mean)
    assert f"KV usage is {kv}%" in d.message
    # the suggested cap is higher and is what the message says
    assert d.suggestion["max_num_seqs"] > 64
    assert f"raising maxNumSeqs to {d.suggestion['max_num_seqs']} fits in the free blocks" in d.message


def test_suggestions_respect_the_users_bounds():
    d = diagnose(observed("seq-cap"), bounds=Bounds.parse(["max-num-seqs=32:100"]))
    assert 64 < d.suggestion["max_num_seqs"] <= 100
    d = diagnose(observed("low-memory"), bounds=Bounds.parse(["gpu-memory-utilization=0.5:0.8"]))
    assert d.cause == "LowKVMemory"
    assert d.suggestion["gpu_memory_utilization"] <= 0.8
    assert "to 0.8 " in d.message


def test_low_memory_never_suggests_more_than_the_measured_memory_allows():
    obs = observed("low-memory")
    d = diagnose(obs)
    m = obs.memory
    u = d.suggestion["gpu_memory_utilization"]
    assert u > obs.config.gpu_memory_utilization
    # weights + activation peak + the KV cache at the suggested utilization leave the safety margin
    kv_after = u * m["device_total"] - m["weights"] - m["activations_peak"]
    assert m["weights"] + m["activations_peak"] + kv_after <= m["device_total"] - (1 << 30)


def test_swap_full_suggests_a_pool_that_holds_the_observed_volume():
    obs = observed("swap-full")
    d = diagnose(obs)
    assert obs.swap_full > 0 and obs.swap_usage_peak > 0.9
    assert d.suggestion["swap_space"] > obs.config.swap_space
    assert f"{obs.swap_full} preemptions found the 1 GiB swap pool" in d.message


def test_healthy():
    trace = mix(requests=200, rate=2.0, prompt_mean=300, output_mean=200, seed=3)
    summary = simulate(trace, EngineConfig(), load_profile("a100-llama3-8b"), SLO(2.0, 0.1))
    d = diagnose(Observation.from_sim_summary(summary, trace=trace))
    assert d.cause == "Healthy", d.message
    assert d.message.startswith("Nothing holds requests back: the queue head was blocked in 0% of steps")
    assert d.knob is None and not d.suggestion


def test_a_tpot_objective_missed_while_nothing_waits_is_prefill_stalling_decodes():
    """Issue 11: long prompts at a load one A100 carries, a 16k token budget: the queue head is never
    blocked, yet TPOT p95 misses its 35 ms objective, because the decodes that share a step with a
    long prefill chunk wait for it. Not Healthy: the diagnosis says which percentile misses, by how
    much, in which kind of step, and names a budget whose mixed step fits; the tuner's loop gets
    within 5% of the best budget of a grid."""
    prof, slo = load_profile("a100-llama3-8b"), SLO(5.0, 0.035)
    trace = mix(requests=800, rate=2.0, prompt_mean=2500, prompt_sigma=0.7, output_mean=300, output_sigma=0.5,
                seed=1)
    cfg = EngineConfig(max_num_batched_tokens=16384, max_num_seqs=256)
    obs = measure(trace, cfg, prof, slo)
    assert obs.blocked_share < 0.1 and obs.tpot_p95_s > slo.tpot_s
    assert diagnose(obs).cause == "Healthy"                      # without the objectives: invisible
    d = diagnose(obs, slo=slo)
    assert d.cause == "PrefillStallsDecodes", d.message
    assert "TPOT p95" in d.message and "35ms objective" in d.message and "prefill chunk" in d.message
    assert d.figures["mixed_step_p95_s"] > slo.tpot_s >= d.figures["decode_step_p95_s"]
    budget = d.suggestion["max_num_batched_tokens"]
    assert budget < cfg.max_num_batched_tokens
    grid = {b: simulate(trace, cfg.with_changes(max_num_batched_tokens=b), prof, slo)["goodput_requests_per_s"]
            for b in (128, 256, 512, 1024, 2048, 8192, 16384)}
    run = simulate_loop(split_windows(trace, 4), cfg, prof,
                        TunerSettings(objectives=Objectives(slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s)))
    tuned = simulate(trace, run.final, prof, slo)["goodput_requests_per_s"]
    assert tuned >= 0.95 * max(grid.values()), (run.final, grid)
    assert run.rolled_back == 0
