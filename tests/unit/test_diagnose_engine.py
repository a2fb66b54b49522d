"""`kvtune diagnose --url` against an HTTP server that renders /metrics with the engine's own collector."""
from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from kvtune_engine.config import EngineConfig
from kvtune_engine.metrics import EngineMetrics, new_histograms
from kvtune_operator.cli import main
from kvtune_operator.tuner.diagnose import diagnose
from kvtune_operator.tuner.observation import MetricFigures, Observation
from local_http import serving

GiB = 1 << 30


def seq_cap_snapshot(steps: int = 1000) -> dict:
    cfg = EngineConfig(max_num_seqs=64, gpu_memory_utilization=0.9, block_size=16).model_dump()
    total = 10_000
    return {
        "config": cfg,
        "blocks": {"total": total, "free": 7300, "used": 2600, "cached": 0, "reserved": 100},
        "swap": {"total": 2000, "used": 0},
        "kv_usage_ratio": 0.26, "kv_internal_fragmentation_ratio": 0.02, "swap_usage_ratio": 0.0,
        "requests": {"running": 64, "waiting": 41, "swapped": 0},
        "queues": {"running": 64, "waiting": 41, "swapped": 0},
        "waiting_reason_steps": {"max_num_seqs": int(steps * 0.9), "none": steps - int(steps * 0.9)},
        "preemptions": {"swap": 0, "recompute": 0, "swap_full": 0},
        "prefix_cache": {"queries_tokens": 1000, "hits_tokens": 100},
        "counters": {"prompt_tokens": 500_000, "generation_tokens": 100_000, "steps": steps,
                     "requests_finished": {"stop": 900, "length": 100}},
        "memory": {"weights": 16 * GiB, "activations_peak": 2 * GiB, "kv_cache": 50 * GiB, "device_total": 80 * GiB},
        "uptime_s": 120.0,
    }


def histograms(steps: int = 1000):
    h = new_histograms()
    for i in range(steps):
        h["step_duration"].observe(0.02 + 0.00001 * (i % 50))
        h["step_tokens"].observe(64 + i % 50)
    for i in range(1000):
        h["queue"].observe(3.0 + (i % 10) * 0.2)
        h["ttft"].observe(3.2 + (i % 10) * 0.2)
        h["itl"].observe(0.03)
        h["e2e"].observe(8.0)
        h["output_tokens"].observe(100)
    return h


@pytest.fixture
def engine_url():
    scrapes = {"n": 0}

    def snapshot() -> dict:
        # every scrape sees 1000 more steps, 90% of them stopped by the sequence cap
        scrapes["n"] += 1
        return seq_cap_snapshot(steps=1000 * scrapes["n"])

    snap = seq_cap_snapshot()
    metrics = EngineMetrics(snapshot, histograms(), "m")
    trace = {"requests": [{"arrival_s": i * 0.05, "prompt_tokens": 400 + i % 200, "output_tokens": 100}
                          for i in range(1000)]}

    def answer(path: str) -> tuple[bytes, str] | None:
        if path == "/metrics":
            return metrics.render(), "text/plain"
        if path == "/kvtune/v1/state":
            return json.dumps(snap).encode(), "application/json"
        if path == "/kvtune/v1/trace":
            return json.dumps(trace).encode(), "application/json"
        return None

    with serving(answer) as url:
        yield url


def test_observation_from_the_engines_metrics_text():
    snap = seq_cap_snapshot()
    text = EngineMetrics(lambda: snap, histograms(), "m").render().decode()
    obs = Observation.from_metrics(MetricFigures.from_prometheus_text(text), state=snap, window_s=120.0)
    assert obs.config.max_num_seqs == 64
    assert obs.num_blocks == 10_000
    assert obs.kv_usage_mean == pytest.approx(0.26)
    assert obs.waiting_cause_share["max_num_seqs"] == pytest.approx(0.9)
    assert obs.running_mean == 64 and obs.waiting_mean == 41
    assert obs.memory["device_total"] == 80 * GiB
    assert 3.0 <= obs.queue_time_p50_s <= 4.0
    assert obs.step_samples and obs.step_samples[0].weight == 1000
    assert obs.prefix_cache_hit_rate == pytest.approx(0.1)
    d = diagnose(obs)
    assert d.cause == "SequenceCap"
    assert "64 of 64 sequences running while KV usage is 26%" in d.message


def test_counters_over_a_window_are_increases_and_gauges_are_averages():
    a = MetricFigures({("kvtune_steps_total", ()): 100.0, ("kvtune_kv_usage_ratio", ()): 0.2})
    b = MetricFigures({("kvtune_steps_total", ()): 300.0, ("kvtune_kv_usage_ratio", ()): 0.4})
    w = MetricFigures.over_scrapes([a, b])
    assert w.get("kvtune_steps_total") == 200.0
    assert w.get("kvtune_kv_usage_ratio") == pytest.approx(0.3)
    assert w.get("kvtune_kv_usage_ratio", agg="max") == pytest.approx(0.4)


def test_kvtune_diagnose_url(engine_url):
    r = CliRunner().invoke(main, ["diagnose", "--url", engine_url, "--window", "0"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("SequenceCap: Requests wait on the sequence cap: 64 of 64 sequences running")
    assert "raising maxNumSeqs to" in r.output
    # over a window: the counters' increases between the scrapes (here 90% of the new steps)
    began = time.monotonic()
    r = CliRunner().invoke(main, ["diagnose", "--url", engine_url, "--window", "0.2", "--json"])
    took = time.monotonic() - began
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["diagnosis"]["cause"] == "SequenceCap"
    assert out["observation"]["waiting_cause_share"]["max_num_seqs"] == pytest.approx(0.9, abs=0.01)
    assert 0 < out["observation"]["window_s"] <= took  # the seconds the scrapes' answers really spanned
    assert out["diagnosis"]["suggestion"]["max_num_seqs"] > 64
    assert out["observation"]["config"]["max-num-seqs"] == 64
    assert out["observation"]["lengths"]["count"] == 1000


def test_kvtune_diagnose_unreachable_engine_is_one_clear_error():
    r = CliRunner().invoke(main, ["diagnose", "--url", "http://127.0.0.1:9"])
    assert r.exit_code != 0
    assert "cannot reach the engine at http://127.0.0.1:9" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("bad", ["0", "-5", "soon"])
def test_kvtune_diagnose_refuses_a_timeout_that_is_not_a_positive_number(bad):
    r = CliRunner().invoke(main, ["diagnose", "--url", "http://127.0.0.1:9", "--timeout", bad])
    assert r.exit_code == 2 and "--timeout" in r.output and "Traceback" not in r.output
    assert "x>0" in r.output or "is not a valid float" in r.output  # what is allowed
