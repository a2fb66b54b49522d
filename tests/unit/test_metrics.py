"""/metrics: every README.md metric and the vLLM subset, checked against known workloads."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
from conftest_engine import build_engine, run_server, tiny_llama  # noqa: F401  (fixture)
from prometheus_client.parser import text_string_to_metric_families

from kvtune_engine.core.request import SamplingParams

README = Path(__file__).resolve().parents[2] / "README.md"  # its Metrics table is the contract

KVTUNE_METRICS = {  # family name (as the parser reports it) -> type
    "kvtune_kv_blocks": "gauge", "kvtune_kv_usage_ratio": "gauge",
    "kvtune_kv_internal_fragmentation_ratio": "gauge", "kvtune_swap_usage_ratio": "gauge",
    "kvtune_requests": "gauge", "kvtune_scheduler_waiting_reason_steps": "counter",
    "kvtune_preemptions": "counter", "kvtune_prefix_cache_queries_tokens": "counter",
    "kvtune_prefix_cache_hits_tokens": "counter", "kvtune_step_duration_seconds": "histogram",
    "kvtune_step_batched_tokens": "histogram", "kvtune_memory_bytes": "gauge",
    "kvtune_engine_config_info": "gauge", "kvtune_time_to_first_token_seconds": "histogram",
    "kvtune_inter_token_latency_seconds": "histogram", "kvtune_e2e_request_latency_seconds": "histogram",
    "kvtune_request_queue_time_seconds": "histogram", "kvtune_request_prompt_tokens": "histogram",
    "kvtune_request_output_tokens": "histogram",
}
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}


def parse(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams, family: str, sample: str | None = None, **labels) -> float:
    for s in fams[family].samples:
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((family, sample, labels))


def test_design_table_names_are_exported(tiny_llama):  # noqa: F811
    """Every metric named in README's Metrics table (the doc is the contract) is in the exposition."""
    rows = [ln for ln in README.read_text().splitlines() if ln.startswith("| `kvtune_")]
    assert len(rows) >= 10, "README.md has lost its Metrics table"
    names = {n for ln in rows for n in re.findall(r"`(kvtune_[a-z0-9_]+)", ln.split("|")[1])}
    eng = build_engine(tiny_llama)
    text = eng.metrics.render().decode()
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    exposed |= {f.name for f in text_string_to_metric_families(text)}
    for n in names | {"kvtune_prefix_cache_hits_tokens_total", "kvtune_prefix_cache_queries_tokens_total"}:
        n = n.rstrip("_")
        if n.endswith("_"):
            continue
        assert n in exposed or n + "_total" in exposed or n + "_count" in exposed, n
    fams = parse(text)
    for name, typ in {**KVTUNE_METRICS, **VLLM_METRICS}.items():
        assert name in fams, name
        assert fams[name].type == typ, (name, fams[name].type)
    for st in ("free", "used", "cached", "reserved"):
        value(fams, "kvtune_kv_blocks", state=st)
    for k in ("weights", "kv_cache", "swap", "device_total"):
        assert value(fams, "kvtune_memory_bytes", kind=k) > 0
    for m in ("swap", "recompute"):
        assert value(fams, "kvtune_preemptions", "kvtune_preemptions_total", mode=m) == 0
    for r in ("max_num_seqs", "token_budget", "kv_blocks", "watermark", "none"):
        value(fams, "kvtune_scheduler_waiting_reason_steps", "kvtune_scheduler_waiting_reason_steps_total",
              reason=r)
    # vLLM's labels
    info = [s for s in fams["vllm:cache_config_info"].samples][0]
    assert info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == str(eng.num_blocks)
    assert info.labels["engine"] == "0"  # vLLM's cache_config_info carries engine, not model_name
    assert value(fams, "vllm:num_requests_waiting", model_name=eng.model_name) == 0
    cfg = [s for s in fams["kvtune_engine_config_info"].samples][0].labels
    assert cfg["max_num_seqs"] == str(eng.config.max_num_seqs) and cfg["enable_prefix_caching"] == "true"


def test_gauges_are_read_at_scrape_time(tiny_llama):  # noqa: F811
    """max_num_seqs=2 with 8 requests: 2 running, 6 waiting, the cause counted, KV usage low."""
    eng = build_engine(tiny_llama, max_num_seqs=2)
    for i in range(8):
        eng.add_request(f"request number {i}", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    f = parse(eng.metrics.render().decode())
    m = eng.model_name
    assert value(f, "kvtune_requests", state="running") == 2 == value(f, "vllm:num_requests_running", model_name=m)
    assert value(f, "kvtune_requests", state="waiting") == 6 == value(f, "vllm:num_requests_waiting", model_name=m)
    assert value(f, "kvtune_scheduler_waiting_reason_steps", "kvtune_scheduler_waiting_reason_steps_total",
                 reason="max_num_seqs") == 3
    usage = value(f, "kvtune_kv_usage_ratio")
    assert 0 < usage < 0.5 and usage == value(f, "vllm:kv_cache_usage_perc", model_name=m)
    used = value(f, "kvtune_kv_blocks", state="used")
    assert used == eng.scheduler.kv.pool.num_used > 0
    assert 0 <= value(f, "kvtune_kv_internal_fragmentation_ratio") < 1
    while eng.has_unfinished():
        eng.step()
    f = parse(eng.metrics.render().decode())
    assert value(f, "kvtune_requests", state="waiting") == 0
    assert value(f, "kvtune_kv_blocks", state="used") == 0
    assert value(f, "kvtune_generation_tokens", "kvtune_generation_tokens_total") == 160
    assert value(f, "vllm:generation_tokens", "vllm:generation_tokens_total", model_name=m) == 160
    assert value(f, "kvtune_e2e_request_latency_seconds", "kvtune_e2e_request_latency_seconds_count") == 8
    assert value(f, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count",
                 model_name=m) == 8
    assert value(f, "kvtune_request_output_tokens", "kvtune_request_output_tokens_sum") == 160
    # 19 gaps per request
    assert value(f, "kvtune_inter_token_latency_seconds", "kvtune_inter_token_latency_seconds_count") == 8 * 19
    assert value(f, "kvtune_request_queue_time_seconds", "kvtune_request_queue_time_seconds_count") == 8
    n_steps = value(f, "kvtune_steps", "kvtune_steps_total")
    assert value(f, "kvtune_step_duration_seconds", "kvtune_step_duration_seconds_count") == n_steps
    assert value(f, "kvtune_step_batched_tokens", "kvtune_step_batched_tokens_sum") == \
        eng.counters["prompt_tokens"] + 160 - 8  # every prompt token once, every output token but the last


def test_prefix_cache_counters(tiny_llama):  # noqa: F811
    eng = build_engine(tiny_llama)
    shared = list(range(10, 58))  # 48 tokens = 3 full blocks
    for tail in ([300], [301], [302]):
        eng.add_request(shared + tail, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
    f = parse(eng.metrics.render().decode())
    q = value(f, "kvtune_prefix_cache_queries_tokens", "kvtune_prefix_cache_queries_tokens_total")
    h = value(f, "kvtune_prefix_cache_hits_tokens", "kvtune_prefix_cache_hits_tokens_total")
    assert q == 3 * 49 and h == 2 * 48
    m = eng.model_name
    assert value(f, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total", model_name=m) == q
    assert value(f, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", model_name=m) == h
    assert value(f, "kvtune_kv_blocks", state="cached") > 0


def test_preemption_counters(tiny_llama):  # noqa: F811
    # 8 blocks of 16 tokens, no swap: 4 requests growing to 40 tokens each must preempt (recompute)
    eng = build_engine(tiny_llama, kv_cache_memory=8 * 16 * 2 * 2 * 2 * 16 * 4 / 2**30, swap_space=0)
    assert eng.num_blocks == 8
    for i in range(4):
        eng.add_request([20 + i] * 10, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    f = parse(eng.metrics.render().decode())
    rec = value(f, "kvtune_preemptions", "kvtune_preemptions_total", mode="recompute")
    assert rec > 0
    assert value(f, "vllm:num_preemptions", "vllm:num_preemptions_total", model_name=eng.model_name) == rec
    assert value(f, "kvtune_scheduler_waiting_reason_steps", "kvtune_scheduler_waiting_reason_steps_total",
                 reason="kv_blocks") > 0


def test_server_metrics_under_load(tiny_llama):  # noqa: F811
    """The issue's workload through the server: max_num_seqs=2, 8 concurrent requests."""
    with run_server(tiny_llama, max_num_seqs=2) as s:
        async def go():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": "count with me", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
                tasks = [asyncio.create_task(c.post(s.url + "/v1/completions", json=body)) for _ in range(8)]
                seen = []
                while not all(t.done() for t in tasks):
                    seen.append(parse((await c.get(s.url + "/metrics")).text))
                    await asyncio.sleep(0.02)
                return [t.result() for t in tasks], seen
        results, seen = asyncio.run(go())
        assert all(r.status_code == 200 for r in results)
        m = s.engine.model_name
        waiting = [value(f, "vllm:num_requests_waiting", model_name=m) for f in seen]
        running = [value(f, "vllm:num_requests_running", model_name=m) for f in seen]
        usage = [value(f, "kvtune_kv_usage_ratio") for f in seen]
        assert max(waiting) > 0
        assert max(running) == 2
        assert max(usage) < 0.5
        f = parse(s.get_text("/metrics"))
        assert value(f, "kvtune_scheduler_waiting_reason_steps", "kvtune_scheduler_waiting_reason_steps_total",
                     reason="max_num_seqs") > 0
        usage_sum = sum(r.json()["usage"]["completion_tokens"] for r in results)
        assert value(f, "vllm:generation_tokens", "vllm:generation_tokens_total", model_name=m) == usage_sum
        prompt_sum = sum(r.json()["usage"]["prompt_tokens"] for r in results)
        assert value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model_name=m) == prompt_sum
        assert value(f, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count",
                     model_name=m) == 8
        assert value(f, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_sum",
                     model_name=m) > 0  # 6 of them queued behind the cap


@pytest.mark.parametrize("n", [1, 2])
def test_registries_are_per_engine(tiny_llama, n):  # noqa: F811
    engines = [build_engine(tiny_llama) for _ in range(n)]
    assert len({id(e.metrics.registry) for e in engines}) == n
