"""Open-loop load for a real vLLM (or our engine): token-id prompts through /v1/completions.

Why token ids: both engines then see exactly the prompt lengths asked for (no tokenizer in between);
``ignore_eos`` makes them generate exactly ``max_tokens``. Used by the vLLM tests and bench/.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any, Sequence

import httpx
from kvtune_operator.demo.load import completion_body


def prompt_ids(n: int, seed: int, vocab: int = 500, prefix: Sequence[int] = ()) -> list[int]:
    rng = random.Random(seed)
    return list(prefix) + [rng.randrange(3, vocab) for _ in range(max(0, n - len(prefix)))]


def chain_prefix(r: dict[str, Any], vocab: int = 500) -> list[int]:
    """The tokens a trace record's hash chain fixes: each id's ``hash_block`` tokens drawn from the id
    alone, so records with the same first k ids agree on their first k blocks (and, w.h.p., differ at
    the next), cut to the prompt's length; empty without a chain."""
    hb = int(r.get("hash_block") or 512)
    out: list[int] = []
    for h in r.get("hash_ids") or ():
        out += prompt_ids(hb, 1_000_003 * int(h) + 17, vocab)
    return out[:int(r["prompt_tokens"])]


async def _one(client: httpx.AsyncClient, url: str, model: str, r: dict[str, Any], seed: int,
               t0: float, results: list) -> None:
    delay = float(r.get("arrival_s", 0.0)) - (time.monotonic() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    prefix = prompt_ids(int(r.get("prefix_tokens", 0)), hash(r.get("prefix_group")) & 0xFFFF) \
        if r.get("prefix_group") else chain_prefix(r)
    body = completion_body(model, prompt_ids(int(r["prompt_tokens"]), seed, prefix=prefix), int(r["output_tokens"]))
    sent = time.monotonic()
    resp = await client.post(url + "/v1/completions", json=body)
    done = time.monotonic()
    resp.raise_for_status()
    usage = resp.json()["usage"]
    results.append({"sent_s": sent - t0, "latency_s": done - sent, "done_s": done - t0,
                    "completion_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"]})


async def replay_async(url: str, model: str, trace: Sequence[dict[str, Any]], timeout_s: float = 600) -> list[dict]:
    """Send each trace request at its arrival time; returns one record per request."""
    results: list[dict] = []
    # one fresh connection per request: a pooled one that the server's keep-alive timer (vLLM: 5 s)
    # closes just as it is reused ends in a ReadError that says nothing about the engine
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(_one(client, url, model, r, i, t0, results) for i, r in enumerate(trace)))
    return results


def replay(url: str, model: str, trace: Sequence[dict[str, Any]], timeout_s: float = 600) -> list[dict]:
    return asyncio.run(replay_async(url, model, trace, timeout_s))


class ClosedLoop:
    """``clients`` clients in a thread, each sending its next request as soon as its last is answered,
    until ``stop()``: a queue that lasts as long as the observer needs. (A fixed trace drains on its own
    schedule: on a busy machine, where a loaded vLLM answers /metrics seconds late, a window closed after
    the load had ended and judged a drained engine.)"""

    def __init__(self, url: str, model: str, *, clients: int, prompt_tokens: int, output_tokens: int):
        self.results: list[dict] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._args = (url, model, clients, {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens})
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._clients(*self._args))
        except BaseException as e:  # reported by stop()
            self.error = e

    async def _clients(self, url: str, model: str, clients: int, shape: dict[str, Any]) -> None:
        async def client_loop(http: httpx.AsyncClient, i: int) -> None:
            n = 0
            while not self._stop.is_set():
                await _one(http, url, model, shape, 1000 * i + n, t0, self.results)
                n += 1

        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)  # see replay_async
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            t0 = time.monotonic()
            await asyncio.gather(*(client_loop(http, i) for i in range(clients)))

    def __enter__(self) -> "ClosedLoop":
        self._t.start()
        return self

    def stop(self, timeout: float = 600) -> list[dict]:
        """No new requests; waits for those in flight. Returns one record per request answered."""
        self._stop.set()
        self._t.join(timeout)
        if self.error is not None:
            raise self.error
        return self.results

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(600)
