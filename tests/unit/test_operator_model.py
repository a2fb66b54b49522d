"""The pydantic model of InferenceDeployment, the knob names, durations, and the settings."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvtune_engine.config import EngineConfig
from kvtune_operator import model as m
from kvtune_operator.settings import Settings


def test_knob_names_are_vllm_camel_case():
    assert m.KNOBS["max_num_seqs"] == "maxNumSeqs"
    assert m.KNOBS["swap_space"] == "swapSpaceGiB"
    assert m.KNOBS["kv_cache_memory"] == "kvCacheMemoryGiB"
    assert set(m.KNOBS) == set(EngineConfig.model_fields)
    assert m.to_engine_dict(m.to_camel_dict(EngineConfig().model_dump())) == EngineConfig().model_dump()


def test_spec_defaults_match_the_engine():
    spec = m.InferenceDeploymentSpec.model_validate({"model": {"path": "/m"}})
    # max_model_len has no default in the resource: the engine takes the model's context length
    assert m.to_engine_dict(spec.engine.dump()) == {k: v for k, v in EngineConfig().model_dump().items()
                                                    if v is not None and k != "max_model_len"}
    assert spec.replicas == 1 and spec.resources.gpus == 1 and spec.metrics.scrape_interval == "15s"


@pytest.mark.parametrize("engine", [
    {"blockSize": 24}, {"gpuMemoryUtilization": 0.99}, {"gpuMemoryUtilization": 0.05},
    {"swapSpaceGiB": -1}, {"maxNumSeqs": 0},
])
def test_spec_bounds(engine):
    with pytest.raises(ValidationError):
        m.InferenceDeploymentSpec.model_validate({"model": {"path": "/m"}, "engine": engine})


def test_from_body_reads_api_objects():
    body = {"apiVersion": m.API_VERSION, "kind": m.KIND,
            "metadata": {"name": "a", "namespace": "n", "uid": "u", "generation": 3, "managedFields": []},
            "spec": {"model": {"path": "/m"}, "autotune": {"mode": "Apply"}, "futureField": 1}}
    infd = m.InferenceDeployment.from_body(body)
    assert infd.metadata.generation == 3 and infd.spec.autotune.mode == "Apply"
    assert infd.status.engine is None


@pytest.mark.parametrize("text,seconds", [("60s", 60), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25),
                                          ("1.5s", 1.5)])
def test_parse_duration(text, seconds):
    assert m.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "5 m", "1d", "-1s"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        m.parse_duration(text)


def test_settings_from_env_and_flags():
    s = Settings.from_env({"KVTUNE_NAMESPACES": "b, a,,a", "KVTUNE_STATUS_INTERVAL": "2",
                           "KVTUNE_AUTOTUNE_MODE": "Apply", "KVTUNE_LIVENESS": ""},
                          engine_image="img:2", prometheus_url=None)
    assert s.namespaces == ("a", "b") and not s.clusterwide
    assert s.status_interval == 2.0 and s.autotune_mode == "Apply" and s.liveness is None
    assert s.engine_image == "img:2" and s.prometheus_url.startswith("http://")
    assert Settings.from_env({}).clusterwide
    assert Settings.from_env({}).autotune_interval_seconds == 60
    with pytest.raises(ValidationError):
        Settings.from_env({"KVTUNE_AUTOTUNE_WINDOW": "five minutes"})
    env = Settings.from_env({}).env()
    assert env["KVTUNE_AUTOTUNE_MODE"] == "Recommend" and env["KVTUNE_NAMESPACES"] == ""
    assert Settings.from_env(env) == Settings.from_env({})


def test_status_written_from_parts_is_checked_against_the_model():
    """status.tuning merged from parts (the tuner's round, the state, the reconciler's phase) goes
    through its model before it is written: a misspelt field or a bad value is an error here, not a
    field the apiserver prunes or refuses; None (a field removed by the merge patch) passes as given."""
    wire = {"mode": "Apply", "phase": "Verifying", "message": "applied", "pending": None,
            "history": [{"time": "2026-12-01T21:16:44Z", "action": "Apply", "message": "m"}]}
    assert m.TuningStatus.checked(wire) == wire
    with pytest.raises(ValueError, match="TuningStatus has no field lastchange"):
        m.TuningStatus.checked({**wire, "lastchange": {"action": "Apply"}})
    with pytest.raises(ValidationError):
        m.TuningStatus.checked({**wire, "phase": "not a phase"})
    with pytest.raises(ValidationError):
        m.TuningStatus.checked({**wire, "history": [{"action": "Apply"}]})  # a decision has a time
