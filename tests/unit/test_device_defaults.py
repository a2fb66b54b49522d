"""Defaults that differ by device are chosen at start-up (``config.for_device``, from the knob table's
``device_defaults``): KV blocks of 128 tokens on CPU (what the CPU decode kernel reads fastest),
16 on CUDA; a value set anywhere (a flag, the operator's config file, a tuner bound) wins."""
from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from kvtune_engine import knobs
from kvtune_engine.config import EngineConfig, for_device
from kvtune_engine.knobs import BY_NAME, CPU_BLOCK_SIZE, device_default
from kvtune_engine.server.cli import serve

from conftest_engine import build_engine, tiny_llama  # noqa: F401  (fixture)


def test_an_unset_block_size_takes_the_devices_default():
    assert for_device(EngineConfig(), "cpu").block_size == CPU_BLOCK_SIZE == 128
    assert for_device(EngineConfig(), "cuda").block_size == 16
    assert for_device(EngineConfig(), "cuda:1").block_size == 16
    assert device_default(BY_NAME["block_size"], "CPU") == 128


def test_a_block_size_set_anywhere_wins_over_the_devices_default():
    assert for_device(EngineConfig.build(block_size=16), "cpu").block_size == 16
    # the operator's engine.yaml (every knob, a tuner's bound applied) reaches the engine as set values
    from_file = EngineConfig.build(**{**EngineConfig().model_dump(), "block_size": 32})
    assert for_device(from_file, "cpu").block_size == 32


def test_the_devices_default_keeps_what_was_set_and_leaves_the_rest_unset():
    cfg = for_device(EngineConfig.build(max_num_seqs=8), "cpu")
    assert cfg.model_fields_set == {"max_num_seqs"}  # max_model_len still comes from the model
    assert (cfg.block_size, cfg.max_num_seqs) == (128, 8)


def test_a_token_budget_under_the_devices_block_takes_the_largest_block_that_fits():
    cfg = for_device(EngineConfig.build(max_num_batched_tokens=64), "cpu")
    assert cfg.block_size == 64 and cfg.max_num_batched_tokens == 64


def test_the_engine_built_on_cpu_runs_the_cpu_block_size_unless_told(tiny_llama):
    eng = build_engine(tiny_llama, block_size=None, max_model_len=None)
    assert eng.config.block_size == eng.runner.block_size == 128
    assert eng.config.max_model_len == 4096  # the tiny model's context length: still resolved from it
    assert build_engine(tiny_llama, block_size=32).runner.block_size == 32


def test_serve_help_says_the_default_on_each_device():
    out = " ".join(CliRunner().invoke(serve, ["--help"]).output.split())
    assert "[default: 128 on cpu, 16 on cuda]" in out


def test_a_device_default_outside_the_knobs_choices_is_refused_by_the_table_check():
    bad = tuple(dataclasses.replace(k, device_defaults=(("cpu", 48),)) if k.name == "block_size" else k
                for k in knobs.TABLE)
    with pytest.raises(AssertionError, match="48 on cpu"):
        knobs.check(bad)
    unknown = tuple(dataclasses.replace(k, device_defaults=(("tpu", 64),)) if k.name == "block_size" else k
                    for k in knobs.TABLE)
    with pytest.raises(AssertionError, match="tpu"):
        knobs.check(unknown)
