"""Bad input: each gets a clear 4xx/503, and afterwards every block is free again."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest_engine import run_server, tiny_llama  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def srv(tiny_llama):  # noqa: F811
    # 64 blocks of 16 tokens x 512 bytes/token = 1024 slots, smaller than max_model_len 2048
    with run_server(tiny_llama, kv_cache_memory=64 * 16 * 512 / 2**30, max_model_len=2048, max_num_batched_tokens=2048,
                    enable_prefix_caching=False) as s:
        yield s


def all_free(srv) -> None:
    st = srv.wait_idle()
    b = st["blocks"]
    assert b["used"] == 0 and b["cached"] == 0
    assert b["free"] + b["reserved"] == b["total"]


def post(srv, path: str, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, timeout=60, **kw)


def err(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_cache_size(srv):
    assert srv.state()["blocks"]["total"] == 64


def test_prompt_over_max_model_len(srv):
    ids = [5] * 2100
    r = post(srv, "/v1/completions", json={"prompt": ids, "max_tokens": 1})
    assert r.status_code == 400
    m = err(r)["message"]
    assert "max_model_len" in m and "2048" in m and "2100" in m
    # prompt fits alone but prompt + max_tokens does not
    r = post(srv, "/v1/completions", json={"prompt": [5] * 1000, "max_tokens": 1100})
    assert r.status_code == 400
    m = err(r)["message"]
    assert "max_model_len" in m and "2100" in m and "1000" in m and "1100" in m
    assert err(r)["param"] == "max_tokens"
    all_free(srv)


def test_prompt_larger_than_cache(srv):
    r = post(srv, "/v1/completions", json={"prompt": [5] * 1500, "max_tokens": 1})
    assert r.status_code == 400
    m = err(r)["message"]
    assert "KV cache" in m and "64 blocks" in m and "1500" in m and "1024" in m
    all_free(srv)


def test_chat_prompt_too_long(srv):
    c = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=srv.engine.model_name, max_tokens=4,
                                  messages=[{"role": "user", "content": "word " * 3000}])
    assert "max_model_len" in str(e.value)
    all_free(srv)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3), ("max_tokens", 0),
    ("max_tokens", -1), ("logprobs", 50), ("stop_token_ids", [10**7]), ("n", 0), ("n", 1000), ("seed", "abc"),
    ("temperature", "hot"), ("stop", 5), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("min_tokens", 4), ("min_tokens", -1), ("logit_bias", {"999999": 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("seed", 2**64), ("seed", -2**63 - 1),
    ("seed", 2**63), ("top_k", 2**40), ("best_of", 2), ("suffix", "tail"),
])
def test_invalid_sampling_field(srv, field, value):
    r = post(srv, "/v1/completions", json={"prompt": "hello", "max_tokens": 3, field: value})
    assert r.status_code == 400, r.text
    e = err(r)
    assert e["param"] == field or field in e["message"], e
    assert field in e["message"]


def test_invalid_sampling_via_openai_client(srv):
    c = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=srv.engine.model_name, messages=[{"role": "user", "content": "hi"}],
                                  temperature=-1)
    assert "temperature" in str(e.value)


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'{"prompt": "x", "max_tokens": }', b"\xff\xfe"])
def test_malformed_json(srv, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = post(srv, path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, body, r.text)
        assert "JSON" in err(r)["message"]


def test_missing_fields(srv):
    r = post(srv, "/v1/completions", json={"max_tokens": 3})
    assert r.status_code == 400 and "prompt" in err(r)["message"]
    r = post(srv, "/v1/chat/completions", json={"messages": [{"content": "hi"}]})
    assert r.status_code == 400 and "role" in err(r)["message"]
    r = post(srv, "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in err(r)["message"]
    r = post(srv, "/v1/completions", json={"prompt": [], "max_tokens": 3})
    assert r.status_code == 400 and "empty" in err(r)["message"]
    r = post(srv, "/v1/completions", json={"prompt": [100000], "max_tokens": 3})
    assert r.status_code == 400 and "vocabulary" in err(r)["message"]
    all_free(srv)


def test_max_waiting_503(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, max_num_seqs=1, max_waiting=1, enable_prefix_caching=False) as s:
        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": "tell me a story", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
                first = asyncio.create_task(c.post(s.url + "/v1/completions", json=body))
                for _ in range(500):                       # wait until it runs
                    if (await c.get(s.url + "/kvtune/v1/state")).json()["queues"]["running"] == 1:
                        break
                    await asyncio.sleep(0.01)
                second = asyncio.create_task(c.post(s.url + "/v1/completions", json=body))
                for _ in range(500):                       # wait until it waits
                    if (await c.get(s.url + "/kvtune/v1/state")).json()["queues"]["waiting"] == 1:
                        break
                    await asyncio.sleep(0.005)
                else:
                    raise AssertionError("the second request never waited")
                third = await c.post(s.url + "/v1/completions", json=body)
                return third, await first, await second
        third, first, second = asyncio.run(go())
        assert third.status_code == 503
        assert third.headers["retry-after"].isdigit()
        assert "max_waiting" in third.json()["error"]["message"]
        assert first.status_code == 200 and second.status_code == 200
        all_free(s)
