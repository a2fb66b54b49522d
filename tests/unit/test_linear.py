"""The prepacked oneDNN matmul (model/linear.py) against torch's own, at the engine's shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtune_engine.model.linear import Linear, check, packing_enabled

def test_check_passes():
    check()


@pytest.mark.parametrize("rows", [1, 7, 256, 2048])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_torch(rows, bias, monkeypatch):
    monkeypatch.delenv("KVTUNE_CPU_GEMM", raising=False)
    assert packing_enabled("cpu", torch.float32), "torch's CPU wheels ship oneDNN: the engine's matmuls need it"
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1024, 512, generator=g) * 512 ** -0.5
    b = torch.randn(1024, generator=g) if bias else None
    x, h = torch.randn(rows, 512, generator=g), torch.randn(rows, 1024, generator=g)
    lin = Linear(w.clone(), b)
    lin.pack()
    assert lin.weight is None  # the packed copy replaces the dense one
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lin.add_to(h, x), h + F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        strided = torch.randn(rows, 1024, generator=g)[:, :512]  # a chunk() view, rows not contiguous
        torch.testing.assert_close(lin(strided), F.linear(strided, w, b), atol=1e-4, rtol=1e-5)


def test_off_switch(monkeypatch):
    monkeypatch.setenv("KVTUNE_CPU_GEMM", "torch")
    assert not packing_enabled("cpu", torch.float32)
    assert not packing_enabled("cpu", torch.bfloat16) and not packing_enabled("meta", torch.float32)
