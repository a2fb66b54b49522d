"""Reading vLLM's /metrics: the real text of a vLLM 0.32 server (tests/vllm/reference) and the rules that
put a capacity wait down to a limit."""
from __future__ import annotations

import re
import time

from kvtune_operator.tuner.observation import MetricFigures
from kvtune_operator.tuner.synth_trace import synthesize_trace
from kvtune_operator.tuner_cli import read_engine
from kvtune_operator.tuner.vllm_observation import (GaugeSample, VllmAssumptions, classify, in_system, is_vllm, read_vllm,
                                                    samples_of_scrapes)
from local_http import serving
from tests.vllm.capture_metrics import REFERENCE_METRICS

REFERENCE = REFERENCE_METRICS  # captured from the real vLLM the tests run (tests/vllm/capture_metrics.py)


def test_real_vllm_text_reads_its_cache_config_and_says_what_it_assumed():
    figs = MetricFigures.from_prometheus_text(REFERENCE.read_text())
    assert is_vllm(figs)
    r = read_vllm(figs, samples_of_scrapes([figs]), window_s=60.0)
    cfg = r.observation.config
    assert cfg.block_size == 128 and r.observation.num_blocks == 8192
    assert cfg.kv_cache_memory == 1.0            # kv_cache_memory_bytes 1 GiB (vLLM on CPU)
    assert cfg.enable_chunked_prefill and cfg.swap_space == 0   # V1: always chunked, recompute only
    assert set(r.assumed) >= {"max_num_seqs", "max_num_batched_tokens", "max_model_len"}
    assert "not exported" in r.assumed["max_num_seqs"]
    assert r.observation.requests_finished == 1 and r.trace_synthesized


def test_given_values_are_used_and_named_as_given():
    figs = MetricFigures.from_prometheus_text(REFERENCE.read_text())
    r = read_vllm(figs, samples_of_scrapes([figs]), window_s=60.0,
                  assume=VllmAssumptions(max_num_seqs=8, max_num_batched_tokens=512, given_by="pod command line"))
    assert r.observation.config.max_num_seqs == 8 and r.observation.config.max_num_batched_tokens == 512
    assert r.assumed["max_num_seqs"] == "8 (pod command line)"


def test_capacity_waits_are_put_down_to_the_limit_the_gauges_show():
    assert classify(GaugeSample(running=4, waiting=0, kv_usage=0.1), 4) is None
    assert classify(GaugeSample(running=4, waiting=3, kv_usage=0.1), 4) == "max_num_seqs"
    assert classify(GaugeSample(running=2, waiting=3, kv_usage=0.95), 4) == "kv_blocks"
    assert classify(GaugeSample(running=2, waiting=3, kv_usage=0.5, preempted=1), 4) == "kv_blocks"
    assert classify(GaugeSample(running=2, waiting=3, kv_usage=0.5), 4, 512) == "token_budget"
    # a budget (or a cap) whose value is unknown explains no wait
    assert classify(GaugeSample(running=2, waiting=3, kv_usage=0.5), 4) == "unexplained"
    assert classify(GaugeSample(running=2, waiting=3, kv_usage=0.5), None, 512) == "unexplained"


def test_synthesized_trace_follows_the_histograms():
    f = MetricFigures()
    for le, c in ((10, 0), (100, 50), (1000, 100), (float("inf"), 100)):
        f.set("vllm:request_prompt_tokens_bucket", c, le=str(le))
        f.set("vllm:request_generation_tokens_bucket", 100 if le >= 100 else 0, le=str(le))
    f.set("vllm:request_prompt_tokens_count", 100)
    f.set("vllm:request_prompt_tokens_sum", 100 * 300)
    tr = synthesize_trace(f, 50.0, seed=1)
    assert len(tr) == 100
    prompts = sorted(r["prompt_tokens"] for r in tr)
    assert 10 < prompts[0] and prompts[-1] <= 1000 and 60 <= prompts[50] <= 250
    assert all(10 < r["output_tokens"] <= 100 for r in tr)
    assert 25 <= tr[-1]["arrival_s"] <= 80      # 2 requests/s over a 50 s window
    assert synthesize_trace(f, 50.0, seed=1) == tr


def test_synthesized_trace_keeps_the_queue_the_window_inherited():
    # 100 finished in 50 s while 40 requests were in the engine at the start and 60 at the end: the
    # window saw 120 arrivals, and the 40 of the start were already there (the histograms count
    # finished requests only, which under a deep queue arrive at the rate the engine served)
    f = MetricFigures()
    for le, c in ((100, 0), (200, 100), (float("inf"), 100)):
        f.set("vllm:request_prompt_tokens_bucket", c, le=str(le))
        f.set("vllm:request_generation_tokens_bucket", c, le=str(le))
    f.set("vllm:request_prompt_tokens_count", 100)
    f.set("vllm:request_prompt_tokens_sum", 100 * 150)
    tr = synthesize_trace(f, 50.0, seed=1, in_system=(40.0, 60.0))
    backlog = [r for r in tr if r.get("backlog")]
    assert len(backlog) == 40 and all(r["arrival_s"] == 0.0 for r in backlog)
    assert len(tr) == 40 + 120 and 30 <= tr[-1]["arrival_s"] <= 70
    samples = [GaugeSample(2, 38, 0.1, replica="a"), GaugeSample(2, 0, 0.1, replica="b"),
               GaugeSample(2, 50, 0.1, replica="a"), GaugeSample(2, 6, 0.1, replica="b")]
    assert in_system(samples) == (42.0, 60.0)


def test_a_window_on_a_slow_server_counts_over_the_seconds_it_really_spans():
    """vLLM's API server, starved by its engine on two cores, answered each /metrics ~2 s late: an 8 s
    window took 24 s and its rates came out 3x too high. Here a real HTTP server answers 0.4 s late
    while 10 requests finish each second: the finished rate read is ~10/s, not 10/s x (span / window)."""
    text, t0 = REFERENCE.read_text(), time.monotonic()

    def answer(path: str) -> tuple[bytes, str]:
        time.sleep(0.4)
        n = 10.0 * (time.monotonic() - t0)   # requests finished so far, each within 0.3 s
        return re.sub(r'^(vllm:e2e_request_latency_seconds_(?:count|bucket)\{[^}]*\}) \S+',
                      lambda m: f"{m.group(1)} {n}", text, flags=re.M).encode(), "text/plain"  # every bucket >= 0.3 s

    with serving(answer) as url:
        began = time.monotonic()
        r = read_engine(url, window_s=2.0, samples=4)
        took = time.monotonic() - began
    obs = r.observation
    # the window is the span its scrapes' answers really covered (their due times on a clock; how late
    # each answer came depends on the machine), never more than the read took
    assert 0 < obs.window_s <= took
    assert 8.0 <= obs.requests_per_s <= 11.0, (obs.requests_per_s, obs.window_s, took)
