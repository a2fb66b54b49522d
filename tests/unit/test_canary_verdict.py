"""The canary verdict (issue 24): one pod runs the change, its siblings are the controls over the same
window; gates are data (spec.autotune.canary.gates) whose defaults match today's before/after rule."""
from __future__ import annotations

import pytest

from kvtune_operator.model import AutotuneSpec, CanaryStatus
from kvtune_operator.tuner import canary
from kvtune_operator.tuner.canary import Gates, PodFigures, canary_applies, judge_canary
from kvtune_operator.tuner.decide import judge
from kvtune_operator.tuning_canary import queue_growth


def pod(name: str, attainment: float, n: float = 200.0, ttft_p99: float | None = 1.0, errors: float = 0.0,
        tokens_per_request: float = 100.0) -> PodFigures:
    return PodFigures(name, n, attainment * n, tokens_per_request * n, errors, ttft_p99)


CONTROLS = [pod("chat-1", 0.8), pod("chat-2", 0.8, n=220)]


@pytest.mark.parametrize("ratio", [0.5, 0.85, 0.89, 0.91, 0.95, 1.0, 1.1, 1.25])
def test_the_default_gates_are_todays_before_after_rule(ratio):
    """The same figures judged before/after (decide.judge, its 10% regression threshold) and as a
    canary with the default gates give the same verdict."""
    c = judge_canary(pod("chat-0", 0.8 * ratio), CONTROLS)
    kept = judge({"goodput_share": 0.8}, {"goodput_share": 0.8 * ratio}, None, 0.10).keep
    assert c.promote == kept
    assert [g.name for g in c.gates] == ["goodputRatioMin"] and c.gates[0].value == pytest.approx(ratio)


def test_the_module_invariant_holds():
    canary.check()


def test_a_ttft_gate_reverts_a_canary_whose_goodput_is_as_good():
    gates = Gates(goodput_ratio_min=1.0, ttft_p99_ratio_max=1.25)
    ok = judge_canary(pod("chat-0", 0.8, ttft_p99=1.2), CONTROLS, gates)
    assert ok.promote and ok.verdict == "Promote"
    slow = judge_canary(pod("chat-0", 0.8, ttft_p99=1.3), CONTROLS, gates, window_s=120)
    assert not slow.promote and slow.verdict == "Revert"
    g = {x.name: x for x in slow.gates}
    assert g["goodputRatioMin"].passed and not g["ttftP99RatioMax"].passed
    assert g["ttftP99RatioMax"].value == pytest.approx(1.3) and g["ttftP99RatioMax"].limit == 1.25
    assert "reverted" in slow.reason and "ttftP99RatioMax FAILED" in slow.reason
    # no p99 measured on the canary: a gate asked for cannot pass
    assert not judge_canary(pod("chat-0", 0.8, ttft_p99=None), CONTROLS, gates).promote


def test_an_error_gate_judges_the_canary_alone():
    gates = Gates(error_rate_max=0.01)
    assert judge_canary(pod("chat-0", 0.8, errors=1), CONTROLS, gates).promote          # 1 of 201
    bad = judge_canary(pod("chat-0", 0.8, errors=10), CONTROLS, gates)
    assert not bad.promote and {g.name: g.passed for g in bad.gates} == {"goodputRatioMin": True,
                                                                        "errorRateMax": False}


def test_with_no_goodput_on_either_side_throughput_decides():
    ctl = [pod("chat-1", 0.0, tokens_per_request=100.0)]
    assert judge_canary(pod("chat-0", 0.0, tokens_per_request=95.0), ctl).promote
    worse = judge_canary(pod("chat-0", 0.0, tokens_per_request=80.0), ctl)
    assert not worse.promote and "output tokens per request" in worse.gates[0].note


def test_one_replica_keeps_the_before_after_verdict():
    assert not canary_applies(1) and not canary_applies(0)
    assert canary_applies(2) and canary_applies(3)


def test_bad_gates_and_no_controls_say_what_is_allowed():
    with pytest.raises(ValueError, match="goodputRatioMin must be >= 0"):
        Gates(goodput_ratio_min=-0.1)
    with pytest.raises(ValueError, match="errorRateMax must be within 0..1"):
        Gates(error_rate_max=2.0)
    with pytest.raises(ValueError, match="at least one control"):
        judge_canary(pod("chat-0", 0.8), [])


def test_gates_in_the_spec_and_the_verdict_in_status():
    spec = AutotuneSpec.model_validate({"canary": {"gates": {"goodputRatioMin": 1.0, "ttftP99RatioMax": 1.25}}})
    gates = spec.canary.gates.gates()
    assert gates == Gates(goodput_ratio_min=1.0, ttft_p99_ratio_max=1.25, error_rate_max=None)
    assert AutotuneSpec.model_validate({"canary": {"gates": {}}}).canary.gates.gates() == Gates()
    with pytest.raises(ValueError):
        AutotuneSpec.model_validate({"canary": {"gates": {"errorRateMax": 1.5}}})
    j = judge_canary(pod("chat-0", 0.8, ttft_p99=1.3), CONTROLS, gates, window_s=120)
    st = CanaryStatus.of(j).dump()
    assert st["verdict"] == "Revert" and st["canary"] == "chat-0" and st["controls"] == ["chat-1", "chat-2"]
    assert st["window"] == "120s" and [g["name"] for g in st["gates"]] == ["goodputRatioMin", "ttftP99RatioMax"]
    assert st["gates"][1] == {"name": "ttftP99RatioMax", "canary": 1.3, "control": pytest.approx(1.0),
                              "value": pytest.approx(1.3), "limit": 1.25, "passed": False, "note": "p99 ttft (s)"}
    # a zero control writes no infinity into JSON
    z = judge_canary(pod("chat-0", 0.5), [pod("chat-1", 0.0)])
    assert z.promote and CanaryStatus.of(z).dump()["gates"][0]["value"] == 1e9


def test_a_gate_within_its_sampling_noise_is_not_settled_until_the_sample_is_large_enough():
    """The canary's attainment is a sample of its share of the requests: a ratio of 0.88 against a 0.9
    gate on 200 requests is within its noise (the point estimate reverts it, the verdict is not
    settled: the round measures on); a ratio of 0.7 or 1.05 on as few requests is clear of it."""
    close = judge_canary(pod("chat-0", 0.8 * 0.88), CONTROLS)
    assert not close.promote and not close.settled and "within sampling noise" in close.gates[0].note
    assert judge_canary(pod("chat-0", 0.8 * 0.7), CONTROLS).settled
    assert judge_canary(pod("chat-0", 0.8 * 1.05), CONTROLS).settled and judge_canary(pod("chat-0", 0.84), CONTROLS).promote
    # the same ratios on fifty times the requests: the noise shrinks, 0.8 of the limit is clear of it
    big = [pod("chat-1", 0.8, n=10_000), pod("chat-2", 0.8, n=11_000)]
    assert judge_canary(pod("chat-0", 0.8 * 0.85, n=10_000), big).settled
    assert canary.attainment_margin(pod("c", 0.72), canary.pooled(CONTROLS), 0.9) == pytest.approx(0.0)
    # with no goodput on either side there is no binomial to allow for: the point estimate settles it
    assert judge_canary(pod("chat-0", 0.0, tokens_per_request=89.0), [pod("chat-1", 0.0)]).settled


def test_how_long_a_canary_may_measure_is_in_the_spec():
    spec = AutotuneSpec.model_validate({"canary": {"maxWindows": 1}})
    assert spec.canary.max_windows == 1
    assert AutotuneSpec.model_validate({"canary": {}}).canary.max_windows is None  # Gates' default, 3
    assert Gates().max_windows == canary.DEFAULT_MAX_WINDOWS == 3
    for bad in (0, 11):
        with pytest.raises(ValueError):
            AutotuneSpec.model_validate({"canary": {"maxWindows": bad}})
    with pytest.raises(ValueError, match="maxWindows must be >= 1"):
        Gates(max_windows=0)


def test_a_canary_whose_queue_grows_counts_the_requests_it_left_waiting_as_misses():
    """A CI run promoted maxNumSeqs 1 against controls at 32: the canary finished the few requests it
    admitted in time (0.57 of them) while its queue grew, and the controls, busier, met 0.47. The
    requests it left waiting were offered in the window too: counted as misses, it is reverted."""
    controls = [PodFigures("c-1", 100, 47, 4800, ttft_p99_s=2.0), PodFigures("c-2", 100, 47, 4800, ttft_p99_s=2.0)]
    survivors = PodFigures("c-0", 35, 20, 1680, ttft_p99_s=1.5)
    assert judge_canary(survivors, controls).promote  # finished requests alone: the survivors read well
    j = judge_canary(PodFigures("c-0", 35, 20, 1680, ttft_p99_s=1.5, unserved=60), controls)
    assert not j.promote and j.gates[0].canary == pytest.approx(20 / 95)
    # the controls' own queue growth counts the same way
    grown = [PodFigures("c-1", 100, 47, 4800, unserved=150), PodFigures("c-2", 100, 47, 4800, unserved=150)]
    assert judge_canary(PodFigures("c-0", 35, 20, 1680, unserved=60), grown).promote


def test_queue_growth_reads_each_runtimes_waiting_gauge_first_to_last():
    def series(name, values, **labels):
        return {"metric": {"__name__": name, "pod": "p", **labels}, "values": [[t, str(v)] for t, v in values]}
    kv = [series("kvtune_requests", [(0, 3), (10, 1), (20, 9)], state="waiting"),
          series("kvtune_requests", [(0, 0), (20, 50)], state="running")]
    assert queue_growth(kv) == 6
    assert queue_growth([series("kvtune_requests", [(0, 9), (20, 2)], state="waiting")]) == 0  # it drained
    assert queue_growth([series("vllm:num_requests_waiting", [(0, 0), (20, 12)])], runtime="vllm") == 12
    assert queue_growth([]) == 0
