"""Issue 23, the prefix cache and the trace across users: a ``cache_salt`` chain is domain-separated
from the unsalted one (no salt makes a salted key equal an unsalted key), and the trace tells shared
prefixes in whole blocks only (not another user's token-exact match length)."""
from __future__ import annotations

from array import array

import httpx
from conftest_engine import run_server, tiny_llama  # noqa: F401  (fixture)

from kvtune_engine.kv.kv_manager import block_keys, chain_root
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


def test_trace_prefix_tokens_are_whole_blocks():
    rec = TraceRecorder(BS)
    base = list(range(100, 100 + 3 * BS))
    a = rec.begin(0.0, base)
    b = rec.begin(1.0, base[:BS + 5] + [1] * (2 * BS))          # 21 tokens in common
    assert a["prefix_group"] == b["prefix_group"]
    assert a["prefix_tokens"] == b["prefix_tokens"] == BS       # not 21
    rec.begin(2.0, base[:3 * BS - 1] + [2] * 4)                 # 21 in common with b
    d = rec.begin(3.0, base[:3 * BS - 1] + [3] * 4)             # 47 in common with the one before
    assert d["prefix_tokens"] == 2 * BS
