"""The demo's (and the GPU-shaped e2e's) trace replay keeps the trace's sharing: an engine's prefix
cache must see the prefixes the trace says are shared, and no others."""
from __future__ import annotations

from kvtune_engine.sim.trace import TraceRequest
from kvtune_operator.demo.load import LoadGenerator, shared_ids


def prompts(reqs: list[TraceRequest], vocab: int = 256) -> list[list[int]]:
    gen = LoadGenerator(lambda: "http://127.0.0.1:1", reqs, vocab=vocab, model="m", seed=3)
    return [gen._prompt(r) for r in reqs]


def test_a_prefix_group_shares_exactly_its_prefix_tokens():
    a, b, c, short = prompts([TraceRequest(0, 300, 4, "sys-a", 200), TraceRequest(1, 250, 4, "sys-a", 200),
                              TraceRequest(2, 300, 4, "sys-b", 200), TraceRequest(3, 120, 4, "sys-a", 200)])
    assert [len(p) for p in (a, b, c, short)] == [300, 250, 300, 120]
    assert a[:200] == b[:200] and a[200:250] != b[200:250]  # the suffixes are the requests' own
    assert a[:200] != c[:200]                               # another group, another prefix
    assert short == a[:120]                                  # a prompt shorter than its prefix is all prefix
    assert all(16 <= t < 256 for p in (a, b, c) for t in p)


def test_hash_chains_share_the_blocks_of_their_common_ids():
    a, b, c = prompts([TraceRequest(0, 64, 4, hash_ids=(7, 8, 9), hash_block=16),
                       TraceRequest(1, 64, 4, hash_ids=(7, 8, 5), hash_block=16),
                       TraceRequest(2, 64, 4, hash_ids=(1, 8, 9), hash_block=16)])
    assert a[:32] == b[:32] and a[32:48] != b[32:48]  # ids 7, 8 shared; 9 vs 5 not
    assert a[:16] != c[:16]                            # a chain is a prefix: a different first id shares nothing
    assert shared_ids(TraceRequest(0, 20, 1, hash_ids=(7, 8), hash_block=16), 256) == a[:20]
