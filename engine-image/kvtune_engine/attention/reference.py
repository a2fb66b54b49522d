"""Plain-PyTorch paged attention: the reference for the Triton kernel and the fast path on CPU.

Decodes are sorted by context length and cut into buckets of a few MiB of K/V (cache-resident
between the gather and its use). Per bucket, one `index_select` of whole blocks per K and V yields
every (head, sequence) context as a contiguous `[positions, head_dim]` matrix, and two batched
matmuls (the query heads of a GQA group are the rows) with a masked softmax in between give the
output: no transposes, no tiny matmuls, few ops per step, and sorting keeps the padding small. Prefill chunks use torch's SDPA one sequence
at a time: a fresh prompt on its own K/V with a causal mask; a chunk after a cached prefix reads
prefix and chunk back from the cache.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata

#: Bytes of gathered K+V per decode bucket (all heads). Measured on the 2-core AMD EPYC dev box
#: (256 decodes, 100..700 tokens of context, fp32): 1-4 MiB is best; 16 MiB is 40% slower.
BUCKET_BYTES = 4 << 20
MAX_BUCKET = 64


_LOCAL = threading.local()  # per thread: two engines in two threads never share a buffer


def _workspace(slot: int, numel: int, like: torch.Tensor) -> torch.Tensor | None:
    """A reused flat buffer (CPU only): gathering into fresh multi-MiB tensors costs page faults
    (measured 2.4x slower than into a reused buffer); None on other devices."""
    if like.device.type != "cpu":
        return None
    ws = getattr(_LOCAL, "ws", None)
    if ws is None:
        ws = _LOCAL.ws = {}
    key = (slot, like.dtype)
    buf = ws.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 16), dtype=like.dtype)
        ws[key] = buf
    return buf[:numel]


def _gather_blocks(cache: torch.Tensor, bt: torch.Tensor, slot: int) -> torch.Tensor:
    """cache [heads, num_blocks, bs, d] rows `bt` of dim 1 -> [heads, len(bt), bs, d]."""
    h, _, bs, d = cache.shape
    buf = _workspace(slot, h * bt.numel() * bs * d, cache)
    if buf is None:
        return cache.index_select(1, bt)
    out = buf.view(h, bt.numel(), bs, d)
    torch.index_select(cache, 1, bt, out=out)
    return out


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
    """K or V of one sequence from a [heads, num_blocks, bs, d] cache, as [heads, length, d]."""
    h, _, bs, d = cache.shape
    nb = -(-length // bs)
    return cache.index_select(1, block_table[:nb]).view(h, nb * bs, d)[:, :length]


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: list[int], scale: float,
                           bucket_bytes: int = BUCKET_BYTES) -> torch.Tensor:
    """q [N, q_heads, d] (one token per sequence) -> [N, q_heads, d]."""
    n, hq, d = q.shape
    hk, _, bs, _ = k_cache.shape
    g = hq // hk
    dev = q.device
    buckets = decode_buckets(context_lens, 2 * hk * d * k_cache.element_size(), bucket_bytes)
    whole = len(buckets) == 1
    if whole:
        buckets = [list(range(n))]  # one bucket: keep the batch order, no scatter back
    out = None if whole else q.new_empty(q.shape)
    qs = q * scale
    for b in buckets:
        c = len(b)
        blens = [context_lens[i] for i in b]
        nb = -(-max(blens) // bs)
        length = nb * bs
        idx = None if whole else torch.tensor(b, device=dev)
        bt = (block_tables if whole else block_tables.index_select(0, idx))[:, :nb].reshape(-1)
        qb = (qs if whole else qs.index_select(0, idx)).view(c, hk, g, d).transpose(0, 1).reshape(hk * c, g, d)
        # [heads, c * nb, bs, d] gathered == [heads * c, L, d]: each row of the batch one context
        kb = _gather_blocks(k_cache, bt, 0).view(hk * c, length, d)
        s = torch.bmm(qb, kb.transpose(1, 2)).float().view(hk, c, g, length)
        if min(blens) < length:
            pad = torch.arange(length, device=dev)[None, :] >= torch.tensor(blens, device=dev)[:, None]
            s.masked_fill_(pad[None, :, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(q.dtype).view(hk * c, g, length)
        o = torch.bmm(p, _gather_blocks(v_cache, bt, 1).view(hk * c, length, d))
        o = o.view(hk, c, g, d).transpose(0, 1).reshape(c, hq, d)
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
    n, hq = q.shape[0], q.shape[1]
    qt = q.transpose(0, 1).unsqueeze(0)
    if start_pos == 0:
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)
        mask = None
    else:
        ctx = start_pos + n
        kt = gather_context(k_cache, block_table, ctx)
        vt = gather_context(v_cache, block_table, ctx)
        rows = torch.arange(start_pos, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows
    gqa = kt.shape[0] != hq
    if gqa and q.is_cuda:  # CUDA's fused SDPA kernels want equal head counts; the copy is small
        kt, vt = kt.repeat_interleave(hq // kt.shape[0], 0), vt.repeat_interleave(hq // vt.shape[0], 0)
        gqa = False
    o = F.scaled_dot_product_attention(qt, kt.unsqueeze(0), vt.unsqueeze(0), attn_mask=mask,
                                       is_causal=mask is None, scale=scale, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None,
                    v_cache: torch.Tensor | None, meta: AttentionMetadata, scale: float,
                    decode_fn=None) -> torch.Tensor:
    """Attention for one layer over the flat step (decodes first, then prefill chunks).

    The step's new K/V must already be in the cache. `decode_fn` replaces the batched decode
    (the Triton kernel on CUDA) with the signature of `triton_decode.paged_decode_triton`.
    """
    nd = meta.num_decodes
    if nd == q.shape[0] and not meta.prefills and decode_fn is not None:  # every row in the kernel
        return decode_fn(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    out = torch.empty_like(q)
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
