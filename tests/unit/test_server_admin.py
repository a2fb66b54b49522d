"""Admin API (/kvtune/v1/state, trace, config), the watched config file, and client disconnects."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import yaml
from conftest_engine import run_server, tiny_llama  # noqa: F401  (fixture)

from kvtune_engine.config import LIVE_KNOBS, RESTART_KNOBS, EngineConfig


@pytest.fixture(scope="module")
def srv(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, max_num_seqs=4) as s:
        yield s


def _complete(url: str, prompt, max_tokens: int = 4, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True, **kw}, timeout=60)


def test_state_shape(srv):
    st = srv.state()
    assert st["config"] == srv.engine.config.model_dump()
    b = st["blocks"]
    assert set(b) >= {"total", "free", "used", "cached", "reserved"}
    assert b["free"] + b["used"] + b["cached"] + b["reserved"] == b["total"] == st["num_blocks"]
    assert set(st["queues"]) == {"running", "waiting", "swapped"}
    assert set(st["swap"]) >= {"total", "used"}
    assert "waiting_cause" in st and "head" in st
    assert set(st["waiting_reason_steps"]) >= {"none", "max_num_seqs", "token_budget", "kv_blocks", "watermark"}
    assert "window_steps" in st["recent_waiting_reasons"]
    assert set(st["preemptions"]) == {"swap", "recompute", "swap_full"}
    assert set(st["memory"]) >= {"weights", "kv_cache", "swap", "device_total"}
    assert 0.0 <= st["kv_usage_ratio"] <= 1.0


def test_state_head_while_blocked(tiny_llama):  # noqa: F811
    # one sequence at a time: while the first runs, the head of the queue waits on max_num_seqs
    with run_server(tiny_llama, max_num_seqs=1) as s:
        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": "hello there", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
                tasks = [asyncio.create_task(c.post(s.url + "/v1/completions", json=body)) for _ in range(2)]
                head = None
                for _ in range(400):
                    st = (await c.get(s.url + "/kvtune/v1/state")).json()
                    if st["head"] is not None and st["queues"]["running"] == 1:
                        head = st
                        break
                    await asyncio.sleep(0.01)
                await asyncio.gather(*tasks)
                return head
        st = asyncio.run(go())
        assert st is not None, "never saw a waiting head"
        head = st["head"]
        assert head["queue"] == "waiting"
        assert head["cause"] == "max_num_seqs"
        assert head["needed_blocks"] >= 1 and head["needed_tokens"] >= 1
        assert st["waiting_reason_steps"]["max_num_seqs"] > 0


def test_trace_unfinished_lists_the_requests_still_in_the_engine(tiny_llama):  # noqa: F811
    # one sequence at a time: while the first runs, the second waits; the tuner's replays need both
    # (the finished requests alone are a queue's survivors)
    with run_server(tiny_llama, max_num_seqs=1) as s:
        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": [5, 6, 7, 8], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
                tasks = [asyncio.create_task(c.post(s.url + "/v1/completions", json=body)) for _ in range(2)]
                seen = None
                for _ in range(400):
                    # since_s filters the finished requests, never the ones still in the engine
                    t = (await c.get(s.url + "/kvtune/v1/trace", params={"unfinished": "true", "since_s": 1e9})).json()
                    live = t["unfinished"]
                    if len(live) == 2 and live[0]["generated_tokens"] > 0:
                        seen = t
                        break
                    await asyncio.sleep(0.01)
                await asyncio.gather(*tasks)
                after = (await c.get(s.url + "/kvtune/v1/trace", params={"unfinished": "true"})).json()
                plain = (await c.get(s.url + "/kvtune/v1/trace")).json()
                return seen, after, plain
        seen, after, plain = asyncio.run(go())
    assert seen is not None, "never saw one request running and one waiting"
    assert seen["requests"] == []
    running, waiting = seen["unfinished"]
    assert 0 < running["generated_tokens"] < 300 and waiting["generated_tokens"] == 0
    assert running["max_tokens"] == waiting["max_tokens"] == 300
    assert running["prompt_tokens"] == waiting["prompt_tokens"] == 4
    assert "output_tokens" not in running and running["arrival_s"] <= waiting["arrival_s"]
    assert after["unfinished"] == [] and [r["output_tokens"] for r in after["requests"][-2:]] == [300, 300]
    assert "unfinished" not in plain


def test_trace_shapes_never_text(srv):
    before = srv.get_json("/kvtune/v1/trace")["recorded_total"]
    shared = "You are a helpful assistant. " * 10   # more than one 128-token chunk of the trace
    for q in ("What is one?", "What is two?"):
        assert _complete(srv.url, shared + q, max_tokens=3).status_code == 200
    assert _complete(srv.url, "unrelated words here", max_tokens=5).status_code == 200
    t = srv.get_json("/kvtune/v1/trace")
    assert t["recorded_total"] == before + 3
    reqs = t["requests"][-3:]
    for r in reqs:
        assert set(r) <= {"arrival_s", "prompt_tokens", "output_tokens", "hash_ids", "hash_block"}
        assert isinstance(r["arrival_s"], float) and r["prompt_tokens"] > 0
    assert [r["output_tokens"] for r in reqs] == [3, 3, 5]
    a, b, c = reqs   # the shared system prompt: at least one whole block with the same id; c none of them
    assert a["hash_block"] == b["hash_block"] and a["hash_ids"][0] == b["hash_ids"][0]
    assert not set(c.get("hash_ids", ())) & set(a["hash_ids"])
    assert [r["arrival_s"] for r in t["requests"]] == sorted(r["arrival_s"] for r in t["requests"])
    # JSONL, straight into `kvtune sim --trace`
    text = srv.get_text("/kvtune/v1/trace?format=jsonl&limit=2")
    assert len(text.splitlines()) == 2
    import io

    from kvtune_engine.sim.trace import read_trace
    assert [r.output_tokens for r in read_trace(io.StringIO(text))] == [3, 5]
    assert len(read_trace(io.StringIO(srv.get_text("/kvtune/v1/trace?format=jsonl")))) == len(t["requests"])
    # since: only later arrivals
    later = srv.get_json(f"/kvtune/v1/trace?since_s={b['arrival_s']}")["requests"]
    assert later and all(r["arrival_s"] > b["arrival_s"] for r in later)


def test_config_get_patch(srv):
    c = srv.get_json("/kvtune/v1/config")
    assert c["config"]["max_num_seqs"] == 4
    assert set(c["live_knobs"]) == LIVE_KNOBS and set(c["restart_knobs"]) == RESTART_KNOBS
    r = httpx.patch(srv.url + "/kvtune/v1/config", json={"max_num_seqs": 6, "watermark": 0.02})
    assert r.status_code == 200, r.text
    assert r.json()["changed"] == {"max_num_seqs": [4, 6], "watermark": [0.01, 0.02]}
    assert srv.state()["config"]["max_num_seqs"] == 6
    assert srv.engine.scheduler.config.max_num_seqs == 6
    # dashed names (the tuner's recommendation format) work too
    r = httpx.patch(srv.url + "/kvtune/v1/config", json={"max-num-seqs": 4, "enable-chunked-prefill": False})
    assert r.status_code == 200, r.text
    assert srv.get_json("/kvtune/v1/config")["config"]["enable_chunked_prefill"] is False
    # restart-only knob: 409 with a message naming it; nothing applied
    r = httpx.patch(srv.url + "/kvtune/v1/config", json={"block_size": 32, "max_num_seqs": 9})
    assert r.status_code == 409
    msg = r.json()["error"]["message"]
    assert "block_size" in msg and "restart" in msg
    assert srv.state()["config"]["max_num_seqs"] == 4
    # a restart knob with the running value is not a change
    r = httpx.patch(srv.url + "/kvtune/v1/config", json={"block_size": 16, "enable_chunked_prefill": True})
    assert r.status_code == 200 and r.json()["changed"] == {"enable_chunked_prefill": [False, True]}
    # bad values and unknown knobs: 400
    r = httpx.patch(srv.url + "/kvtune/v1/config", json={"max_num_seqs": 0})
    assert r.status_code == 400 and "max_num_seqs" in r.json()["error"]["message"]
    r = httpx.patch(srv.url + "/kvtune/v1/config", json={"max_num_sequences": 3})
    assert r.status_code == 400 and "max_num_sequences" in r.json()["error"]["message"]
    r = httpx.patch(srv.url + "/kvtune/v1/config", content=b"{nope")
    assert r.status_code == 400
    # the metrics show the effective config
    assert 'max_num_seqs="4"' in srv.get_text("/metrics")


def test_config_file_watch(tiny_llama, tmp_path):  # noqa: F811
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump({"max_num_seqs": 3, "block_size": 16}))
    with run_server(tiny_llama, config_file=path, max_num_seqs=3) as s:
        assert s.get_json("/kvtune/v1/config")["config_file"]["path"] == str(path)

        def wait_for(pred, timeout=10.0):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                c = s.get_json("/kvtune/v1/config")
                if pred(c):
                    return c
                time.sleep(0.05)
            raise AssertionError(f"config never matched: {c}")

        # a ConfigMap update: written elsewhere and renamed into place (like the kubelet's symlink swap)
        tmp = tmp_path / "new.yaml"
        tmp.write_text(yaml.safe_dump({"max_num_seqs": 7, "max_num_batched_tokens": 256, "block_size": 32,
                                       "bogus": 1}))
        tmp.replace(path)
        c = wait_for(lambda c: c["config"]["max_num_seqs"] == 7)
        assert c["config"]["max_num_batched_tokens"] == 256
        assert c["config"]["block_size"] == 16                       # restart knob: not applied...
        fs = c["config_file"]
        assert fs["pending_restart"] == {"block_size": {"running": 16, "file": 32}}   # ...but reported
        assert fs["unknown_keys"] == ["bogus"]
        assert s.engine.scheduler.config.max_num_seqs == 7
        # an invalid file is reported and changes nothing
        path.write_text("max_num_seqs: -5\n")
        c = wait_for(lambda c: c["config_file"]["error"] is not None)
        assert "max_num_seqs" in c["config_file"]["error"] and c["config"]["max_num_seqs"] == 7
        path.write_text("max_num_seqs: [\n")
        c = wait_for(lambda c: "YAML" in (c["config_file"]["error"] or ""))
        path.write_text("max_num_seqs: 5\n")
        wait_for(lambda c: c["config"]["max_num_seqs"] == 5 and c["config_file"]["error"] is None)


def test_disconnect_aborts_and_frees_blocks(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, enable_prefix_caching=False) as s:
        total = s.state()["blocks"]["total"]
        body = {"prompt": "a long story " * 10, "max_tokens": 460, "temperature": 0, "ignore_eos": True}

        async def stream_then_leave():
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}) as r:
                    n = 0
                    async for _line in r.aiter_lines():
                        n += 1
                        if n >= 3:
                            break
            # the connection is closed here, mid-stream

        async def wait_then_leave():
            async with httpx.AsyncClient(timeout=0.1) as c:
                with pytest.raises(httpx.ReadTimeout):
                    await c.post(s.url + "/v1/completions", json={**body, "prompt": [body["prompt"]] * 4})

        for leave in (stream_then_leave, wait_then_leave):
            asyncio.run(leave())
            st = s.wait_idle(timeout=20)
            assert st["blocks"]["used"] == 0
            assert st["blocks"]["free"] + st["blocks"]["reserved"] == total
        # aborted early, not run to the end
        assert s.state()["counters"]["generation_tokens"] < 5 * 460
        assert s.state()["counters"]["requests_finished"].get("abort", 0) == 5


def test_live_config_patch_affects_scheduling(srv):
    r = httpx.patch(srv.url + "/kvtune/v1/config", json={"max_num_seqs": 1})
    assert r.status_code == 200
    try:
        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": "x y z", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
                await asyncio.gather(*(c.post(srv.url + "/v1/completions", json=body) for _ in range(3)))
        before = srv.state()["waiting_reason_steps"]["max_num_seqs"]
        asyncio.run(go())
        assert srv.state()["waiting_reason_steps"]["max_num_seqs"] > before
    finally:
        httpx.patch(srv.url + "/kvtune/v1/config", json={"max_num_seqs": 4})


def test_config_is_valid_engine_config(srv):
    EngineConfig.model_validate(srv.get_json("/kvtune/v1/config")["config"])
