"""KVCacheManager: per-request block tables over two pools of KV blocks, the
device pool and the host pool (FastServe §4.2's two tiers).

Pure Python. The scheduler asks ``can_allocate``/``allocate`` before it puts a
request's tokens into a step, and ``swap_out``/``swap_in`` to move a whole
request between the tiers. Memory itself is never touched here: a move
returns a plain ``{source block: destination block}`` map that travels in the
StepPlan to the worker's cache engine, which does the copy.

Where a request's KV lives::

    resident (device table)    the request can run; its host table is empty
    swapped  (host table)      KV only on the host; it must be swapped in to run

A block freed by a move is the *source* of a copy that has not run yet, so
it stays pending (not reusable) until ``release_pending()``, which the
scheduler calls when the step that carried the copy has finished.

With prefix caching, full blocks are shared: ``admit`` starts a request's
table with the longest chain of cached blocks its keys find (see
prefix_cache.py) and allocates only the rest; ``cache_blocks`` indexes a
request's blocks as they fill. A shared block's reference count is the
number of tables holding it; freed blocks keep their content (and their
index entry) until the allocator hands them out again, LRU first.
"""

from __future__ import annotations

from dataclasses import dataclass

from fluidserve.kvcache.allocator import BlockAllocator
from fluidserve.kvcache.prefix_cache import PrefixIndex


@dataclass
class PrefixCacheStats:
    query_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of which found cached on the device
    evicted_blocks: int = 0  # cached blocks handed out for other content


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.host = BlockAllocator(num_host_blocks) if num_host_blocks else None
        self._tables: dict[str, list[int]] = {}  # device blocks of resident requests
        self._host_tables: dict[str, list[int]] = {}  # host blocks of swapped requests
        self.prefix = PrefixIndex() if enable_prefix_caching else None
        self.prefix_stats = PrefixCacheStats()
        self._num_indexed: dict[str, int] = {}  # leading blocks of a table already offered to the index

    # -- device pool figures ------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    @property
    def usage(self) -> float:
        return self.allocator.num_used / self.allocator.num_blocks

    # -- host pool figures --------------------------------------------------
    @property
    def num_host_blocks(self) -> int:
        return self.host.num_blocks if self.host else 0

    @property
    def num_used_host_blocks(self) -> int:
        return self.host.num_used if self.host else 0

    # -- device allocation --------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Device blocks ``request_id`` still needs to hold ``num_tokens``
        tokens (a swapped request counts its host blocks too: they come back)."""
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.allocator.can_allocate(self.num_new_blocks(request_id, num_tokens))

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the resident request's table to hold ``num_tokens`` tokens;
        False (and no change) when the pool cannot supply the blocks."""
        if request_id in self._host_tables:
            raise ValueError(f"request {request_id!r} is swapped out: swap it in before it grows")
        need = self.num_new_blocks(request_id, num_tokens)
        if not self.allocator.can_allocate(need):
            return False
        table = self._tables.setdefault(request_id, [])
        if need:
            table.extend(self._allocate(need))
        return True

    def _allocate(self, n: int) -> list[int]:
        """Fresh blocks for new content: any cached prefix they held is gone."""
        blocks = self.allocator.allocate(n)
        if self.prefix is not None:
            for b in blocks:
                self.prefix_stats.evicted_blocks += self.prefix.evict(b)
        return blocks

    # -- prefix caching ------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        return self.prefix is not None

    def _hits(self, keys: list[int], num_tokens: int) -> list[int]:
        """Device blocks of the longest cached chain of ``keys``, leaving at
        least one of ``num_tokens`` to compute (something must be sampled
        from, and a shared block is never written)."""
        if self.prefix is None:
            return []
        limit = min(len(keys), (num_tokens - 1) // self.block_size)
        hits = []
        for key in keys[:limit]:
            block = self.prefix.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix_tokens(self, keys: list[int], num_tokens: int) -> int:
        """Tokens of a prompt that admission would find cached now."""
        return len(self._hits(keys, num_tokens)) * self.block_size

    def admission_blocks(self, keys: list[int], num_tokens: int) -> int:
        """Free blocks admitting a new request of ``num_tokens`` would use:
        new blocks for what is not cached, plus cached blocks that are free."""
        hits = self._hits(keys, num_tokens)
        return self.blocks_for(num_tokens) - len(hits) + sum(map(self.allocator.is_free, hits))

    def admit(self, request_id: str, keys: list[int], num_tokens: int) -> int | None:
        """Give a request with no KV a table for ``num_tokens`` tokens, sharing
        its cached prefix; the number of tokens found cached, or None (and no
        change) when the pool cannot supply the rest."""
        if self._tables.get(request_id) or request_id in self._host_tables:
            raise ValueError(f"request {request_id!r} already holds KV")
        hits = self._hits(keys, num_tokens)
        if self.admission_blocks(keys, num_tokens) > self.allocator.num_free:
            return None
        for b in hits:
            if self.allocator.is_free(b):
                self.allocator.reuse(b)
            else:
                self.allocator.incref(b)
        self._tables[request_id] = hits + self._allocate(self.blocks_for(num_tokens) - len(hits))
        self._num_indexed[request_id] = len(hits)
        if keys and self.prefix is not None:
            self.prefix_stats.query_tokens += num_tokens
            self.prefix_stats.hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def cache_blocks(self, request_id: str, keys: list[int], num_computed_tokens: int) -> None:
        """Index the request's blocks that are full, computed and keyed."""
        if self.prefix is None:
            return
        table = self._tables.get(request_id)
        if not table:
            return
        done = self._num_indexed.get(request_id, 0)
        full = min(len(keys), num_computed_tokens // self.block_size, len(table))
        for i in range(done, full):
            self.prefix.insert(keys[i], table[i])
        if full > done:
            self._num_indexed[request_id] = full

    def holds(self, request_id: str) -> bool:
        """True when the request has KV on the device."""
        return bool(self._tables.get(request_id))

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._host_tables

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request's KV occupies, in whichever tier it is."""
        return len(self._tables.get(request_id) or self._host_tables.get(request_id, ()))

    def free(self, request_id: str) -> int:
        """Release every block of the request in both tiers; returns how many.
        Called between steps (finish, abort) or for a recompute preemption of
        a request with no copy in flight, so the blocks are free at once."""
        table = self._tables.pop(request_id, [])
        self._num_indexed.pop(request_id, None)
        self.allocator.free(table)
        host = self._host_tables.pop(request_id, [])
        if host:
            self.host.free(host)
        return len(table) + len(host)

    # -- moves between tiers -------------------------------------------------
    def can_swap_out(self, request_id: str) -> bool:
        return self.host is not None and self.host.can_allocate(len(self._tables.get(request_id, ())))

    def swap_out(self, request_id: str) -> dict[int, int]:
        """Move a resident request's KV to the host: {device block: host block}.
        Its device blocks stay pending until the copy has run."""
        if not self.can_swap_out(request_id):
            raise ValueError(f"host pool cannot hold request {request_id!r}")
        table = self._tables.pop(request_id)
        self._num_indexed.pop(request_id, None)
        host = self.host.allocate(len(table))
        self._host_tables[request_id] = host
        # Blocks other requests still share stay (and stay cached); the rest
        # wait for the copy and leave the index, which must only point at
        # blocks that can be taken.
        self.allocator.free(table, deferred=True)
        if self.prefix is not None:
            for b in table:
                if self.allocator.refcount(b) == 0:
                    self.prefix.evict(b)
        return dict(zip(table, host))

    def can_swap_in(self, request_id: str, num_tokens: int = 0) -> bool:
        """Whether the device pool can take the request back, grown to hold
        ``num_tokens`` tokens."""
        n = max(len(self._host_tables.get(request_id, ())), self.blocks_for(num_tokens))
        return self.allocator.can_allocate(n)

    def swap_in(self, request_id: str) -> dict[int, int]:
        """Move a swapped request's KV back to the device: {host block: device
        block}. Its host blocks stay pending until the copy has run."""
        host = self._host_tables[request_id]
        if not self.allocator.can_allocate(len(host)):
            raise ValueError(f"device pool cannot take request {request_id!r} back ({len(host)} blocks)")
        del self._host_tables[request_id]
        table = self._allocate(len(host))
        self._tables[request_id] = table
        self.host.free(host, deferred=True)
        return dict(zip(host, table))

    def release_pending(self) -> None:
        """The step whose copies read the pending blocks has completed."""
        self.allocator.release_pending()
        if self.host:
            self.host.release_pending()

    # -- invariants ----------------------------------------------------------
    def check_integrity(self) -> None:
        """Every block is owned by exactly one table of its tier, pending, or
        free; no request lives in both tiers; refcounts match ownership."""
        both = self._tables.keys() & self._host_tables.keys()
        assert not both, f"requests in both tiers: {sorted(both)[:4]}"
        pools = [(self.allocator, self._tables, "device")]
        if self.host:
            pools.append((self.host, self._host_tables, "host"))
        else:
            assert not self._host_tables, "host tables without a host pool"
        if self.prefix is not None:
            pending = self.allocator.pending_blocks()
            for key, block in self.prefix.items():
                assert block not in pending, f"cached block {block} is pending"
                assert self.prefix.key_of(block) == key, f"index disagrees on block {block}"
        for alloc, tables, tier in pools:
            alloc.check_integrity()
            owned: dict[int, int] = {}
            for table in tables.values():
                for b in table:
                    owned[b] = owned.get(b, 0) + 1
            for b, n in owned.items():
                assert alloc.refcount(b) == n, (
                    f"{tier} block {b}: owned by {n} tables, refcount {alloc.refcount(b)}"
                )
            assert len(owned) + alloc.num_pending == alloc.num_used, (
                f"{tier}: {alloc.num_used} blocks in use but {len(owned)} owned and {alloc.num_pending} pending"
            )
