"""The engine's recorder of recent request shapes, in the trace format of ``trace.py`` (never text).

Invariant owned here: an entry holds arrival time, prompt and output lengths and the prompt's
prefix structure, nothing else. The structure is a hash chain (``hash_ids``, one id per
``hash_block`` tokens: the smallest multiple of the engine's block size of at least
``HASH_TOKENS``): the id of a chunk is a counter handed out the first time the recorder meets the
chunk's chained key (``kv_manager.block_keys`` at that chunk size, salted by the request's
``cache_salt`` exactly as the cache salts its keys), so

- equal leading ids mean the prompts' first chunks are equal (the cache could share those whole
  blocks), and a replay in the simulator shares exactly those; a token-exact match length is never
  told. Sharing is told in whole chunks: up to ``hash_block - 1`` shared tokens per request go
  untold, the price of a trace that stays small (a 32k-token prompt is 256 ids, not 2048: the
  tuner reads 10000 of them per window under the engine client's byte cap);
- requests with different ``cache_salt`` values never get a common id (their keys never meet), so
  one tenant's trace cannot show that another sent the same prompt;
- an id is a counter, not a digest of tokens: holding the trace, no one can test a guessed prompt
  against it.

The recorder remembers the last ``CHAIN_KEYS`` block keys; a key met again after it was forgotten
gets a new id (the trace then tells less sharing than there was, never more). A request given an
explicit ``prefix_group`` (the one-level form) is recorded with that group instead. The trace is
served behind the admin key only: shapes still describe other users.
"""
from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from ..kv.kv_manager import block_keys

TRACE_CAPACITY = 10_000
CHAIN_KEYS = 1 << 16
HASH_TOKENS = 128   # the least tokens per hash id (module docstring)


class TraceRecorder:
    """A bounded ring of finished requests' shapes, each prompt's blocks as a chain of ids."""

    def __init__(self, block_size: int, capacity: int = TRACE_CAPACITY, chain_keys: int = CHAIN_KEYS,
                 hash_tokens: int = HASH_TOKENS):
        self.block_size = block_size
        self.hash_block = -(-max(hash_tokens, block_size) // block_size) * block_size
        self.capacity = capacity
        self.chain_keys = chain_keys
        self._ring: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self.recorded = 0
        self._ids: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._next_id = 0

    def chain(self, prompt_ids: Sequence[int], cache_salt: str | None = None) -> tuple[int, ...]:
        """The ids of the prompt's full chunks (module docstring)."""
        ids, known = [], self._ids
        for key in block_keys(list(prompt_ids), self.hash_block, cache_salt):
            i = known.get(key)
            if i is None:
                i = known[key] = self._next_id
                self._next_id += 1
                if len(known) > self.chain_keys:
                    known.popitem(last=False)
            else:
                known.move_to_end(key)
            ids.append(i)
        return tuple(ids)

    def begin(self, arrival_s: float, prompt_ids: list[int], prefix_group: str | None = None,
              cache_salt: str | None = None) -> dict[str, Any]:
        """The entry of a request just admitted (its output length is filled in by ``finish``)."""
        e: dict[str, Any] = {"arrival_s": round(arrival_s, 6), "prompt_tokens": len(prompt_ids), "output_tokens": 0}
        if prefix_group:
            e["prefix_group"] = prefix_group
            return e
        ids = self.chain(prompt_ids, cache_salt)
        if ids:
            e["hash_ids"] = ids
            e["hash_block"] = self.hash_block
        return e

    def finish(self, entry: dict[str, Any], output_tokens: int) -> None:
        """Record a finished request (one aborted before its first token left no load: not traced)."""
        if output_tokens:
            entry["output_tokens"] = output_tokens
            self._ring.append(entry)
            self.recorded += 1

    def view(self, since_s: float | None = None, limit: int | None = None) -> dict[str, Any]:
        entries = [dict(e) for e in self._ring]
        reqs = sorted((e for e in entries if since_s is None or e["arrival_s"] > since_s),
                      key=lambda e: e["arrival_s"])
        if limit is not None and limit >= 0:
            reqs = reqs[-limit:] if limit else []
        return {"capacity": self.capacity, "recorded_total": self.recorded,
                "dropped_total": max(0, self.recorded - len(entries)), "requests": reqs}
