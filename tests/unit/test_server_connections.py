"""The real `kvtune serve` with the clients users run: a pooled client (aiohttp, one session, as
benchmark clients, gateways and SDKs keep) sees no reset connection, a refused body is answered
with its JSON error, and each connection bound (keep-alive, request-head timeout, connection cap)
holds and is logged.

Before the fix, uvicorn's 5 s keep-alive closed the burst's idle pooled connections while the client
picked them for its next streamed request: 2-5 requests of a run failed with `Connection reset by
peer` or `Server disconnected` (in 2 of 3 runs by hand with a slower model; the load here shows it
less often, the idle connection checked after it is the deterministic part); and a 24 MiB POST from urllib (which asks `Connection: close`) got a
reset instead of its 413.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest
from conftest_engine import tiny_llama  # noqa: F401  (fixture)
from test_serve_startup_failure import KVTUNE, free_port

from kvtune_engine.server import http_connection
from tests.vllm.server import spawn_logged, wait_healthy

pytestmark = pytest.mark.slow


@contextmanager
def kvtune_serve(model: Path, log: Path, *flags: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = spawn_logged([KVTUNE, "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                      "--served-model-name", "tiny", "--max-model-len", "512", "--max-num-seqs", "256",
                      "--kv-cache-memory", "0.05", *flags], {**os.environ, "OMP_NUM_THREADS": "1"}, log)
    try:
        wait_healthy(p, url, 120, "kvtune serve", lambda: log.read_text()[-3000:])
        yield url, port
    finally:
        p.terminate()
        p.wait(30)


def completion(stream: bool, prompt_len: int, max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": [7 + (i % 400) for i in range(prompt_len)], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def pooled_rounds(url: str, rounds: int, min_stream_s: float) -> tuple[int, list[str]]:
    """Each round on one pool: 256 requests at once, then 32 clients sending streamed requests back to
    back for at least ``min_stream_s`` (longer than uvicorn's 5 s keep-alive, whatever the machine's
    speed). Returns (requests answered, failures)."""
    failures: list[str] = []
    done = 0

    async def one(s: aiohttp.ClientSession, body: dict) -> None:
        nonlocal done
        try:
            async with s.post(url + "/v1/completions", json=body) as r:
                chunks = [c async for c in r.content] if body["stream"] else [await r.read()]
                if r.status != 200 or not chunks:
                    failures.append(f"status {r.status}")
                done += 1
        except aiohttp.ClientError as e:
            failures.append(f"{type(e).__name__}: {e}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=300)) as s:
        for _ in range(rounds):
            await asyncio.gather(*(one(s, completion(False, 8 + k % 48, 4 + k % 24)) for k in range(256)))
            until = time.monotonic() + min_stream_s

            async def client(k: int) -> None:
                while time.monotonic() < until:
                    await one(s, completion(True, 8 + k % 24, 64 + 8 * (k % 16)))

            await asyncio.gather(*(client(k) for k in range(32)))
    return done, failures


def read_response(c: socket.socket) -> bytes:
    """One whole response (head and its Content-Length of body) from a raw connection."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = c.recv(65536)
        assert chunk, f"the server closed the connection: {got!r}"
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    n = int(next(v for k, _, v in (ln.partition(b": ") for ln in head.split(b"\r\n")) if k.lower() == b"content-length"))
    while len(body) < n:
        chunk = c.recv(65536)
        assert chunk, f"the server closed the connection: {got!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_pooled_client_sees_no_reset_connection(tiny_llama, tmp_path):  # noqa: F811
    """Two rounds of a 256-request burst then streams of at least 8 s on one pool (the resets came
    about 11 s into the streamed phase), then an idle keep-alive connection held past uvicorn's old
    timeout. Time (about 25 s): the streams' length, which is the point."""
    log = tmp_path / "serve.log"
    with kvtune_serve(tiny_llama, log) as (url, port):
        done, failures = asyncio.run(pooled_rounds(url, rounds=2, min_stream_s=8.0))
        assert failures == [], f"{len(failures)} of {done + len(failures)} requests failed: {failures[:5]}"
        assert done >= 2 * (256 + 32)

        # an idle keep-alive connection outlives every common client pool's idle timeout (aiohttp's
        # 15 s is checked here only up to uvicorn's old 5 s plus a margin) and is announced
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head = read_response(c)
            assert head.startswith(b"HTTP/1.1 200") and b"keep-alive: timeout=120" in head.lower(), head
            time.sleep(6.5)
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(c).startswith(b"HTTP/1.1 200"), "the idle pooled connection was closed"


def post(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_refusals_before_the_body_is_read_are_answered(tiny_llama, tmp_path):  # noqa: F811
    """urllib sends the whole body before it reads and asks `Connection: close`: it reads the 413 of a
    24 MiB body and the 401 of a request without the key, each with its JSON message."""
    with kvtune_serve(tiny_llama, tmp_path / "serve.log", "--api-key", "k") as (url, _):
        big = b'{"model": "tiny", "prompt": "' + b"a" * (24 * 2**20) + b'"}'
        for _ in range(3):
            status, body = post(url + "/v1/completions", big, {"Authorization": "Bearer k"})
            assert status == 413 and body["error"]["code"] == "body_too_large", (status, body)
            assert "exceeds the limit of 4194304 bytes" in body["error"]["message"]
        status, body = post(url + "/v1/completions", b'{"model": "tiny", "prompt": "' + b"a" * 2**20 + b'"}')
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (status, body)
        # the same pooled connection goes on serving after a refusal whose body was read
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as c:
            n = 5 * 2**20
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer k\r\nContent-Length: %d\r\n\r\n" % n + b"a" * n)
            refused = read_response(c)
            assert refused.startswith(b"HTTP/1.1 413") and b"body_too_large" in refused, refused
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(c).endswith(b'{"status":"ok"}')


def test_a_slow_request_head_gets_408_and_is_logged(tiny_llama, tmp_path):  # noqa: F811
    log = tmp_path / "serve.log"
    with kvtune_serve(tiny_llama, log, "--header-timeout", "1") as (url, port):
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
            c.settimeout(30)
            got = b""
            while chunk := c.recv(4096):
                got += chunk
        assert got.startswith(b"HTTP/1.1 408") and b"header_timeout" in got, got
        assert "its request head was not complete within 1s (--header-timeout)" in log.read_text()
        assert urllib.request.urlopen(url + "/health", timeout=10).status == 200  # others unaffected


def test_the_connection_cap_closes_idle_ones_first_then_refuses_with_503(tiny_llama, tmp_path):  # noqa: F811
    log = tmp_path / "serve.log"
    with kvtune_serve(tiny_llama, log, "--max-connections", "3") as (url, port):
        def open_idle() -> socket.socket:
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(c).startswith(b"HTTP/1.1 200")
            return c
        idle = [open_idle() for _ in range(3)]
        # a fourth client is served: the longest-idle connection made room
        assert urllib.request.urlopen(url + "/health", timeout=10).status == 200
        idle[0].settimeout(10)
        assert idle[0].recv(4096) == b"", "the longest-idle connection stays open over the cap"
        assert "to admit a new one (--max-connections 3)" in log.read_text()
        # three connections each holding a request in flight (a head not yet complete counts as busy)
        busy = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        for c in busy:
            c.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.5)
        status, body = _get_status(url + "/health")
        assert status == 503 and body["error"]["code"] == "too_many_connections", (status, body)
        for c in idle + busy:
            c.close()


def _get_status(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_uvicorn_still_has_what_the_connection_bounds_build_on():
    http_connection.check()
