"""Issue 23, the prefix cache and the trace across users: a ``cache_salt`` chain is domain-separated
from the unsalted one (no salt makes a salted key equal an unsalted key), and the trace's hash chains
tell shared prefixes in whole blocks only (not another user's token-exact match length), never across
salts."""
from __future__ import annotations

import io
import json
from array import array

import httpx
from conftest_engine import run_server, tiny_llama  # noqa: F401  (fixture)

from kvtune_engine.kv.kv_manager import block_keys, chain_root
from kvtune_engine.sim.trace import read_trace
from kvtune_engine.sim.trace_recorder import TraceRecorder

BS = 16


def _salt_spelling(ids: list[int]) -> str:
    """A salt whose UTF-8 bytes are the key bytes of these token ids (ids < 128: valid UTF-8)."""
    return array("I", ids).tobytes().decode("utf-8")


def test_no_salt_makes_a_salted_chain_meet_the_unsalted_one():
    ids = [(7 * i + 3) % 120 for i in range(4 * BS)]
    unsalted = set(block_keys(ids, BS))
    # the salt spells block 0's bytes, the prompt is the rest: the old root (root + salt) lined up
    for salt in (_salt_spelling(ids[:BS]), _salt_spelling(ids[:2 * BS]), "", "x"):
        assert not unsalted & set(block_keys(ids[BS:], BS, salt)), repr(salt[:8])
    assert len({chain_root(None), chain_root(""), chain_root("a"), chain_root("b")}) == 4
    assert block_keys(ids, BS, "a") == block_keys(ids, BS, "a") != block_keys(ids, BS, "b")


def test_a_salt_spelling_a_block_gets_no_hit_on_unsalted_cache(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, block_size=BS,
                    server_settings={"enable_prompt_tokens_details": True}) as s:
        ids = [(5 * i + 11) % 120 for i in range(4 * BS)]

        def cached(prompt: list[int], **kw) -> int:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, **kw}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        cached(ids)                                    # another user's unsalted prompt, now cached
        assert cached(ids) > 0                         # (it is cached)
        assert cached(ids[BS:], cache_salt=_salt_spelling(ids[:BS])) == 0


def test_trace_chains_tell_whole_blocks_only():
    rec = TraceRecorder(BS, hash_tokens=BS)
    base = list(range(100, 100 + 3 * BS))
    a = rec.begin(0.0, base)
    b = rec.begin(1.0, base[:BS + 5] + [1] * (2 * BS))          # 21 tokens in common: 1 block
    assert a["hash_block"] == b["hash_block"] == BS and len(a["hash_ids"]) == len(b["hash_ids"]) == 3
    assert a["hash_ids"][0] == b["hash_ids"][0] and a["hash_ids"][1] != b["hash_ids"][1]
    c = rec.begin(2.0, base[:3 * BS - 1] + [2] * 4)             # 47 in common with a: 2 blocks
    assert c["hash_ids"][:2] == a["hash_ids"][:2] and c["hash_ids"][2] != a["hash_ids"][2]
    assert "prefix_tokens" not in c and rec.begin(3.0, base[:BS - 1])["prompt_tokens"] == BS - 1   # no full block


def test_the_default_chunk_is_a_multiple_of_the_block_of_at_least_128_tokens():
    assert [TraceRecorder(b).hash_block for b in (8, 16, 128)] == [128, 128, 128]
    assert TraceRecorder(16, hash_tokens=100).hash_block == 112
    rec = TraceRecorder(16)
    a = rec.begin(0.0, list(range(300)))
    b = rec.begin(1.0, list(range(200)) + [7] * 100)   # 200 in common: one whole 128-token chunk told
    assert a["hash_block"] == 128 and a["hash_ids"][0] == b["hash_ids"][0] and a["hash_ids"][1] != b["hash_ids"][1]


def test_trace_chains_of_two_tenants_never_meet():
    rec = TraceRecorder(BS, hash_tokens=BS)
    ids = [(3 * i + 1) % 120 for i in range(4 * BS)]
    plain, a1, a2, b1 = (rec.begin(0.0, ids), rec.begin(1.0, ids, cache_salt="tenant-a"),
                         rec.begin(2.0, ids, cache_salt="tenant-a"), rec.begin(3.0, ids, cache_salt="tenant-b"))
    assert a1["hash_ids"] == a2["hash_ids"]                       # one tenant: its sharing is kept
    for x, y in ((plain, a1), (plain, b1), (a1, b1)):
        assert not set(x["hash_ids"]) & set(y["hash_ids"])        # across tenants: not one id in common
    # an id is a counter, not a digest of the tokens: the same prompt in a fresh recorder gets the same small ids
    assert TraceRecorder(BS, hash_tokens=BS).begin(0.0, ids)["hash_ids"] == plain["hash_ids"] == (0, 1, 2, 3)


def test_a_forgotten_key_tells_less_sharing_never_more():
    rec = TraceRecorder(BS, chain_keys=4, hash_tokens=BS)
    first = rec.begin(0.0, list(range(2 * BS)))
    for j in range(3):                                            # 6 other keys push the first 2 out
        rec.begin(1.0 + j, [500 + j] * (2 * BS))
    again = rec.begin(9.0, list(range(2 * BS)))
    assert not set(again["hash_ids"]) & set(first["hash_ids"])


def test_the_served_trace_shares_within_a_tenant_and_never_across(tiny_llama):  # noqa: F811
    key = {"Authorization": "Bearer admin-k"}
    with run_server(tiny_llama, block_size=BS, server_settings={"admin_key": "admin-k"}) as s:
        ids = [(5 * i + 7) % 120 for i in range(2 * 128 + 4)]     # two whole 128-token chunks
        for salt in ("tenant-a", "tenant-a", "tenant-b", None):
            body = {"prompt": ids, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        r = httpx.get(s.url + "/kvtune/v1/trace", params={"format": "jsonl"}, headers=key, timeout=30)
        assert r.status_code == 200, r.text
    src = io.StringIO(r.text)
    src.name = "engine-trace.jsonl"
    a1, a2, b, plain = read_trace(src)                  # our own loader reads what the engine serves
    assert a1.hash_block == 128 and len(a1.hash_ids) == 2 and a1.hash_ids == a2.hash_ids
    for x, y in ((a1, b), (a1, plain), (b, plain)):
        assert not set(x.hash_ids) & set(y.hash_ids)
    assert all(set(line) <= {"arrival_s", "prompt_tokens", "output_tokens", "hash_ids", "hash_block"}
               for line in map(json.loads, r.text.splitlines()))   # shapes only: no text, no salt
