"""The engine under hostile input (issue 10), against the real server through HTTP and the openai client.

Each case: what a client sends, the clear answer it gets, that nothing leaks (every block free again
afterwards) and that other clients' requests are not hurt.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time

import httpx
import openai
import pytest
from conftest_engine import run_server, tiny_llama  # noqa: F401  (fixture)

from kvtune_operator.demo.engine import free_port

ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def srv(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, max_num_seqs=8,
                    server_settings={"max_body_bytes": 256 * 1024, "enable_prompt_tokens_details": True}) as s:
        yield s


def all_free(srv) -> None:
    st = srv.wait_idle()
    b = st["blocks"]
    assert b["used"] == 0 and b["free"] + b["reserved"] + b["cached"] == b["total"]
    assert st["server"]["engine_alive"]


def post(srv, path: str, timeout: float = 60, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, timeout=timeout, **kw)


def complete(srv, **body) -> httpx.Response:
    return post(srv, "/v1/completions", json={"prompt": "hello world", "max_tokens": 4, "temperature": 0, **body})


def chat(srv, **body) -> httpx.Response:
    return post(srv, "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})


def err(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text
    return r.json()["error"]


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0)


# ---------------------------------------------------------------------------------------------- isolation

@pytest.mark.parametrize("seed", [2**64, 2**63, -2**63 - 1, 2**70])
def test_seed_out_of_int64_is_400_and_engine_lives(srv, seed):
    for r in (complete(srv, seed=seed, temperature=1.0), chat(srv, seed=seed)):
        assert r.status_code == 400, r.text
        assert err(r)["param"] == "seed" and "int64" in err(r)["message"]
    ok = complete(srv, seed=2**63 - 1, temperature=1.0)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(srv.url + "/health").status_code == 200
    all_free(srv)


def test_one_request_failing_in_the_sampler_fails_only_itself(srv, monkeypatch):
    """A sampling error the validation did not foresee ends that request (500 naming it); a stream
    running beside it finishes untouched and the engine keeps serving."""
    from kvtune_engine.runner.sampler import Sampler
    real = Sampler._process_row

    def boom(self, row, req):
        if 7 in req.sampling.logit_bias:
            raise RuntimeError("injected sampler fault")
        return real(self, row, req)
    monkeypatch.setattr(Sampler, "_process_row", boom)

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            good = {"prompt": "one two three", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            bad = {"prompt": "four five", "max_tokens": 10, "logit_bias": {"7": 1.0}}

            async def stream():
                texts = []
                async with c.stream("POST", srv.url + "/v1/completions", json=good) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            texts.append(json.loads(line[6:]))
                return texts
            st = asyncio.create_task(stream())
            await asyncio.sleep(0.2)
            r_bad = await c.post(srv.url + "/v1/completions", json=bad)
            return r_bad, await st
    r_bad, chunks = asyncio.run(go())
    assert r_bad.status_code == 500 and "injected sampler fault" in err(r_bad)["message"]
    assert all("error" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    monkeypatch.setattr(Sampler, "_process_row", real)
    assert complete(srv).status_code == 200
    all_free(srv)


def test_one_request_failing_in_output_processing_fails_only_itself(srv, monkeypatch):
    from kvtune_engine.detokenizer import Detokenizer
    real = Detokenizer.check_stop

    def boom(st):
        if "BOOM" in st.stops:
            raise ValueError("injected stop-string fault")
        return real(st)
    monkeypatch.setattr(Detokenizer, "check_stop", staticmethod(boom))
    r = chat(srv, stop=["BOOM"])
    assert r.status_code == 500 and "injected stop-string fault" in err(r)["message"]
    monkeypatch.setattr(Detokenizer, "check_stop", staticmethod(real))
    assert chat(srv, stop=["x"]).status_code == 200
    all_free(srv)


# ---------------------------------------------------------------------------------------------- limits

def test_body_over_the_cap_is_413(srv):
    r = post(srv, "/v1/completions", content=b'{"prompt": "' + b"a" * 300_000 + b'"}',
             headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in err(r)["message"]
    # chunked (no Content-Length): the cap still holds
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 10_000
        yield b'"}'
    r = post(srv, "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    all_free(srv)


def test_prompt_too_long_refused_before_tokenizing(srv, monkeypatch):
    tok = srv.engine.tokenizer
    calls: list[int] = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **kw: calls.append(len(text)) or encode(text, *a, **kw))
    assert post(srv, "/v1/completions", json={"prompt": "word " * 10, "max_tokens": 2}).status_code == 200
    assert calls, "the hook does not see the server's tokenization"
    r = post(srv, "/v1/completions", json={"prompt": "word " * 50_000, "max_tokens": 2})
    assert r.status_code == 400
    e = err(r)
    assert "max_model_len" in e["message"] and "characters" in e["message"] and e["param"] == "prompt"
    assert 250_000 not in calls, "the long prompt was tokenized before it was refused"
    all_free(srv)


def test_huge_requests_do_not_stall_another_stream(tiny_llama):  # noqa: F811
    """Other clients' big requests (a long prompt tokenized, a rejected huge one, a big JSON body)
    do not delay a running stream's tokens beyond a small bound."""
    bursts = 3
    with run_server(tiny_llama, max_model_len=4096, kv_cache_memory=0.01) as s:
        mml_chars = 4096 * s.engine.tokenizer.max_token_chars
        # under the character bound, so it is tokenized (~11k tokens: then refused by max_model_len), and a
        # text over the bound (refused unread); neither queues work for the engine, so any gap is the server's
        long_ok = ("lorem ipsum dolor " * (mml_chars // 18))[:mml_chars]
        too_long = "word " * 200_000                          # 1e6 characters (the issue: a 1.6 s freeze)
        # encoded once, here: the client shares this process (and its GIL) with the server, so its own
        # JSON encoding must not show as the server's stall
        bodies = [json.dumps({"prompt": p, "max_tokens": 1}).encode() for p in (long_ok, too_long, long_ok, too_long)]
        hdrs = {"content-type": "application/json"}

        async def go():
            async with httpx.AsyncClient(timeout=120) as c:
                streams: list[list[float]] = []     # each stream's token times (a gap is within one stream)
                started, done = asyncio.Event(), asyncio.Event()

                async def stream():
                    # one stream after another until the hostile requests are done: a fast engine finishes
                    # max_tokens (bounded by max_model_len 4096) before a slow machine finishes the bursts
                    body = {"prompt": "a b c", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                            "stream": True}
                    while not done.is_set():
                        streams.append(times := [])
                        async with c.stream("POST", s.url + "/v1/completions", json=body) as r:
                            async for line in r.aiter_lines():
                                if line.startswith("data: "):
                                    times.append(time.monotonic())
                                    started.set()
                st = asyncio.create_task(stream())
                await started.wait()
                spans, answers = [], []
                for _ in range(bursts):
                    await asyncio.sleep(1.0)  # the control: this machine's gaps with no hostile request
                    t0 = time.monotonic()
                    answers += await asyncio.gather(*[c.post(s.url + "/v1/completions", content=b, headers=hdrs)
                                                      for b in bodies])
                    spans.append((t0, time.monotonic()))
                await asyncio.sleep(0.1)
                done.set()
                st.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await st
                return streams, spans, answers
        streams, spans, rs = asyncio.run(go())
        assert [r.status_code for r in rs] == [400] * 4 * bursts
        assert "characters" in rs[1].json()["error"]["message"] and "tokens" in rs[0].json()["error"]["message"]
        assert streams[-1][-1] > spans[-1][1], "no stream ran to the end of the hostile requests"
        gaps = [(b, b - a) for times in streams for a, b in zip(times, times[1:])]
        seen = []
        for i, (t0, t1) in enumerate(spans):
            control = sorted(g for b, g in gaps if t0 - 1.0 <= b < t0)
            during = [g for b, g in gaps if t0 <= b <= t1 + 0.1]
            assert control and during, (i, len(control), len(during))
            seen.append((control[len(control) // 2], control[-1], max(during), t1 - t0))
        # A server that tokenized on its event loop froze the stream for the whole tokenization (~1.6 s for
        # the 1e6 characters), in every burst. A busy machine's scheduler alone stalls a process for a few
        # hundred ms now and then (seen at load average 10-25 on 2 cores), in one burst, not in each: so the
        # burst that stalled least must stay under the bound, this machine's own: 10x the stream's median
        # gap, or twice the longest gap of the control second before it, and never under 0.25 s.
        assert any(longest < max(0.25, 10 * base, 2 * control) for base, control, longest, _ in seen), seen


# ---------------------------------------------------------------------------------------------- admin key

def test_admin_api_needs_the_admin_key(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, api_key="api-secret", server_settings={"admin_key": ADMIN}) as s:
        for method, path in (("GET", "/kvtune/v1/state"), ("GET", "/kvtune/v1/trace"), ("GET", "/kvtune/v1/steps"),
                             ("GET", "/kvtune/v1/config"), ("PATCH", "/kvtune/v1/config")):
            kw = {"json": {"max_num_seqs": 1}} if method == "PATCH" else {}
            for headers in ({}, {"Authorization": "Bearer api-secret"}, {"Authorization": "Bearer wrong"}):
                r = httpx.request(method, s.url + path, headers=headers, timeout=30, **kw)
                assert r.status_code == 401, (path, headers, r.text)
                assert "admin key" in err(r)["message"]
        good = {"Authorization": f"Bearer {ADMIN}"}
        assert httpx.get(s.url + "/kvtune/v1/state", headers=good).status_code == 200
        r = httpx.patch(s.url + "/kvtune/v1/config", json={"max_num_seqs": 5}, headers=good)
        assert r.status_code == 200 and s.engine.config.max_num_seqs == 5
        # the admin key does not open /v1; /metrics and /health stay open and hold no request text
        assert httpx.get(s.v1 + "/models", headers=good).status_code == 401
        c = openai.OpenAI(base_url=s.v1, api_key="api-secret", max_retries=0)
        c.completions.create(model=s.engine.model_name, prompt="the secret word is zebra", max_tokens=2)
        m = httpx.get(s.url + "/metrics")
        assert m.status_code == 200 and "zebra" not in m.text
        assert httpx.get(s.url + "/health").status_code == 200


def test_admin_api_without_key_answers_on_loopback_only(tiny_llama):  # noqa: F811
    addrs = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    addrs |= {ip for ip in _local_ipv4() if not ip.startswith("127.")}
    other = sorted(a for a in addrs if not a.startswith("127."))
    assert other, "this machine has no non-loopback IPv4 address to test from"
    with run_server(tiny_llama, host="0.0.0.0", api_key="api-secret") as s:
        port = s.url.rsplit(":", 1)[1]
        assert httpx.get(s.url + "/kvtune/v1/state").status_code == 200           # loopback
        r = httpx.get(f"http://{other[0]}:{port}/kvtune/v1/state", timeout=30)
        assert r.status_code == 403 and "loopback" in err(r)["message"]
        r = httpx.patch(f"http://{other[0]}:{port}/kvtune/v1/config", json={"max_num_seqs": 1},
                        headers={"Authorization": "Bearer api-secret"}, timeout=30)
        assert r.status_code == 403 and s.engine.config.max_num_seqs != 1
        assert httpx.get(f"http://{other[0]}:{port}/metrics", timeout=30).status_code == 200


def _local_ipv4() -> list[str]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))   # no packet is sent: picks the outgoing interface
        return [s.getsockname()[0]]
    except OSError:
        return []
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------- privacy

def test_cache_salt_separates_prefix_sharing(srv):
    prompt = "You are a helpful bank assistant. The customer's PIN is 48213. " * 4
    def cached(**kw) -> int:
        r = complete(srv, prompt=prompt, max_tokens=1, **kw)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached(cache_salt="alice")
    assert cached(cache_salt="alice") > 0          # same salt: shared
    assert cached(cache_salt="mallory") == 0       # other salt: nothing shared
    assert cached() == 0                           # no salt: nothing shared with a salted request
    r = complete(srv, prompt=prompt, cache_salt="")
    assert r.status_code == 400 and err(r)["param"] == "cache_salt"
    all_free(srv)


def test_prompt_tokens_details_only_when_enabled(tiny_llama):  # noqa: F811
    with run_server(tiny_llama) as s:
        prompt = "shared system prompt with enough tokens to fill a block or two " * 3
        for _ in range(2):
            r = complete(s, prompt=prompt, max_tokens=1)
            assert r.status_code == 200 and "prompt_tokens_details" not in r.json()["usage"]
        assert s.state()["prefix_cache"]["hits_tokens"] > 0   # it was cached, just not told


def test_trace_records_shapes_only(srv):
    complete(srv, prompt="my password is hunter2", max_tokens=2)
    text = httpx.get(srv.url + "/kvtune/v1/trace?format=jsonl").text
    assert "hunter2" not in text and "password" not in text
    for line in text.splitlines():
        assert set(json.loads(line)) <= {"arrival_s", "prompt_tokens", "output_tokens", "hash_ids", "hash_block"}


# ---------------------------------------------------------------------------------------------- no silent ignores

@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("/v1/chat/completions", "tool_choice", "auto"),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/completions", "response_format", {"type": "json_object"}),
])
def test_unsupported_fields_are_400_not_supported_yet(srv, path, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = post(srv, path, json={**body, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert err(r)["param"] == field and "not supported yet" in err(r)["message"]


def test_unknown_fields_are_400_naming_them(srv):
    r = complete(srv, max_token=5, foo=1)
    assert r.status_code == 400
    e = err(r)
    assert "max_token" in e["message"] and "foo" in e["message"] and "max_tokens" in e["message"]
    r = chat(srv, stream=True, stream_options={"include_usage": True, "bogus": True})
    assert r.status_code == 400 and "bogus" in err(r)["message"]


def test_top_logprobs_without_logprobs_is_400(srv):
    r = chat(srv, top_logprobs=3)
    assert r.status_code == 400 and err(r)["param"] == "top_logprobs"


def test_n_choices_completions_and_chat(srv):
    c = client(srv)
    r = c.completions.create(model=srv.engine.model_name, prompt=["a b", "c d"], n=3, max_tokens=5,
                             temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == list(range(6))
    assert r.usage.completion_tokens == 30
    assert len({ch.text for ch in r.choices[:3]}) > 1          # seeded choices differ from each other
    again = c.completions.create(model=srv.engine.model_name, prompt=["a b", "c d"], n=3, max_tokens=5,
                                 temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]   # and are reproducible
    r = c.chat.completions.create(model=srv.engine.model_name, messages=[{"role": "user", "content": "hi"}],
                                  n=2, max_tokens=4, extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == 8
    chunks = list(c.chat.completions.create(model=srv.engine.model_name, n=2, max_tokens=3, stream=True,
                                            messages=[{"role": "user", "content": "hi"}],
                                            extra_body={"ignore_eos": True}))
    roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role]
    assert sorted(roles) == [0, 1]
    all_free(srv)


def test_echo(srv):
    c = client(srv)
    r = c.completions.create(model=srv.engine.model_name, prompt="echo this", echo=True, max_tokens=3,
                             temperature=0)
    plain = c.completions.create(model=srv.engine.model_name, prompt="echo this", max_tokens=3, temperature=0)
    assert r.choices[0].text == "echo this" + plain.choices[0].text
    s = "".join(ch.choices[0].text for ch in c.completions.create(
        model=srv.engine.model_name, prompt="echo this", echo=True, max_tokens=3, temperature=0, stream=True))
    assert s == r.choices[0].text
    bad = complete(srv, echo=True, logprobs=1)
    assert bad.status_code == 400 and err(bad)["param"] == "echo"


def test_logit_bias_and_min_tokens(srv):
    eos = srv.engine.eos_token_ids[0]
    target = srv.engine.encode("zebra")[-1]
    r = complete(srv, max_tokens=5, logit_bias={str(target): 100})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    toks = r.json()["usage"]["completion_tokens"]
    out = complete(srv, max_tokens=5, logit_bias={str(target): 100}, logprobs=1).json()["choices"][0]
    assert out["logprobs"]["tokens"] == [srv.engine.tokenizer.token_str(target)] * toks
    # eos forced: it ends at once, unless min_tokens holds it back
    r = complete(srv, max_tokens=20, logit_bias={str(eos): 100}).json()
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop"
    r = complete(srv, max_tokens=20, min_tokens=6, logit_bias={str(eos): 100}).json()
    assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "stop"
    all_free(srv)


def test_penalties_change_greedy_output(srv):
    base = {"prompt": "the the the the the", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    def ids(**kw) -> list[str]:
        r = post(srv, "/v1/completions", json={**base, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]
    plain = ids()
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.8}):
        pen = ids(**kw)
        assert len(set(pen)) > len(set(plain)), (kw, plain, pen)   # fewer repeats
    assert ids(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0) == plain
    all_free(srv)


def test_continuous_usage_stats(srv):
    c = client(srv)
    chunks = list(c.completions.create(model=srv.engine.model_name, prompt="count", max_tokens=6, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    used = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert used == sorted(used) and used[-1] == 6 and all(u is not None for u in used)
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_get_model_by_id(srv):
    c = client(srv)
    m = c.models.retrieve(srv.engine.model_name)
    assert m.id == srv.engine.model_name
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")


# ---------------------------------------------------------------------------------------------- max_model_len

def test_max_model_len_defaults_to_the_model_and_is_refused_above(tiny_llama):  # noqa: F811
    from kvtune_engine.config import ConfigError
    from conftest_engine import build_engine
    ctx = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    with run_server(tiny_llama, max_model_len=None, kv_cache_memory=0.02) as s:
        assert s.engine.config.max_model_len == ctx
        assert client(s).models.retrieve(s.engine.model_name).model_extra["max_model_len"] == ctx
        r = complete(s, prompt=[5] * (ctx + 100), max_tokens=1)
        assert r.status_code == 400 and str(ctx) in err(r)["message"]
    with pytest.raises(ConfigError, match=rf"max_model_len {ctx + 1} exceeds .*max_position_embeddings {ctx}"):
        build_engine(tiny_llama, max_model_len=ctx + 1)


# ---------------------------------------------------------------------------------------------- fixes 7-12

@pytest.mark.parametrize("raw", [
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "\\ud800 lone", "max_tokens": 2}',
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": "hi", "max_tokens": NaN}',
    b'{"prompt": "hi", "temperature": 1e999}',
])
def test_malformed_input_is_openai_4xx(srv, raw):
    r = post(srv, "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert set(err(r)) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("kw", [
    {"messages": [{"role": "user", "content": "\ud800"}]},
    {"chat_template_kwargs": {"add_generation_prompt": False}},
    {"chat_template_kwargs": {"messages": []}},
    {"chat_template_kwargs": {"bos_token": "x"}},
    {"messages": [{"role": "user", "content": "hi"}], "stop": ["\udfff"]},
])
def test_malformed_chat_is_openai_400(srv, kw):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}
    raw = json.dumps(body).encode()        # json.dumps writes lone surrogates as \\ud800 escapes
    r = post(srv, "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(err(r)) == {"message", "type", "param", "code"}
    all_free(srv)


def test_tiny_temperature_is_greedy(srv):
    greedy = complete(srv, prompt="tiny temperature", max_tokens=12, temperature=0, ignore_eos=True).json()
    for t in (1e-39, 1e-30, 1e-6):
        r = complete(srv, prompt="tiny temperature", max_tokens=12, temperature=t, ignore_eos=True).json()
        assert r["choices"][0]["text"] == greedy["choices"][0]["text"] and r["usage"]["completion_tokens"] == 12


def test_chat_role_chunk_goes_out_with_the_first_token(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, max_num_seqs=1) as s:
        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                blocker = asyncio.create_task(c.post(s.url + "/v1/completions", json={
                    "prompt": "hold the engine", "max_tokens": 150, "temperature": 0, "ignore_eos": True}))
                while s.engine.scheduler.num_running == 0:
                    await asyncio.sleep(0.005)
                events = []
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
                async with c.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            events.append((time.monotonic(), json.loads(line[6:])))
                b = await blocker
                return events, b
        events, blocker = asyncio.run(go())
        assert blocker.status_code == 200
        (t_role, role), (t_first, first) = events[0], events[1]
        assert role["choices"][0]["delta"]["role"] == "assistant"
        assert "role" not in first["choices"][0]["delta"]
        assert t_first - t_role < 0.05                  # sent together, once the request runs


def test_sampled_token_always_in_top_logprobs_and_text_offset_matches_text(srv):
    eng = srv.engine
    target = eng.encode("zebra")[-1]
    out = complete(srv, max_tokens=4, logprobs=1, logit_bias={str(target): 30}, ignore_eos=True).json()["choices"][0]
    lp = out["logprobs"]
    for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert tok in top
    # special tokens add no characters to text: offsets index the text itself
    eos = eng.eos_token_ids[0]
    out = complete(srv, max_tokens=4, logprobs=0, ignore_eos=True, logit_bias={str(eos): 100}).json()["choices"][0]
    assert out["text"] == "" and out["logprobs"]["text_offset"] == [0, 0, 0, 0]
    out = complete(srv, prompt="offsets", max_tokens=10, logprobs=0, temperature=0).json()["choices"][0]
    offs, text = out["logprobs"]["text_offset"], out["text"]
    assert offs == sorted(offs) and all(0 <= o <= len(text) for o in offs)
    pieces = [text[a:b] for a, b in zip(offs, offs[1:] + [len(text)])]
    assert "".join(pieces) == text
    all_free(srv)


def test_disconnect_logged_at_debug_not_error(srv):
    records: list[logging.LogRecord] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record)
    h = Grab(level=logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "kvtune", "")]
    for lg in loggers:
        lg.addHandler(h)
    try:
        for _ in range(5):
            with pytest.raises(httpx.ReadTimeout):  # the client leaves mid-generation (500 tokens take > 0.1 s)
                post(srv, "/v1/completions", timeout=0.1, json={"prompt": "bye", "max_tokens": 500,
                                                                "ignore_eos": True, "temperature": 0})
        all_free(srv)
    finally:
        for lg in loggers:
            lg.removeHandler(h)
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]


# ---------------------------------------------------------------------------------------------- loop death

_DYING_SERVE = """
import sys
from kvtune_engine.runner.model_runner import ModelRunner
real = ModelRunner.execute
calls = [0]
def execute(self, batch):
    calls[0] += 1
    if calls[0] > 3:
        raise RuntimeError("injected runner fault (a CUDA error, say)")
    return real(self, batch)
ModelRunner.execute = execute
from kvtune_engine.server.cli import serve
serve(sys.argv[1:])
"""


def test_engine_loop_death_exits_the_process_non_zero(tiny_llama, tmp_path):  # noqa: F811
    """A fault no request can be blamed for (here: the forward pass) stops the loop; the process
    then exits non-zero so that Kubernetes restarts it, instead of answering 503 forever."""
    import subprocess
    import sys
    port = free_port()
    script = tmp_path / "dying_serve.py"
    script.write_text(_DYING_SERVE)
    p = subprocess.Popen([sys.executable, str(script), "--model", str(tiny_llama), "--port", str(port),
                          "--host", "127.0.0.1", "--kv-cache-memory", "0.004", "--max-model-len", "256",
                          "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read() if p.poll() is not None else ""
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 20, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 500 and "engine loop failed" in r.json()["error"]["message"]
        rc = p.wait(timeout=30)
        out = p.stdout.read()
        assert rc != 0
        assert "injected runner fault" in out.splitlines()[-1], out[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
