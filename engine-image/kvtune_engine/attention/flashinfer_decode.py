"""Paged decode attention on CUDA through FlashInfer (`flashinfer-python`), the kernel the field uses.

Our per-layer cache is `[kv_heads, num_blocks, block_size, head_dim]`; FlashInfer's "HND" paged
layout is `[pages, kv_heads, page_size, head_dim]`, which is the same memory seen through
`permute(1, 0, 2, 3)` (a strided view, no copy). FlashInfer wants its page table as CSR (`indptr`,
`indices`, `last_page_len`); it is built once per step from the padded block tables the runner
already makes (the same tensor object reaches every layer, so one `plan` serves all layers).

Not testable on the CPU machines this project is developed on: the runner only uses it after
`check()` has compared it with the Triton kernel on the device at start-up, and falls back to Triton
otherwise (tests/unit/test_runner_cuda.py, marker `cuda`, compares it with the reference).

Invariant owned here: `FlashInferDecode.__call__` has the signature and the results of
`reference.paged_decode_reference`.
"""
from __future__ import annotations

import torch

from .reference import paged_decode_reference

try:  # optional: CUDA installs only
    import flashinfer
except Exception:  # pragma: no cover - ImportError, or a CUDA-less build failing at import
    flashinfer = None

WORKSPACE_BYTES = 128 << 20


def available() -> bool:
    return flashinfer is not None and torch.cuda.is_available()


def csr_page_table(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int):
    """Padded tables [N, max_blocks] + lengths -> (indptr [N+1], indices, last_page_len [N]), int32."""
    lens = context_lens.to(torch.int64)
    nblocks = (lens + block_size - 1) // block_size
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    indices = block_tables[cols[None, :] < nblocks[:, None]].to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=block_tables.device)
    indptr[1:] = torch.cumsum(nblocks, 0).to(torch.int32)
    last = (lens - (nblocks - 1) * block_size).to(torch.int32)
    return indptr, indices, last


class FlashInferDecode:
    """A decode_fn (see reference.paged_attention) backed by one FlashInfer wrapper per device."""

    def __init__(self, device: torch.device):
        if flashinfer is None:
            raise RuntimeError("flashinfer is not installed")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, kv_layout="HND")
        self._planned: tuple | None = None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        n, hq, d = q.shape
        hk, _, bs, _ = k_cache.shape
        if n == 0:
            return torch.empty_like(q)
        key = (id(block_tables), id(context_lens), q.dtype, scale)
        if self._planned != key:  # first layer of a step: plan once for all layers
            indptr, indices, last = csr_page_table(block_tables, context_lens, bs)
            self.wrapper.plan(indptr, indices, last, hq, hk, d, bs, pos_encoding_mode="NONE",
                              q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=float(scale))
            self._planned = key
        kv = (k_cache.permute(1, 0, 2, 3), v_cache.permute(1, 0, 2, 3))
        return self.wrapper.run(q.contiguous(), kv)


def check(fn: FlashInferDecode, device: torch.device) -> None:
    """One ragged GQA case on the device against the PyTorch reference (AssertionError if off)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    hk, hq, d, bs, nb = 2, 8, 128, 16, 40
    kc = torch.randn(hk, nb, bs, d, generator=g).to(device)
    vc = torch.randn(hk, nb, bs, d, generator=g).to(device)
    lens = [1, 17, 100]
    bt = torch.randperm(nb, generator=g)[:21].view(3, 7).to(device)
    q = torch.randn(3, hq, d, generator=g).to(device)
    ref = paged_decode_reference(q, kc, vc, bt, lens, d ** -0.5)
    got = fn(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device=device), d ** -0.5)
    assert torch.allclose(ref.float(), got.float(), atol=2e-3, rtol=0), float((ref - got).abs().max())
