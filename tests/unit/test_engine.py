"""LLMEngine loop glue with the real tokenizer and scheduler and a scripted runner (no model)."""
from __future__ import annotations

import pytest
from conftest_engine import scripted_engine, tiny_llama  # noqa: F401  (fixture)

from kvtune_engine.config import ConfigError
from kvtune_engine.core.request import SamplingParams
from kvtune_engine.engine import InvalidRequest, RestartRequired

PROMPT = [1, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def tok(tiny_llama):  # noqa: F811
    from kvtune_engine.model import load_tokenizer
    return load_tokenizer(tiny_llama)


def run(eng, rid: str):
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_incremental_detokenization_multibyte(tiny_llama, tok):  # noqa: F811
    text = "héllo wörld — 日本語 ok 🙂 done"
    ids = ids_of(tok, text)
    eng = scripted_engine(tiny_llama, {"r": ids + [tok.eos_token_id]})
    eng.add_request(PROMPT, SamplingParams(max_tokens=200, temperature=0), request_id="r")
    outs = run(eng, "r")
    final = outs[-1]
    assert final.finished and final.finish_reason == "stop"
    assert final.text == tok.decode(ids) == text
    assert "".join(o.delta_text for o in outs) == text
    assert all("\ufffd" not in o.delta_text for o in outs)
    assert final.token_ids == ids + [tok.eos_token_id]
    assert final.stop_reason == tok.eos_token_id
    assert eng.scheduler.kv.pool.num_used == 0


def test_stop_string_cut_and_never_streamed(tiny_llama, tok):  # noqa: F811
    ids = ids_of(tok, "Hello world. STOP here and more words after it")
    eng = scripted_engine(tiny_llama, {"r": ids})
    eng.add_request(PROMPT, SamplingParams(max_tokens=len(ids), temperature=0, stop=["STOP", "nothere"]),
                    request_id="r")
    outs = run(eng, "r")
    assert outs[-1].text == "Hello world. "
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "STOP"
    assert "".join(o.delta_text for o in outs) == "Hello world. "
    assert len(outs[-1].token_ids) < len(ids)
    # the scheduler let the request go: its blocks are free
    assert eng.scheduler.kv.pool.num_used == 0 and not eng.scheduler.has_unfinished()


def test_stop_string_earliest_wins_and_at_end(tiny_llama, tok):  # noqa: F811
    ids = ids_of(tok, "abc def ghi")
    eng = scripted_engine(tiny_llama, {"a": ids, "b": ids})
    eng.add_request(PROMPT, SamplingParams(max_tokens=len(ids), temperature=0, stop=["ghi", "def"]),
                    request_id="a")
    # a stop string completed by the very last allowed token still counts (stop beats length)
    eng.add_request(PROMPT, SamplingParams(max_tokens=len(ids), temperature=0, stop=["ghi"]), request_id="b")
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["a"][-1].text == "abc " and outs["a"][-1].stop_reason == "def"
    assert outs["b"][-1].text == "abc def " and outs["b"][-1].finish_reason == "stop"


def test_stop_token_ids_eos_and_ignore_eos(tiny_llama, tok):  # noqa: F811
    ids = ids_of(tok, "one two three four five")
    eos = tok.eos_token_id
    script = ids[:3] + [eos] + ids[3:]
    eng = scripted_engine(tiny_llama, {"eos": script, "ign": script, "stid": ids, "len": ids})
    eng.add_request(PROMPT, SamplingParams(max_tokens=50, temperature=0), request_id="eos")
    eng.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), request_id="ign")
    eng.add_request(PROMPT, SamplingParams(max_tokens=50, temperature=0, stop_token_ids=[ids[2]]), request_id="stid")
    eng.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0), request_id="len")
    fin = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                fin[o.request_id] = o
    assert fin["eos"].finish_reason == "stop" and fin["eos"].token_ids == script[:4]
    assert fin["eos"].text == tok.decode(ids[:3])
    assert fin["ign"].finish_reason == "length" and len(fin["ign"].token_ids) == 6
    assert fin["stid"].finish_reason == "stop" and fin["stid"].stop_reason == ids[2]
    assert fin["stid"].token_ids == ids[:3]
    assert fin["len"].finish_reason == "length" and len(fin["len"].token_ids) == 2


def test_abort_frees_blocks(tiny_llama, tok):  # noqa: F811
    eng = scripted_engine(tiny_llama, default=[50])
    eng.add_request(list(range(2, 60)), SamplingParams(max_tokens=100, temperature=0), request_id="x")
    eng.step()
    assert eng.scheduler.kv.pool.num_used > 0
    out = eng.abort("x")
    assert out.finished and out.finish_reason == "abort"
    assert eng.scheduler.kv.pool.num_used == 0 and not eng.has_unfinished()
    assert eng.abort("x") is None
    assert eng.snapshot()["counters"]["requests_finished"] == {"abort": 1}


def test_validation_names_the_field(tiny_llama):  # noqa: F811
    eng = scripted_engine(tiny_llama, default=[50])
    for field, kw in [("temperature", {"temperature": -1.0}), ("top_p", {"top_p": 0.0}), ("top_k", {"top_k": 0}),
                      ("max_tokens", {"max_tokens": 0}), ("logprobs", {"logprobs": 21}),
                      ("stop", {"stop": [""]}), ("stop_token_ids", {"stop_token_ids": [10**6]}),
                      ("seed", {"seed": 1.5})]:
        with pytest.raises(InvalidRequest) as e:
            eng.add_request(PROMPT, SamplingParams(**kw))
        assert e.value.field == field and field in str(e.value)
    with pytest.raises(InvalidRequest, match="max_model_len"):
        eng.add_request([5] * 600, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="whole KV cache"):   # 64 blocks x 16 = 1024 > max_model_len 512?
        scripted_engine(tiny_llama, num_blocks=4).add_request([5] * 100, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        eng.add_request([10**6], SamplingParams(max_tokens=1))
    assert not eng.has_unfinished() and eng.scheduler.kv.pool.num_used == 0


def test_update_config_live_restart_bad(tiny_llama):  # noqa: F811
    eng = scripted_engine(tiny_llama, default=[50], max_num_seqs=4)
    assert eng.update_config({"max_num_seqs": 8, "watermark": 0.05}) == {"max_num_seqs": [4, 8],
                                                                          "watermark": [0.01, 0.05]}
    assert eng.config.max_num_seqs == 8 == eng.scheduler.config.max_num_seqs
    assert eng.update_config({"max_num_seqs": 8}) == {}
    with pytest.raises(RestartRequired) as e:
        eng.update_config({"swap_space": 1.0, "max_num_seqs": 2})
    assert "swap_space" in str(e.value) and eng.config.max_num_seqs == 8
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        eng.update_config({"max_num_batched_tokens": 4})
    with pytest.raises(ConfigError, match="unknown"):
        eng.update_config({"foo": 1})
    with pytest.raises(ConfigError):
        eng.update_config({"block_size": 17})  # an invalid value is a 400, not a 409
    # the engine keeps the scheduler's config and its own in step
    assert eng.config == eng.scheduler.config


def test_trace_ring_bounded_and_prefix_groups(tiny_llama):  # noqa: F811
    eng = scripted_engine(tiny_llama, default=[50, 51, 52])
    from kvtune_engine.sim.trace_recorder import TraceRecorder
    eng.outputs.recorder = TraceRecorder(eng.config.block_size, capacity=5, hash_tokens=eng.config.block_size)
    sys_prompt = list(range(100, 140))  # 40 shared tokens
    for i in range(3):
        eng.add_request(sys_prompt + [200 + i] * (i + 1), SamplingParams(max_tokens=3, temperature=0))
    for i in range(4):
        eng.add_request([300 + i] * 5, SamplingParams(max_tokens=2, temperature=0))
    while eng.has_unfinished():
        eng.step()
    t = eng.trace()
    assert t["recorded_total"] == 7 and t["dropped_total"] == 2 and len(t["requests"]) == 5
    chained = [r for r in eng.trace(limit=None)["requests"] if "hash_ids" in r]
    bs = eng.config.block_size   # whole blocks only: 40 shared tokens are told as 32 (issue 23)
    assert len(chained) >= 1 and all(r["hash_block"] == bs for r in chained)
    assert len({r["hash_ids"][:40 // bs] for r in chained if r["prompt_tokens"] > 40}) == 1
    for r in t["requests"]:
        assert set(r) <= {"arrival_s", "prompt_tokens", "output_tokens", "hash_ids", "hash_block"}


def test_multiple_eos_ids_all_stop(tiny_llama, tok):  # noqa: F811
    ids = ids_of(tok, "alpha beta gamma")
    eng = scripted_engine(tiny_llama, {"r": ids[:2] + [7] + ids[2:]})
    eng.eos_token_ids = [tok.eos_token_id, 7]
    eng.add_request(PROMPT, SamplingParams(max_tokens=20, temperature=0), request_id="r")
    out = run(eng, "r")[-1]
    assert out.finish_reason == "stop" and out.token_ids == ids[:2] + [7]


def test_final_only_request_yields_its_finished_output_alone(tiny_llama, tok):  # noqa: F811
    """A client that does not stream gets one output, the finished one, with the same text, tokens,
    offsets and stop as a streaming client's last; the streaming request beside it still gets one
    output per step (the server's event loop wakes per step only for streams)."""
    ids = ids_of(tok, "Hello world. STOP here and more words after it")
    eng = scripted_engine(tiny_llama, {"s": ids, "f": ids})
    for rid, final_only in (("s", False), ("f", True)):
        eng.add_request(PROMPT, SamplingParams(max_tokens=len(ids), temperature=0, stop=["STOP"],
                                               final_only=final_only), request_id=rid)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    streamed = [o for o in outs if o.request_id == "s"]
    final = [o for o in outs if o.request_id == "f"]
    assert len(streamed) > 3 and len(final) == 1 and final[0].finished
    a, b = streamed[-1], final[0]
    assert (b.text, b.token_ids, b.text_offsets, b.finish_reason, b.stop_reason) == \
        (a.text, a.token_ids, a.text_offsets, a.finish_reason, a.stop_reason) == \
        (a.text, a.token_ids, a.text_offsets, "stop", "STOP")
    assert b.text == "Hello world. " and b.delta_text == b.text
    assert eng.scheduler.kv.pool.num_used == 0
