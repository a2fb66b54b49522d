"""Fuzzing the real server (bounded for ``make test``; ``bench/fuzz_server.py`` runs more cases).

Random and mutated request bodies for every endpoint, interleaved with valid greedy requests: no
client error ever gets a 5xx, every 4xx is in OpenAI's error shape, valid requests come back exactly
as on an idle server, the server stays up, and every KV block is free again at the end.
"""
from __future__ import annotations

import asyncio
import os

import httpx
from conftest_engine import run_server, tiny_llama  # noqa: F401  (fixture)
from fuzz_requests import cases, run_cases

CASES = int(os.environ.get("KVTUNE_FUZZ_CASES", "160"))
PROMPTS = ["hello", "the cat sat", "one two three four"]


def test_fuzz_every_endpoint(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, max_model_len=128, max_num_seqs=16) as s:
        config = s.engine.config.model_dump()
        refs = {}
        for p in PROMPTS:
            r = httpx.post(s.url + "/v1/completions", timeout=60,
                           json={"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            refs[p] = r.json()["choices"][0]["text"]
        found = asyncio.run(run_cases(s.url, cases(seed=10, n=CASES, model=s.engine.model_name, references=refs)))
        assert found.cases == CASES
        assert not found.problems, "\n".join(found.problems[:20])
        assert sum(n for st, n in found.by_status.items() if 400 <= st < 500) > CASES // 3   # it did probe
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
        httpx.patch(s.url + "/kvtune/v1/config", json={k: config[k] for k in
                                                       ("max_num_seqs", "watermark", "enable_prefix_caching")})
        st = s.wait_idle()
        b = st["blocks"]
        assert b["used"] == 0 and b["free"] + b["cached"] + b["reserved"] == b["total"]
