"""Window figures from Prometheus range-query results (the shape prometheus-api-client returns)."""
from kvtune_operator.prometheus import window_figures


def _series(name, values, pod="p0", **labels):
    return {"metric": {"__name__": name, "pod": pod, "instance": f"127.0.0.1:{800 + int(pod[1:])}",
                       "namespace": "ns", "inference_deployment": "chat", **labels},
            "values": [[i, str(v)] for i, v in enumerate(values)]}


def test_counters_increase_gauges_mean_and_replicas_averaged():
    figs, instances = window_figures([
        _series("kvtune_steps_total", [100, 150, 200]),
        _series("kvtune_steps_total", [10, 40, 70], pod="p1"),
        _series("kvtune_scheduler_waiting_reason_steps_total", [5, 5, 45], reason="max_num_seqs"),
        _series("kvtune_kv_usage_ratio", [0.2, 0.3, 0.4]),
        _series("kvtune_kv_usage_ratio", [0.0, 0.1, 0.2], pod="p1"),
    ])
    assert instances == ["127.0.0.1:800", "127.0.0.1:801"]
    assert figs.get("kvtune_steps_total") == 80.0            # (100 + 60) / 2 replicas
    assert figs.get("kvtune_scheduler_waiting_reason_steps_total", reason="max_num_seqs") == 40.0
    assert abs(figs.get("kvtune_kv_usage_ratio") - 0.2) < 1e-9  # mean of 0.3 and 0.1
    assert abs(figs.get("kvtune_kv_usage_ratio", agg="max") - 0.4) < 1e-9


def test_counter_reset_is_not_a_negative_increase():
    figs, _ = window_figures([_series("kvtune_steps_total", [100, 120, 5, 25])])
    assert figs.get("kvtune_steps_total") == 20 + 5 + 20


def test_histogram_buckets_keep_le_and_give_quantiles():
    figs, _ = window_figures([
        _series("kvtune_request_queue_time_seconds_bucket", [0, 10], le="1.0"),
        _series("kvtune_request_queue_time_seconds_bucket", [0, 20], le="2.0"),
        _series("kvtune_request_queue_time_seconds_bucket", [0, 20], le="+Inf"),
    ])
    assert 0.9 < figs.hist_quantile("kvtune_request_queue_time_seconds", 0.5) <= 1.0
    assert figs.hist_quantile("kvtune_request_queue_time_seconds", 0.99) > 1.9
