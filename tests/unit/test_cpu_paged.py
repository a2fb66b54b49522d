"""The compiled CPU paged-decode kernel against the PyTorch reference (the oracle).

Kernel level: block sizes 8..128, ragged lengths (1, partial and exact blocks), GQA groups 1/2/4/8,
head_dim 24..128, shuffled blocks, blocks shared by several sequences (prefix hits), bf16.
Runner level: the same requests through the runner with the kernel (the CPU default: decodes and
prefill chunks) and with the reference (batched decode, SDPA per prefill chunk), under prefix
caching, chunked prefill and swap out/in: identical greedy tokens and logprobs within 1e-5.
"""
from __future__ import annotations

import math

import pytest
import torch

from kvtune_engine.attention import cpu_paged
from kvtune_engine.attention.reference import paged_decode_reference
from kvtune_engine.config import EngineConfig
from kvtune_engine.core.request import Request, SamplingParams
from kvtune_engine.runner import ModelRunner

from test_attention import make_cache

ATOL = 1e-5

pytestmark = pytest.mark.skipif(cpu_paged.load_kernel() is None, reason="no C++ toolchain to build the kernel")


def run_both(q, kc, vc, bt, lens):
    scale = 1 / math.sqrt(q.shape[-1])
    ref = paged_decode_reference(q, kc, vc, bt, lens, scale)
    out = cpu_paged.paged_decode_cpu(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), scale)
    return ref, out


@pytest.mark.parametrize("bs", [8, 16, 32, 64, 128])
# generic loop (d 32, 24) and every compiled-in (group, head_dim) pair: groups 1, 2, 4, 8 at d 64 and 128
@pytest.mark.parametrize("hq,hk,d", [(4, 4, 32), (8, 2, 24), (4, 4, 64), (8, 4, 64), (8, 2, 64), (8, 1, 64),
                                     (4, 4, 128), (16, 8, 128), (4, 1, 128), (16, 2, 128)])
def test_kernel_matches_reference(bs, hq, hk, d):
    lens = [1, bs - 1, bs, 2 * bs + 5, 37, 300]
    kc, vc, bt, _ = make_cache(lens, hk, d, bs, seed=bs + hq + d)
    q = torch.randn(len(lens), hq, d)
    ref, out = run_both(q, kc, vc, bt, lens)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_shared_prefix_blocks_and_strided_queries():
    """Two sequences whose tables start with the same blocks (a prefix-cache hit), queries a view
    into a wider qkv row, as the model passes them."""
    bs, hq, hk, d = 16, 8, 4, 64
    kc, vc, bt, _ = make_cache([70, 50], hk, d, bs, seed=3)
    tables = torch.stack([bt[0], torch.cat([bt[0][:3], bt[1][:2]])])
    qkv = torch.randn(2, (hq + 2 * hk) * d)
    q = qkv[:, :hq * d].view(2, hq, d)
    assert not q.is_contiguous()
    ref, out = run_both(q, kc, vc, tables, [70, 3 * bs + 20])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_bf16():
    kc, vc, bt, _ = make_cache([5, 40, 129], 2, 64, 16, seed=1)
    kc, vc, q = kc.bfloat16(), vc.bfloat16(), torch.randn(3, 4, 64).bfloat16()
    ref, out = run_both(q, kc, vc, bt, [5, 40, 129])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("hq,hk,d", [(8, 4, 64), (8, 1, 64), (16, 2, 128), (4, 4, 32)])
def test_bf16_caches_are_read_exactly_and_summed_in_float32(bs, hq, hk, d):
    """A bf16 cache widens to float32 exactly, so the kernel's bf16 output is the float32 result on
    the same values rounded once to bf16: within half a bf16 ulp (2^-9 relative) of it, plus the
    float32 path's own 1e-5 (a kernel summing in bf16 would be off by ~2^-8 per product summed)."""
    lens = [1, bs - 1, bs + 3, 300]
    kc, vc, bt, _ = make_cache(lens, hk, d, bs, seed=bs + hq + d)
    kc, vc, q = kc.bfloat16(), vc.bfloat16(), torch.randn(len(lens), hq, d).bfloat16()
    ref32, _ = run_both(q.float(), kc.float(), vc.float(), bt, lens)
    out = cpu_paged.paged_decode_cpu(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), 1 / math.sqrt(d))
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref32).abs() <= ref32.abs() * 2.0 ** -8 + ATOL).all()


def test_check():
    cpu_paged.check()


# ---------------------------------------------------------------- through the runner
BS = 16


def workload():
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 500, (3 * BS,), generator=g).tolist()
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 37, 90)]
    prompts += [shared + torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 20, 41)]
    return prompts


def outputs(runner, cfg, drive):
    reqs = [Request(list(p), SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True))
            for p in workload()]
    sched, lps = drive(runner, cfg, {0: reqs[:4], 3: reqs[4:]})
    return sched, [([x.token_id for x in v], [x.logprob for x in v]) for v in lps.values()]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_runner_kernel_matches_reference(tiny_model, drive, arch):
    d = tiny_model(arch)
    cfg = EngineConfig(block_size=BS, kv_cache_memory=0.002, swap_space=0.001, max_model_len=256,
                       max_num_batched_tokens=BS * 2, max_num_seqs=16, enable_prefix_caching=True,
                       enable_chunked_prefill=True, watermark=0.0)
    fast = ModelRunner(d, cfg, seed=0, num_blocks=12, num_swap_blocks=64)
    assert fast.model.decode_fn is cpu_paged.paged_decode_cpu  # the CPU default
    assert fast.fold_prefills  # and the kernel attends the prefill chunks too, row by row
    ref = ModelRunner(d, cfg, seed=0, num_blocks=12, num_swap_blocks=64)
    ref.model.decode_fn, ref.fold_prefills = None, False
    s_fast, got = outputs(fast, cfg, drive)
    s_ref, want = outputs(ref, cfg, drive)
    for s in (s_fast, s_ref):  # the events this test is about really happened
        assert s.stats.preemptions["swap"] > 0 and s.stats.prefix_hit_tokens > 0
    assert [t for t, _ in got] == [t for t, _ in want]
    torch.testing.assert_close(torch.tensor([lp for _, l in got for lp in l]),
                               torch.tensor([lp for _, l in want for lp in l]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37, 700])
def test_kv_write_matches_the_reference_write(dtype, tokens):
    """The step's K/V, views into a wider qkv row as the model passes them, at shuffled slots."""
    from kvtune_engine.attention import AttentionMetadata, write_kv
    hk, d, bs, nb = 4, 64, 16, 64
    g = torch.Generator().manual_seed(tokens)
    kc, vc = torch.randn(hk, nb, bs, d, generator=g).to(dtype), torch.randn(hk, nb, bs, d, generator=g).to(dtype)
    qkv = torch.randn(tokens, (8 + 2 * hk) * d, generator=g).to(dtype)
    k = qkv[:, 8 * d:(8 + hk) * d].view(tokens, hk, d)
    v = qkv[:, (8 + hk) * d:].view(tokens, hk, d)
    meta = AttentionMetadata(bs, torch.randperm(nb * bs, generator=g)[:tokens])
    want_k, want_v = kc.clone(), vc.clone()
    write_kv(want_k, want_v, k, v, meta)
    cpu_paged.write_kv_cpu(kc, vc, k, v, meta)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_kv_write_refuses_a_slot_outside_the_cache_and_writes_nothing():
    from kvtune_engine.attention import AttentionMetadata
    kc, vc = torch.zeros(2, 4, 8, 32), torch.zeros(2, 4, 8, 32)
    k = v = torch.ones(3, 2, 32)
    with pytest.raises(RuntimeError, match="slot 32 outside the cache's 32"):
        cpu_paged.write_kv_cpu(kc, vc, k, v, AttentionMetadata(8, torch.tensor([0, 5, 32])))
    assert not kc.any() and not vc.any()
