"""Paged attention against a dense float64 attention over the same K/V.

The cache is filled through `write_kv` with shuffled (non-contiguous) blocks, so block tables,
slot mapping, ragged lengths and GQA are all exercised. The Triton decode kernel runs under
TRITON_INTERPRET=1 on CPU and must match the PyTorch reference.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from kvtune_engine.attention import AttentionMetadata, PrefillChunk, paged_attention, write_kv
from kvtune_engine.attention.reference import paged_decode_reference

# float32 paths against a float64 dense computation
ATOL = 2e-5
# Triton (float32 online softmax) against the reference
TRITON_ATOL = 1e-5


def make_cache(lens, hk, d, bs, seed=0, extra_blocks=3):
    """Random K/V per sequence, written into a cache at shuffled blocks; returns cache, tables, dense K/V."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // bs) for n in lens]
    total = sum(nbs) + extra_blocks
    perm = torch.randperm(total, generator=g).tolist()
    kc, vc = torch.zeros(hk, total, bs, d), torch.zeros(hk, total, bs, d)
    tables, dense, i = [], [], 0
    for n, nb in zip(lens, nbs):
        bt = perm[i:i + nb]
        i += nb
        k = torch.randn(n, hk, d, generator=g)
        v = torch.randn(n, hk, d, generator=g)
        slots = torch.tensor([bt[p // bs] * bs + p % bs for p in range(n)])
        write_kv(kc, vc, k, v, AttentionMetadata(bs, slots))
        tables.append(bt)
        dense.append((k, v))
    width = max(nbs)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    return kc, vc, bt, dense


def dense_attention(q, k, v, q_pos, scale):
    """q [n, hq, d] at positions q_pos attending to k/v [L, hk, d] causally, in float64."""
    hq, hk = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(hq // hk, dim=1)
    v = v.double().repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    mask = torch.arange(k.shape[0])[None, :] > torch.as_tensor(q_pos)[:, None]
    s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("bs", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2)])
def test_decode_reference_matches_dense(bs, hq, hk):
    d, lens = 16, [70, 1, bs + 1, 7, bs, 3 * bs - 2]
    kc, vc, bt, dense = make_cache(lens, hk, d, bs, seed=bs + hq)
    q = torch.randn(len(lens), hq, d)
    scale = 1 / math.sqrt(d)
    # one bucket in batch order, and a budget of ~3 sequences' K/V: several buckets sorted by length
    for budget in (1 << 30, 3 * 70 * 2 * hk * d * 4):
        out = paged_decode_reference(q, kc, vc, bt, lens, scale, bucket_bytes=budget)
        for i, (n, (k, v)) in enumerate(zip(lens, dense)):
            ref = dense_attention(q[i:i + 1], k, v, [n - 1], scale)
            torch.testing.assert_close(out[i:i + 1].double(), ref, atol=ATOL, rtol=0)


def test_decode_buckets_sort_and_respect_the_budget():
    from kvtune_engine.attention.reference import decode_buckets
    lens = [50, 10, 400, 30, 390, 20]
    b = decode_buckets(lens, bytes_per_token=10, budget=1000, max_bucket=3)
    assert b == [[1, 5, 3], [0], [4], [2]]
    assert all(len(x) * max(lens[i] for i in x) * 10 <= 1000 or len(x) == 1 for x in b)


@pytest.mark.parametrize("bs", [8, 32, 128])
def test_mixed_step_prefix_chunk_and_decode(bs):
    """One flat step: two decodes, a fresh prompt, and a chunk after a cached prefix (GQA)."""
    hq, hk, d = 6, 2, 32
    scale = 1 / math.sqrt(d)
    lens = [5, 2 * bs + 3, 9, bs + 11]  # decode, decode, fresh prompt (start 0), chunk with start_pos
    starts = [4, 2 * bs + 2, 0, bs - 3]
    kc, vc, bt, dense = make_cache(lens, hk, d, bs, seed=bs)
    q_all, k_all, v_all, q_pos = [], [], [], []
    for n, s0, (k, v) in zip(lens, starts, dense):
        q_all.append(torch.randn(n - s0, hq, d))
        k_all.append(k[s0:])
        v_all.append(v[s0:])
        q_pos.append(list(range(s0, n)))
    q, k, v = torch.cat(q_all), torch.cat(k_all), torch.cat(v_all)
    meta = AttentionMetadata(
        block_size=bs, slot_mapping=None, num_decodes=2, decode_block_tables=bt[:2],
        decode_context_lens=torch.tensor(lens[:2], dtype=torch.int32), decode_context_lens_list=lens[:2],
        prefills=[PrefillChunk(2, lens[2], 0, bt[2]), PrefillChunk(2 + lens[2], lens[3] - starts[3], starts[3], bt[3])])
    out = paged_attention(q, k, v, kc, vc, meta, scale)
    off = 0
    for i, (n, (kd, vd)) in enumerate(zip(lens, dense)):
        m = n - starts[i]
        ref = dense_attention(q[off:off + m], kd, vd, q_pos[i], scale)
        torch.testing.assert_close(out[off:off + m].double(), ref, atol=ATOL, rtol=0)
        off += m


def test_decode_bf16_close_to_float64():
    bs, hq, hk, d, lens = 16, 4, 2, 64, [3, 40, 100]
    kc, vc, bt, dense = make_cache(lens, hk, d, bs, seed=3)
    q = torch.randn(len(lens), hq, d)
    out = paged_decode_reference(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), bt, lens, 1 / 8)
    for i, (n, (k, v)) in enumerate(zip(lens, dense)):
        ref = dense_attention(q[i:i + 1], k, v, [n - 1], 1 / 8)
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=3e-2, rtol=0)  # bf16: 8 mantissa bits
