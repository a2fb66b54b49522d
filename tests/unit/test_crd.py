"""The CRD generated from the pydantic model: current, structural, explained, and in the chart."""
from __future__ import annotations

from pathlib import Path

import yaml

from kvtune_engine.config import BLOCK_SIZES, EngineConfig
from kvtune_operator import crd, model

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / crd.CRD_FILE


def _schema() -> dict:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_committed_crd_is_current():
    assert COMMITTED.read_text() == crd.render_crd(), (
        "crds/ is stale: run `kvtune crd > crds/inferencedeployments.kvtune.io.yaml` "
        "and copy it to charts/kvtune/crds/")


def test_committed_crd_parses_as_the_built_object():
    assert yaml.safe_load(COMMITTED.read_text()) == crd.build_crd()


def test_schema_is_structural():
    for path, node in _walk(_schema()):
        if not isinstance(node, dict):
            continue
        assert "$ref" not in node and "anyOf" not in node and "allOf" not in node and "title" not in node, path
        if "exclusiveMinimum" in node or "exclusiveMaximum" in node:
            assert isinstance(node.get("exclusiveMinimum", True), bool), path
            assert isinstance(node.get("exclusiveMaximum", True), bool), path
        if path.endswith(".properties") or ".properties." not in path and not path.endswith("]"):
            continue
        if "properties" in node:
            assert "additionalProperties" not in node, path


def test_every_spec_and_status_field_is_described_and_typed():
    root = _schema()
    for part in ("spec", "status"):
        for path, node in _walk(root["properties"][part], part):
            if isinstance(node, dict) and "properties" in node:
                for name, prop in node["properties"].items():
                    assert prop.get("description"), f"{path}.{name} has no description"
                    assert prop.get("type"), f"{path}.{name} has no type"


def test_engine_mirrors_engine_config():
    engine = _schema()["properties"]["spec"]["properties"]["engine"]
    assert set(engine["properties"]) == {model.KNOBS[k] for k in EngineConfig.model_fields}
    assert engine["properties"]["blockSize"]["enum"] == list(BLOCK_SIZES)
    gpu = engine["properties"]["gpuMemoryUtilization"]
    assert (gpu["minimum"], gpu["maximum"]) == (0.1, 0.98)
    assert engine["properties"]["swapSpaceGiB"]["minimum"] == 0
    assert engine["properties"]["maxNumSeqs"]["minimum"] == 1
    defaults = EngineConfig().model_dump()
    defaults.pop("max_model_len")   # no default: the model's context length, which only the engine knows
    assert "default" not in engine["properties"]["maxModelLen"]
    for snake, camel in model.KNOBS.items():
        if defaults.get(snake) is not None:
            assert engine["properties"][camel]["default"] == defaults[snake], camel
    # The object default spells out every default so nested defaults apply and CEL sees all keys.
    assert engine["default"] == {model.KNOBS[k]: v for k, v in defaults.items() if v is not None}
    assert "restarts" in engine["properties"]["blockSize"]["description"]
    assert "live" in engine["properties"]["maxNumSeqs"]["description"]


def test_cross_field_rules_are_cel():
    spec = _schema()["properties"]["spec"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert any("self.engine.blockSize in self.autotune.bounds.blockSize" in r for r in rules)
    for knob in ("gpuMemoryUtilization", "swapSpaceGiB", "maxNumSeqs", "maxNumBatchedTokens"):
        assert any(f"self.engine.{knob} >= self.autotune.bounds.{knob}.min" in r for r in rules), knob
    bounds = spec["properties"]["autotune"]["properties"]["bounds"]["properties"]
    assert bounds["blockSize"]["items"]["enum"] == list(BLOCK_SIZES)
    for knob in ("gpuMemoryUtilization", "swapSpaceGiB", "maxNumSeqs", "maxNumBatchedTokens"):
        assert "self.min <= self.max" in bounds[knob]["x-kubernetes-validations"][0]["rule"]
    # every list used by CEL has a maxItems (the apiserver's cost estimate needs one)
    for path, node in _walk(_schema()):
        if isinstance(node, dict) and node.get("type") == "array":
            assert "maxItems" in node, path


def test_names_subresources_and_columns():
    c = crd.build_crd()
    assert c["metadata"]["name"] == "inferencedeployments.kvtune.io"
    names = c["spec"]["names"]
    assert names["shortNames"] == ["infd"] and names["categories"] == ["kvtune"]
    assert c["spec"]["scope"] == "Namespaced"
    v = c["spec"]["versions"][0]
    assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
    assert v["subresources"]["status"] == {}
    assert v["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                          "statusReplicasPath": ".status.replicas",
                                          "labelSelectorPath": ".status.selector"}
    default_columns = [col["name"] for col in v["additionalPrinterColumns"] if not col.get("priority")]
    assert default_columns == ["Ready", "Replicas", "Block", "MemUtil", "KV%", "Waiting", "Cause", "Tuning", "Age"]
    status = _schema()["properties"]["status"]
    for col in v["additionalPrinterColumns"]:
        path = col["jsonPath"]
        if path.startswith(".status."):
            node = status
            for part in path.split("[")[0].split(".")[2:]:
                node = node["properties"][part]
            assert node, path


def test_status_has_no_defaults_and_bounded_history():
    status = _schema()["properties"]["status"]
    assert not [p for p, n in _walk(status) if isinstance(n, dict) and "default" in n]
    tuning = status["properties"]["tuning"]["properties"]
    assert tuning["history"]["maxItems"] == 10
    cond = status["properties"]["conditions"]
    assert cond["x-kubernetes-list-type"] == "map" and cond["x-kubernetes-list-map-keys"] == ["type"]
    assert cond["items"]["properties"]["type"]["enum"] == [
        "Ready", "Progressing", "MetricsAvailable", "Tuned", "Degraded", "RoundsLate", "PredictionsUnreliable",
        "EngineDrift"]
    assert set(cond["items"]["required"]) >= {"type", "status", "reason", "lastTransitionTime"}
    assert status["properties"]["diagnosis"]["properties"]["figures"]["x-kubernetes-preserve-unknown-fields"]
