"""Plain-PyTorch paged attention: the reference for the Triton kernel and the fast path on CPU.

Decodes are sorted by context length and cut into buckets of a few MiB of K/V. A bucket gathers its
sequences' blocks (`index_select` of whole blocks, the fastest gather torch has) and never reshuffles
them: scores are computed per (sequence, block, kv head) tile with one batched matmul, the softmax runs
over the (block, slot) axes, and P @ V is summed over blocks. Sorting keeps a bucket's padding small.
Prefill chunks use torch's SDPA one sequence at a time: a fresh prompt uses its own K/V with a causal
mask; a chunk after a cached prefix reads prefix and chunk back from the cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata

#: Bytes of gathered K+V per decode bucket: small enough to stay in the last-level cache between
#: the gather and the two matmuls that read it, large enough to amortise per-op overhead.
BUCKET_BYTES = 8 << 20
MAX_BUCKET = 64


def decode_buckets(lens: list[int], bytes_per_token: int, budget: int = BUCKET_BYTES,
                   max_bucket: int = MAX_BUCKET) -> list[list[int]]:
    """Sequence indices grouped by context length (ascending), each group within the byte budget
    at its longest member's length."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and ((len(cur) + 1) * lens[i] * bytes_per_token > budget or len(cur) == max_bucket):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of one sequence from a [num_blocks, heads, bs, d] cache, as [heads, length, d]."""
    _, h, bs, d = cache.shape
    nb = -(-length // bs)
    g = cache.index_select(0, block_table[:nb])           # [nb, h, bs, d]
    return g.transpose(0, 1).reshape(h, nb * bs, d)[:, :length]


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: list[int], scale: float,
                           bucket_bytes: int = BUCKET_BYTES) -> torch.Tensor:
    """q [N, q_heads, d] (one token per sequence) -> [N, q_heads, d]."""
    n, hq, d = q.shape
    _, hk, bs, _ = k_cache.shape
    g = hq // hk
    dev = q.device
    buckets = decode_buckets(context_lens, 2 * hk * d * k_cache.element_size(), bucket_bytes)
    whole = len(buckets) == 1
    if whole:
        buckets = [list(range(n))]  # one bucket: keep the batch order, no scatter back
    out = q.new_empty(q.shape) if not whole else None
    slot = torch.arange(bs, device=dev)
    for b in buckets:
        c = len(b)
        blens = [context_lens[i] for i in b]
        nb = -(-max(blens) // bs)
        idx = None if whole else torch.tensor(b, device=dev)
        bt = (block_tables if whole else block_tables.index_select(0, idx))[:, :nb].reshape(-1)
        kb = k_cache.index_select(0, bt).view(c, nb, hk, bs, d)
        vb = v_cache.index_select(0, bt).view(c, nb, hk, bs, d)
        qb = (q if whole else q.index_select(0, idx)).view(c, 1, hk, g, d)
        s = torch.matmul(qb, kb.transpose(-1, -2)).float()               # [c, nb, hk, g, bs]
        if min(blens) < nb * bs:
            pos = (torch.arange(nb, device=dev)[:, None] * bs + slot).view(1, nb, 1, 1, bs)
            s.masked_fill_(pos >= torch.tensor(blens, device=dev).view(c, 1, 1, 1, 1), float("-inf"))
        s = torch.exp((s - s.amax(dim=(1, 4), keepdim=True)).mul_(scale))  # softmax numerator
        den = s.sum(dim=(1, 4), keepdim=True).squeeze(1)                 # [c, hk, g, 1]
        o = (torch.matmul(s.to(vb.dtype), vb).sum(dim=1) / den).to(q.dtype).reshape(c, hq, d)
        if whole:
            return o
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
