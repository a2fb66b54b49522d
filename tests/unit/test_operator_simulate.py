"""spec.simulate: a simulated engine instead of a model (issue 22).

The render passes ``--simulate PROFILE`` to ``kvtune serve`` in place of ``--model`` and ``--device``
and mounts no weights; the resource refuses runtime vllm with simulate, a spec with neither a model
nor simulate, and a profile the simulator does not have (naming the ones it has), in the model as in
the CRD's schema and CEL rules.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import PROFILES
from kvtune_operator import crd
from kvtune_operator import render as r
from kvtune_operator.model import InferenceDeployment
from tests.infd import infd_body


def body(**spec) -> dict:
    b = infd_body("fleet-a", namespace="llm", uid="uid-1", generation=1, **spec)
    if "model" not in spec:
        del b["spec"]["model"]
    return b


def deployment(resource: InferenceDeployment) -> dict:
    return next(c for c in r.render_children(resource, EngineConfig(), image="img:1", pod_monitor=False)
                if c["kind"] == "Deployment")


def test_simulated_engine_runs_the_profile_instead_of_a_model():
    infd = InferenceDeployment.from_body(body(simulate="h200-qwen3-0.6b", resources={"gpus": 0}))
    container = deployment(infd)["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert container["command"] == ["kvtune", "serve"]
    assert args[args.index("--simulate") + 1] == "h200-qwen3-0.6b"
    assert "--model" not in args and "--device" not in args  # the profile is the device
    assert args[args.index("--served-model-name") + 1] == "fleet-a"
    assert args[args.index("--config-file") + 1] == r.CONFIG_FILE  # live knobs as on a real engine


def test_simulated_engine_mounts_no_weights_and_keeps_the_served_name():
    infd = InferenceDeployment.from_body(body(
        simulate="a100-llama3-8b",
        model={"path": "/models/m", "servedModelName": "llama",
               "volume": {"persistentVolumeClaim": {"claimName": "weights"}}}))
    pod = deployment(infd)["spec"]["template"]["spec"]
    assert "model" not in [v["name"] for v in pod["volumes"]]
    assert "model" not in [m["name"] for m in pod["containers"][0]["volumeMounts"]]
    args = pod["containers"][0]["args"]
    assert args[args.index("--served-model-name") + 1] == "llama" and "--model" not in args
    assert infd.spec.weights_volume is None  # nor does the operator look for the claim


def test_a_real_engine_still_gets_its_model_and_device():
    infd = InferenceDeployment.from_body(infd_body("real", namespace="llm", uid="u", generation=1,
                                                   resources={"gpus": 0}))
    args = deployment(infd)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/qwen" and "--simulate" not in args
    assert args[args.index("--device") + 1] == "cpu"


@pytest.mark.parametrize("spec,words", [
    ({"simulate": "h100-gpt5"}, ["simulate", *sorted(PROFILES)]),
    ({"simulate": "cpu-tiny", "runtime": "vllm"}, ["runtime vllm has no such mode", "runtime kvtune"]),
    ({}, ["spec.model is required", "unless spec.simulate"]),
])
def test_bad_simulate_specs_are_refused_with_what_is_allowed(spec, words):
    with pytest.raises(ValidationError) as e:
        InferenceDeployment.from_body(body(**spec))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_the_crd_offers_exactly_the_simulators_profiles_and_documents_the_mode():
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = schema["properties"]["simulate"]
    assert field["enum"] == sorted(PROFILES)
    assert "never the default" in field["description"]
    assert "model" not in schema.get("required", [])  # a simulated deployment needs none
    rules = {v["rule"] for v in schema["x-kubernetes-validations"]}
    assert "has(self.model) || has(self.simulate)" in rules
    assert "!has(self.simulate) || self.runtime != 'vllm'" in rules
    # the chart's copy is the same generated text
    root = Path(__file__).resolve().parents[2]
    for path in (root / "crds" / crd.CRD_FILE, root / "charts" / "kvtune" / "crds" / crd.CRD_FILE):
        assert yaml.safe_load(path.read_text()) == crd.build_crd(), path
