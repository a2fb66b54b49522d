"""Replays a request trace against an engine's OpenAI API, on its own thread and event loop.

Prompts are token-id lists with `ignore_eos` and `max_tokens`, so each request has exactly the shape
the trace gives, its sharing included: requests of one prefix group start with the same
`prefix_tokens` ids, and requests whose hash chains agree on their first k ids agree on their first k
blocks of `hash_block` tokens (`shared_ids`), so an engine's prefix cache sees what the trace says. A request that finds the engine down (a restart) retries until it is back: the load
goes on across restarts, as clients of a Service would.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import httpx

from kvtune_engine.sim.trace import TraceRequest


def completion_body(model: str, prompt: list[int], output_tokens: int) -> dict:
    """A request of exactly this shape: token ids in, ``output_tokens`` out (EOS ignored)."""
    return {"model": model, "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True, "temperature": 0.0}


def shared_ids(req: TraceRequest, vocab: int, low: int = 16) -> list[int]:
    """The ids a request shares with others of its prefix group or hash chain, drawn from the group's
    name or each hash id alone (the same in every process: crc32, not Python's salted hash)."""
    def draw(seed: int, n: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(low, vocab) for _ in range(n)]
    if req.prefix_group is not None:
        return draw(zlib.crc32(req.prefix_group.encode()), min(req.prefix_tokens, req.prompt_tokens))
    out: list[int] = []
    for h in req.hash_ids:
        if len(out) >= req.prompt_tokens:
            break
        out += draw(1_000_003 * h + 17, req.hash_block)
    return out[:req.prompt_tokens]


@dataclass
class LoadStats:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    retried: int = 0
    dropped: int = 0  # not sent: the in-flight bound was reached (the tests' open-loop load)
    ttft: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class LoadGenerator:
    def __init__(self, url: Callable[[], str], trace: list[TraceRequest], *, vocab: int, model: str,
                 seed: int = 0, max_in_flight: int = 256):
        self.url, self.trace, self.vocab, self.model = url, trace, vocab, model
        self.rng = random.Random(seed)
        self.stats = LoadStats()
        self.max_in_flight = max_in_flight
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="demo-load", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(30)

    def _prompt(self, req: TraceRequest) -> list[int]:
        shared = shared_ids(req, self.vocab)
        return shared + [self.rng.randrange(16, self.vocab) for _ in range(req.prompt_tokens - len(shared))]

    async def _one(self, client: httpx.AsyncClient, req: TraceRequest, sem: asyncio.Semaphore) -> None:
        body = completion_body(self.model, self._prompt(req), req.output_tokens)
        async with sem:
            self.stats.sent += 1
            while not self._stop.is_set():
                try:
                    r = await client.post(f"{self.url()}/v1/completions", json=body)
                except httpx.TransportError:  # engine restarting: retry, as a Service client would
                    self.stats.retried += 1
                    await asyncio.sleep(0.3)
                    continue
                if r.status_code == 200:
                    self.stats.ok += 1
                elif r.status_code == 503:
                    self.stats.retried += 1
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    continue
                else:
                    self.stats.failed += 1
                    self.stats.errors.append(f"{r.status_code}: {r.text[:200]}")
                return

    async def _run(self) -> None:
        sem = asyncio.Semaphore(self.max_in_flight)
        limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=32)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=2.0), limits=limits) as client:
            tasks: set[asyncio.Task] = set()
            t0, offset, span = time.monotonic(), 0.0, (self.trace[-1].arrival_s + 0.5)
            while not self._stop.is_set():
                for req in self.trace:  # the trace loops for as long as the demo runs
                    delay = t0 + offset + req.arrival_s - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if self._stop.is_set():
                        break
                    task = asyncio.create_task(self._one(client, req, sem))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                offset += span
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def measure_tokens_per_s(url: str, *, model: str, vocab: int, requests: int, prompt_tokens: int,
                         output_tokens: int, seed: int = 0) -> float:
    """Output tokens per second of ``requests`` requests sent at once: what this machine's engine can
    serve, so that the demo sizes its load to the machine (a fixed rate saturates a slow one)."""
    rng = random.Random(seed)

    async def burst() -> float:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
            t0 = time.monotonic()
            rs = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=completion_body(
                model, [rng.randrange(16, vocab) for _ in range(prompt_tokens)], output_tokens))
                for _ in range(requests)))
            elapsed = time.monotonic() - t0
        bad = [r for r in rs if r.status_code != 200]
        if bad:
            raise RuntimeError(f"calibration request failed: {bad[0].status_code} {bad[0].text[:200]}")
        return sum(r.json()["usage"]["completion_tokens"] for r in rs) / elapsed

    return asyncio.run(burst())
