"""`kvtune serve --admin-port`: the real process on two ports. /metrics and the admin API answer on
the admin port only, the OpenAI API on the API port only, /health on both, so that a NetworkPolicy
(which sees ports, not paths) can admit API clients to one port and only Prometheus and the operator
to the other."""
from __future__ import annotations

import os
import subprocess

import httpx
import pytest
from conftest_engine import tiny_llama  # noqa: F401  (fixture)
from test_serve_startup_failure import KVTUNE, free_port

from tests.vllm.server import spawn_logged, wait_healthy

pytestmark = pytest.mark.slow
KEY = "admin-port-key"


@pytest.fixture(scope="module")
def two_ports(tiny_llama, tmp_path_factory):  # noqa: F811
    api, admin = free_port(), free_port()
    log = tmp_path_factory.mktemp("admin-port") / "serve.log"
    p = spawn_logged([KVTUNE, "serve", "--model", str(tiny_llama), "--host", "127.0.0.1", "--port", str(api),
                      "--admin-port", str(admin), "--admin-key", KEY, "--served-model-name", "tiny",
                      "--max-model-len", "256", "--max-num-batched-tokens", "256", "--swap-space", "0",
                      "--kv-cache-memory", "0.01"], {**os.environ, "OMP_NUM_THREADS": "1"}, log)
    try:
        wait_healthy(p, f"http://127.0.0.1:{api}", 120, "kvtune serve --admin-port", lambda: log.read_text()[-3000:])
        yield f"http://127.0.0.1:{api}", f"http://127.0.0.1:{admin}", admin
    finally:
        p.terminate()
        p.wait(30)


def test_the_api_port_serves_the_api_and_not_the_admin_api_or_metrics(two_ports):
    api, _, admin_port = two_ports
    r = httpx.post(api + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(api + "/health").status_code == 200
    for path in ("/metrics", "/kvtune/v1/state", "/kvtune/v1/trace", "/kvtune/v1/config"):
        r = httpx.get(api + path, headers={"Authorization": f"Bearer {KEY}"})  # the key does not matter
        assert r.status_code == 404, (path, r.text)
        assert f"served on the admin port {admin_port}" in r.json()["error"]["message"]
    r = httpx.patch(api + "/kvtune/v1/config", json={"max_num_seqs": 1}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404


def test_the_admin_port_serves_metrics_and_the_admin_api_only(two_ports):
    _, admin, admin_port = two_ports
    m = httpx.get(admin + "/metrics")
    assert m.status_code == 200 and "vllm:num_requests_waiting" in m.text
    assert httpx.get(admin + "/health").status_code == 200
    assert httpx.get(admin + "/kvtune/v1/state").status_code == 401  # still behind the admin key
    good = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(admin + "/kvtune/v1/state", headers=good).json()["config"]["max_num_seqs"] > 0
    r = httpx.patch(admin + "/kvtune/v1/config", json={"max_num_seqs": 3}, headers=good)
    assert r.status_code == 200 and httpx.get(admin + "/kvtune/v1/config", headers=good).json()["config"][
        "max_num_seqs"] == 3
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, admin + path, json={"model": "tiny", "prompt": "x"} if method == "POST" else None)
        assert r.status_code == 404, (path, r.text)
        assert f"admin port {admin_port} serves /metrics" in r.json()["error"]["message"]


def test_the_admin_port_must_differ_from_the_api_port(tiny_llama):  # noqa: F811
    port = free_port()
    r = subprocess.run([KVTUNE, "serve", "--model", str(tiny_llama), "--port", str(port), "--admin-port", str(port)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"--admin-port {port} is the API port too" in r.stderr, r.stderr
