"""Hierarchical prefixes (hash chains) in traces: the format reads and writes them, and the simulator
shares exactly the blocks a chain implies, at every engine block size."""
from __future__ import annotations

import io

import pytest

from kvtune_engine.config import BLOCK_SIZES, EngineConfig
from kvtune_engine.sim.profiles import PROFILES
from kvtune_engine.sim.simulator import simulate
from kvtune_engine.sim.stepper import SimEngine
from kvtune_engine.sim.trace import TraceError, TraceRequest, dumps, read_trace

P = PROFILES["a100-llama3-8b"]

# a tree of prefixes: B and C branch off A after 2 and 3 blocks, D shares nothing, E is A again,
# F shares A's first block and ends mid-block
TREE = [((1, 2, 3, 4), 2048), ((1, 2, 5, 6), 2048), ((1, 2, 3, 7), 2048), ((9, 10), 1024),
        ((1, 2, 3, 4), 2048), ((1, 11), 1000)]


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_hits(chains: list[tuple[tuple[int, ...], int]], hb: int, bs: int) -> int:
    """What the chain implies: each request finds the whole blocks it shares with an earlier one
    (tokens equal up to common ids x hb, inside both prompts; the earlier one cached its full
    blocks), never its own last prompt token (it must be computed)."""
    total = 0
    for j, (ids, p) in enumerate(chains):
        best = 0
        for ids_i, p_i in chains[:j]:
            same = min(_common(ids, ids_i) * hb, p, p_i)
            best = max(best, same // bs)
        total += min(best, (p - 1) // bs) * bs
    return total


def _trace(chains, hb=512):
    # far apart: each request runs alone and finds every earlier one's blocks in the cache
    return [TraceRequest(10.0 * i, p, 2, hash_ids=ids, hash_block=hb) for i, (ids, p) in enumerate(chains)]


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_a_chain_shares_exactly_its_common_blocks_at_every_block_size(bs):
    s = simulate(_trace(TREE), EngineConfig(block_size=bs), P)
    pc = s["prefix_cache"]
    assert pc["query_tokens"] == sum(p for _, p in TREE)
    assert pc["hit_tokens"] == expected_hits(TREE, 512, bs)
    # spelled out: B 1024, C 1536, D 0, E all but its last block, F 512
    assert pc["hit_tokens"] == 1024 + 1536 + 0 + (2048 - bs) + 512
    off = simulate(_trace(TREE), EngineConfig(block_size=bs, enable_prefix_caching=False), P)
    assert off["prefix_cache"]["hit_tokens"] == 0


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_a_chain_block_that_is_not_a_multiple_of_the_engine_block(bs):
    # 100 tokens per id: two prompts sharing 2 ids share 200 tokens, the cache only whole blocks of them
    chains = [((1, 2, 3), 300), ((1, 2, 4), 300), ((1, 2, 3), 250)]
    s = simulate(_trace(chains, hb=100), EngineConfig(block_size=bs), P)
    assert s["prefix_cache"]["hit_tokens"] == expected_hits(chains, 100, bs)
    assert s["prefix_cache"]["hit_tokens"] == 200 // bs * bs + min(250 // bs, 249 // bs) * bs


def test_chain_tokens_agree_up_to_the_common_ids_and_differ_after():
    eng = SimEngine(EngineConfig(), P)
    a = eng.request(0, TraceRequest(0.0, 1536, 1, hash_ids=(5, 6, 7))).prompt_token_ids
    b = eng.request(1, TraceRequest(0.0, 1536, 1, hash_ids=(5, 6, 8))).prompt_token_ids
    c = eng.request(2, TraceRequest(0.0, 1536, 1, hash_ids=(5,))).prompt_token_ids  # own tokens after id 5
    assert a[:1024] == b[:1024] and a[1024] != b[1024]
    assert c[:512] == a[:512] and c[512] != a[512] and c[512] != b[512]
    assert len(a) == len(b) == len(c) == 1536


def test_old_prefix_groups_and_chains_in_one_trace_round_trip():
    reqs = [TraceRequest(0.0, 812, 190, "sys-a", 600), TraceRequest(0.5, 1300, 40, hash_ids=(7, 8, 31)),
            TraceRequest(0.7, 300, 4, hash_ids=(7, 9, 10), hash_block=128)]
    text = dumps(reqs)
    assert '"hash_ids": [7, 8, 31]}' in text and '"hash_block": 128' in text
    assert read_trace(io.StringIO(text)) == reqs


@pytest.mark.parametrize("fields, msg", [
    ('"hash_ids": [1, 2, 3]', "hash_ids has 3 ids; a prompt of 600 tokens at 512 tokens per id holds at most 2"),
    ('"hash_ids": [1, -2]', r"hash_ids\[1\] must be an integer >= 0"),
    ('"hash_ids": [1, "a"]', r"hash_ids\[1\] must be an integer >= 0"),
    ('"hash_ids": 7', "hash_ids must be a list of integers >= 0"),
    ('"hash_ids": [1], "hash_block": 0', "hash_block must be >= 1"),
    ('"hash_block": 64', "hash_block needs hash_ids"),
    ('"hash_ids": [1], "prefix_group": "g", "prefix_tokens": 5', "a request carries prefix_group or hash_ids, not both"),
])

def test_malformed_chains_name_the_line_and_field(fields, msg):
    text = ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3}\n'
            '{"arrival_s": 0, "prompt_tokens": 600, "output_tokens": 3, ' + fields + '}\n')
    src = io.StringIO(text)
    src.name = "t.jsonl"
    with pytest.raises(TraceError, match=f"^t.jsonl:2: {msg}"):
        read_trace(src)


def test_a_mooncake_file_given_to_the_loader_says_to_import_it(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n')
    with pytest.raises(TraceError, match=r"m.jsonl:1: missing arrival_s, prompt_tokens, output_tokens: a Mooncake .*"
                                         r"`kvtune trace import` first"):
        read_trace(tmp_path / "m.jsonl")


def test_chain_sharing_reads_the_longest_earlier_common_prefix():
    from kvtune_engine.sim.trace import chain_sharing
    chains = [((1, 2, 3), 512, 1500), ((1, 2, 4), 512, 1536), ((1, 2, 3), 512, 1200), ((9,), 512, 100),
              ((1,), 512, 300), ((1, 2), 64, 128), ((9, 7), 512, 900)]
    # 2 ids with the first; all 3 with the first (capped at its own 1200 tokens); none; 1 id, capped at 300;
    # 2 ids of 64 tokens; id 9, but the one before with it had only 100 tokens
    assert chain_sharing(chains) == [0, 1024, 1200, 0, 300, 128, 100]


def test_the_real_engine_load_builds_chain_prompts_that_share_exactly_the_common_blocks():
    from tests.vllm.load import chain_prefix
    a = chain_prefix({"prompt_tokens": 1300, "hash_ids": [4, 5, 6]})
    b = chain_prefix({"prompt_tokens": 1536, "hash_ids": [4, 5, 9]})
    c = chain_prefix({"prompt_tokens": 100, "hash_ids": [4, 5, 6], "hash_block": 64})
    assert len(a) == 1300 and len(b) == 1536 and a[:1024] == b[:1024]
    assert sum(x != y for x, y in zip(a[1024:1040], b[1024:1040])) > 8     # they part at the third block
    assert c[:64] == chain_prefix({"prompt_tokens": 64, "hash_ids": [4], "hash_block": 64}) and len(c) == 100
    assert chain_prefix({"prompt_tokens": 10}) == []


def test_the_tuner_reads_a_chains_sharing_from_engine_records_and_trace_requests():
    from kvtune_operator.tuner.observation import LengthStats
    recs = [{"arrival_s": 0.0, "prompt_tokens": 1200, "output_tokens": 5, "hash_ids": [1, 2, 3]},
            {"arrival_s": 1.0, "prompt_tokens": 1500, "output_tokens": 5, "hash_ids": [1, 2, 4]},
            {"arrival_s": 2.0, "prompt_tokens": 300, "output_tokens": 5, "hash_ids": [9]},
            {"arrival_s": 3.0, "prompt_tokens": 600, "output_tokens": 5, "hash_ids": [9, 10]}]
    for records in (recs, [TraceRequest(r["arrival_s"], r["prompt_tokens"], r["output_tokens"],
                                        hash_ids=tuple(r["hash_ids"]), hash_block=r.get("hash_block", 512))
                           for r in recs]):
        L = LengthStats.from_trace(records)
        # the second shares 1024 tokens with the first, the fourth the third's whole 300-token prompt
        assert L.prefix_share == 0.5 and L.prefix_tokens_mean == (1024 + 300) / 2 and L.prefix_groups == 2
