"""The block pool: `num_blocks` fixed-size KV blocks, reference-counted, with an LRU prefix cache.

Invariant owned here: every block is in exactly one state,

    free        ref == 0, no cache key; on the free stack
    used        ref  > 0 (held by one or more block tables; may also carry a cache key)
    cached-idle ref == 0, carries a cache key; in the LRU, reusable on a hit until evicted

so free + used + cached-idle == num_blocks. Any free or idle block can back any logical block of
any request: there is no contiguity anywhere (a paged pool has no external fragmentation).

Every operation is O(1) per block: the free stack is a list, the LRU an OrderedDict (pop the oldest,
delete a hit), and the cache a dict from key to block id.
"""
from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocks(RuntimeError):
    """allocate() was asked for more blocks than are free plus evictable."""


class BlockPool:
    __slots__ = ("num_blocks", "ref", "key_of", "cached", "_free", "_idle", "num_evictions", "num_shared")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.ref: list[int] = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks   # cache key of a block, if any
        self.cached: dict[bytes, int] = {}                        # cache key -> block id
        # Pop from the end: block 0 comes out first (only for readable tests; any order is valid).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._idle: OrderedDict[int, None] = OrderedDict()        # cached-idle blocks, oldest first
        self.num_evictions = 0
        self.num_shared = 0            # blocks referenced by more than one block table

    # ---- counts (cheap: read by the scheduler every step and by /metrics) ----
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_idle(self) -> int:
        return len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._idle)

    @property
    def num_allocatable(self) -> int:
        """Blocks an allocation may take: free ones, then idle cached ones (evicted, LRU first)."""
        return len(self._free) + len(self._idle)

    # ---- operations ----
    def allocate(self, n: int) -> list[int]:
        """n blocks with ref 1, whatever their ids. Free blocks first, then evict idle cached ones."""
        free = self._free
        if n <= len(free):
            if n == 0:
                return []
            out = free[-n:]
            del free[-n:]
        else:
            if n > len(free) + len(self._idle):
                raise NoFreeBlocks(
                    f"asked for {n} blocks; {len(free)} free + {len(self._idle)} evictable")
            out = free[:]
            free.clear()
            idle, key_of, cached = self._idle, self.key_of, self.cached
            evict = n - len(out)
            for _ in range(evict):
                b, _ = idle.popitem(last=False)
                del cached[key_of[b]]
                key_of[b] = None
                out.append(b)
            self.num_evictions += evict
        ref = self.ref
        for b in out:
            ref[b] = 1
        return out

    def take_one(self) -> int | None:
        """allocate(1) without the list: a block id, or None when nothing is allocatable."""
        if self._free:
            b = self._free.pop()
        elif self._idle:
            b, _ = self._idle.popitem(last=False)
            del self.cached[self.key_of[b]]
            self.key_of[b] = None
            self.num_evictions += 1
        else:
            return None
        self.ref[b] = 1
        return b

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference on each block (prefix-cache hit); an idle block leaves the LRU."""
        ref, idle = self.ref, self._idle
        for b in blocks:
            r = ref[b]
            if r == 0:
                del idle[b]          # KeyError here would mean a free block was hit: a bug
            elif r == 1:
                self.num_shared += 1
            ref[b] = r + 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block, in the given order. A block whose last reference goes
        becomes idle-cached (if it has a cache key; it joins the LRU as the newest) or free."""
        ref, key_of, idle, free = self.ref, self.key_of, self._idle, self._free
        for b in blocks:
            r = ref[b] - 1
            if r < 0:
                raise RuntimeError(f"block {b} freed more often than referenced")
            ref[b] = r
            if r == 1:
                self.num_shared -= 1
            elif r == 0:
                if key_of[b] is None:
                    free.append(b)
                else:
                    idle[b] = None

    def publish(self, keys: list[bytes], blocks: list[int]) -> int:
        """Publish full, computed blocks under their cache keys (keys[i] for blocks[i]); returns how
        many were published. A key already taken (another request computed the same content first)
        or a block that already has a key is left as it is."""
        cached, key_of = self.cached, self.key_of
        n = 0
        for k, b in zip(keys, blocks):
            if k not in cached and key_of[b] is None:
                cached[k] = b
                key_of[b] = k
                n += 1
        return n

    def longest_cached(self, keys: list[bytes]) -> list[int]:
        """Blocks cached under keys[0], keys[1], ... up to the first key that is not cached."""
        cached = self.cached
        out = []
        for key in keys:
            b = cached.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def lookup(self, key: bytes) -> int | None:
        return self.cached.get(key)

    def evict_all_idle(self) -> int:
        """Drop every idle cached block to the free stack (used when prefix caching is switched off)."""
        n = len(self._idle)
        while self._idle:
            b, _ = self._idle.popitem(last=False)
            del self.cached[self.key_of[b]]
            self.key_of[b] = None
            self._free.append(b)
        self.num_evictions += n
        return n

    # ---- checking (tests; O(num_blocks)) ----
    def check(self) -> None:
        free = set(self._free)
        idle = set(self._idle)
        assert len(free) == len(self._free), "a block is twice on the free stack"
        assert not free & idle, "a block is both free and cached-idle"
        for b in range(self.num_blocks):
            r = self.ref[b]
            assert r >= 0, f"block {b} has refcount {r}"
            if b in free:
                assert r == 0 and self.key_of[b] is None, f"free block {b} is referenced or keyed"
            elif b in idle:
                assert r == 0 and self.key_of[b] is not None, f"idle block {b} is referenced or unkeyed"
            else:
                assert r > 0, f"block {b} is neither free, idle nor referenced"
            k = self.key_of[b]
            if k is not None:
                assert self.cached.get(k) == b, f"block {b}'s key maps elsewhere"
        assert len(self.cached) == sum(k is not None for k in self.key_of)
        assert self.num_shared == sum(r > 1 for r in self.ref), "shared-block count is off"
        assert self.num_free + self.num_used + self.num_cached_idle == self.num_blocks
