"""`kvtune serve --simulate PROFILE`: the real server, engine and scheduler over a runner that sleeps
each step's profile cost. One real process on a loopback port, driven by the official openai client."""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from kvtune_engine.sim.profiles import load_profile  # noqa: E402
from kvtune_operator.demo.engine import free_port  # noqa: E402

PROFILE = "h200-qwen3-0.6b"


def _http(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvtune_engine.server.cli", "--simulate", PROFILE,
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            pytest.fail(f"kvtune serve --simulate exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if _http(base + "/health")[0] == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("kvtune serve --simulate did not become healthy")
        time.sleep(0.2)
    yield proc, base
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _state(base: str) -> dict:
    return json.loads(_http(base + "/kvtune/v1/state")[1])


def _client(base: str):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_state_says_simulated_and_sizes_blocks_from_the_profile_device(server):
    _, base = server
    s = _state(base)
    assert s["simulated"] == PROFILE
    assert s["model"] == PROFILE
    profile = load_profile(PROFILE)
    from kvtune_engine.config import EngineConfig
    want = profile.kv_cache_size(EngineConfig.build(**{k: v for k, v in s["config"].items()}))
    assert s["num_blocks"] == want.num_blocks and s["num_swap_blocks"] == want.num_swap_blocks
    assert s["memory"]["device_total"] == profile.device_total_bytes


def test_openai_client_completions_and_chat_exact_lengths(server):
    _, base = server
    c = _client(base)
    r = c.completions.create(model=PROFILE, prompt="hello simulated world", max_tokens=37)
    assert r.usage.completion_tokens == 37 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len("hello simulated world".encode())
    assert len(r.choices[0].text) == 37            # one ASCII byte per token

    chunks = list(c.completions.create(model=PROFILE, prompt="hi", max_tokens=25, stream=True,
                                       stream_options={"include_usage": True}))
    assert len("".join(ch.choices[0].text for ch in chunks if ch.choices)) == 25
    assert [ch.usage.completion_tokens for ch in chunks if ch.usage] == [25]

    r = c.chat.completions.create(model=PROFILE, messages=[{"role": "user", "content": "hi"}], max_tokens=19)
    assert r.usage.completion_tokens == 19 and len(r.choices[0].message.content) == 19

    chunks = list(c.chat.completions.create(model=PROFILE, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=23, stream=True, stream_options={"include_usage": True}))
    assert len("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)) == 23
    assert [ch.usage.completion_tokens for ch in chunks if ch.usage] == [23]


def test_metrics_have_kvtune_and_vllm_names(server):
    _, base = server
    status, text = _http(base + "/metrics")
    assert status == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "kvtune_kv_blocks", "kvtune_kv_usage_ratio"):
        assert name in text, name


def test_live_knob_applies_and_restart_knob_is_refused(server):
    _, base = server
    status, body = _http(base + "/kvtune/v1/config", "PATCH", {"max_num_seqs": 100})
    assert status == 200, body
    assert _state(base)["config"]["max_num_seqs"] == 100
    status, body = _http(base + "/kvtune/v1/config", "PATCH", {"block_size": 32})
    assert status == 409, body
    assert _http(base + "/kvtune/v1/config", "PATCH", {"max_num_seqs": 256})[0] == 200


def test_burst_queues_behind_the_sequence_cap(server):
    _, base = server
    assert _http(base + "/kvtune/v1/config", "PATCH", {"max_num_seqs": 2})[0] == 200
    c = _client(base)
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(c.completions.create, model=PROFILE, prompt=f"burst {i}", max_tokens=300)
                    for i in range(6)]
            seen = None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(f.done() for f in futs):
                s = _state(base)
                if s["queues"]["waiting"] > 0 and s["queues"]["running"] <= 2 \
                        and s["recent_waiting_reasons"].get("max_num_seqs", 0) > 0:
                    seen = s
                    break
                time.sleep(0.02)
            assert [f.result().usage.completion_tokens for f in futs] == [300] * 6
        assert seen is not None, "no state showed requests waiting on max_num_seqs"
        assert seen["waiting_cause"] == "max_num_seqs"
    finally:
        _http(base + "/kvtune/v1/config", "PATCH", {"max_num_seqs": 256})


def test_steps_sleep_their_cost_and_use_little_cpu(server):
    proc, base = server
    profile = load_profile(PROFILE)
    n, length = 8, 400
    c = _client(base)
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
        outs = list(pool.map(lambda i: c.completions.create(model=PROFILE, prompt=f"load {i}", max_tokens=length),
                             range(n)))
        wall, cpu = time.monotonic() - t0, _cpu_s(proc.pid) - cpu0
    assert [o.usage.completion_tokens for o in outs] == [length] * n
    # every request samples one token per step, so at least `length` decode steps ran, each costing at
    # least the profile's floor (overhead + one read of the weights): the engine really slept them
    floor = length * (profile.step_overhead_s + profile.weights_read_s)
    assert wall >= floor, (wall, floor)
    # sleeping, not computing: the server process used well under half a core meanwhile
    assert cpu / wall < 0.5, (cpu, wall)
    print(f"simulated load: {n} x {length} tokens in {wall:.2f} s wall, server CPU {cpu:.2f} s "
          f"({100 * cpu / wall:.0f}% of one core), decode floor {floor:.2f} s")
