"""The engine's recorder of recent request shapes, in the trace format of ``trace.py`` (never text).

Invariant owned here: an entry holds arrival time, prompt and output lengths and a shared-prefix
group, nothing else; requests with different ``cache_salt`` values never share a group (they
never share cache blocks either), so a replay in the simulator shares exactly what the engine
could share. ``prefix_tokens`` is rounded down to whole blocks: the cache shares whole blocks
only, and a token-exact length would tell the admin key's holder how long another user's prompt
matched theirs. The trace is served behind the admin key only: shapes still describe other users.
"""
from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from typing import Any

TRACE_CAPACITY = 10_000
_GROUP_KEYS = 1024


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class TraceRecorder:
    """A bounded ring of finished requests' shapes; prefix groups found by the first block's tokens."""

    def __init__(self, block_size: int, capacity: int = TRACE_CAPACITY):
        self.block_size = block_size
        self.capacity = capacity
        self._ring: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self.recorded = 0
        self._groups: collections.OrderedDict[bytes, tuple[str, list[int], dict]] = collections.OrderedDict()
        self._next_group = 0

    def begin(self, arrival_s: float, prompt_ids: list[int], prefix_group: str | None = None,
              cache_salt: str | None = None) -> dict[str, Any]:
        """The entry of a request just admitted (its output length is filled in by ``finish``)."""
        e: dict[str, Any] = {"arrival_s": round(arrival_s, 6), "prompt_tokens": len(prompt_ids), "output_tokens": 0}
        if prefix_group:
            e["prefix_group"] = prefix_group
            return e
        bs = self.block_size
        if len(prompt_ids) < bs:
            return e
        key = hashlib.blake2b(repr((cache_salt, prompt_ids[:bs])).encode(), digest_size=12).digest()
        hit = self._groups.get(key)
        if hit is None:
            self._groups[key] = ("", list(prompt_ids), e)
            if len(self._groups) > _GROUP_KEYS:
                self._groups.popitem(last=False)
            return e
        group, prev_ids, first = hit
        self._groups.move_to_end(key)
        n = _common_prefix(prev_ids, prompt_ids) // bs * bs   # whole blocks only (module docstring)
        if not group:
            group = f"p{self._next_group}"
            self._next_group += 1
            first["prefix_group"] = group
            first["prefix_tokens"] = n
        e["prefix_group"] = group
        e["prefix_tokens"] = n
        self._groups[key] = (group, list(prompt_ids), first)
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
