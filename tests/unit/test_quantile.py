"""One percentile between measurement and verdict: the observed and the predicted p95 are the same
statistic of the same samples; a histogram estimate is named as one wherever it is compared."""
from __future__ import annotations

import random

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.metrics import QUEUE_TIME_BUCKETS, Histogram
from kvtune_engine.quantile import bucket_counts, bucket_quantile, check, percentile
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_operator.tuner.decide import FROM_BUCKETS, judge, window_figures
from kvtune_operator.tuner.loop import measured_figures
from kvtune_operator.tuner.observation import LengthStats, MetricFigures, Observation
from kvtune_operator.tuner.predict import window_summary

SC = SCENARIOS["seq-cap"]
SLO_ = SLO(SC.slo_ttft_s, SC.slo_tpot_s)


@pytest.fixture(scope="module")
def replay():
    trace = SC.trace(0)[:300]
    return trace, simulate(trace, EngineConfig(), load_profile(SC.profile), SLO_, per_request=True)


def test_percentile_keeps_its_invariant():
    rng = random.Random(0)
    for n in (0, 1, 2, 7, 100):
        check([rng.lognormvariate(0, 1) for _ in range(n)])
    assert percentile(list(range(1, 11)), 0.95) == pytest.approx(9.55)   # not nearest rank (10)


def test_request_lengths_use_the_one_percentile():
    prompts = list(range(100, 1100, 100))
    stats = LengthStats.from_trace([{"arrival_s": i, "prompt_tokens": p, "output_tokens": 2 * p}
                                    for i, p in enumerate(prompts)])
    assert stats.prompt_p95 == percentile(prompts, 0.95) == pytest.approx(955.0)
    assert stats.output_p50 == percentile([2 * p for p in prompts], 0.5)


def test_verdict_compares_like_with_like(replay):
    """The same requests, once as the observed window and once as the prediction of it: the verdict
    holds one p95 for both, the exact percentile of those requests' queue times."""
    _, full = replay
    observed = Observation.from_sim_summary(full)
    predicted = window_summary(full, float("-inf"), SLO_)
    queue = sorted(r["queue_s"] for r in full["per_request"])
    ttft = sorted(r["ttft_s"] for r in full["per_request"])
    assert observed.quantiles == "exact"
    assert observed.queue_time_p95_s == predicted["queue_time_p95_s"] == percentile(queue, 0.95) > 0
    assert observed.ttft_p95_s == predicted["ttft_p95_s"] == percentile(ttft, 0.95)
    m, p = measured_figures(observed), window_figures(predicted)
    v = judge(m, m, p, 0.1)
    assert v.keep and v.like_with_like and FROM_BUCKETS not in m
    assert v.measured["queue_time_p95_s"] == v.predicted["queue_time_p95_s"]
    assert "histogram" not in v.reason


def test_a_histogram_estimate_is_named_as_one(replay):
    """The same queue times read from the engine's buckets: the observation says its p95 is an
    estimate (Prometheus' reading of those buckets), and a verdict against an exact prediction says so."""
    _, full = replay
    queue = sorted(r["queue_s"] for r in full["per_request"])
    buckets = bucket_counts(queue, QUEUE_TIME_BUCKETS)
    f = MetricFigures()
    for le, c in buckets:
        f.set("kvtune_request_queue_time_seconds_bucket", c, le="+Inf" if le == float("inf") else repr(le))
    f.set("kvtune_request_queue_time_seconds_count", len(queue))
    f.set("kvtune_request_queue_time_seconds_sum", sum(queue))
    obs = Observation.from_metrics(f, config=EngineConfig(), window_s=60.0)
    h = Histogram(QUEUE_TIME_BUCKETS)
    h.observe_many(queue)
    assert obs.quantiles == "histogram"
    assert obs.queue_time_p95_s == bucket_quantile(buckets, 0.95) == h.quantile_estimate(0.95)
    assert obs.queue_time_p95_s != percentile(queue, 0.95)       # an estimate, not the percentile
    m = measured_figures(obs)
    v = judge(m, m, window_figures(window_summary(full, float("-inf"), SLO_)), 0.1)
    assert m[FROM_BUCKETS] == 1.0 and not v.like_with_like
    assert "measured p95s (and the share within the objectives) are estimates from the engine's histogram " \
           "buckets, predicted ones exact" in v.reason
    both = judge(m, m, m, 0.1)
    assert both.like_with_like and "histogram" not in both.reason
