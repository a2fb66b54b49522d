"""Step costs and frontend time from vLLM's counters (tuner/vllm_steps.py), and the simulator adding
the frontend to the latencies it replays."""
from __future__ import annotations

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import PROFILES
from kvtune_engine.sim.simulator import simulate
from kvtune_engine.sim.trace import TraceRequest
from kvtune_operator.tuner.observation import MetricFigures, StepSample
from kvtune_operator.tuner.vllm_steps import (Scrape, frontend_s, interval_samples, landing_step_s, prefill_samples,
                                              scrapes_of_series, step_samples)


def _scrape(t: float, steps: float, tokens: float, prefills: float = 0, prefill_s: float = 0.0,
            computed: float = 0.0, prompt: float = 0.0, running: float = 4, preemptions: float = 0) -> Scrape:
    v = {"vllm:iteration_tokens_total_count": steps, "vllm:iteration_tokens_total_sum": tokens,
         "vllm:request_prefill_time_seconds_count": prefills, "vllm:request_prefill_time_seconds_sum": prefill_s,
         "vllm:request_prefill_kv_computed_tokens_count": prefills,
         "vllm:request_prefill_kv_computed_tokens_sum": computed,
         "vllm:request_prompt_tokens_count": prefills, "vllm:request_prompt_tokens_sum": prompt,
         "vllm:num_requests_running": running, "vllm:num_preemptions_total": preemptions}
    return Scrape(t, v)


def test_interval_samples_are_the_steps_and_tokens_between_two_scrapes():
    a, b = _scrape(0.0, 0, 0), _scrape(1.0, 100, 2000)
    (s,) = interval_samples([a, b])
    assert (s.duration_s, s.batched_tokens, s.weight, s.t_s) == (pytest.approx(0.01), 20.0, 100, 0.5)
    # nothing running at one end (an idle stretch, not a step time): no sample
    assert interval_samples([a, _scrape(1.0, 100, 2000, running=0)]) == []
    # a counter missing from one scrape adds nothing (not its whole value as the interval's increase)
    gap = Scrape(0.0, {k: v for k, v in a.values.items() if k != "vllm:num_preemptions_total"})
    (s,) = interval_samples([gap, _scrape(1.0, 100, 2000, preemptions=50)], prompt_tokens_mean=300.0)
    assert s.batched_tokens == 20.0


def test_a_prefill_sample_counts_the_prompts_that_arrived_during_the_step_before_it():
    """10 requests finished in a second, each prefilled 200 computed tokens of a 300-token prompt in
    30 ms; 4 running. Alone, a step holds its chunk and 3 decodes; with arrivals at 10/s and steps an
    arrival lands in of 20 ms, a step is shared by 0.2 more prompts on average."""
    a = _scrape(0.0, 0, 0)
    b = _scrape(1.0, 50, 3000, prefills=10, prefill_s=0.3, computed=2000, prompt=3000)
    (alone,) = prefill_samples([a, b], budget=512, landing_s=0.0)
    assert alone.duration_s == pytest.approx(0.03) and alone.weight == 10
    assert alone.batched_tokens == pytest.approx(200 + 3)
    assert alone.prefill_pairs == pytest.approx(200 * 100 + 200 * 201 / 2)  # against the cached 100, and causal
    (shared,) = prefill_samples([a, b], budget=512, landing_s=0.02)
    assert shared.batched_tokens == pytest.approx(200 * 1.2 + 3)
    assert shared.prefill_pairs == pytest.approx(alone.prefill_pairs * 1.2)
    # a prompt longer than the budget is computed in chunks: one sample per chunk step
    (chunked,) = prefill_samples([a, _scrape(1.0, 50, 3000, prefills=10, prefill_s=0.6, computed=8000, prompt=8000)],
                                 budget=512, landing_s=0.0)
    assert chunked.weight == 20 and chunked.duration_s == pytest.approx(0.03)
    assert chunked.batched_tokens == pytest.approx(400 + 3)


def test_the_step_an_arrival_lands_in_is_weighted_by_its_length():
    # 90 steps of 10 ms and 10 of 100 ms: a tenth of the steps, half the time
    samples = [StepSample(0.01, 10, weight=90), StepSample(0.1, 300, weight=10)]
    assert landing_step_s(samples) == pytest.approx((90 * 0.01 ** 2 + 10 * 0.1 ** 2) / (90 * 0.01 + 10 * 0.1))
    assert landing_step_s([]) == 0.0


def test_step_samples_are_interval_and_prefill_samples_of_each_engine():
    labels = {"namespace": "ns", "inference_deployment": "d"}

    def series(inst: str, name: str, *values: float) -> dict:
        return {"metric": {"__name__": name, "instance": inst, **labels},
                "values": [[100.0 + i, str(v)] for i, v in enumerate(values)]}
    rows = []
    for inst in ("10.0.0.1:8000", "10.0.0.2:8000"):
        rows += [series(inst, "vllm:iteration_tokens_total_count", 0, 100),
                 series(inst, "vllm:iteration_tokens_total_sum", 0, 2000),
                 series(inst, "vllm:num_requests_running", 4, 4),
                 series(inst, "vllm:request_prefill_time_seconds_count", 0, 5),
                 series(inst, "vllm:request_prefill_time_seconds_sum", 0, 0.1),
                 series(inst, "vllm:request_prefill_kv_computed_tokens_count", 0, 5),
                 series(inst, "vllm:request_prefill_kv_computed_tokens_sum", 0, 500),
                 series(inst, "vllm:request_prompt_tokens_count", 0, 5),
                 series(inst, "vllm:request_prompt_tokens_sum", 0, 500),
                 series(inst, "vllm:kv_cache_usage_perc", 0.1, 0.2)]  # not a step figure: not read
    per_engine = scrapes_of_series(rows)
    assert [[s.t_s for s in e] for e in per_engine] == [[100.0, 101.0], [100.0, 101.0]]
    assert "vllm:kv_cache_usage_perc" not in per_engine[0][0].values
    samples = step_samples(per_engine[0], budget=512)
    assert [s.weight for s in samples] == [100, 5]  # the interval's steps, then its prefill steps
    land = landing_step_s([StepSample(0.01, 0, weight=100), StepSample(0.02, 0, weight=5)])
    assert samples[1].batched_tokens == pytest.approx(100 * (1 + 5 * land) + 3)


def _text(e2e: float, queue: float, inference: float, n: int = 10) -> str:
    lines = []
    for name, mean in (("e2e_request_latency_seconds", e2e), ("request_queue_time_seconds", queue),
                       ("request_inference_time_seconds", inference)):
        lines += [f"vllm:{name}_sum {mean * n}", f"vllm:{name}_count {n}",
                  f'vllm:{name}_bucket{{le="+Inf"}} {n}']
    return "\n".join(lines) + "\n"


def test_frontend_is_the_time_outside_the_engine_core_less_the_wait_for_the_step_in_progress():
    figures = MetricFigures.from_prometheus_text(_text(e2e=0.700, queue=0.100, inference=0.590))
    steps = [StepSample(0.008, 10, weight=100)]  # every step 8 ms: an arrival waits 4 ms for the one running
    assert frontend_s(figures, steps) == pytest.approx(0.010 - 0.004)
    # never negative, and nothing to say without finished requests
    assert frontend_s(figures, [StepSample(0.05, 10, weight=100)]) == 0.0
    assert frontend_s(MetricFigures.from_prometheus_text(""), steps) == 0.0


def test_the_simulator_adds_the_frontend_to_each_requests_ttft_and_e2e_and_schedules_the_same():
    trace = [TraceRequest(0.05 * i, 64 + 8 * (i % 5), 16) for i in range(40)]
    profile = PROFILES["a100-llama3-8b"]
    cfg = EngineConfig(max_num_seqs=8)
    plain = simulate(trace, cfg, profile, per_request=True)
    hops = simulate(trace, cfg, profile.model_copy(update={"frontend_s": 0.005}), per_request=True)
    a, b = (sorted(r["per_request"], key=lambda r: r["id"]) for r in (plain, hops))
    assert [y["ttft_s"] - x["ttft_s"] for x, y in zip(a, b)] == pytest.approx([0.005] * 40)
    assert [y["e2e_s"] - x["e2e_s"] for x, y in zip(a, b)] == pytest.approx([0.005] * 40)
    assert [(x["queue_s"], x["prefill_s"]) for x in a] == [(y["queue_s"], y["prefill_s"]) for y in b]
