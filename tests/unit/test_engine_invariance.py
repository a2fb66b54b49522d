"""Greedy outputs must not change under prefix-cache hits, chunked prefill, preemption with recompute,
or swap out and in (issue 6, section 4), checked end to end through the engine on a tiny model."""
from __future__ import annotations

import random

import pytest
from conftest_engine import build_engine, tiny_llama  # noqa: F401  (fixture)

from kvtune_engine.core.request import SamplingParams
from kvtune_engine.llm import LLM

BYTES_PER_BLOCK = 16 * 512  # block_size 16 x (2 layers x 2 (K,V) x 2 kv heads x 16 dims x 4 bytes)


def prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 500) for _ in range(shared)]
    return [prefix + [rng.randrange(10, 500) for _ in range(rng.randint(5, 60))] for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def reference(tiny_llama):  # noqa: F811
    """Each prompt alone: big cache, no prefix caching, whole-prompt prefill, nothing preempted."""
    eng = build_engine(tiny_llama, enable_prefix_caching=False, enable_chunked_prefill=False,
                       max_num_batched_tokens=512, max_model_len=512)
    llm = LLM.from_engine(eng)
    cache: dict[tuple, list[int]] = {}

    def get(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = llm.generate([prompt], greedy(n))[0].token_ids
        return cache[key]
    return get


def same(outs, ps, n, reference):
    for p, o in zip(ps, outs):
        assert o.token_ids == reference(p, n), "greedy output changed"


def test_prefix_cache_hits(tiny_llama, reference):  # noqa: F811
    llm = LLM.from_engine(build_engine(tiny_llama, enable_prefix_caching=True))
    ps = prompts(4, seed=1, shared=40)
    outs = [llm.generate([p], greedy(16))[0] for p in ps]  # one by one: later ones hit the cache
    snap = llm.engine.snapshot()
    assert snap["prefix_cache"]["hits_tokens"] >= 3 * 32
    assert [o.num_cached_tokens for o in outs][1:] == [32, 32, 32]
    same(outs, ps, 16, reference)
    # a prompt fully cached up to its last block boundary, run again in a batch with itself
    again = llm.generate([ps[0], ps[0]], greedy(16))
    same(again, [ps[0]] * 2, 16, reference)


def test_chunked_prefill(tiny_llama, reference):  # noqa: F811
    llm = LLM.from_engine(build_engine(tiny_llama, enable_prefix_caching=False, enable_chunked_prefill=True,
                                       max_num_batched_tokens=16))
    ps = prompts(3, seed=2, shared=0)
    ps[0] = ps[0] + list(range(100, 160))  # long: 4+ chunks
    outs = llm.generate(ps, greedy(12))
    same(outs, ps, 12, reference)
    steps = llm.engine.steps()
    assert max(s["batched_tokens"] for s in steps) <= 16


def test_preemption_recompute(tiny_llama, reference):  # noqa: F811
    eng = build_engine(tiny_llama, kv_cache_memory=10 * BYTES_PER_BLOCK / 2**30, swap_space=0,
                       enable_prefix_caching=False, watermark=0.0)
    assert eng.num_blocks == 10
    llm = LLM.from_engine(eng)
    ps = prompts(5, seed=3)
    outs = llm.generate(ps, greedy(40))
    pre = eng.snapshot()["preemptions"]
    assert pre["recompute"] > 0 and pre["swap"] == 0
    same(outs, ps, 40, reference)
    assert eng.scheduler.kv.pool.num_used == 0


def test_swap_out_and_in(tiny_llama, reference):  # noqa: F811
    eng = build_engine(tiny_llama, kv_cache_memory=10 * BYTES_PER_BLOCK / 2**30,
                       swap_space=64 * BYTES_PER_BLOCK / 2**30, enable_prefix_caching=False, watermark=0.0)
    assert eng.num_blocks == 10 and eng.scheduler.num_swap_blocks == 64
    llm = LLM.from_engine(eng)
    ps = prompts(5, seed=4)
    outs = llm.generate(ps, greedy(40))
    pre = eng.snapshot()["preemptions"]
    assert pre["swap"] > 0
    assert sum(s["swap_in_blocks"] for s in eng.steps()) > 0
    same(outs, ps, 40, reference)
    assert eng.scheduler.kv.pool.num_used == 0 and eng.snapshot()["swap"]["used"] == 0


def test_swap_full_falls_back_to_recompute(tiny_llama, reference):  # noqa: F811
    eng = build_engine(tiny_llama, kv_cache_memory=10 * BYTES_PER_BLOCK / 2**30,
                       swap_space=2 * BYTES_PER_BLOCK / 2**30, enable_prefix_caching=False, watermark=0.0)
    llm = LLM.from_engine(eng)
    ps = prompts(6, seed=5)
    outs = llm.generate(ps, greedy(40))
    pre = eng.snapshot()["preemptions"]
    assert pre["recompute"] > 0 and pre["swap_full"] > 0
    same(outs, ps, 40, reference)
