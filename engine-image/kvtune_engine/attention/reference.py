"""Plain-PyTorch paged attention: the reference for the Triton kernel and the fast path on CPU.

Decodes are sorted by context length and cut into buckets. A bucket gathers its sequences' blocks
(`index_select` of whole blocks, the fastest gather torch has) and never reshuffles them: scores are
computed per (sequence, block, kv head) tile with one batched matmul, the softmax runs over the
(block, slot) axes, and P @ V is summed over blocks. Sorting keeps the padding of a bucket small.
Prefill chunks use torch's SDPA one sequence at a time: a fresh prompt uses its own K/V with a causal
mask; a chunk after a cached prefix reads prefix and chunk back from the cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata

DECODE_BUCKET = 32  # sequences per gathered decode bucket


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of one sequence from a [num_blocks, heads, bs, d] cache, as [heads, length, d]."""
    _, h, bs, d = cache.shape
    nb = -(-length // bs)
    g = cache.index_select(0, block_table[:nb])           # [nb, h, bs, d]
    return g.transpose(0, 1).reshape(h, nb * bs, d)[:, :length]


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: list[int], scale: float,
                           bucket: int = DECODE_BUCKET) -> torch.Tensor:
    """q [N, q_heads, d] (one token per sequence) -> [N, q_heads, d]."""
    n, hq, d = q.shape
    _, hk, bs, _ = k_cache.shape
    g = hq // hk
    dev = q.device
    out = torch.empty_like(q)
    lens = torch.tensor(context_lens, dtype=torch.int64)
    order = torch.argsort(lens, stable=True) if n > bucket else None
    slot = torch.arange(bs, device=dev)
    for i in range(0, n, bucket):
        idx = order[i:i + bucket].to(dev) if order is not None else None
        blens = lens[i:i + bucket] if idx is None else lens[order[i:i + bucket]]
        c = len(blens)
        nb = -(-int(blens.max()) // bs)
        bt = block_tables[i:i + c] if idx is None else block_tables.index_select(0, idx)
        bt = bt[:, :nb].reshape(-1)
        kb = k_cache.index_select(0, bt).view(c, nb, hk, bs, d)
        vb = v_cache.index_select(0, bt).view(c, nb, hk, bs, d)
        qb = (q[i:i + c] if idx is None else q.index_select(0, idx)).view(c, 1, hk, g, d)
        s = torch.matmul(qb, kb.transpose(-1, -2)).float() * scale      # [c, nb, hk, g, bs]
        pos = (torch.arange(nb, device=dev)[:, None] * bs + slot).view(1, nb, 1, 1, bs)
        s.masked_fill_(pos >= blens.to(dev).view(c, 1, 1, 1, 1), float("-inf"))
        s = torch.exp(s - s.amax(dim=(1, 4), keepdim=True))
        den = s.sum(dim=(1, 4), keepdim=True).squeeze(1)                 # [c, hk, g, 1]
        o = (torch.matmul(s.to(vb.dtype), vb).sum(dim=1) / den).to(q.dtype)  # [c, hk, g, d]
        o = o.reshape(c, hq, d)
        if idx is None:
            out[i:i + c] = o
        else:
            out.index_copy_(0, idx, o)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None,
                      v_cache: torch.Tensor | None, block_table: torch.Tensor | None, start_pos: int,
                      scale: float) -> torch.Tensor:
    """One prefill chunk: q [n, q_heads, d], its own k/v [n, kv_heads, d] -> [n, q_heads, d].

    With start_pos > 0 the keys are the cached prefix plus this chunk, read back from the cache
    (the chunk is already written there).
    """
    n = q.shape[0]
    qt = q.transpose(0, 1).unsqueeze(0)
    if start_pos == 0:
        kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        ctx = start_pos + n
        kt = gather_context(k_cache, block_table, ctx).unsqueeze(0)
        vt = gather_context(v_cache, block_table, ctx).unsqueeze(0)
        rows = torch.arange(start_pos, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None,
                    v_cache: torch.Tensor | None, meta: AttentionMetadata, scale: float,
                    decode_fn=None) -> torch.Tensor:
    """Attention for one layer over the flat step (decodes first, then prefill chunks).

    The step's new K/V must already be in the cache. `decode_fn` replaces the batched decode
    (the Triton kernel on CUDA) with the signature of `triton_decode.paged_decode_triton`.
    """
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        if decode_fn is not None:
            out[:nd] = decode_fn(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
        else:
            out[:nd] = paged_decode_reference(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                              meta.decode_context_lens_list, scale)
    for c in meta.prefills:
        sl = slice(c.start, c.start + c.num_tokens)
        out[sl] = prefill_attention(q[sl], k[sl], v[sl], k_cache, v_cache, c.block_table, c.start_pos, scale)
    return out
