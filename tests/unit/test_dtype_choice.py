"""bfloat16 where the CPU has it: ``--dtype bfloat16`` (or a bf16 checkpoint at auto) runs bf16 on a
CPU with avx512_bf16 or AMX, and float32, said at start-up, on one without. The CPU without is a thin
stand-in: ``cpu_features.cpu_flags`` patched to another CPU's flags (this machine's are real)."""
from __future__ import annotations

import logging

import pytest
import torch

from kvtune_engine import cpu_features
from kvtune_engine.config import EngineConfig
from kvtune_engine.model.dtype_choice import choose_dtype
from kvtune_engine.model.linear import packing_enabled
from kvtune_engine.runner import ModelRunner

#: flags of an AVX-512 CPU without bf16 (Skylake-SP) and of one with it (Sapphire Rapids, abridged)
NO_BF16 = frozenset({"fpu", "sse2", "avx2", "avx512f", "avx512bw", "avx512vl"})
WITH_BF16 = NO_BF16 | {"avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.fixture
def cpu(monkeypatch):
    def use(flags: frozenset[str]) -> None:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    return use


def test_bf16_is_run_where_the_cpu_has_it(cpu):
    cpu(WITH_BF16)
    assert choose_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16
    assert choose_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert packing_enabled("cpu", torch.bfloat16) == torch.backends.mkldnn.is_available()
    cpu(frozenset({"avx512_bf16"}))  # either flag will do
    assert cpu_features.has_bf16()


def test_bf16_on_a_cpu_without_it_runs_float32_and_says_so(cpu, caplog):
    cpu(NO_BF16)
    with caplog.at_level(logging.WARNING, logger="kvtune.model"):
        assert choose_dtype("bfloat16", torch.float32, "cpu") == torch.float32
    assert "this CPU has no bfloat16 arithmetic" in caplog.text and "running float32" in caplog.text
    assert "--dtype" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtune.model"):
        assert choose_dtype(None, torch.bfloat16, "cpu") == torch.float32
    assert "the checkpoint's dtype" in caplog.text
    assert not packing_enabled("cpu", torch.bfloat16)


def test_float32_and_cuda_are_not_changed_by_the_cpus_flags(cpu, caplog):
    cpu(NO_BF16)
    with caplog.at_level(logging.WARNING, logger="kvtune.model"):
        assert choose_dtype("float32", torch.bfloat16, "cpu") == torch.float32
        assert choose_dtype("auto", torch.float32, "cpu") == torch.float32
        assert choose_dtype("bfloat16", torch.float32, "cuda:0") == torch.bfloat16
    assert not caplog.text


def test_the_runner_on_a_cpu_without_bf16_keeps_weights_and_kv_cache_in_float32(cpu, tiny_model, caplog):
    d = tiny_model("llama")
    cfg = EngineConfig(block_size=16, kv_cache_memory=0.002, swap_space=0.0, max_model_len=256,
                       max_num_batched_tokens=256)
    cpu(NO_BF16)
    with caplog.at_level(logging.WARNING, logger="kvtune.model"):
        runner = ModelRunner(d, cfg, dtype="bfloat16", seed=0)
    assert runner.dtype == runner.k_cache.dtype == runner.model.embed.dtype == torch.float32
    assert "running float32" in caplog.text
    cpu(WITH_BF16)
    runner = ModelRunner(d, cfg, dtype="bfloat16", seed=0)
    assert runner.dtype == runner.k_cache.dtype == runner.v_cache.dtype == torch.bfloat16
