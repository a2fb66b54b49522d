"""The pydantic model of InferenceDeployment, the knob names, durations, and the settings."""
from __future__ import annotations

import re

import pytest
import yaml
from pydantic import ValidationError

from kvtune_engine.config import EngineConfig
from kvtune_engine.knobs import BY_CAMEL
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


# -- the trust model (README, "Trust model"): what the resource may not set ---------------------------

def _spec(**fields) -> dict:
    return {"model": {"path": "/models/m"}, **fields}


@pytest.mark.parametrize("env,message", [
    ({"name": "LD_PRELOAD", "value": "/models/evil.so"}, "env name is reserved"),
    ({"name": "PYTHONPATH", "value": "/models"}, "env name is reserved"),
    ({"name": "PATH", "value": "/models/bin"}, "env name is reserved"),
    ({"name": "KVTUNE_EXT_DIR", "value": "/models/ext"}, "env name is reserved"),
    ({"name": "KVTUNE_ADMIN_KEY", "secretKeyRef": {"name": "mine", "key": "k"}}, "env name is reserved"),
    ({"name": "VLLM_SERVER_DEV_MODE", "value": "1"}, "env name is reserved"),
    ({"name": "GREETING", "value": "$(KVTUNE_ADMIN_KEY)"}, "env value must not contain '$('"),
    ({"name": "TOKEN", "secretKeyRef": {"name": "other-admin-key", "key": "admin-key"}},
     "must not name an admin-key Secret of the operator"),
])
def test_reserved_env_is_refused_with_what_is_allowed(env, message):
    with pytest.raises(ValidationError, match=re.escape(message)) as e:
        m.InferenceDeploymentSpec.model_validate(_spec(env=[env]))
    if "reserved" in message:
        assert "KVTUNE_API_KEY is allowed" in str(e.value)


def test_user_env_that_is_not_ours_is_allowed():
    spec = m.InferenceDeploymentSpec.model_validate(_spec(env=[
        {"name": "KVTUNE_API_KEY", "secretKeyRef": {"name": "my-keys", "key": "api"}},
        {"name": "VLLM_API_KEY", "secretKeyRef": {"name": "my-keys", "key": "api"}},
        {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"},
        {"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "PRICE", "value": "$5 (each)"}]))
    assert [e.name for e in spec.env][:3] == ["KVTUNE_API_KEY", "VLLM_API_KEY", "VLLM_CPU_OMP_THREADS_BIND"]


@pytest.mark.parametrize("model,message", [
    ({"path": "/models/m", "servedModelName": "$(S)"}, "model.servedModelName must not contain '$('"),
    ({"path": "/models/$(KVTUNE_ADMIN_KEY)"}, "model.path must not contain '$('"),
])
def test_variable_expansion_in_our_fields_is_refused(model, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        m.InferenceDeploymentSpec.model_validate({"model": model})
    with pytest.raises(ValidationError, match=re.escape("extraArgs must not contain '$('")):
        m.InferenceDeploymentSpec.model_validate(_spec(extraArgs=["--dtype", "$(S)"]))


@pytest.mark.parametrize("runtime", ["kvtune", "vllm"])
@pytest.mark.parametrize("args", [
    ["--port", "9000"], ["--port=9000"], ["--admin-port", "9"], ["--admin-key=k"], ["--api-key", "k"],
    ["--trust-remote-code"], ["--trust_remote_code"], ["--trust-remote"], ["--host=127.0.0.1"],
    ["--config-file", "/models/x.yaml"], ["--config", "/models/more-flags.yaml"],
    ["--served-model-name", "other"], ["--max-num-seqs", "100000"], ["--no-enable-prefix-caching"],
])
def test_reserved_extra_args_are_refused_on_both_runtimes(runtime, args):
    with pytest.raises(ValidationError, match="extraArgs must not set what the operator sets") as e:
        m.InferenceDeploymentSpec.model_validate(_spec(runtime=runtime, extraArgs=["--dtype", "float32", *args]))
    assert "--port" in str(e.value) and "spec.engine" in str(e.value)


def test_extra_args_that_are_not_ours_are_allowed():
    for args in (["--device", "cpu"], ["--dtype", "bfloat16"], ["--device-memory", "0.5"], ["--max-waiting", "9"],
                 ["--kv-cache-dtype=fp8"], ["--model-impl", "transformers"], ["positional"]):
        assert m.InferenceDeploymentSpec.model_validate(_spec(extraArgs=args)).extra_args == args


@pytest.mark.parametrize("engine,field", [
    ({"swapSpaceGiB": 1e308}, "swapSpaceGiB"), ({"swapSpaceGiB": 1025}, "swapSpaceGiB"),
    ({"kvCacheMemoryGiB": 1e308}, "kvCacheMemoryGiB"), ({"maxNumSeqs": 10 ** 9}, "maxNumSeqs"),
    ({"maxNumBatchedTokens": 10 ** 12}, "maxNumBatchedTokens"), ({"maxModelLen": 2 ** 40}, "maxModelLen"),
])
def test_engine_knobs_have_maxima(engine, field):
    with pytest.raises(ValidationError, match=f"engine.{field}[\\s\\S]*less than or equal"):
        m.InferenceDeploymentSpec.model_validate(_spec(engine=engine))
    lo, hi = BY_CAMEL[field].allowed
    assert m.InferenceDeploymentSpec.model_validate(_spec(engine={field: hi, "maxNumBatchedTokens": 2 ** 20}))
    with pytest.raises(ValidationError, match="swapSpaceGiB.max"):
        m.InferenceDeploymentSpec.model_validate(_spec(autotune={"bounds": {"swapSpaceGiB": {"max": 1e308}}}))


@pytest.mark.parametrize("autotune,message", [
    ({"interval": "1ms"}, "autotune.interval must be between 5s and 1h"),
    ({"interval": "720h"}, "autotune.interval must be between 5s and 1h"),
    ({"window": "1s"}, "autotune.window must be between 10s and 1h"),
    ({"window": "2h"}, "autotune.window must be between 10s and 1h"),
    ({"interval": "10m", "window": "5m"}, "autotune.window must be at least autotune.interval"),
])
def test_autotune_interval_and_window_are_bounded(autotune, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        m.InferenceDeploymentSpec.model_validate(_spec(autotune=autotune))
    ok = m.InferenceDeploymentSpec.model_validate(_spec(autotune={"interval": "8s", "window": "20s"}))
    assert ok.autotune.interval == "8s"


def test_every_python_check_is_a_cel_rule_of_the_crd():
    """The operator refuses what the apiserver refuses: each check is in the generated CRD, word for word."""
    from kvtune_operator.crd import render_crd

    def rules(node):
        if isinstance(node, dict):
            yield from ((r["rule"], r["message"]) for r in node.get("x-kubernetes-validations", []))
            for v in node.values():
                yield from rules(v)
        elif isinstance(node, list):
            for v in node:
                yield from rules(v)
    committed = set(rules(yaml.safe_load(render_crd())))
    for check in (*m._ENV_CHECKS, *m._MODEL_CHECKS, *m._SPEC_CHECKS, *m._AUTOTUNE_CHECKS):
        assert (check.rule, check.message) in committed, check.rule
