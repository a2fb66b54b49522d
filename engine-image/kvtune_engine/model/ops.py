"""The decoder's elementwise steps (RMSNorm, RoPE, SiLU-and-mul): fused C++ on CPU float32, PyTorch otherwise.

The PyTorch path is the numerical reference (transformers' order: RMSNorm in float32 then cast,
rotate-half RoPE); cpu_fused.cpp does each in one pass instead of 4-8 ops and tensors, built on
first use (../native.py) and by `make setup`. `KVTUNE_CPU_FUSED=torch` keeps the PyTorch path.

Invariant owned here: each function gives the PyTorch path's result, fused or not, up to float32
summation order (`check()` and tests/unit/test_fused_ops.py compare them); `rope` may work in place
on its input, so callers use its return value and pass a tensor they own.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from ..native import NativeKernel

KERNEL = NativeKernel(Path(__file__).with_name("cpu_fused.cpp"), "CPU fused-ops kernel")
_STATE: dict[str, object] = {}


def fused_module():
    """The compiled module when the fused path applies (built here if need be), else None."""
    if "mod" not in _STATE:
        _STATE["mod"] = None if os.environ.get("KVTUNE_CPU_FUSED", "").lower() == "torch" else KERNEL.load()
    return _STATE["mod"]


def _fast(x: torch.Tensor) -> object:
    return fused_module() if x.device.type == "cpu" and x.dtype == torch.float32 else None


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    mod = _fast(x)
    if mod is not None and x.dim() == 2 and x.stride(-1) == 1:
        return mod.rms_norm(x, w, eps)
    return rms_norm_torch(x, w, eps)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d/2] (rotate-half layout: pairs are (i, i + d/2))."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [T, heads, d]; in place on the fused path (x must be the caller's own tensor)."""
    mod = _fast(x)
    if (mod is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.dtype == torch.float32
            and cos.is_contiguous() and sin.is_contiguous()):
        mod.rope_(x, cos, sin)
        return x
    return rope_torch(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> SiLU(gate) * up, [T, I]."""
    mod = _fast(gate_up)
    if mod is not None and gate_up.stride(-1) == 1:
        return mod.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def check() -> None:
    """Each fused op against its PyTorch path on a small case (raises AssertionError)."""
    mod = fused_module()
    if mod is None:
        return
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 40, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(mod.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    qkv = torch.randn(5, 7 * 16, generator=g)
    heads = qkv[:, :6 * 16].view(5, 6, 16)
    cos, sin = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    want = rope_torch(heads, cos, sin)
    mod.rope_(heads, cos, sin)
    torch.testing.assert_close(heads, want, atol=1e-5, rtol=1e-5)
    gu = torch.randn(5, 48, generator=g)
    torch.testing.assert_close(mod.silu_and_mul(gu), F.silu(gu[:, :24]) * gu[:, 24:], atol=1e-5, rtol=1e-5)
