"""Plain-PyTorch paged attention: the reference for the Triton kernel and the fast path on CPU.

Decodes are sorted by context length and cut into buckets: each bucket gathers its blocks into one
`[kv_heads, seqs, L, head_dim]` tensor (padded to the bucket's longest context, so little padding,
and small enough to stay in cache) and runs one batched matmul per kv head, with the query heads of
a GQA group as the rows. Prefill chunks run torch's SDPA one sequence at a time: a fresh prompt uses
its own K/V with a causal mask; a chunk after a cached prefix gathers the prefix from the cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata

DECODE_BUCKET = 32  # sequences per gathered decode bucket


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of one sequence ([heads, num_blocks, bs, d] cache) as [heads, length, d]."""
    h, _, bs, d = cache.shape
    nb = -(-length // bs)
    return cache.index_select(1, block_table[:nb]).view(h, nb * bs, d)[:, :length]


def paged_decode_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: list[int], scale: float,
                           bucket: int = DECODE_BUCKET) -> torch.Tensor:
    """q [N, q_heads, d] (one token per sequence) -> [N, q_heads, d]."""
    n, hq, d = q.shape
    _, hk, _, bs, _ = kv_cache.shape
    g = hq // hk
    out = torch.empty_like(q)
    lens = torch.tensor(context_lens, dtype=torch.int64)
    order = torch.argsort(lens, stable=True) if n > bucket else torch.arange(n)
    dev = q.device
    for i in range(0, n, bucket):
        idx = order[i:i + bucket]
        c = len(idx)
        blens = lens[idx]
        nb = -(-int(blens.max()) // bs)
        idx_d = idx.to(dev)
        bt = block_tables.index_select(0, idx_d)[:, :nb].reshape(-1)
        k = kv_cache[0].index_select(1, bt).view(hk, c, nb * bs, d)
        v = kv_cache[1].index_select(1, bt).view(hk, c, nb * bs, d)
        qh = q.index_select(0, idx_d).view(c, hk, g, d).transpose(0, 1)  # [hk, c, g, d]
        s = torch.matmul(qh, k.transpose(-1, -2)).float() * scale       # [hk, c, g, L]
        pad = torch.arange(nb * bs, device=dev)[None, :] >= blens.to(dev)[:, None]
        s.masked_fill_(pad[None, :, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(v.dtype)
        o = torch.matmul(p, v)                                            # [hk, c, g, d]
        out.index_copy_(0, idx_d, o.transpose(0, 1).reshape(c, hq, d))
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
                      block_table: torch.Tensor | None, start_pos: int, scale: float) -> torch.Tensor:
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
        kt = gather_context(kv_cache[0], block_table, ctx).unsqueeze(0)
        vt = gather_context(kv_cache[1], block_table, ctx).unsqueeze(0)
        rows = torch.arange(start_pos, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
                    meta: AttentionMetadata, scale: float, decode_fn=None) -> torch.Tensor:
    """Attention for one layer over the flat step (decodes first, then prefill chunks).

    The new K/V must already be in the cache. `decode_fn` replaces the batched decode (Triton on CUDA).
    """
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        if decode_fn is not None:
            out[:nd] = decode_fn(q[:nd], kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
        else:
            out[:nd] = paged_decode_reference(q[:nd], kv_cache, meta.decode_block_tables,
                                              meta.decode_context_lens_list, scale)
    for c in meta.prefills:
        sl = slice(c.start, c.start + c.num_tokens)
        out[sl] = prefill_attention(q[sl], k[sl], v[sl], kv_cache, c.block_table, c.start_pos, scale)
    return out
