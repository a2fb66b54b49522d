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


def test_an_engine_that_started_inside_the_window_counts_from_zero():
    # 20 s window scraped every second; the new engine's first scrape, 12 s in, already shows 30 steps
    def s(values, start, pod):
        d = _series("kvtune_steps_total", values, pod=pod)
        d["values"] = [[start + i, str(v)] for i, v in enumerate(values)]
        return d
    old = s([100] * 20, 0, "p0")
    new = s([30, 40, 50], 17, "p1")
    figs, _ = window_figures([old, new], window_s=20)
    assert figs.get("kvtune_steps_total") == (0 + 50) / 2        # 50 steps: from zero, not from 30
    figs, _ = window_figures([new], new_instances=["127.0.0.1:801"])
    assert figs.get("kvtune_steps_total") == 50.0
    figs, _ = window_figures([s([30, 40, 50], 0, "p1")], window_s=3)  # there all along: only the increase
    assert figs.get("kvtune_steps_total") == 20.0


def test_status_patch_replaces_nested_objects_it_rewrites():
    from kvtune_operator.tuning_record import replacing as _replacing

    old = {"action": "Apply", "before": {"maxNumSeqs": 2}, "after": {"maxNumSeqs": 64}, "restart": False}
    new = {"action": "RollBack", "message": "fell 40%"}
    assert _replacing(old, new) == {"action": "RollBack", "message": "fell 40%", "before": None,
                                    "after": None, "restart": None}


def _scrapes(stamps, pod="p0"):
    d = _series("kvtune_steps_total", list(range(len(stamps))), pod=pod)
    d["values"] = [[t, str(i)] for i, t in enumerate(stamps)]
    return d


def test_coverage_counts_the_scraped_share_of_the_window():
    from kvtune_operator.prometheus import MIN_COVERAGE, coverage

    full = [float(t) for t in range(1, 21)]                      # every second of a 20 s window
    assert coverage([_scrapes(full)], 20) == 1.0
    # Prometheus down for 12 s in the middle: the window is mostly a guess
    gap = [t for t in full if not 5 < t < 18]
    assert coverage([_scrapes(gap)], 20) < MIN_COVERAGE
    # only the last 6 s scraped (Prometheus came back with an empty store)
    assert coverage([_scrapes(full[-6:])], 20) < MIN_COVERAGE
    # ... unless the engine itself started then (judged on its own life)
    assert coverage([_scrapes(full[-6:])], 20, new_instances=["127.0.0.1:800"]) == 1.0
    # the best-covered replica counts
    assert coverage([_scrapes(gap), _scrapes(full, pod="p1")], 20) == 1.0


def test_read_window_refuses_a_window_with_too_few_scrapes(monkeypatch):
    import pytest
    from kvtune_operator import prometheus
    from kvtune_operator.prometheus import MetricsUnavailable, read_window

    stamps = [float(t) for t in range(1, 21) if not 5 < t < 18]
    monkeypatch.setattr(prometheus, "query", lambda url, promql, **kw: [_scrapes(stamps)])
    with pytest.raises(MetricsUnavailable) as e:
        read_window("http://127.0.0.1:9", "ns", "chat", 20)
    assert e.value.reason == "IncompleteWindow" and "of the last 20s" in str(e.value)
