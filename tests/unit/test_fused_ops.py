"""The fused CPU elementwise ops (model/cpu_fused.cpp) against their PyTorch paths, at the engine's layouts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtune_engine.model import ops


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    monkeypatch.delenv("KVTUNE_CPU_FUSED", raising=False)
    ops._STATE.clear()
    mod = ops.fused_module()
    assert mod is not None, f"the fused kernel did not build: {ops.KERNEL.failed}"  # make setup builds it
    yield mod
    ops._STATE.clear()


def test_check_passes():
    ops.check()


@pytest.mark.parametrize("rows", [1, 3, 257, 2048])
def test_rms_norm_on_strided_rows(rows):
    g = torch.Generator().manual_seed(rows)
    base = torch.randn(rows, 1024, generator=g) * 3
    x, w = base[:, :512], torch.randn(512, generator=g)  # a slice: rows not contiguous
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_torch(x, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rope_in_place_on_the_qkv_heads(rows):
    """The layer's call: q and k heads of the fused qkv output, rotated in place; v untouched."""
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (8 + 4 + 4) * 64, generator=g)
    v_before = qkv[:, 12 * 64:].clone()
    heads = qkv[:, :12 * 64].view(rows, 12, 64)
    ang = torch.randn(rows, 32, generator=g) * 10
    want = ops.rope_torch(heads.clone(), ang.cos(), ang.sin())
    got = ops.rope(heads, ang.cos(), ang.sin())
    assert got.data_ptr() == heads.data_ptr()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, 12 * 64:], v_before, atol=0, rtol=0)


def test_silu_and_mul_including_large_magnitudes():
    gu = torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 30  # exp overflow territory
    want = F.silu(gu[:, :1536]) * gu[:, 1536:]
    torch.testing.assert_close(ops.silu_and_mul(gu), want, atol=1e-4, rtol=1e-5)


def test_other_dtypes_take_the_torch_path():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.randn(16, dtype=torch.bfloat16)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_torch(x, w, 1e-6), atol=0, rtol=0)


def test_off_switch(monkeypatch):
    monkeypatch.setenv("KVTUNE_CPU_FUSED", "torch")
    ops._STATE.clear()
    assert ops.fused_module() is None
