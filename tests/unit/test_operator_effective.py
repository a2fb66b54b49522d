"""Merging the user's spec.engine with tuned values from status (a pure function)."""
from __future__ import annotations

import pytest

from kvtune_operator.effective import effective_engine, in_bounds, knob_bounds, tuned_status
from kvtune_operator.tuner.candidates import Range
from kvtune_operator.model import InferenceDeploymentSpec, InferenceDeploymentStatus

BOUNDS = {"blockSize": [16, 32], "maxNumSeqs": {"min": 32, "max": 512}, "gpuMemoryUtilization": {"max": 0.95}}


def spec(engine=None, mode="Apply", bounds=BOUNDS, frozen=None) -> InferenceDeploymentSpec:
    autotune = {"mode": mode, "bounds": bounds}
    if frozen:
        autotune["frozenKnobs"] = frozen
    return InferenceDeploymentSpec.model_validate(
        {"model": {"path": "/m"}, "engine": engine or {"maxNumSeqs": 64}, "autotune": autotune})


def status(engine, baseline) -> InferenceDeploymentStatus:
    return InferenceDeploymentStatus.model_validate({"engine": engine, "baseline": baseline})


def test_no_status_is_the_spec():
    eff = effective_engine(spec(), None, "Apply")
    assert eff.config.max_num_seqs == 64 and eff.tuned == {} and eff.dropped == {}
    assert eff.status_engine()["maxNumSeqs"] == 64 and eff.status_baseline() == eff.status_engine()


def test_tuned_value_is_kept():
    eff = effective_engine(spec(), status({"maxNumSeqs": 160, "blockSize": 32}, {"maxNumSeqs": 64, "blockSize": 16}),
                           "Apply")
    assert (eff.config.max_num_seqs, eff.config.block_size) == (160, 32)
    assert eff.tuned == {"max_num_seqs": 160, "block_size": 32}
    assert eff.baseline.max_num_seqs == 64 and eff.status_baseline()["maxNumSeqs"] == 64


def test_recommend_keeps_what_was_applied():
    eff = effective_engine(spec(mode="Recommend"), status({"maxNumSeqs": 160}, {"maxNumSeqs": 64}), "Recommend")
    assert eff.config.max_num_seqs == 160


def test_off_runs_the_spec():
    eff = effective_engine(spec(mode="Off"), status({"maxNumSeqs": 160}, {"maxNumSeqs": 64}), "Off")
    assert eff.config.max_num_seqs == 64 and "max_num_seqs" in eff.dropped


def test_user_edit_wins_over_tuned_value():
    eff = effective_engine(spec({"maxNumSeqs": 100}), status({"maxNumSeqs": 160}, {"maxNumSeqs": 64}), "Apply")
    assert eff.config.max_num_seqs == 100 and "edited" in eff.dropped["max_num_seqs"]


def test_old_spec_value_in_status_is_not_a_tuned_value():
    eff = effective_engine(spec({"maxNumSeqs": 100}), status({"maxNumSeqs": 64}, {"maxNumSeqs": 64}), "Apply")
    assert eff.config.max_num_seqs == 100 and eff.dropped == {} and eff.tuned == {}


def test_tightened_bounds_drop_a_tuned_value():
    s = spec(bounds={"maxNumSeqs": {"min": 32, "max": 128}})
    eff = effective_engine(s, status({"maxNumSeqs": 160}, {"maxNumSeqs": 64}), "Apply")
    assert eff.config.max_num_seqs == 64 and "outside" in eff.dropped["max_num_seqs"]


def test_frozen_and_untunable_knobs_stay_at_the_spec():
    s = spec(frozen=["maxNumSeqs"])
    eff = effective_engine(s, status({"maxNumSeqs": 160, "maxModelLen": 4096},
                                     {"maxNumSeqs": 64, "maxModelLen": 8192}), "Apply")
    assert eff.config.max_num_seqs == 64 and eff.config.max_model_len == 8192
    assert set(eff.dropped) == {"max_num_seqs", "max_model_len"}


def test_inconsistent_tuned_values_fall_back_to_the_spec():
    # chunked prefill off with a budget below max_model_len is refused by the engine's own validation
    s = spec({"maxNumSeqs": 64, "maxNumBatchedTokens": 4096, "maxModelLen": 8192})
    eff = effective_engine(s, status({"enableChunkedPrefill": False}, {"enableChunkedPrefill": True}), "Apply")
    assert eff.config.enable_chunked_prefill is True and eff.tuned == {}
    assert "inconsistent" in eff.dropped["enable_chunked_prefill"]


def test_knob_bounds_defaults_and_user_bounds():
    b = knob_bounds(spec(bounds=None))
    assert b.block_size == (8, 16, 32, 64, 128)
    assert b.gpu_memory_utilization == Range(0.1, 0.98)
    assert 10_000 in b.max_num_seqs and 0 not in b.max_num_seqs
    assert not b.admits("max_model_len", 4096) and not b.admits("watermark", 0.01)
    b = knob_bounds(spec())
    assert b.block_size == (16, 32) and b.gpu_memory_utilization == Range(0.1, 0.95)
    assert in_bounds(spec(), "max_num_seqs", 512) and not in_bounds(spec(), "max_num_seqs", 513)
    assert not in_bounds(spec(), "max_num_seqs", True)


def test_tuned_status_for_the_tuner():
    s = spec()
    cur = effective_engine(s, None, "Apply").config
    out = tuned_status(s, cur, {"max_num_seqs": 160})
    assert out["engine"]["maxNumSeqs"] == 160 and out["baseline"]["maxNumSeqs"] == 64
    eff = effective_engine(s, InferenceDeploymentStatus.model_validate(out), "Apply")
    assert eff.config.max_num_seqs == 160
    with pytest.raises(ValueError):
        tuned_status(s, cur, {"max_num_seqs": 1000})
    with pytest.raises(ValueError):
        tuned_status(s, cur, {"max_model_len": 4096})


def test_resolve_autotune_prefers_the_spec():
    from kvtune_operator.effective import resolve_autotune
    from kvtune_operator.settings import Settings

    settings = Settings.from_env({})
    plan = resolve_autotune(InferenceDeploymentSpec.model_validate({"model": {"path": "/m"}}), settings)
    assert (plan.mode, plan.interval_s, plan.window_s, plan.cooldown_s) == ("Recommend", 60, 300, 900)
    assert plan.prometheus_url == settings.prometheus_url
    s = InferenceDeploymentSpec.model_validate({"model": {"path": "/m"}, "metrics": {"prometheusUrl": "http://p:9090"},
                                                "autotune": {"mode": "Apply", "interval": "10s", "cooldown": "1m"}})
    plan = resolve_autotune(s, settings)
    assert (plan.mode, plan.interval_s, plan.window_s, plan.cooldown_s) == ("Apply", 10, 300, 60)
    assert plan.prometheus_url == "http://p:9090"


def test_a_knob_left_to_the_engine_is_not_claimed_in_status():
    """maxModelLen unset: the engine takes the model's context length, which only it knows; status.engine
    must not show the config's default (8192) for it (an integration test saw 8192 there while the engine
    ran the model's 4096). Set in the spec, it is rendered and reported as written."""
    eff = effective_engine(spec(), None, "Apply")
    assert eff.omitted == {"max_model_len"}
    assert eff.status_engine()["maxModelLen"] is None and eff.status_baseline()["maxModelLen"] is None
    assert "maxModelLen" not in tuned_status(spec(), eff.config, {"max_num_seqs": 160})["engine"]
    given = effective_engine(spec({"maxNumSeqs": 64, "maxModelLen": 4096}), None, "Apply")
    assert given.omitted == frozenset() and given.status_engine()["maxModelLen"] == 4096
    assert tuned_status(spec({"maxNumSeqs": 64, "maxModelLen": 4096}), given.config,
                        {"max_num_seqs": 160})["engine"]["maxModelLen"] == 4096


def test_an_earlier_operator_default_for_an_omitted_knob_is_no_change_event():
    from kvtune_operator.reconcile import knob_change_events

    eff = effective_engine(spec(), None, "Apply")
    claimed = {**{k: v for k, v in eff.status_engine().items() if v is not None}, "maxModelLen": 8192}
    assert knob_change_events(claimed, eff, "cm", "dep") == []
    assert knob_change_events({**claimed, "maxModelLen": 4096}, eff, "cm", "dep")[0].message.startswith(
        "maxModelLen 4096 -> unset")
