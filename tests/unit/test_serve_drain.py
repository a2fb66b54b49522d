"""A stopping `kvtune serve` (SIGTERM: a rollout's old pod, after its preStop sleep) takes no new
request and finishes every one it holds, running or queued, within --shutdown-timeout: a restart
change fails no request."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from conftest_engine import tiny_llama  # noqa: F401  (fixture)
from test_serve_startup_failure import KVTUNE, free_port

from tests.vllm.server import spawn_logged, wait_healthy

pytestmark = pytest.mark.slow


def test_sigterm_drains_running_and_queued_requests_then_refuses_new_ones(tiny_llama, tmp_path):  # noqa: F811
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    p = spawn_logged([KVTUNE, "serve", "--model", str(tiny_llama), "--host", "127.0.0.1", "--port", str(port),
                      "--served-model-name", "tiny", "--max-model-len", "512", "--max-num-seqs", "1",
                      "--swap-space", "0", "--kv-cache-memory", "0.01", "--shutdown-timeout", "60"],
                     {**os.environ, "OMP_NUM_THREADS": "1"}, log)
    try:
        wait_healthy(p, url, 120, "kvtune serve", lambda: log.read_text()[-3000:])
        results: list[tuple[float, httpx.Response | Exception]] = []

        def send() -> None:
            try:
                r = httpx.post(url + "/v1/completions", timeout=120, json={
                    "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True})
            except Exception as e:  # noqa: BLE001 - the assertion shows it
                r = e
            results.append((time.monotonic(), r))

        threads = [threading.Thread(target=send) for _ in range(12)]
        for t in threads:
            t.start()
        # the stop comes while one runs and others wait on the sequence cap (on a fast machine the
        # first may finish before the last arrives: whatever is queued at the signal must finish)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = httpx.get(url + "/metrics").text
            running = next(float(x.split()[-1]) for x in m.splitlines() if x.startswith("vllm:num_requests_running"))
            waiting = next(float(x.split()[-1]) for x in m.splitlines() if x.startswith("vllm:num_requests_waiting{"))
            if running == 1 and waiting >= 4 and running + waiting + len(results) == 12:
                break
            time.sleep(0.02)
        assert running == 1 and waiting >= 4, (running, waiting, len(results))
        stopped_at = time.monotonic()
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 1}, timeout=5)
        for t in threads:
            t.join(120)
        # uvicorn exits by the signal it was given, once the server has shut down
        assert p.wait(60) in (0, -signal.SIGTERM), log.read_text()[-3000:]
        assert "Application shutdown complete" in log.read_text()
        assert len(results) == 12
        for _, r in results:
            assert isinstance(r, httpx.Response) and r.status_code == 200, r
            assert r.json()["usage"]["completion_tokens"] == 480 and r.json()["choices"][0]["finish_reason"] == "length"
        # every request queued at the signal ran whole after it (one at a time: the cap is 1)
        after = sorted(t for t, _ in results if t > stopped_at)
        assert len(after) >= running + waiting, (len(after), running, waiting)
        print(f"drained {len(after)} requests in {after[-1] - stopped_at:.1f} s")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
