"""The six field-report scenarios: under its baseline flags each trace shows the symptom the
report describes, and the knob the report names relieves it (the values `kvtune trace gen
--scenario NAME` prints, replayed through the real scheduler)."""
from __future__ import annotations

import functools

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import PROFILES
from kvtune_engine.sim.scenarios import SCENARIOS
from kvtune_engine.sim.simulator import SLO, simulate


@functools.cache
def run(name: str, fixed: bool, **override) -> dict:
    sc = SCENARIOS[name]
    flags = {**sc.baseline, **(sc.fix if fixed else {}), **override}
    return simulate(sc.trace(0), EngineConfig(**flags), PROFILES[sc.profile], SLO(sc.slo_ttft_s, sc.slo_tpot_s))


def kv_wait(s: dict) -> float:
    """Share of steps in which the queue head waited for KV blocks (with or without the reserve)."""
    return s["waiting_cause_share"]["kv_blocks"] + s["waiting_cause_share"]["watermark"]


def test_seq_cap():
    base, fix = run("seq-cap", False), run("seq-cap", True)
    # symptom: the cache is mostly empty while the sequence cap is full and the queue grows
    assert base["config"]["max_num_seqs"] == 64
    assert base["kv_usage_mean"] < 0.4
    assert base["dominant_waiting_cause"] == "max_num_seqs" and base["waiting_cause_share"]["max_num_seqs"] > 0.5
    assert base["running_max"] == 64 and base["queued_max"] > 100
    # relief: a higher cap
    assert fix["goodput_requests_per_s"] > 2 * base["goodput_requests_per_s"]
    assert fix["queue_time_p99_s"] < base["queue_time_p99_s"] / 5
    assert fix["waiting_cause_share"]["max_num_seqs"] < base["waiting_cause_share"]["max_num_seqs"] / 2


def test_shared_prefix():
    base, fix = run("shared-prefix", False), run("shared-prefix", True)
    # symptom: the groups' prefixes are held by references (shared blocks pin a large part of the
    # pool) and requests wait for blocks though each prefix is stored once and hits are frequent
    assert base["prefix_cache"]["hit_rate"] > 0.5
    assert base["shared_blocks_mean_share"] > 0.3
    assert kv_wait(base) > 0.15
    # relief: size the memory (gpu_memory_utilization) for the pinned prefixes plus the running set
    assert kv_wait(fix) < 0.05
    assert fix["goodput_requests_per_s"] > 1.5 * base["goodput_requests_per_s"]
    # and prefix caching is what makes the shared prompts affordable at all: off is worse
    off = run("shared-prefix", True, enable_prefix_caching=False)
    assert off["prefix_cache"]["hit_tokens"] == 0
    assert off["goodput_requests_per_s"] < fix["goodput_requests_per_s"]


def test_long_prompt():
    base, fix = run("long-prompt", False), run("long-prompt", True)
    # symptom: a ~32k prompt at the queue head cannot fit the budget next to the running decodes;
    # the queue behind it starves
    assert not base["config"]["enable_chunked_prefill"]
    assert base["dominant_waiting_cause"] == "token_budget" and base["waiting_cause_share"]["token_budget"] > 0.1
    # relief: chunked prefill with a moderate budget
    assert fix["waiting_cause_share"]["token_budget"] < base["waiting_cause_share"]["token_budget"] / 5
    assert fix["ttft_p99_s"] < 0.7 * base["ttft_p99_s"]
    assert fix["goodput_requests_per_s"] > 1.1 * base["goodput_requests_per_s"]


def test_block_waste():
    base, fix = run("block-waste", False), run("block-waste", True)
    # symptom: most slots of the 128-token blocks stay empty, and the queue waits on blocks
    assert base["config"]["block_size"] == 128
    assert base["internal_fragmentation_mean"] > 0.5
    assert kv_wait(base) > 0.5
    # relief: a block size that fits the lengths
    assert fix["internal_fragmentation_mean"] < 0.2
    assert fix["running_max"] > 1.5 * base["running_max"]
    assert fix["requests_per_s"] > 1.1 * base["requests_per_s"]
    assert fix["goodput_requests_per_s"] > 2 * base["goodput_requests_per_s"]


def test_low_memory():
    base, fix = run("low-memory", False), run("low-memory", True)
    n = base["requests"]["total"]
    pre = base["preemptions"]["swap"] + base["preemptions"]["recompute"]
    # symptom: preemptions climb while a large part of the GPU memory is unused
    assert pre > 0.3 * n
    assert base["memory_bytes"]["unused"] > 0.3 * base["memory_bytes"]["device_total"]
    assert kv_wait(base) > 0.2
    # relief: a higher gpu_memory_utilization
    assert fix["preemptions"]["swap"] + fix["preemptions"]["recompute"] < 0.1 * pre
    assert fix["goodput_requests_per_s"] > 1.3 * base["goodput_requests_per_s"]
    assert fix["num_blocks"] > 2 * base["num_blocks"]


def test_swap_full():
    base, fix = run("swap-full", False), run("swap-full", True)
    # symptom: the swap pool fills up and preemption falls back to recompute
    assert base["swap_usage_peak"] > 0.95
    assert base["preemptions"]["swap_full"] >= 10
    assert base["preemptions"]["recompute"] == base["preemptions"]["swap_full"]
    # relief: swap space sized for the observed swap volume
    assert fix["preemptions"]["swap_full"] == 0 and fix["preemptions"]["recompute"] == 0
    assert fix["swap_usage_peak"] < 0.5
    assert fix["goodput_requests_per_s"] >= base["goodput_requests_per_s"]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_traces_are_deterministic(name):
    sc = SCENARIOS[name]
    assert sc.trace(0) == sc.trace(0)
    assert sc.trace(0) != sc.trace(1)
    cmd = sc.sim_command("t.jsonl", fixed=True)
    assert cmd.startswith(f"kvtune sim --trace t.jsonl --profile {sc.profile}")
