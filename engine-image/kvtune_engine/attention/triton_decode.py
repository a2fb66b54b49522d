"""Paged decode attention as a Triton kernel (CUDA; runs on CPU under TRITON_INTERPRET=1 for tests;
the variable must be set before triton is first imported, as triton's own helpers are jitted then).

One program per (sequence, query head): it walks the sequence's block table, loads one contiguous
`block_size x head_dim` K tile and V tile of its kv head per block, and keeps an online softmax
(running max and sum) in float32, so no context is ever gathered or padded.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, scale,
        stride_qn, stride_qh, stride_on, stride_oh,
        stride_kb, stride_kh, stride_bt,
        GROUP: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kvh = (head // GROUP).to(tl.int64)
        ctx = tl.load(lens_ptr + seq)
        d = tl.arange(0, D_P)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_qn + head * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
        offs = tl.arange(0, BLOCK)
        m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        l_i = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        acc = tl.zeros([D_P], tl.float32)
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_kh
        for b in range(0, (ctx + BLOCK - 1) // BLOCK):
            blk = tl.load(bt_ptr + seq * stride_bt + b).to(tl.int64)
            pmask = (b * BLOCK + offs) < ctx
            tile = blk * stride_kb + offs[:, None] * HEAD_DIM + d[None, :]
            tmask = pmask[:, None] & dmask[None, :]
            k = tl.load(k_base + tile, mask=tmask, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(pmask, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_base + tile, mask=tmask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        o = acc / l_i
        tl.store(out_ptr + seq * stride_on + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=dmask)


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, q_heads, d]; k/v cache [kv_heads, num_blocks, bs, d]; block_tables [N, max_blocks];
    context_lens [N] (>= 1) -> [N, q_heads, d]."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    n, hq, d = q.shape
    hk, _, bs, _ = k_cache.shape
    for c in (k_cache, v_cache):  # tiles must be contiguous; block and head strides are passed
        assert c.stride(-1) == 1 and c.stride(-2) == d and c.stride() == k_cache.stride()
    q = q.contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    block_tables = block_tables.contiguous()
    _paged_decode_kernel[(n, hq)](
        out, q, k_cache, v_cache, block_tables, context_lens.to(torch.int32).contiguous(), float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(0), block_tables.stride(0),
        GROUP=hq // hk, BLOCK=bs, HEAD_DIM=d, D_P=triton.next_power_of_2(d),
    )
    return out
