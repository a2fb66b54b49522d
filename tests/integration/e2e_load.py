"""An open-loop load generator for end-to-end tests of engine pods run by the pod node.

Requests arrive at a fixed rate whatever the engine does (open loop: a slow config builds a queue,
as it would under real traffic, and the engine's trace records arrivals the tuner can replay under
other configs). Prompts are token-id lists with ``ignore_eos`` and ``max_tokens``, so every request
has exactly the shape asked for (``prompt_tokens``, ``output_tokens``) whatever the random model
generates. Shape and rate can change while it runs (``set_load``): the test's phases. It is bounded
in requests, in time and in requests in flight, and sends only to 127.0.0.1. The URL is looked up
again after a connection error, so the load follows an engine that restarts in a new pod (a
rollout), as clients of a Service would.
"""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable
from urllib.parse import urlsplit

import httpx

from kvtune_operator.demo.load import LoadStats, completion_body, measure_tokens_per_s


class OpenLoopLoad:
    """``rate`` requests per second of ``prompt_tokens`` + ``output_tokens`` to ``url()``."""

    def __init__(self, url: Callable[[], str | None], model: str, *, rate: float, prompt_tokens: int,
                 output_tokens: int, vocab: int, max_requests: int, max_seconds: float, max_in_flight: int = 64,
                 seed: int = 0, request_timeout_s: float = 120.0):
        self.url, self.model, self.vocab = url, model, vocab
        self.rate, self.shape = rate, (prompt_tokens, output_tokens)
        self.max_requests, self.max_seconds, self.max_in_flight = max_requests, max_seconds, max_in_flight
        self.request_timeout_s = request_timeout_s
        self.stats = LoadStats()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._in_flight = 0
        self._issued = 0  # handed to the pool; ``stats.sent`` counts those posted to the engine
        self._deadline = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._local = threading.local()
        self._clients: list[httpx.Client] = []

    def set_load(self, *, rate: float, prompt_tokens: int, output_tokens: int) -> None:
        with self._lock:
            self.rate, self.shape = rate, (prompt_tokens, output_tokens)

    def start(self) -> "OpenLoopLoad":
        self._deadline = time.monotonic() + self.max_seconds
        self._pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="e2e-load")
        self._thread = threading.Thread(target=self._arrivals, name="e2e-arrivals", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._thread = self._pool = None
        for c in self._clients:
            c.close()
        self._clients = []

    def __enter__(self) -> "OpenLoopLoad":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _over(self) -> bool:
        return self._stop.is_set() or time.monotonic() > self._deadline

    def _arrivals(self) -> None:
        nxt = time.monotonic()
        while not self._over():
            with self._lock:
                if self._issued + self.stats.dropped >= self.max_requests:
                    return
                rate, (p, o) = self.rate, self.shape
                if self._in_flight >= self.max_in_flight:
                    self.stats.dropped += 1
                    body = None
                else:
                    self._in_flight += 1
                    self._issued += 1
                    body = completion_body(self.model, [self._rng.randrange(16, self.vocab) for _ in range(p)], o)
            if body is not None:
                self._pool.submit(self._send, body)
            nxt += 1.0 / rate
            self._stop.wait(max(0.0, nxt - time.monotonic()))

    def _client(self) -> httpx.Client:
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = httpx.Client(timeout=httpx.Timeout(self.request_timeout_s, connect=2.0))
            with self._lock:
                self._clients.append(c)
        return c

    def _send(self, body: dict) -> None:
        # ``sent`` counts a request once it is posted: one the pool had not started when the load
        # stopped never reached the engine, and counted as sent it read as a request the engine lost
        # (sent 223, ok 222, failed 0 on a busy machine)
        posted = False
        try:
            while not self._over():
                base = self.url()
                if not base:
                    time.sleep(0.2)
                    continue
                if urlsplit(base).hostname != "127.0.0.1":
                    raise ValueError(f"the load goes to 127.0.0.1 only, not {base}")
                if not posted:
                    posted = True
                    with self._lock:
                        self.stats.sent += 1
                try:
                    r = self._client().post(f"{base}/v1/completions", json=body)
                except httpx.TransportError:  # the engine restarts (a rollout): find it again
                    with self._lock:
                        self.stats.retried += 1
                    time.sleep(0.3)
                    continue
                if r.status_code == 503:  # the waiting queue is full, or the engine is starting
                    with self._lock:
                        self.stats.retried += 1
                    time.sleep(0.5)
                    continue
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == body["max_tokens"]
                with self._lock:
                    if ok:
                        self.stats.ok += 1
                    else:
                        self.stats.failed += 1
                        self.stats.errors.append(f"{r.status_code}: {r.text[:200]}")
                        del self.stats.errors[:-20]
                return
        except Exception as e:  # noqa: BLE001 - counted, the test reads the errors
            with self._lock:
                self.stats.failed += 1
                self.stats.errors.append(repr(e))
        finally:
            with self._lock:
                self._in_flight -= 1


def served_rate(url: Callable[[], str | None], model: str, *, requests: int, prompt_tokens: int,
                output_tokens: int, vocab: int, seed: int = 0) -> float:
    """Requests per second the engine at ``url()`` serves as it is configured, ``requests`` of this shape
    sent at once (the demo's calibration): a test that needs a load which outruns a config (a queue
    that grows) sizes its rate from this, not from a constant of one machine."""
    deadline = time.monotonic() + 120
    while not (base := url()) and time.monotonic() < deadline:  # the pod is not Ready (in the Service) yet
        time.sleep(0.2)
    if not base or urlsplit(base).hostname != "127.0.0.1":
        raise ValueError(f"served_rate measures an engine on 127.0.0.1, not {base}")
    return measure_tokens_per_s(base, model=model, vocab=vocab, requests=requests, prompt_tokens=prompt_tokens,
                                output_tokens=output_tokens, seed=seed) / output_tokens
