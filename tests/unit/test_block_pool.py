"""Block pool and KV manager: invariants under random operations, and no contiguity anywhere."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def words(data: bytes) -> list[int]:
    """Random operations as 30-bit words: hypothesis draws (and shrinks) one byte string per
    example, which is much cheaper than a list of integers."""
    return [int.from_bytes(data[i:i + 4], "little") >> 2 for i in range(0, len(data) - 3, 4)]

from kvtune_engine.config import ConfigError
from kvtune_engine.core.request import Request
from kvtune_engine.kv.block_pool import BlockPool, NoFreeBlocks
from kvtune_engine.kv.kv_manager import KVManager, block_keys
from kvtune_engine.kv.sizing import GIB, kv_bytes_per_token, kv_cache_size, num_swap_blocks

#: operations executed by the property test in this module (see the last test)
OPS = {"pool": 0}


def _model_refs(pool: BlockPool, holders: list[list[int]]) -> None:
    """The pool's refcounts are exactly the references the test holds."""
    refs = [0] * pool.num_blocks
    for h in holders:
        for b in h:
            refs[b] += 1
    assert refs == pool.ref


OP_NAMES = ("alloc", "alloc", "free", "free", "hit", "publish", "publish_dup")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(1, 40), ops=st.binary(min_size=4 * 200, max_size=4 * 300).map(words))
def test_pool_invariants_hold_after_every_operation(num_blocks, ops):
    """Random allocate / free / prefix hit / publish sequences (each drawn number picks an
    operation and its argument); every invariant is checked after every operation."""
    pool = BlockPool(num_blocks)
    holders: list[list[int]] = []     # block lists held by "requests" (one reference each)
    next_key = 0
    for x in ops:
        name = OP_NAMES[x % len(OP_NAMES)]
        x //= len(OP_NAMES)
        if name == "alloc":
            allocatable = pool.num_allocatable
            n = x % (allocatable + 3)
            before = (list(pool.ref), pool.num_free, pool.num_cached_idle)
            single = n == 1 or (n == 2 and allocatable == 0)   # take_one() for a single block
            if single:
                n = 1
            if n > allocatable:
                if single:
                    assert pool.take_one() is None
                else:
                    with pytest.raises(NoFreeBlocks):
                        pool.allocate(n)
                assert (list(pool.ref), pool.num_free, pool.num_cached_idle) == before  # untouched
            else:
                got = [pool.take_one()] if single else pool.allocate(n)
                assert len(got) == len(set(got)) == n
                assert all(before[0][b] == 0 for b in got), "handed out a referenced block"
                assert all(pool.ref[b] == 1 and pool.key_of[b] is None for b in got)
                holders.append(got)
        elif name == "free" and holders:
            h = holders.pop(x % len(holders))
            pool.free(h[::-1] if x & 1 else h)
        elif name == "hit" and pool.cached:
            keys = list(pool.cached)
            b = pool.lookup(keys[x % len(keys)])
            pool.touch([b])
            holders.append([b])
        elif name in ("publish", "publish_dup") and holders:
            h = holders[x % len(holders)]
            b = h[(x >> 8) % len(h)] if h else None
            if b is None:
                continue
            if name == "publish":
                key = next_key.to_bytes(8, "little")
                next_key += 1
                had_key = pool.key_of[b] is not None
                assert (pool.publish([key], [b]) == 1) is not had_key   # a block is published once
                assert pool.lookup(key) == (None if had_key else b)
            elif pool.cached:   # a key already taken never moves to another block
                key = next(iter(pool.cached))
                owner = pool.cached[key]
                assert pool.publish([key], [b]) == 0
                assert pool.cached[key] == owner
        pool.check()
        _model_refs(pool, holders)
        assert pool.num_free + pool.num_used + pool.num_cached_idle == num_blocks
        OPS["pool"] += 1


def test_freed_cached_blocks_are_reused_in_lru_order_and_evicted_only_when_needed():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    assert pool.publish([b"a", b"b", b"c"], [a, b, c]) == 3
    pool.free([b])        # idle order: b, then a, then c
    pool.free([a])
    pool.free([c])
    assert pool.num_cached_idle == 3 and pool.num_free == 0
    pool.touch([pool.lookup(b"a")])          # a hit takes a out of the LRU
    assert pool.ref[a] == 1 and pool.num_cached_idle == 2
    got = pool.allocate(1)                   # evicts the least recently freed idle block: b
    assert got == [b] and pool.lookup(b"b") is None and pool.lookup(b"c") == c
    assert pool.num_evictions == 1
    pool.free([d])                           # d has no key: it becomes free, not cached
    assert pool.num_free == 1 and pool.allocate(1) == [d]   # free blocks go before evicting c
    assert pool.lookup(b"c") == c


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 200), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_allocation_succeeds_whenever_the_count_covers_it_whatever_the_layout(num_blocks, seed, data):
    """Free, cached-idle and used blocks interleaved at random ids: any `allocatable` blocks can be
    had at once, never one more. A paged pool has no external fragmentation."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_blocks)
    rng.shuffle(blocks)
    n_free = data.draw(st.integers(0, num_blocks))
    n_cached = data.draw(st.integers(0, num_blocks - n_free))
    to_free, to_cache = blocks[:n_free], blocks[n_free:n_free + n_cached]
    pool.publish([f"k{i}".encode() for i in range(len(to_cache))], to_cache)
    pool.free(to_free + to_cache)      # the rest stay used, scattered among them
    need = pool.num_allocatable
    assert need == n_free + n_cached
    if data.draw(st.booleans()):
        with pytest.raises(NoFreeBlocks):
            pool.allocate(need + 1)
    got = pool.allocate(need)
    assert sorted(got) == sorted(to_free + to_cache)
    pool.check()


def test_kv_manager_tables_hits_swap_and_free():
    kv = KVManager(num_blocks=10, block_size=4, num_swap_blocks=6)
    a = Request(list(range(10)))          # 2 full blocks + 2 tokens
    t = kv.admit(a, [], 3)
    kv.commit(a, 10)                      # publishes the 2 full prompt blocks, not the partial one
    assert len(kv.pool.cached) == 2 and kv.pool.key_of[t[2]] is None
    b = Request(list(range(10)) + [99])
    hits = kv.cached_prefix(b)
    assert hits == t[:2]
    assert kv.blocks_to_take(hits, 1) == 1          # hits are in use: they cost nothing more
    tb = kv.admit(b, hits, 1)
    assert kv.pool.ref[t[0]] == 2 and kv.pool.num_shared == 2
    kv.check({a: 10, b: 11})
    pairs = kv.swap_out(b)
    assert [d for d, _ in pairs] == tb and kv.num_free_swap_blocks == 3
    assert kv.pool.ref[t[0]] == 1                   # b's references are gone from the device
    back = kv.swap_in(b)
    assert [h for h, _ in back] == [h for _, h in pairs] and kv.num_free_swap_blocks == 6
    kv.check({a: 10, b: 11})
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_used == 0 and kv.num_table_blocks == 0
    kv.check()


def test_a_whole_prompt_in_the_cache_still_leaves_its_last_token_to_compute():
    kv = KVManager(num_blocks=8, block_size=4)
    a = Request(list(range(8)))           # exactly 2 full blocks
    kv.admit(a, [], 2)
    kv.commit(a, 8)
    same = Request(list(range(8)))
    assert len(kv.cached_prefix(same)) == 1    # the second block is recomputed for the last token


def test_prefix_keys_are_chained_so_equal_blocks_after_different_prefixes_differ():
    k1 = block_keys([1, 2, 3, 4, 9, 9, 9, 9], 4)
    k2 = block_keys([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert k1[1] != k2[1]
    assert block_keys([1, 2, 3, 4, 9, 9, 9, 9, 7], 4) == k1     # partial tail block: no key
    assert len(set(k1 + k2)) == 4


def test_sizing_formula_is_the_one_documented():
    kvt = kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert kvt == 131072
    s = kv_cache_size(device_total_bytes=80 * GIB, gpu_memory_utilization=0.9, weights_bytes=16 * GIB,
                      activation_peak_bytes=2 * GIB, block_size=16, kv_bytes_per_token=kvt, swap_space_gib=4)
    budget = int(80 * GIB * 0.9) - 18 * GIB
    assert s.num_blocks == budget // (16 * kvt) and s.budget_bytes == budget
    assert s.num_swap_blocks == 4 * GIB // (16 * kvt) == num_swap_blocks(4, 16, kvt)
    fixed = kv_cache_size(device_total_bytes=1, gpu_memory_utilization=0.5, weights_bytes=0,
                          activation_peak_bytes=0, block_size=16, kv_bytes_per_token=kvt,
                          kv_cache_memory_gib=1.0)
    assert fixed.num_blocks == GIB // (16 * kvt)
    with pytest.raises(ConfigError, match="no room for the KV cache"):
        kv_cache_size(device_total_bytes=20 * GIB, gpu_memory_utilization=0.5, weights_bytes=16 * GIB,
                      activation_peak_bytes=0, block_size=16, kv_bytes_per_token=kvt)
    with pytest.raises(ConfigError, match="swap_space"):
        num_swap_blocks(-1, 16, kvt)


def test_property_test_ran_enough_operations():
    if OPS["pool"] == 0:
        pytest.skip("the property test did not run in this session")
    assert OPS["pool"] >= 400 * 200
