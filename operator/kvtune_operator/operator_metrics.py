"""The operator's own Prometheus metrics (prometheus_client), served at settings.metrics_port.

Invariant owned here: every figure the operator reports about itself is defined once, in this file,
under the ``kvtune_operator_`` prefix (base units, ``_total`` for counters). The engines' metrics are
the engine's (kvtune_engine.metrics); these say whether the operator keeps up with its fleet.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()

#: due -> start of each tuning round: how late the tuner runs (round_queue.py)
ROUND_LAG = Histogram(
    "kvtune_operator_tuning_round_lag_seconds",
    "Seconds from a deployment's due tuning round (its last round's start plus its autotune interval) "
    "to the round's start.",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800), registry=REGISTRY)
ROUND_DURATION = Histogram(
    "kvtune_operator_tuning_round_duration_seconds", "Seconds one tuning round takes (read, decide, write).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=REGISTRY)
ROUNDS_RUNNING = Gauge("kvtune_operator_tuning_rounds_running", "Tuning rounds running now.", registry=REGISTRY)
ROUNDS_WAITING = Gauge("kvtune_operator_tuning_rounds_waiting",
                       "Deployments due for a tuning round and waiting for a free slot.", registry=REGISTRY)
ROUNDS_LATE = Gauge("kvtune_operator_tuning_rounds_late",
                    "Deployments whose last tuning round started more than one interval late.", registry=REGISTRY)

#: per deployment: the tuner's running prediction error (status.tuning.predictionError)
PREDICTION_ERROR = Gauge("kvtune_operator_prediction_error_ratio",
                         "Running prediction error of a deployment's tuner: a moving average of the verdicts' "
                         "|predicted - measured| / measured slo attainment.", ("namespace", "name"), registry=REGISTRY)


def forget(namespace: str, name: str) -> None:
    """Drop a deleted deployment's series, so /metrics describes only deployments that exist."""
    try:
        PREDICTION_ERROR.remove(namespace, name)
    except KeyError:
        pass  # it never had a verdict


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Serve /metrics on ``port`` in a daemon thread (the operator's process lives as long)."""
    start_http_server(port, addr=address, registry=REGISTRY)
