"""The simulator: sizing from profiles, the step-time model, the trace format, the summary."""
from __future__ import annotations

import io
import json
import math
import statistics

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.core.batch import Batch, ScheduledSeq
from kvtune_engine.core.request import Request
from kvtune_engine.sim.profile import Profile, ProfileError, fit_step_costs
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.profiles import PROFILES
from kvtune_engine.sim.runner import SimulatedRunner
from kvtune_engine.sim.scenarios import mix
from kvtune_engine.sim.simulator import SLO, percentile, simulate
from kvtune_engine.sim.trace import TraceError, TraceRequest, dumps, read_trace, write_trace

REQUIRED_KEYS = ("output_tokens_per_s", "requests_per_s", "goodput_requests_per_s", "ttft_p50_s", "ttft_p99_s",
                 "tpot_p50_s", "tpot_p99_s", "queue_time_p50_s", "queue_time_p99_s", "preemptions",
                 "waiting_cause_share", "kv_usage_mean", "internal_fragmentation_mean", "swap_usage_peak",
                 "num_blocks", "config")


def test_num_blocks_follow_the_memory_formula():
    p = PROFILES["a100-llama3-8b"]
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    for cfg in (EngineConfig(), EngineConfig(gpu_memory_utilization=0.5),
                EngineConfig(block_size=32, max_num_batched_tokens=16384, swap_space=8)):
        act = p.activation_base_bytes + p.activation_bytes_per_batched_token * cfg.max_num_batched_tokens
        budget = int(p.device_total_bytes * cfg.gpu_memory_utilization) - p.weights_bytes - int(act)
        block = cfg.block_size * p.kv_bytes_per_token
        s = simulate([TraceRequest(0.0, 10, 2)], cfg, p)
        assert s["num_blocks"] == budget // block
        assert s["num_swap_blocks"] == int(cfg.swap_space * 2**30) // block
        assert s["memory_bytes"]["kv_cache"] == s["num_blocks"] * block


def test_every_named_profile_sizes_a_cache_and_runs():
    for name, p in PROFILES.items():
        cfg = EngineConfig(kv_cache_memory=0.5) if name == "cpu-tiny" else EngineConfig()
        s = simulate(mix(requests=30, rate=5.0, seed=1), cfg, p)
        assert s["requests"]["finished"] == 30 and s["num_blocks"] > 0 and s["profile"] == name


def test_summary_has_the_documented_keys_and_is_deterministic():
    trace = mix(requests=300, rate=20.0, prefix_groups=3, prefix_tokens=256, seed=4)
    cfg = EngineConfig(max_num_seqs=32)
    a = simulate(trace, cfg, PROFILES["l20-qwen3-8b"], SLO(2.0, 0.1))
    b = simulate(list(reversed(trace)), cfg, PROFILES["l20-qwen3-8b"], SLO(2.0, 0.1))   # order-free
    assert a == b
    for k in REQUIRED_KEYS:
        assert k in a
    assert set(a["preemptions"]) == {"swap", "recompute", "swap_full"}
    assert set(a["waiting_cause_share"]) >= {"max_num_seqs", "token_budget", "kv_blocks", "watermark"}
    assert a["config"] == cfg.model_dump()
    assert math.isclose(sum(a["waiting_cause_share"].values()), 1.0)
    assert math.isclose(sum(a["kv_blocks_mean_share"].values()), 1.0)
    json.dumps(a)


def test_a_lone_request_takes_exactly_the_cost_model_time():
    p = PROFILES["a100-llama3-8b"]
    s = simulate([TraceRequest(5.0, 100, 3)], EngineConfig(), p)
    t1 = p.step_time(100, 0, 100 * 101 / 2)          # prefill: 100 queries, causal pairs
    t2 = p.step_time(1, 101)                         # decode of token 101 (context 101)
    t3 = p.step_time(1, 102)
    assert s["ttft_p50_s"] == pytest.approx(t1)
    assert s["tpot_p50_s"] == pytest.approx((t2 + t3) / 2)
    assert s["duration_s"] == pytest.approx(t1 + t2 + t3)
    assert s["queue_time_p50_s"] == 0.0 and s["output_tokens"] == 3


def test_step_time_model():
    p = PROFILES["h200-qwen3-0.6b"]
    r = SimulatedRunner(p, block_bytes=16 * p.kv_bytes_per_token)
    decodes = [ScheduledSeq(Request([1] * 50), 50, 1, [0, 1, 2, 3], True) for _ in range(8)]
    out = r.execute(Batch(seqs=decodes, num_batched_tokens=8, num_decode_context_tokens=8 * 51))
    assert out.tokens == [0] * 8
    expect = p.step_overhead_s + max(p.weights_read_s, 8 * p.per_token_s) + 8 * 51 * p.per_context_token_s
    assert out.duration_s == pytest.approx(expect)
    chunk = ScheduledSeq(Request([1] * 300), 100, 50, list(range(10)), False)
    out = r.execute(Batch(seqs=[chunk], swap_out=[(1, 2), (3, 4)], num_batched_tokens=50))
    assert out.tokens == [None]
    pairs = 50 * 100 + 50 * 51 / 2
    expect = (p.step_overhead_s + max(p.weights_read_s, 50 * p.per_token_s) + pairs * p.per_prefill_pair_s
              + 2 * 16 * p.kv_bytes_per_token / p.swap_bandwidth_bytes_per_s)
    assert out.duration_s == pytest.approx(expect)


def test_prefix_groups_share_exactly_their_prefix():
    # far-apart arrivals: each request finds the group's prefix cached by the ones before
    trace = [TraceRequest(10.0 * i, 600, 2, "sys", 512) for i in range(5)]
    trace += [TraceRequest(100.0 + 10 * i, 600, 2) for i in range(3)]       # no group: no hits
    s = simulate(trace, EngineConfig(block_size=16), PROFILES["a100-llama3-8b"])
    pc = s["prefix_cache"]
    assert pc["query_tokens"] == 8 * 600 and pc["hit_tokens"] == 4 * 512
    off = simulate(trace, EngineConfig(enable_prefix_caching=False), PROFILES["a100-llama3-8b"])
    assert off["prefix_cache"]["hit_tokens"] == 0 and off["ttft_p50_s"] > s["ttft_p50_s"]


def test_requests_that_cannot_fit_are_counted_as_rejected():
    trace = [TraceRequest(0.0, 9000, 5), TraceRequest(0.1, 100, 5)]
    s = simulate(trace, EngineConfig(max_model_len=8192), PROFILES["a100-llama3-8b"])
    assert s["requests"] == {"total": 2, "finished": 1, "rejected": 1, "meeting_slo": 1, "cut_by_cache": 0}


def test_goodput_counts_only_requests_meeting_the_slo():
    trace = [TraceRequest(0.0, 50, 2) for _ in range(3)] + [TraceRequest(0.0, 8000, 2)]
    p = PROFILES["l20-qwen3-8b"]     # ~0.5 s per 2048-token step: the 8k prompt takes 4 of them
    s = simulate(trace, EngineConfig(max_num_batched_tokens=2048), p, SLO(ttft_s=1.0))
    assert s["requests"]["finished"] == 4 and s["requests"]["meeting_slo"] == 3   # the 8k prompt misses
    assert s["goodput_requests_per_s"] == pytest.approx(3 / s["duration_s"])
    assert s["ttft_p99_s"] > 1.0 > s["ttft_p50_s"]


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.99) == pytest.approx(3.97)
    assert percentile([], 0.5) is None


# ---------------------------------------------------------------------- traces
def test_trace_round_trip_and_comments():
    reqs = [TraceRequest(0.013, 812, 190, "sys-a", 600), TraceRequest(0.5, 20, 1)]
    text = "# a comment\n\n" + dumps(reqs)
    assert read_trace(io.StringIO(text)) == reqs
    assert dumps(reqs).splitlines()[0] == (
        '{"arrival_s": 0.013, "prompt_tokens": 812, "output_tokens": 190, "prefix_group": "sys-a", '
        '"prefix_tokens": 600}')


def test_trace_reads_files_and_ignores_unknown_keys(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"arrival_s": 1, "prompt_tokens": 3, "output_tokens": 4, "request_id": "x"}\n')
    assert read_trace(f) == [TraceRequest(1.0, 3, 4)]
    write_trace([TraceRequest(2.0, 5, 6)], tmp_path / "o.jsonl")
    assert read_trace(str(tmp_path / "o.jsonl")) == [TraceRequest(2.0, 5, 6)]


@pytest.mark.parametrize("line, msg", [
    ('{"arrival_s": 0, "prompt_tokens": 10}', "missing output_tokens"),
    ('{"arrival_s": 0, "prompt_tokens": 10.5, "output_tokens": 3}', "prompt_tokens must be an integer"),
    ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 3}', "prompt_tokens must be >= 1"),
    ('{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 3}', "arrival_s must be a number >= 0"),
    ('{"arrival_s": "soon", "prompt_tokens": 5, "output_tokens": 3}', "arrival_s must be a number >= 0"),
    ('{"arrival_s": 0, "prompt_tokens": true, "output_tokens": 3}', "prompt_tokens must be an integer"),
    ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3, "prefix_group": "g"}', "needs prefix_tokens"),
    ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3, "prefix_tokens": 2}', "needs a prefix_group"),
    ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3, "prefix_group": "g", "prefix_tokens": 9}',
     "prefix_tokens 9 > prompt_tokens 5"),
    ('[1, 2]', "expected a JSON object"),
    ('{"arrival_s": 0, "prompt_tokens": 5,', "not valid JSON"),
])
def test_malformed_trace_lines_name_the_line(line, msg):
    text = '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3}\n\n' + line + "\n"
    with pytest.raises(TraceError, match=f"^t.jsonl:3: .*{msg}"):
        src = io.StringIO(text)
        src.name = "t.jsonl"
        read_trace(src)


def test_empty_or_missing_trace(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n# nothing\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(tmp_path / "e.jsonl")
    with pytest.raises(TraceError, match="cannot open"):
        read_trace(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------------- generators
def test_mix_is_deterministic_and_honours_its_parameters():
    a = mix(requests=2000, rate=50.0, prompt_mean=300, output_mean=100, max_tokens=1024,
            prefix_groups=4, prefix_tokens=128, prefix_share=0.25, seed=7)
    assert a == mix(requests=2000, rate=50.0, prompt_mean=300, output_mean=100, max_tokens=1024,
                    prefix_groups=4, prefix_tokens=128, prefix_share=0.25, seed=7)
    assert a != mix(requests=2000, rate=50.0, prompt_mean=300, output_mean=100, max_tokens=1024,
                    prefix_groups=4, prefix_tokens=128, prefix_share=0.25, seed=8)
    assert all(r.prompt_tokens + r.output_tokens <= 1024 for r in a)
    grouped = [r for r in a if r.prefix_group]
    assert 0.2 < len(grouped) / len(a) < 0.3 and {r.prefix_group for r in grouped} == {f"prefix-{i}" for i in range(4)}
    assert all(r.prefix_tokens == 128 < r.prompt_tokens for r in grouped)
    assert 2000 / a[-1].arrival_s == pytest.approx(50.0, rel=0.1)
    assert statistics.mean(r.output_tokens for r in a) == pytest.approx(100, rel=0.15)


def test_bursty_arrivals_clump():
    def cv(ts):
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        return statistics.pstdev(gaps) / statistics.mean(gaps)
    poisson = [r.arrival_s for r in mix(requests=3000, rate=10.0, seed=1)]
    bursty = [r.arrival_s for r in mix(requests=3000, rate=10.0, arrival="bursty", burstiness=3.0, seed=1)]
    assert cv(poisson) == pytest.approx(1.0, abs=0.1) and cv(bursty) > 2.0


@pytest.mark.parametrize("kw, msg", [
    (dict(rate=0), "rate must be > 0"), (dict(requests=0), "requests must be >= 1"),
    (dict(prefix_groups=2), "go together"), (dict(arrival="weekly"), "poisson or bursty"),
    (dict(prefix_share=1.5), "prefix_share"),
])
def test_mix_rejects_bad_parameters(kw, msg):
    with pytest.raises(ValueError, match=msg):
        mix(**kw)


# ---------------------------------------------------------------------- profiles
def test_profile_files_load_and_bad_ones_say_why(tmp_path):
    good = tmp_path / "mine.json"
    good.write_text(PROFILES["cpu-tiny"].model_copy(update={"name": "mine"}).model_dump_json())
    p = load_profile(str(good))
    assert isinstance(p, Profile) and p.name == "mine" and p.kv_bytes_per_token == 4096  # the demo model
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**PROFILES["cpu-tiny"].model_dump(), "step_overhead_s": -1, "colour": 1}))
    with pytest.raises(ProfileError, match=r"bad.json: .*step_overhead_s.*colour"):
        load_profile(str(bad))
    (tmp_path / "nojson.json").write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        load_profile(str(tmp_path / "nojson.json"))
    with pytest.raises(ProfileError, match="unknown profile 'nope'.*a100-llama3-8b"):
        load_profile("nope")


def test_fit_step_costs_recovers_a_linear_model():
    c0, ct, cc = 4e-3, 30e-6, 2e-7
    samples = [(b, c, c0 + ct * b + cc * c) for b in (1, 8, 64, 300) for c in (0, 1000, 20000)]
    got = fit_step_costs(samples)
    assert got == pytest.approx((c0, ct, cc), rel=1e-6)
    with pytest.raises(ValueError):
        fit_step_costs([(1, 1, 1.0)] * 5)


def test_a_speed_timeline_scales_the_steps_that_start_in_its_windows():
    from kvtune_engine.sim.profile import SpeedTimeline
    base = PROFILES["a100-llama3-8b"]
    t1, t2, t3 = base.step_time(100, 0, 100 * 101 / 2), base.step_time(1, 101), base.step_time(1, 102)
    # the prefill starts at 5.0 in a window at 2x; the decodes start after it, outside the timeline (1x)
    slow = base.model_copy(update={"speed": SpeedTimeline(start_s=4.0, window_s=1.0 + 1.5 * t1, factors=(2.0,))})
    s = simulate([TraceRequest(5.0, 100, 3)], EngineConfig(), slow)
    assert s["ttft_p50_s"] == pytest.approx(2 * t1)
    assert s["duration_s"] == pytest.approx(2 * t1 + t2 + t3)
    tl = SpeedTimeline(start_s=1.0, window_s=2.0, factors=(0.5, 3.0))
    assert [tl.at(t) for t in (0.9, 1.0, 2.9, 3.0, 4.9, 5.0)] == [1.0, 0.5, 0.5, 3.0, 3.0, 1.0]


def test_a_slow_stretch_builds_the_queue_a_steady_machine_would_not():
    from kvtune_engine.sim.profile import SpeedTimeline
    p = PROFILES["a100-llama3-8b"]
    trace = mix(requests=200, rate=40.0, prompt_mean=256, output_mean=64, seed=3)
    cfg = EngineConfig(max_num_seqs=8)
    steady = simulate(trace, cfg, p)
    slow = simulate(trace, cfg, p.model_copy(update={"speed": SpeedTimeline(start_s=0.0, window_s=1.0,
                                                                              factors=(1.0, 1.5, 1.5))}))
    fast = simulate(trace, cfg, p.model_copy(update={"speed": SpeedTimeline(start_s=0.0, window_s=1.0,
                                                                              factors=(1.0, 0.7, 0.7))}))
    assert slow["queue_time_p50_s"] > steady["queue_time_p50_s"] > fast["queue_time_p50_s"]
    assert slow["duration_s"] > steady["duration_s"] > fast["duration_s"]


def test_vllm_queue_time_starts_when_the_loop_takes_the_request_in():
    from kvtune_engine.sim.vllm_policy import QUEUE_CLOCK
    p = PROFILES["a100-llama3-8b"]
    t1 = p.step_time(100, 0, 100 * 101 / 2)
    trace = [TraceRequest(0.0, 100, 3), TraceRequest(t1 / 2, 100, 3)]   # the second arrives mid-prefill
    ours = simulate(trace, EngineConfig(), p, per_request=True)
    vllm = simulate(trace, EngineConfig(), p, per_request=True, queue_clock=QUEUE_CLOCK)
    q = {r["id"]: r["queue_s"] for r in ours["per_request"]}
    assert q["r1"] == pytest.approx(t1 / 2)          # waited for the step running at its arrival
    qv = {r["id"]: r["queue_s"] for r in vllm["per_request"]}
    assert qv["r1"] == pytest.approx(0.0)            # taken in at the step's end, scheduled at once
    assert vllm["ttft_p50_s"] == ours["ttft_p50_s"]  # TTFT still from the arrival
    with pytest.raises(ValueError, match="queue_clock"):
        simulate(trace, EngineConfig(), p, queue_clock="scrape")
