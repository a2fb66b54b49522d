"""The OpenAI-compatible API, through the official `openai` client against a real uvicorn server."""
from __future__ import annotations

import openai
import pytest
from conftest_engine import run_server, tiny_llama  # noqa: F401  (fixture)

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def srv(tiny_llama):  # noqa: F811
    with run_server(tiny_llama) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60)


def test_models(client, srv):
    models = client.models.list()
    assert [m.id for m in models.data] == [srv.engine.model_name]


def test_completion_max_tokens_and_usage(client, srv):
    r = client.completions.create(model=srv.engine.model_name, prompt=PROMPT, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    ch = r.choices[0]
    assert ch.finish_reason == "length"
    n_prompt = len(srv.engine.encode(PROMPT))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == n_prompt + 7
    assert isinstance(ch.text, str)


def test_greedy_is_deterministic_and_matches_offline(client, srv, tiny_llama):  # noqa: F811
    kw = dict(model=srv.engine.model_name, prompt=PROMPT, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    from kvtune_engine.core.request import SamplingParams
    from kvtune_engine.llm import LLM
    from conftest_engine import build_engine
    llm = LLM.from_engine(build_engine(tiny_llama))
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out.text == a


def test_streaming_completion_equals_non_streaming(client, srv):
    kw = dict(model=srv.engine.model_name, prompt=PROMPT, max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_streaming_without_include_usage_still_reports_usage(client, srv):
    chunks = list(client.completions.create(model=srv.engine.model_name, prompt=PROMPT, max_tokens=4,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_chat(client, srv):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    r = client.chat.completions.create(model=srv.engine.model_name, messages=msgs, max_tokens=9, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 9
    expected_prompt = len(srv.engine.raw_tokenizer.encode_chat(msgs))
    assert r.usage.prompt_tokens == expected_prompt
    # streaming: same text, role first, usage at the end
    chunks = list(client.chat.completions.create(model=srv.engine.model_name, messages=msgs, max_tokens=9,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == expected_prompt


def _stop_candidate(text: str) -> str | None:
    # a short run of ASCII letters well inside the text, to use as a stop string
    for i in range(2, len(text) - 3):
        s = text[i:i + 2]
        if s.isascii() and s.isalpha():
            return s
    return None


def test_stop_string(client, srv):
    kw = dict(model=srv.engine.model_name, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=40, **kw).choices[0].text
    stop = _stop_candidate(full)
    assert stop is not None, full
    expect = full[:full.index(stop)]
    r = client.completions.create(max_tokens=40, stop=[stop], **kw)
    assert r.choices[0].text == expect
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    # streaming never leaks the stop string, even partially
    chunks = list(client.completions.create(max_tokens=40, stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expect
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(client, srv):
    r = client.completions.create(model=srv.engine.model_name, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and len(lp.tokens) == 5
    for best, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        assert best <= 0.0
        assert abs(max(top.values()) - best) < 1e-4  # greedy: the sampled token is the best one


def test_seeded_sampling_reproducible(client, srv):
    kw = dict(model=srv.engine.model_name, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_batch_prompts(client, srv):
    r = client.completions.create(model=srv.engine.model_name, prompt=[PROMPT, "Hello"], max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 6


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_blocks_return_after_requests(srv):
    st = srv.wait_idle()
    b = st["blocks"]
    assert b["used"] == 0
    assert b["free"] + b["reserved"] + b["cached"] == b["total"]


def test_api_key(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, api_key="sekret") as s:
        ok = openai.OpenAI(base_url=s.v1, api_key="sekret", max_retries=0)
        assert ok.completions.create(model=s.engine.model_name, prompt="a", max_tokens=1).choices
        bad = openai.OpenAI(base_url=s.v1, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=s.engine.model_name, prompt="a", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        # health, metrics and the admin API are not behind the key (probes and Prometheus)
        assert s.get_json("/health")["status"] == "ok"
        assert "kvtune_kv_usage_ratio" in s.get_text("/metrics")


def test_streams_one_chunk_per_token_even_without_text(client, srv):
    """A token whose text is held back (incomplete UTF-8, a possible stop string, an id the
    tokenizer renders as nothing) still gets its chunk, as vLLM sends it: a client timing tokens by
    chunks (every serving benchmark does) sees each step."""
    kw = dict(model=srv.engine.model_name, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in client.completions.create(prompt=PROMPT, stop=["zzzz"], **kw) if c.choices]
    assert len(chunks) == 24
    chat = [c for c in client.chat.completions.create(messages=[{"role": "user", "content": "Say hi."}], **kw)
            if c.choices and c.choices[0].delta.role is None]
    assert len(chat) == 24
