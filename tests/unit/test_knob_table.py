"""The knob table is the one source of each knob's facts: a knob added to it shows up in the CLI,
the resource's schema, the tuner's bounds and its candidates, and the published CRD says what it says."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import pytest
import yaml
from annotated_types import Ge
from click.testing import CliRunner

from kvtune_engine import knobs
from kvtune_engine.config import ConfigError, config_model
from kvtune_engine.flags import engine_config, engine_options
from kvtune_engine.knobs import BY_NAME, TABLE, Knob
from kvtune_operator import crd
from kvtune_operator import model as m
from kvtune_operator.tuner.bounds import Range, bounds_class
from kvtune_operator.tuner.candidates import propose
from kvtune_operator.tuner.observation import Observation

FAKE = Knob("prefill_patience", "prefillPatience", int, 4, "Steps a prefill may wait behind decodes.", live=True,
            limits=(Ge(0),), tuned=True, bounded=True, search=(0, 16), allowed=(0, 64))
WITH_FAKE = TABLE + (FAKE,)


def test_a_knob_added_to_the_table_is_a_flag_of_the_engine_cli():
    config = config_model(WITH_FAKE)

    @click.command()
    @lambda f: engine_options(f, config)
    def cmd(**values):
        click.echo(f"patience={engine_config(values, config).prefill_patience}")

    runner = CliRunner()
    help_text = " ".join(runner.invoke(cmd, ["--help"]).output.split())
    assert "--prefill-patience INTEGER Steps a prefill may wait behind decodes. [default: 4]" in help_text
    assert runner.invoke(cmd, ["--prefill-patience", "7"]).output == "patience=7\n"
    assert runner.invoke(cmd, []).output == "patience=4\n"
    refused = runner.invoke(cmd, ["--prefill-patience", "-1"])
    assert refused.exit_code == 2 and "--prefill-patience" in refused.output
    with pytest.raises(ConfigError, match="prefill_patience"):
        config.build(prefill_patience=-1)


def test_a_knob_added_to_the_table_is_in_the_resource_schema():
    spec, status = m.engine_models(WITH_FAKE)
    field = crd.structural(spec)["properties"]["prefillPatience"]
    assert (field["type"], field["default"], field["minimum"], field["maximum"]) == ("integer", 4, 0, 64)
    assert field["description"].startswith("Steps a prefill may wait behind decodes. Applied live")
    assert "vLLM has no such flag" in field["description"]
    assert "default" not in crd.structural(status, keep_defaults=False)["properties"]["prefillPatience"]
    bound = crd.structural(m.bounds_model(WITH_FAKE))["properties"]["prefillPatience"]["properties"]
    assert (bound["min"]["minimum"], bound["max"]["maximum"]) == (0, 64)


def test_a_knob_added_to_the_table_is_bounded_and_moved_by_the_tuner():
    bounds_of = bounds_class(WITH_FAKE)
    config = config_model(WITH_FAKE)
    assert bounds_of().prefill_patience == Range(0, 16)
    user = bounds_of.parse(["prefill-patience=2:8"])
    assert user == bounds_of.parse({"prefillPatience": {"min": 2, "max": 8}})
    assert user.prefill_patience == Range(2, 8)
    outside = config(prefill_patience=12)
    assert user.violations(outside) == ["prefill_patience=12 outside [2, 8]"]
    assert user.clamp(outside).prefill_patience == 8
    assert user.freeze(outside, ["prefillPatience"]).prefill_patience == Range(12, 12)

    moves = propose(Observation(config=config()), bounds_of())
    moved = sorted(c.prefill_patience for c in moves.configs if c.prefill_patience != 4)
    assert moved == [0, 2, 8, 16]
    assert "prefill_patience 4 -> 8" in moves.why.values()


def test_the_table_refuses_a_search_range_outside_the_allowed_one():
    knobs.check()
    gpu = BY_NAME["gpu_memory_utilization"]
    assert gpu.allowed[0] <= gpu.search[0] <= gpu.search[1] <= gpu.allowed[1]
    bad = tuple(dataclasses.replace(k, search=(0.05, 0.95)) if k is gpu else k for k in TABLE)
    with pytest.raises(AssertionError, match="gpu_memory_utilization: search range .* leaves its allowed range"):
        knobs.check(bad)
    with pytest.raises(AssertionError, match="default"):
        knobs.check(TABLE + (dataclasses.replace(FAKE, default=100),))


def test_the_published_crd_names_each_knobs_vllm_flag():
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / crd.CRD_FILE).read_text())
    engine = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    for k in TABLE:
        text = " ".join(engine["properties"][k.camel]["description"].split())
        assert (f"vLLM flag {k.vllm}." if k.vllm else "vLLM has no such flag (runtime vllm refuses it).") in text, k.name
