"""gather_vllm's window across a rollout: a whole window of the vLLM engines running now, from their
first scrape.

A new vLLM pod's process starts a minute or more before it serves (and Prometheus first scrapes it);
the old pod serves, and is scraped, until the new one is ready. A window judged back to the new
process' start would be the old pod's (regression: a restart change was rolled back on such a window),
and one of the new pod's first seconds its start-up (regression: a 6x gain rolled back as a 92% fall).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_operator import tuning_vllm
from kvtune_operator.prometheus import MetricsUnavailable, Window, window_figures

NOW, OLD, NEW = 10_000.0, "10.0.0.1:8000", "10.0.0.2:8000"


def series(inst: str, first: float, last: float, running: float, started: float) -> list[dict]:
    ts = [t for t in range(int(first), int(last) + 1)]  # scraped every second
    labels = {"instance": inst, "namespace": "ns", "inference_deployment": "d", "model_name": "tiny"}
    done = [[t, str(5.0 * (t - first))] for t in ts]     # 5 requests/s finished
    return [{"metric": {"__name__": "vllm:num_requests_running", **labels}, "values": [[t, str(running)] for t in ts]},
            {"metric": {"__name__": "vllm:request_success_total", **labels, "finished_reason": "length"},
             "values": done},
            {"metric": {"__name__": "process_start_time_seconds", **labels}, "values": [[t, str(started)] for t in ts]}]


@pytest.fixture
def prometheus(monkeypatch):
    """read_window over fixed series: the samples in (now - window, now], as a range query returns."""
    prom = SimpleNamespace(series=[], calls=[])

    def read_window(url, namespace, name, window_s, *, timeout_s=10.0, new_instances=(), runtime="kvtune"):
        prom.calls.append((window_s, sorted(new_instances)))
        lo = NOW - int(window_s)
        got = [{**s, "values": [v for v in s["values"] if v[0] > lo]} for s in prom.series]
        got = [s for s in got if s["values"]]
        figures, instances = window_figures(got, max(1, int(window_s)), new_instances)
        return Window(figures, instances, window_s, got)
    monkeypatch.setattr(tuning_vllm, "read_window", read_window)
    return prom


class Plan:
    prometheus_url = "http://prometheus"


def gather(window: float = 20.0):
    return tuning_vllm.gather_vllm(Plan(), "ns", "d", EngineConfig(max_num_seqs=64), window, now=NOW)


def test_a_window_that_spans_a_rollout_waits_for_the_new_engines_alone(prometheus):
    # the new engine's process started 140 s ago, it serves since 15 s ago, the old one left 12 s ago
    prometheus.series = (series(OLD, NOW - 30, NOW - 12, 2, NOW - 400) +
                         series(NEW, NOW - 15, NOW, 10, NOW - 140))
    with pytest.raises(MetricsUnavailable) as e:
        gather()
    assert e.value.reason == "WindowTooShort" and "12s ago (an engine left)" in str(e.value)
    assert "whole 20s window" in str(e.value)


def test_after_a_rollout_a_whole_window_of_the_new_engine_is_judged(prometheus):
    prometheus.series = (series(OLD, NOW - 60, NOW - 25, 2, NOW - 400) +
                         series(NEW, NOW - 28, NOW, 10, NOW - 140))
    _, _, window, _, _ = gather()
    assert window == 20.0 and prometheus.calls == [(20.0, [])]
    assert all(s["metric"]["instance"] == NEW for s in tuning_vllm.read_window(
        "", "ns", "d", window).series)                # the old engine is not in the judged window


def test_a_new_engine_counts_from_its_first_scrape_not_its_process_start(prometheus):
    # started 140 s ago (longer than the window), serving for 14 s: not yet a window of its own
    prometheus.series = series(NEW, NOW - 14, NOW, 10, NOW - 140)
    with pytest.raises(MetricsUnavailable) as e:
        gather()
    assert e.value.reason == "WindowTooShort"


def test_the_same_engines_all_along_keep_the_whole_window(prometheus):
    prometheus.series = series(OLD, NOW - 19, NOW, 2, NOW - 400)
    _, _, window, _, _ = gather()
    assert window == 20.0 and prometheus.calls == [(20.0, [])]


def test_cache_config_info_that_contradicts_the_command_line_is_drift(prometheus):
    """vLLM's cache_config_info against the knobs the operator rendered: a model length other than
    the command line's (vLLM 0.32's own labels: 8192 blocks of 128 hold 512 requests of 2048 tokens)
    is a finding that names both figures; the same labels against a command line of 2048 are none;
    a knob left to vLLM is never one."""
    info = {"__name__": "vllm:cache_config_info", "instance": NEW, "block_size": "128", "num_gpu_blocks": "8192",
            "kv_cache_size_tokens": "1048576", "kv_cache_max_concurrency": "512.0", "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9"}
    prometheus.series = series(NEW, NOW - 19, NOW, 2, NOW - 400) + [
        {"metric": info, "values": [[t, "1"] for t in range(int(NOW - 19), int(NOW) + 1)]}]
    rendered = EngineConfig(max_num_seqs=64, block_size=128, max_model_len=4096)
    *_, found = tuning_vllm.gather_vllm(Plan(), "ns", "d", rendered, 20.0, now=NOW)
    assert len(found) == 1 and found[0].startswith(f"{NEW}: vLLM reports room for 512 requests")
    assert "a model length of about 2048, the command line 4096" in found[0]
    *_, found = tuning_vllm.gather_vllm(Plan(), "ns", "d", rendered.with_changes(max_model_len=2048), 20.0, now=NOW)
    assert found == []
    *_, found = tuning_vllm.gather_vllm(Plan(), "ns", "d", rendered, 20.0, now=NOW,
                                        left_to_engine=frozenset({"max_model_len"}))
    assert found == []
    *_, found = tuning_vllm.gather_vllm(Plan(), "ns", "d", rendered.with_changes(max_model_len=2048, block_size=16),
                                        20.0, now=NOW)
    assert found == [f"{NEW}: vLLM reports block_size 128, the command line 16"]


def test_step_samples_count_the_recompute_vllm_leaves_out():
    """vLLM's iteration_tokens_total counts prompts once, at their first token: a preempted request's
    recompute is not in it. Between two scrapes with 3 preemptions and prompts of 280 tokens on
    average, the interval's tokens are its counted 2000 plus 3 prompts computed again; an interval
    with no preemption keeps its count."""
    labels = {"instance": OLD, "namespace": "ns", "inference_deployment": "d"}

    def s(name: str, *values: float) -> dict:
        return {"metric": {"__name__": name, **labels}, "values": [[NOW + i, str(v)] for i, v in enumerate(values)]}
    series = [s("vllm:iteration_tokens_total_count", 0, 100, 200), s("vllm:iteration_tokens_total_sum", 0, 2000, 4000),
              s("vllm:num_requests_running", 8, 8, 8), s("vllm:num_preemptions_total", 5, 8, 8)]
    first, second = tuning_vllm.step_samples(series, 512, prompt_tokens_mean=280.0)
    assert first.batched_tokens == pytest.approx((2000 + 3 * 280) / 100) and first.weight == 100
    assert second.batched_tokens == pytest.approx(20.0)
    assert [x.batched_tokens for x in tuning_vllm.step_samples(series, 512)] == [20.0, 20.0]  # no prompt mean: as counted
