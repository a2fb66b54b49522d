"""The model's matmuls: `x @ W.T (+ b)`, and the same added to a residual, on prepacked oneDNN weights on CPU.

Why: on CPU, torch's `F.linear`/`addmm` hand the plain row-major weight to a BLAS GEMM on every
call; oneDNN's linear on a weight reordered once at load time into its own blocked layout (`mkldnn._reorder_linear_weight`,
what torch.compile's CPU freezing does) runs the benchmark model's shapes at ~200-215 GFLOP/s against
~160-175 for `F.linear` (2 threads, fp32; bench/engine_vs_vllm.py prints both peaks), and folds the
residual add into the same kernel. The packed copy replaces the dense weight (no memory is added), so
a packed `Linear` keeps only `packed`; `KVTUNE_CPU_GEMM=torch` keeps torch's own path.

Invariant owned here: `Linear(w, b)(x)` equals `F.linear(x, w, b)` and `add_to(h, x)` equals
`h + F.linear(x, w, b)` to float32 summation order, packed or not (`check()` compares them).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_features


def _packable(dtype: torch.dtype) -> bool:
    """float32; bfloat16 where the CPU computes in it (AMX / avx512_bf16: oneDNN's packed bf16 GEMM
    ran the benchmark model's shapes at 1.1-8x ``F.linear`` in bf16, 2 threads); float16 keeps torch's path."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_features.has_bf16())


def packing_enabled(device: torch.device | str, dtype: torch.dtype) -> bool:
    """oneDNN prepacking applies: CPU, float32 (or bf16 on a bf16 CPU), torch built with oneDNN, not turned off."""
    return (torch.device(device).type == "cpu" and _packable(dtype) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and os.environ.get("KVTUNE_CPU_GEMM", "").lower() != "torch")


class Linear(nn.Module):
    """One weight [out, in] with an optional bias; `pack()` moves it to oneDNN's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight: torch.Tensor | None = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed: torch.Tensor | None = None
        self.out_features = weight.shape[0]

    def pack(self, batch_hint: int = 256, keep_dense: bool = False) -> None:
        """Reorder the weight once for oneDNN; drop the dense copy unless something else shares it."""
        w = self.weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        if not keep_dense:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h + x @ W.T (+ b). fp32 without bias: the add is fused into the GEMM. In 16-bit types
        transformers rounds the product before the add, so it stays a separate add there."""
        if self.bias is None and h.dtype == torch.float32:
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, h, self.packed, None, "add")
            return torch.addmm(h, x, self.weight.t())
        return h + self(x)


def check() -> None:
    """Packed against torch's path on a small case, with and without bias and residual."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    x, h = torch.randn(5, 16, generator=g), torch.randn(5, 24, generator=g)
    for bias in (None, b):
        plain, packed = Linear(w.clone(), bias), Linear(w.clone(), bias)
        if not packing_enabled("cpu", torch.float32):
            return
        packed.pack()
        assert packed.weight is None
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed.add_to(h, x), plain.add_to(h, x), atol=1e-5, rtol=1e-5)
