"""Per-request KV state on top of the block pool: block tables, prefix-cache keys, the host swap pool.

The scheduler and the simulator go through this class for everything about blocks (what to take,
what is allocatable, counts, usage); the block pool and the tables are this layer's own.

Invariant owned here: a request on the device has a block table of exactly the blocks covering the
tokens it has been given slots for (the scheduler keeps that at ceil(computed / block_size) between
steps); a swapped request has a host table instead, never both.

Prefix cache: the key of full block i of a prompt is sha256(key of block i-1 + token ids of block i)
(32 bytes). Block 0 chains from a root digest of its own domain: sha256 of a tag for unsalted
requests, sha256 of another tag + the ``cache_salt`` for salted ones (``chain_root``). Both tags
are longer than a digest, so a root equals no key of any chain (that would be a sha256 preimage),
and a salted key never equals an unsalted one: a salt spelling a block's token bytes cannot line up
with an unsalted chain. A chained cryptographic hash is collision-safe: two blocks share a key only
if they and every block before them hold the same tokens, under the same salt. Only full prompt
blocks are keyed, and a block is published only after the step that computed it (see `commit`), so
a hit never reads a block that is still being written.
"""
from __future__ import annotations

import hashlib
from array import array

from ..request import Request
from .block_pool import BlockPool, NoFreeBlocks

_sha256 = hashlib.sha256
#: domain tags of the chain roots (longer than a 32-byte digest: see the module docstring)
_UNSALTED_TAG = b"kvtune prefix cache v2: unsalted chain\x00"
_SALTED_TAG = b"kvtune prefix cache v2: salted chain\x00"
_UNSALTED_ROOT = _sha256(_UNSALTED_TAG).digest()


def chain_root(salt: str | None) -> bytes:
    """The parent digest of block 0: one per salt, and the unsalted one apart from them all."""
    if salt is None:
        return _UNSALTED_ROOT
    return _sha256(_SALTED_TAG + salt.encode("utf-8", "surrogatepass")).digest()


def block_keys(token_ids: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """Chained keys of the full blocks of `token_ids` (a salt starts its own chain)."""
    n = len(token_ids) // block_size
    if n == 0:
        return []
    try:
        data = array("I", token_ids).tobytes()   # "I": CPython converts unsigned ints ~8x faster
        step = 4 * block_size
    except OverflowError:                        # a token id outside [0, 2**32): never in practice
        data = array("q", token_ids).tobytes()
        step = 8 * block_size
    keys = []
    parent = chain_root(salt)
    for off in range(0, n * step, step):
        parent = _sha256(parent + data[off:off + step]).digest()
        keys.append(parent)
    return keys


class KVManager:
    __slots__ = ("block_size", "pool", "tables", "host_tables", "num_swap_blocks", "_host_free",
                 "_keys", "_published", "num_table_blocks")

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[Request, list[int]] = {}        # device block tables
        self.host_tables: dict[Request, list[int]] = {}   # swap pool block tables
        self.num_swap_blocks = num_swap_blocks
        self._host_free = list(range(num_swap_blocks - 1, -1, -1))
        self._keys: dict[Request, list[bytes]] = {}       # prefix keys of the prompt's full blocks
        self._published: dict[Request, int] = {}          # leading table blocks already in the cache
        self.num_table_blocks = 0                         # sum of len(table) over device tables

    # ---- what the scheduler and the simulator read (they never reach into the pool) ----
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_allocatable(self) -> int:
        """Blocks an admission or growth may take now: free plus evictable idle cached blocks."""
        return self.pool.num_allocatable

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    @property
    def num_cached_idle(self) -> int:
        return self.pool.num_cached_idle

    @property
    def num_shared(self) -> int:
        """Blocks referenced by more than one block table (prefix sharing)."""
        return self.pool.num_shared

    @property
    def num_used_swap_blocks(self) -> int:
        return self.num_swap_blocks - len(self._host_free)

    @property
    def num_tables(self) -> int:
        """Requests with a device block table."""
        return len(self.tables)

    def on_device(self, req: Request) -> bool:
        return req in self.tables

    def is_swapped(self, req: Request) -> bool:
        return req in self.host_tables

    def num_host_blocks(self, req: Request) -> int:
        """Blocks a swapped request holds in the host pool (what its swap-in brings back)."""
        return len(self.host_tables[req])

    def table(self, req: Request) -> list[int]:
        """The request's device block table (the scheduler's own reference: it grows in place)."""
        return self.tables[req]

    # ---- prefix cache ----
    def keys(self, req: Request) -> list[bytes]:
        k = self._keys.get(req)
        if k is None:
            k = self._keys[req] = block_keys(req.prompt_token_ids, self.block_size, req.cache_salt)
        return k

    def cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the prompt, leaving at least the last token
        of the request to compute (its logits are needed)."""
        limit = (len(req.prompt_token_ids) + len(req.output_token_ids) - 1) // self.block_size
        if limit <= 0:
            return []
        return self.pool.longest_cached(self.keys(req)[:limit])

    def commit(self, req: Request, num_computed: int) -> None:
        """Publish the request's full prompt blocks computed so far under their prefix keys."""
        table = self.tables[req]
        keys = self.keys(req)
        upto = min(num_computed // self.block_size, len(keys), len(table))
        start = self._published.get(req, 0)
        if upto > start:
            self.pool.publish(keys[start:upto], table[start:upto])
            self._published[req] = upto

    def clear_cache(self) -> None:
        """Forget every prefix key (prefix caching switched off): idle cached blocks become free."""
        self.pool.evict_all_idle()
        pool = self.pool
        for b, k in enumerate(pool.key_of):
            if k is not None:
                pool.key_of[b] = None
        pool.cached.clear()
        self._keys.clear()
        self._published.clear()

    # ---- device blocks ----
    def blocks_to_take(self, hits: list[int], new_blocks: int) -> int:
        """Allocatable blocks an admission consumes: new blocks plus hit blocks that are idle
        (a hit on an idle cached block takes it out of the evictable set)."""
        ref = self.pool.ref
        return new_blocks + sum(1 for b in hits if ref[b] == 0)

    def admit(self, req: Request, hits: list[int], new_blocks: int) -> list[int]:
        """Create the request's device table: the hit blocks (one more reference each) + new ones."""
        pool = self.pool
        pool.touch(hits)
        table = hits + pool.allocate(new_blocks)
        self.tables[req] = table
        self.num_table_blocks += len(table)
        if hits:
            self._published[req] = len(hits)
        return table

    def grow(self, table: list[int], n: int) -> None:
        """Append n new blocks to a device table (raises NoFreeBlocks when they are not there)."""
        table += self.pool.allocate(n)
        self.num_table_blocks += n

    def grow_one(self, table: list[int]) -> bool:
        """Append one new block to a device table; False (nothing taken) when none is allocatable."""
        b = self.pool.take_one()
        if b is None:
            return False
        table.append(b)
        self.num_table_blocks += 1
        return True

    def free(self, req: Request) -> None:
        """Release everything the request holds, device and host. Device blocks are released last
        block first, so the LRU evicts a prompt's tail before its (more shareable) head."""
        table = self.tables.pop(req, None)
        if table is not None:
            self.num_table_blocks -= len(table)
            self.pool.free(table[::-1])
        host = self.host_tables.pop(req, None)
        if host is not None:
            self._host_free += host
        self._keys.pop(req, None)
        self._published.pop(req, None)

    # ---- swap pool ----
    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._host_free)

    def can_swap_out(self, req: Request) -> bool:
        return len(self.tables.get(req, ())) <= len(self._host_free)

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the host pool: (device block, host block) pairs to copy
        before the device blocks are reused. Caller checks can_swap_out first."""
        table = self.tables.pop(req)
        n = len(table)
        host = self._host_free[-n:] if n else []
        del self._host_free[len(self._host_free) - n:]
        self.host_tables[req] = host
        self.num_table_blocks -= n
        self.pool.free(table[::-1])
        self._published.pop(req, None)
        return list(zip(table, host))

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back: (host block, device block) pairs. Raises NoFreeBlocks."""
        host = self.host_tables[req]
        dev = self.pool.allocate(len(host))
        del self.host_tables[req]
        self._host_free += host
        self.tables[req] = dev
        self.num_table_blocks += len(dev)
        return list(zip(host, dev))

    # ---- checking (tests) ----
    def check(self, block_size_tokens: dict[Request, int] | None = None) -> None:
        """Pool invariants, plus: every reference is a table entry; with `block_size_tokens`
        (request -> tokens it holds slots for), each table has exactly ceil(tokens / block_size)."""
        self.pool.check()
        assert min(len(_SALTED_TAG), len(_UNSALTED_TAG)) > 32, "a chain root's tag must be longer than a key"
        refs = [0] * self.pool.num_blocks
        for table in self.tables.values():
            for b in table:
                refs[b] += 1
        assert refs == self.pool.ref, "block refcounts differ from the block tables"
        assert self.num_table_blocks == sum(len(t) for t in self.tables.values())
        assert not set(self.tables) & set(self.host_tables), "a request is both on device and host"
        host = [b for t in self.host_tables.values() for b in t] + self._host_free
        assert sorted(host) == list(range(self.num_swap_blocks)), "swap pool blocks lost or doubled"
        if block_size_tokens is not None:
            bs = self.block_size
            for req, tokens in block_size_tokens.items():
                t = self.tables.get(req) or self.host_tables.get(req) or []
                assert len(t) == -(-tokens // bs), (
                    f"{req.request_id}: table of {len(t)} blocks for {tokens} tokens (block size {bs})")


__all__ = ["KVManager", "NoFreeBlocks", "block_keys"]
