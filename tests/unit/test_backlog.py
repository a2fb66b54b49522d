"""The requests still in the engine join the window's trace (tuner.backlog): estimated lengths, what a
replay of the survivors alone gets wrong under a deep queue, and the next window scored from the
queue a change starts from; a vLLM engine predicted under vLLM's policy."""
from __future__ import annotations

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_engine.sim.trace import TraceRequest
from kvtune_engine.sim.vllm_policy import QUEUE_CLOCK, vllm_v1_config
from kvtune_operator.effective import AutotunePlan
from kvtune_operator.model import AutotuneMode, InferenceDeploymentSpec
from kvtune_operator.tuner.backlog import WindowTrace, estimated_output, in_engine, with_unfinished
from kvtune_operator.tuner.predict import Predictor, as_trace
from kvtune_operator.tuning import tuner_settings


def test_estimated_output_is_the_median_of_longer_finished_outputs_within_the_cap():
    assert estimated_output(0, 32, [32] * 5) == 32            # a fixed shape: exact
    assert estimated_output(10, None, [5, 8, 20, 40]) == 40   # only outputs longer than 10 count
    assert estimated_output(3, 4, []) == 4                    # nothing finished: one more, within the cap
    assert estimated_output(50, 100, [10, 20]) == 51          # longer than every finished one
    assert estimated_output(0, 16, [100, 200]) == 16          # never past max_tokens
    assert estimated_output(16, 16, [100]) == 16              # done, not yet recorded


def test_window_trace_splits_at_the_start_and_marks_estimates():
    got = {"requests": [{"arrival_s": 1.0, "prompt_tokens": 3, "output_tokens": 5},
                        {"arrival_s": 11.0, "prompt_tokens": 3, "output_tokens": 7}],
           "unfinished": [{"arrival_s": 9.0, "prompt_tokens": 4, "generated_tokens": 0, "max_tokens": 9},
                          {"arrival_s": 12.0, "prompt_tokens": 4, "generated_tokens": 2, "max_tokens": 9}]}
    w = WindowTrace.split(got, 10.0)
    assert w.finished == [got["requests"][1]]
    assert [(r["arrival_s"], r["output_tokens"], r.get("estimated", False)) for r in w.trace] == \
        [(11.0, 7, False), (12.0, 7, True)]
    assert [(r["arrival_s"], r["output_tokens"]) for r in w.lead] == [(1.0, 5), (9.0, 7)]
    assert "max_tokens" not in w.lead[1] and as_trace(w.trace)[1].output_tokens == 7
    # the queue a change would start from: the two still in the engine, with what they have left
    assert in_engine(w.lead + w.trace) == [TraceRequest(0.0, 4, 7), TraceRequest(0.0, 4, 5)]
    assert WindowTrace.split({"requests": got["requests"]}, 10.0).trace == [got["requests"][1]]


def test_the_backlog_shows_the_load_a_sequence_cap_could_not_serve():
    # 8 requests/s offered for 20 s to an engine capped at 2 sequences that serves far fewer: by the
    # end of the window most requests still wait. Cut the simulated run at the window's end, as the
    # engine's trace would be read then: finished requests, and the others with what they generated.
    cfg, prof = EngineConfig(max_num_seqs=2), load_profile("a100-llama3-8b")
    offered = [TraceRequest(i / 8.0, 256, 128) for i in range(160)]
    rows = simulate(list(offered), cfg, prof, SLO(), per_request=True)["per_request"]
    end = 20.0
    done = [{"arrival_s": r["arrival_s"], "prompt_tokens": 256, "output_tokens": 128}
            for r in rows if r["arrival_s"] + r["e2e_s"] <= end]
    live = [{"arrival_s": r["arrival_s"], "prompt_tokens": 256, "max_tokens": 128,
             "generated_tokens": 0 if r["arrival_s"] + r["queue_s"] > end else 64}
            for r in rows if r["arrival_s"] + r["e2e_s"] > end and r["arrival_s"] <= end]
    assert len(done) < len(offered) / 2 < len(live) + len(done)
    survivors, full = as_trace(done), as_trace(with_unfinished(done, live))
    pred = Predictor(prof, SLO(ttft_s=2.0))
    wide = EngineConfig(max_num_seqs=64)
    # the survivors arrive at the rate the cap served: a replay barely queues, more sequences look
    # like a small gain; with the backlog the replay is the offered load, and the cap is the bottleneck
    gain_survivors = pred.predict(survivors, wide)["goodput_requests_per_s"] / max(
        1e-9, pred.predict(survivors, cfg)["goodput_requests_per_s"])
    gain_full = pred.predict(full, wide)["goodput_requests_per_s"] / max(
        1e-9, pred.predict(full, cfg)["goodput_requests_per_s"])
    assert len(full) == len(done) + len(live)
    assert gain_full > 2 * gain_survivors, (gain_full, gain_survivors)


def test_the_next_window_is_scored_with_the_queue_a_change_starts_from():
    # a cap that just keeps up with the arrivals never drains the 100 requests already waiting; a
    # replay from an empty engine cannot tell it from one that does
    prof, slo = load_profile("a100-llama3-8b"), SLO(ttft_s=2.0)
    small, big = EngineConfig(max_num_seqs=8), EngineConfig(max_num_seqs=64)
    rate = 0.9 * simulate([TraceRequest(0.0, 256, 128)] * 200, small, prof)["requests_per_s"]
    arrivals = [TraceRequest(i / rate, 256, 128) for i in range(int(20 * rate))]
    plain, nxt = Predictor(prof, slo), Predictor(prof, slo, backlog=[TraceRequest(0.0, 256, 128)] * 100)

    def goodput(p, cfg):
        return p.predict(arrivals, cfg)["goodput_requests_per_s"]
    assert goodput(plain, small) > 0.8 * goodput(plain, big)
    assert goodput(nxt, small) < 0.2 * goodput(nxt, big)
    # throughput counts the backlog's tokens too; goodput only the window's own arrivals
    s = nxt.predict(arrivals, big)
    assert s["requests_finished"] == len(arrivals)
    assert s["output_tokens_per_s"] * s["duration_s"] == pytest.approx(128 * (len(arrivals) + 100))


def test_a_vllm_engine_is_predicted_under_vllms_policy():
    # spec.runtime vllm: the replay chunks every prefill and starts queue time at intake, as vLLM V1
    # does, whatever the config says (the operator's settings carry the runtime)
    prof, slo = load_profile("a100-llama3-8b"), SLO(ttft_s=2.0)
    cfg = EngineConfig(max_num_seqs=8, enable_chunked_prefill=False)
    trace = [TraceRequest(i / 6.0, 3000, 64) for i in range(60)]
    got = Predictor(prof, slo, vllm=True).predict(trace, cfg)
    want = simulate(list(trace), vllm_v1_config(cfg), prof, slo, queue_clock=QUEUE_CLOCK)
    assert got == want and got != Predictor(prof, slo).predict(trace, cfg)
    plan = AutotunePlan(AutotuneMode.APPLY, 8.0, 20.0, 60.0, "http://prometheus:9090")
    for runtime in ("vllm", "kvtune"):
        spec = InferenceDeploymentSpec.model_validate({"model": {"path": "/m"}, "runtime": runtime})
        assert tuner_settings(spec, plan).vllm is (runtime == "vllm")
