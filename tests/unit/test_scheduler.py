"""The scheduler: admission limits, waiting causes, chunked prefill, preemption, prefix caching,
stop conditions, live knobs, and its invariants under random operations."""
from __future__ import annotations

import itertools
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def words(data: bytes) -> list[int]:
    """Random operations as 30-bit words: hypothesis draws (and shrinks) one byte string per
    example, which is much cheaper than a list of integers."""
    return [int.from_bytes(data[i:i + 4], "little") >> 2 for i in range(0, len(data) - 3, 4)]

from kvtune_engine.config import ConfigError, EngineConfig
from kvtune_engine.core.batch import StepOutput
from kvtune_engine.core.request import FinishReason, Request, RequestStatus, SamplingParams
from kvtune_engine.core.scheduler import RequestRejected, Scheduler

TOK = 7
OPS = {"sched": 0}
_fresh = itertools.count(1000)


def prompt(n: int, prefix: list[int] | None = None) -> list[int]:
    """n tokens no other prompt shares (after `prefix`)."""
    p = list(prefix or [])
    return p + [next(_fresh) for _ in range(n - len(p))]


def req(n: int, max_tokens: int = 4, prefix=None, **sp) -> Request:
    return Request(prompt(n, prefix), SamplingParams(max_tokens=max_tokens, **sp))


def sched(num_blocks=64, num_swap_blocks=0, **cfg) -> Scheduler:
    base = dict(block_size=16, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048,
                watermark=0.0, enable_prefix_caching=True, enable_chunked_prefill=True)
    return Scheduler(EngineConfig(**{**base, **cfg}), num_blocks, num_swap_blocks)


def step(s: Scheduler, now: float = 0.0, token: int = TOK):
    b = s.schedule(now)
    fin = s.update(b, StepOutput([token if q.sample else None for q in b.seqs], 1.0), now + 1.0)
    s.check()
    return b, fin


# ---------------------------------------------------------------------- waiting causes
def test_sequence_cap_is_named_while_blocks_are_plentiful():
    s = sched(max_num_seqs=2)
    rs = [req(20) for _ in range(3)]
    for r in rs:
        s.add_request(r)
    b, _ = step(s)
    assert [q.request for q in b.seqs] == rs[:2]
    assert s.stats.last_cause == "max_num_seqs" and s.stats.cause_steps["max_num_seqs"] == 1
    snap = s.snapshot()
    assert snap["head"]["request_id"] == rs[2].request_id and snap["head"]["needed_tokens"] == 20
    assert snap["head"]["needed_blocks"] == 2 and snap["queues"] == {"running": 2, "waiting": 1, "swapped": 0}
    assert snap["kv_usage_ratio"] < 0.1


def test_token_budget_without_chunking_then_admission_when_decodes_finish():
    s = sched(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    small = [req(4, max_tokens=3) for _ in range(10)]
    big = req(60)
    for r in small + [big]:
        s.add_request(r)
    b, _ = step(s)                          # 40 prompt tokens in; 60 do not fit the 24 left
    assert b.num_batched_tokens == 40 and s.stats.last_cause == "token_budget"
    b, _ = step(s)                          # 10 decodes leave 54 < 60
    assert b.num_batched_tokens == 10 and s.stats.last_cause == "token_budget"
    while big.status is RequestStatus.WAITING:
        step(s)
    assert s.stats.cause_steps["token_budget"] >= 2 and big.num_computed_tokens == 60


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    s = sched(max_num_batched_tokens=32)
    r = req(100, max_tokens=2)
    s.add_request(r)
    chunks, tables = [], []
    while r.first_token_s is None:
        b, _ = step(s)
        chunks.append(b.seqs[0].num_tokens)
        tables.append(len(b.seqs[0].block_table))
        assert b.seqs[0].sample == (r.first_token_s is not None)
    assert chunks == [32, 32, 32, 4] and tables == [2, 4, 6, 7]
    assert r.output_token_ids == [TOK]


def test_chunked_prefill_admits_the_head_with_what_is_left_of_the_budget():
    s = sched(max_num_batched_tokens=64, max_model_len=64)
    small = [req(4, max_tokens=20) for _ in range(10)]
    big = req(60)
    for r in small + [big]:
        s.add_request(r)
    b, _ = step(s)
    assert b.num_batched_tokens == 64 and big.num_computed_tokens == 24
    assert s.stats.last_cause == "none"


def test_kv_blocks_then_watermark_causes():
    s = sched(num_blocks=100, watermark=0.1)          # 10 blocks reserved
    hog = req(85 * 16 - 1, max_tokens=50)             # 85 blocks once it is in
    s.add_request(hog)
    step(s)
    assert s.kv.pool.num_used == 85
    fits_but_for_reserve = req(8 * 16)                # 8 blocks: 15 allocatable - 10 reserve = 5
    s.add_request(fits_but_for_reserve)
    step(s)
    assert s.stats.last_cause == "watermark"
    assert s.snapshot()["allocatable_blocks"] == 5
    s.abort(fits_but_for_reserve.request_id)
    too_big = req(16 * 16)                            # 16 blocks > 15 allocatable
    s.add_request(too_big)
    step(s)
    assert s.stats.last_cause == "kv_blocks"
    s.abort(hog.request_id)
    step(s)                                           # nothing running: admitted
    assert too_big.status is RequestStatus.RUNNING and s.stats.last_cause == "none"


def test_nothing_waits_forever_on_the_watermark_when_nothing_runs():
    s = sched(num_blocks=10, watermark=0.5)           # 5 blocks reserved
    r = req(9 * 16 - 1)                               # needs 9 of 10 blocks
    s.add_request(r)
    step(s)
    assert r.status is RequestStatus.RUNNING


def test_empty_queue_records_none():
    s = sched()
    s.add_request(req(10))
    step(s)
    step(s)
    assert s.stats.cause_steps == {"none": 2, "max_num_seqs": 0, "token_budget": 0, "kv_blocks": 0,
                                   "watermark": 0}


# ---------------------------------------------------------------------- rejection
def test_requests_that_can_never_fit_are_rejected_at_once_with_the_numbers():
    s = sched(num_blocks=4, max_model_len=100)
    too_long = req(100)
    with pytest.raises(RequestRejected, match=r"100 tokens \+ 1 output token exceeds max_model_len 100"):
        s.add_request(too_long)
    assert too_long.status is RequestStatus.FINISHED and too_long.finish_reason is FinishReason.REJECTED
    too_big = req(64)
    with pytest.raises(RequestRejected, match=r"needs 5 KV blocks of 16 tokens; the whole cache has 4 blocks"):
        s.add_request(too_big)
    assert s.stats.rejected == 2 and not s.has_unfinished()
    with pytest.raises(RequestRejected, match="empty prompt"):
        s.add_request(Request([]))


def test_a_lone_request_that_outgrows_the_whole_cache_ends_with_length():
    s = sched(num_blocks=2, max_model_len=2048)
    r = req(20, max_tokens=1000)
    s.add_request(r)
    fin = []
    for i in range(40):
        _, f = step(s, float(i))
        fin += f
        if fin:
            break
    assert fin == [r] and r.finish_reason is FinishReason.LENGTH
    assert r.num_tokens == 33 and "KV cache full" in r.error        # 32 slots, 1 sampled token
    assert s.stats.cache_limit_finishes == 1 and s.kv.pool.num_used == 0


# ---------------------------------------------------------------------- preemption
def test_preemption_swaps_then_swapped_requests_return_before_new_admissions():
    s = sched(num_blocks=6, num_swap_blocks=3, block_size=8)
    a, b = req(16, max_tokens=100), req(16, max_tokens=100)
    s.add_request(a)
    s.add_request(b)
    swaps = []
    for i in range(12):
        bt, _ = step(s, float(i))
        swaps += bt.swap_out
        if swaps:
            break
    assert b.status is RequestStatus.SWAPPED and a.status is RequestStatus.RUNNING
    assert s.stats.preemptions == {"swap": 1, "recompute": 0} and len(swaps) == 3
    assert s.swap_usage_ratio == 1.0 and b.num_preemptions == 1
    c = req(3)                                   # would fit in the free block, but b goes first
    s.add_request(c)
    step(s, 20.0)
    assert c.status is RequestStatus.WAITING and s.stats.last_cause in ("kv_blocks", "watermark")
    s.abort(a.request_id)
    bt, _ = step(s, 21.0)
    assert b.status is RequestStatus.RUNNING and len(bt.swap_in) == 3
    assert {h for h, _ in bt.swap_in} == {h for _, h in swaps}
    assert c.status is RequestStatus.RUNNING       # admitted after b, in the same step


def test_preemption_falls_back_to_recompute_when_swap_is_full():
    s = sched(num_blocks=6, num_swap_blocks=2, block_size=8)
    a, b = req(16, max_tokens=30), req(16, max_tokens=30)      # 46 tokens each: fits 48 slots alone
    s.add_request(a)
    s.add_request(b)
    for i in range(12):
        step(s, float(i))
        if s.stats.preemptions["recompute"]:
            break
    assert s.stats.preemptions == {"swap": 0, "recompute": 1} and s.stats.swap_full == 1
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    produced = list(b.output_token_ids)
    assert produced                                   # kept across the recompute
    t = 100.0
    while s.has_unfinished():
        step(s, t)
        t += 1.0
    assert b.finish_reason is FinishReason.LENGTH and len(b.output_token_ids) == 30
    assert b.output_token_ids[:len(produced)] == produced


# ---------------------------------------------------------------------- prefix caching
def test_prefix_hits_share_published_blocks_only():
    s = sched(block_size=16)
    shared = prompt(40)
    a = Request(list(shared), SamplingParams(max_tokens=5))
    same_step = Request(list(shared), SamplingParams(max_tokens=5))
    s.add_request(a)
    s.add_request(same_step)
    step(s)                                          # both computed in the same step: no hit yet
    assert a.num_cached_tokens == 0 and same_step.num_cached_tokens == 0
    later = Request(shared[:32] + prompt(10), SamplingParams(max_tokens=5))
    s.add_request(later)
    b, _ = step(s)
    assert later.num_cached_tokens == 32
    seq = next(q for q in b.seqs if q.request is later)
    assert seq.start_pos == 32 and seq.num_tokens == 10
    ta = s.kv.tables[a]
    assert seq.block_table[:2] == ta[:2] and s.kv.pool.ref[ta[0]] == 2
    assert s.stats.prefix_hit_tokens == 32 and s.stats.prefix_query_tokens == 40 + 40 + 42
    whole = Request(shared[:32], SamplingParams(max_tokens=5))  # fully cached prompt
    s.add_request(whole)
    b, _ = step(s)
    seq = next(q for q in b.seqs if q.request is whole)
    assert whole.num_cached_tokens == 16 and seq.num_tokens == 16 and seq.sample


def test_idle_cached_blocks_count_as_allocatable_and_are_reused_on_a_hit():
    s = sched(num_blocks=4, block_size=16)
    p = prompt(48)
    first = Request(list(p), SamplingParams(max_tokens=1))
    s.add_request(first)
    step(s)
    assert first.is_finished and s.block_counts() == {"free": 1, "reserved": 0, "used": 0, "cached": 3}
    assert s.snapshot()["allocatable_blocks"] == 4
    again = Request(list(p), SamplingParams(max_tokens=1))
    s.add_request(again)
    step(s)
    assert again.num_cached_tokens == 32


# ---------------------------------------------------------------------- stop conditions
@pytest.mark.parametrize("sp, eos, token, reason, n_out", [
    (dict(max_tokens=3), None, TOK, FinishReason.LENGTH, 3),
    (dict(max_tokens=10), TOK, TOK, FinishReason.STOP, 1),
    (dict(max_tokens=4, ignore_eos=True), TOK, TOK, FinishReason.LENGTH, 4),
    (dict(max_tokens=10, stop_token_ids=[TOK]), None, TOK, FinishReason.STOP, 1),
])
def test_stop_conditions(sp, eos, token, reason, n_out):
    s = sched()
    r = Request(prompt(10), SamplingParams(**sp), eos_token_id=eos, arrival_s=0.5)
    s.add_request(r)
    fin, t = [], 1.0
    while not fin:
        _, fin = step(s, t, token)
        t += 1.0
    assert fin == [r] and r.finish_reason is reason and len(r.output_token_ids) == n_out
    assert r.first_scheduled_s == 1.0 and r.first_token_s == 2.0 and r.finished_s == t
    assert s.kv.pool.num_used == 0 and not s.has_unfinished()


def test_max_model_len_ends_generation():
    s = sched(max_model_len=32)
    r = req(30, max_tokens=100)
    s.add_request(r)
    while s.has_unfinished():
        step(s)
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 32


# ---------------------------------------------------------------------- abort / finish
def test_abort_frees_everything_in_every_queue():
    s = sched(num_blocks=6, num_swap_blocks=3, block_size=8, max_num_seqs=2)
    a, b, w = req(16, max_tokens=100), req(16, max_tokens=100), req(4)
    for r in (a, b, w):
        s.add_request(r)
    while b.status is not RequestStatus.SWAPPED:
        step(s)
    for r in (w, b, a):                        # waiting, swapped, running
        assert s.abort(r.request_id) is r
        assert r.finish_reason is FinishReason.ABORT
        s.check()
    assert s.abort("nope") is None
    assert s.kv.pool.num_used == 0 and s.kv.num_free_swap_blocks == 3 and not s.has_unfinished()


def test_finish_from_outside_while_the_step_runs():
    s = sched()
    r, other = req(10, max_tokens=50), req(10, max_tokens=50)
    s.add_request(r)
    s.add_request(other)
    step(s)
    b = s.schedule(2.0)
    s.finish(r.request_id, FinishReason.STOP, now=2.5)     # e.g. a stop string, seen by the engine
    fin = s.update(b, StepOutput([TOK] * len(b.seqs), 1.0), 3.0)
    s.check()
    assert fin == [] and r.finish_reason is FinishReason.STOP and r.finished_s == 2.5
    assert len(other.output_token_ids) == 2 and len(r.output_token_ids) == 1


# ---------------------------------------------------------------------- live knobs
def test_live_knobs_apply_atomically_and_restart_knobs_are_refused():
    s = sched(max_num_seqs=1)
    a, b = req(10, max_tokens=50), req(10, max_tokens=50)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert s.stats.last_cause == "max_num_seqs"
    with pytest.raises(ConfigError, match="block_size"):
        s.update_config(max_num_seqs=8, block_size=32)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        s.update_config(max_num_seqs=8, max_num_batched_tokens=4)
    assert s.config.max_num_seqs == 1                     # nothing half-applied
    s.update_config(max_num_seqs=8)
    step(s)
    assert b.status is RequestStatus.RUNNING


def test_switching_prefix_caching_off_forgets_cached_blocks():
    s = sched()
    r = req(40, max_tokens=1)
    s.add_request(r)
    step(s)
    assert s.block_counts()["cached"] == 2
    s.update_config(enable_prefix_caching=False)
    assert s.block_counts()["cached"] == 0 and not s.kv.pool.cached
    s.check()


# ---------------------------------------------------------------------- what it reports
def test_snapshot_is_json_and_ratios_are_right():
    s = sched(num_blocks=10, num_swap_blocks=4, watermark=0.2)
    r = req(20, max_tokens=50)                 # 2 blocks, 20 of 32 slots filled after prefill
    s.add_request(r)
    step(s)
    assert s.kv_usage_ratio == pytest.approx(0.2)
    assert s.internal_fragmentation_ratio == pytest.approx(12 / 32)
    assert s.block_counts() == {"free": 6, "reserved": 2, "used": 2, "cached": 0}
    snap = json.loads(json.dumps(s.snapshot()))
    for key in ("config", "blocks", "queues", "head", "allocatable_blocks", "waiting_cause",
                "waiting_cause_steps", "recent_waiting_cause_steps", "preemptions", "prefix_cache",
                "kv_usage_ratio", "internal_fragmentation_ratio", "swap_usage_ratio"):
        assert key in snap
    assert snap["preemptions"] == {"swap": 0, "recompute": 0, "swap_full": 0}
    assert snap["config"]["watermark"] == 0.2 and snap["allocatable_blocks"] == 6


def test_slot_mapping_follows_the_block_table():
    s = sched(block_size=16)
    r = req(20)
    s.add_request(r)
    b = s.schedule(0.0)
    seq = b.seqs[0]
    bt = seq.block_table
    assert seq.slot_mapping(16) == [bt[0] * 16 + i for i in range(16)] + [bt[1] * 16 + i for i in range(4)]


def test_admission_uses_any_free_blocks_whatever_their_ids():
    """Free blocks scattered between used and cached ones: a request needing exactly the
    allocatable count (after the watermark) gets in; one more block and it waits on the watermark."""
    s = sched(num_blocks=40, watermark=0.1, block_size=16)    # 4 reserved
    small = [req(4, max_tokens=10) for _ in range(20)]        # 1 block each, never a second one
    for r in small:
        s.add_request(r)
    step(s)
    for r in small[::2]:
        s.abort(r.request_id)                                  # every other block id is free again
    free_ids = sorted(b for b in range(40) if s.kv.pool.ref[b] == 0)
    assert any(b2 - b1 > 1 for b1, b2 in zip(free_ids, free_ids[1:]))
    allocatable = s.kv.pool.num_allocatable - s.reserve_blocks
    exact = req(allocatable * 16 - 1)          # prefill and first decode fit in `allocatable` blocks
    s.add_request(exact)
    step(s)
    assert exact.status is RequestStatus.RUNNING
    s.abort(exact.request_id)
    allocatable = s.kv.pool.num_allocatable - s.reserve_blocks
    one_more = req(allocatable * 16 + 1)
    s.add_request(one_more)
    step(s)
    assert one_more.status is RequestStatus.WAITING and s.stats.last_cause == "watermark"


# ---------------------------------------------------------------------- property test
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([8, 16]),
       num_blocks=st.integers(4, 48), num_swap=st.integers(0, 24),
       chunked=st.booleans(), caching=st.booleans(),
       ops=st.binary(min_size=4 * 200, max_size=4 * 300).map(words))
def test_scheduler_invariants_under_random_operations(seed, block_size, num_blocks, num_swap, chunked,
                                                      caching, ops):
    """add / step / abort / finish / live knob changes at random, invariants after each; then
    everything admitted finishes (nothing waits forever)."""
    rng = random.Random(seed)
    max_len = 256
    s = Scheduler(EngineConfig(block_size=block_size, max_num_seqs=6, max_num_batched_tokens=max_len,
                               max_model_len=max_len, watermark=0.05, enable_chunked_prefill=chunked,
                               enable_prefix_caching=caching), num_blocks, num_swap)
    prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    now = 0.0
    for x in ops:
        kind = x % 10
        if kind < 4:
            n = 1 + (x >> 4) % 120
            pre = prefixes[(x >> 12) % 3][:min(n, (x >> 14) % 41)]
            r = Request(pre + [rng.randrange(50) for _ in range(n - len(pre))],
                        SamplingParams(max_tokens=1 + (x >> 20) % 40), eos_token_id=3)
            try:
                s.add_request(r)
            except RequestRejected:
                assert r.finish_reason is FinishReason.REJECTED
        elif kind < 8:
            b = s.schedule(now)
            if s.has_unfinished():
                assert b.seqs or b.swap_out, "no progress with requests pending"
            toks = [rng.randrange(50) if q.sample else None for q in b.seqs]
            now += 1.0
            s.update(b, StepOutput(toks, 1.0), now)
        elif kind == 8 and s.requests:
            rid = sorted(s.requests)[(x >> 4) % len(s.requests)]
            if x & 16:
                s.abort(rid)
            else:
                s.finish(rid, FinishReason.STOP, now)
        elif kind == 9:
            knob = (x >> 4) % 3
            if knob == 0:
                s.update_config(max_num_seqs=1 + (x >> 6) % 8)
            elif knob == 1:
                s.update_config(watermark=((x >> 6) % 4) / 10)
            else:
                s.update_config(enable_prefix_caching=bool(x & 64))
        s.check()
        OPS["sched"] += 1
    for _ in range(20000):
        if not s.has_unfinished():
            break
        b = s.schedule(now)
        now += 1.0
        s.update(b, StepOutput([TOK if q.sample else None for q in b.seqs], 1.0), now)
    else:
        pytest.fail("requests still pending after 20000 steps")
    s.check()
    assert s.kv.pool.num_used == 0 and s.kv.num_free_swap_blocks == num_swap


def test_property_tests_ran_enough_operations():
    if OPS["sched"] == 0:
        pytest.skip("the property test did not run in this session")
    assert OPS["sched"] >= 120 * 200


def test_a_runner_that_skips_a_sampled_token_is_caught():
    s = sched()
    s.add_request(req(10))
    b = s.schedule(0.0)
    with pytest.raises(ValueError, match="returned 0 tokens for 1 sequences"):
        s.update(b, StepOutput([], 1.0), 1.0)
    with pytest.raises(ValueError, match="sampled no token"):
        s.update(b, StepOutput([None], 1.0), 1.0)
