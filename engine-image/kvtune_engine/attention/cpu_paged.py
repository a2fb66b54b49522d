"""The CPU paged-decode kernel (cpu_paged.cpp), built on first use (../native.py).

Why compiled: the PyTorch reference gathers every decode's context into contiguous K/V before two
batched matmuls, which at 256 sequences copies ~1.4 GB per step on the benchmark model; the kernel
reads each block in place, once. Without a compiler it is unavailable and the reference path runs;
`KVTUNE_CPU_ATTENTION=reference` forces the reference.

Invariant owned here: `paged_decode_cpu` has the signature and the results of
`reference.paged_decode_reference`, and `write_kv_cpu` those of `metadata.write_kv`
(tests/unit/test_cpu_paged.py compares them); `check()` runs one small case of each.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..native import NativeKernel
from .metadata import AttentionMetadata, write_kv
from .reference import paged_decode_reference

KERNEL = NativeKernel(Path(__file__).with_name("cpu_paged.cpp"), "CPU paged-attention kernel")


def load_kernel():
    """The compiled module, or None (the reason is logged once)."""
    return KERNEL.load()


def enabled() -> bool:
    """True when decodes on CPU should use the compiled kernel (built here if need be)."""
    if os.environ.get("KVTUNE_CPU_ATTENTION", "").lower() == "reference":
        return False
    return load_kernel() is not None


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, q_heads, d] -> [N, q_heads, d]; caches [kv_heads, num_blocks, block_size, d]."""
    mod = load_kernel()
    if mod is None:
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {KERNEL.failed}")
    with torch.profiler.record_function("kvtune::paged_decode_cpu"):  # named in profiles; ~free otherwise
        return mod.paged_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale))


def write_kv_cpu(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
    """`metadata.write_kv` with one copy per token and head (the kernel checks every slot's bounds);
    the PyTorch path where the kernel's layout does not apply (another dtype, a strided head)."""
    mod = load_kernel()
    if (mod is None or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k.stride(1) != k.shape[2]
            or v.stride(1) != v.shape[2] or k.stride(2) != 1 or v.stride(2) != 1):
        return write_kv(k_cache, v_cache, k, v, meta)
    mod.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)


def check() -> None:
    """One ragged GQA case against the reference (raises AssertionError on a mismatch)."""
    g = torch.Generator().manual_seed(0)
    hk, hq, d, bs, nb = 2, 4, 32, 8, 16
    kc, vc = torch.randn(hk, nb, bs, d, generator=g), torch.randn(hk, nb, bs, d, generator=g)
    lens = [1, 9, 30]
    bt = torch.randperm(nb, generator=g)[:12].view(3, 4)
    q = torch.randn(3, hq, d, generator=g)
    ref = paged_decode_reference(q, kc, vc, bt, lens, d ** -0.5)
    got = paged_decode_cpu(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), d ** -0.5)
    assert torch.allclose(ref, got, atol=1e-5, rtol=1e-4), (ref - got).abs().max()
    k, v = torch.randn(5, hk, d, generator=g), torch.randn(5, hk, d, generator=g)
    meta = AttentionMetadata(bs, torch.randperm(nb * bs, generator=g)[:5])
    want_k, want_v = kc.clone(), vc.clone()
    write_kv(want_k, want_v, k, v, meta)
    write_kv_cpu(kc, vc, k, v, meta)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
