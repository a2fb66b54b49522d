"""Large non-streamed responses (issue 23): built and JSON-encoded off the event loop, so other
streams and /health go on meanwhile; and a cap on the logprob entries one response may hold."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import httpx
import pytest
from conftest_engine import run_server, tiny_llama  # noqa: F401  (fixture)

from kvtune_engine.core.request import SamplingParams
from kvtune_engine.server import protocol as P


@pytest.fixture(scope="module")
def srv(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, max_num_seqs=8, max_model_len=4096, kv_cache_memory=0.01) as s:
        yield s


def test_encode_json_is_json_dumps():
    obj = {"a": [1, 2.5, None, "é\u2028\"x"], "c": [{"t": i, "top": [[i, -1.0]] * 3} for i in range(700)],
           "l": list(range(1000)), "e": [], "d": {}}
    assert P.encode_json(obj).decode() == json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def test_logprob_volume_cap():
    big = [SamplingParams(max_tokens=400, logprobs=20) for _ in range(128)]     # 1,075,200 entries
    with pytest.raises(P.HTTPError) as ei:
        P.check_logprob_volume(big, stream=False)
    e = ei.value
    assert e.status == 400 and str(P.MAX_LOGPROB_ENTRIES) in e.message and "1075200" in e.message
    assert "stream" in e.message and e.code == "response_too_large"
    P.check_logprob_volume(big, stream=True)                       # streamed step by step: no cap
    P.check_logprob_volume([SamplingParams(max_tokens=4000)] * 128, stream=False)   # no logprobs: text only
    P.check_logprob_volume([SamplingParams(max_tokens=4000, logprobs=20)] * 12, stream=False)


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 20}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20}),
])
def test_a_response_over_the_cap_is_400_before_any_work(srv, path, extra):
    r = httpx.post(srv.url + path, json={"n": 128, "max_tokens": 400, **extra}, timeout=30)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "response_too_large" and "n x max_tokens x (1 + top_logprobs)" in err["message"]
    assert srv.wait_idle()["counters"]["requests_added"] == srv.engine.counters["requests_added"]


def test_a_large_response_being_built_does_not_stall_health_or_streams(srv, monkeypatch):
    """While the big response's logprobs are built (held open by the test until it has seen /health
    answer and another stream's tokens arrive), the event loop keeps serving."""
    building, release = threading.Event(), threading.Event()
    held: list[bool] = []
    real = P.chat_logprobs

    def slow_chat_logprobs(lps, token_str):
        if lps is not None and len(lps) >= 200 and not held:
            held.append(True)
            building.set()
            held.append(release.wait(10))       # a slow machine, standing in: until the test saw enough
        return real(lps, token_str)

    monkeypatch.setattr(P, "chat_logprobs", slow_chat_logprobs)

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            tokens = 0
            started = asyncio.Event()

            async def stream():
                nonlocal tokens
                body = {"prompt": "a b c", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
                async with c.stream("POST", srv.url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            tokens += 1
                            started.set()
            st = asyncio.create_task(stream())
            await started.wait()
            big = asyncio.create_task(c.post(srv.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 300, "ignore_eos": True,
                "logprobs": True, "top_logprobs": 20}))
            assert await asyncio.to_thread(building.wait, 60), "the big response was never built"
            seen = tokens
            health = []
            for _ in range(3):
                with contextlib.suppress(httpx.TimeoutException):
                    health.append((await c.get(srv.url + "/health", timeout=2)).status_code)
            for _ in range(100):
                if tokens >= seen + 3:
                    break
                await asyncio.sleep(0.02)
            advanced = tokens - seen
            release.set()
            r = await big
            st.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await st
            return health, advanced, r
    health, advanced, r = asyncio.run(go())
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(len(ch["logprobs"]["content"]) == 300 for ch in choices)
    assert all(len(t["top_logprobs"]) == 20 for t in choices[0]["logprobs"]["content"])
    assert health == [200, 200, 200], "/health did not answer while a response was built"
    assert advanced >= 3, "another stream got no tokens while a response was built"
    assert held == [True, True], "the test released the builder before seeing enough"
