"""One workload on the real engine and in the simulator: both fill the same Observation fields.

The tuner reads every window through `Observation`, built from the engine's /metrics (in a
cluster: Prometheus) or from a simulator summary (predictions, `kvtune tune`, the benches). A field
one source fills and the other leaves empty is a figure the tuner silently reads as 0 on one side
(issue 12: the simulator's summary lacked kv_usage_peak and queued_mean, so the KV-peak trigger never
fired in any prediction). Here the real engine serves a sequence-cap workload over HTTP, the
simulator replays its own trace with step costs fitted from its step log, and the two observations
are compared field by field.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import httpx

from conftest_engine import TEST_FLAGS, run_server, tiny_llama  # noqa: F401  (fixture)
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_operator.tuner.observation import Observation
from kvtune_operator.tuner.predict import as_trace, fitted
from kvtune_operator.tuner_cli import read_engine

#: fields that name the source or carry raw inputs rather than figures
NOT_FIGURES = {"source", "summary", "step_samples", "frontend_s", "lengths", "config", "window_s"}
N = 16
#: figures this workload must make non-zero in both (a cap of 2 under N concurrent requests)
MUST_SHOW = ("kv_usage_mean", "kv_usage_peak", "num_blocks", "running_mean", "running_peak", "waiting_peak",
             "queue_time_p50_s", "queue_time_p95_s", "queue_time_p99_s", "ttft_p95_s", "tpot_p95_s",
             "output_tokens_per_s", "requests_per_s", "goodput_requests_per_s", "requests_finished")


def _request(url: str, model: str, i: int) -> None:
    body = {"model": model, "prompt": [5 + (i * 7 + j) % 400 for j in range(24 + i % 5)], "max_tokens": 48,
            "ignore_eos": True, "temperature": 0.0}
    httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()


def test_engine_and_simulator_fill_the_same_observation_fields(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, **{**TEST_FLAGS, "max_num_seqs": 2}) as srv:
        model = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
        with ThreadPoolExecutor(N) as pool:
            done = [pool.submit(_request, srv.url, model, i) for i in range(N)]
            # a window of scrapes while the load runs, as Prometheus would take them
            engine = read_engine(srv.url, window_s=3.0, samples=12)
            for d in done:
                d.result()
        srv.wait_idle()
        steps = httpx.get(f"{srv.url}/kvtune/v1/steps", params={"limit": 2000}).json()["steps"]
        trace = httpx.get(f"{srv.url}/kvtune/v1/trace").json()["requests"]
    engine = engine.with_engine_steps(steps)
    profile, _ = fitted(engine, None, min_samples=5)
    summary = simulate(as_trace(trace), engine.config, profile, SLO())
    sim = Observation.from_sim_summary(summary, trace=trace, config=engine.config)

    assert engine.waiting_cause_share.keys() == sim.waiting_cause_share.keys()
    assert engine.waiting_cause_share["max_num_seqs"] > 0.1 and sim.waiting_cause_share["max_num_seqs"] > 0.1
    unfilled = {}
    for f in dataclasses.fields(Observation):
        if f.name in NOT_FIGURES:
            continue
        e, s = getattr(engine, f.name), getattr(sim, f.name)
        if f.name == "memory":  # on CPU nothing profiles the activations: the engine says so (no key)
            e = {k: v for k, v in e.items() if k != "activations_peak"}
            s = {k: v for k, v in s.items() if k != "activations_peak"}
        if (e is None) != (s is None) or (isinstance(e, dict) and e.keys() != s.keys()):
            unfilled[f.name] = (e, s)
    assert not unfilled, f"filled by one source only (engine, simulator): {unfilled}"
    empty = {k: (getattr(engine, k), getattr(sim, k)) for k in MUST_SHOW
             if not getattr(engine, k) or not getattr(sim, k)}
    assert not empty, f"zero in one source (engine, simulator): {empty}"
    assert 0 < engine.requests_finished <= N and 0 < sim.requests_finished <= N
