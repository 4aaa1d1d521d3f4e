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
"""

from __future__ import annotations

from fluidserve.kvcache.allocator import BlockAllocator


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.host = BlockAllocator(num_host_blocks) if num_host_blocks else None
        self._tables: dict[str, list[int]] = {}  # device blocks of resident requests
        self._host_tables: dict[str, list[int]] = {}  # host blocks of swapped requests

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

    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_free if self.host else 0

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
            table.extend(self.allocator.allocate(need))
        return True

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
        host = self.host.allocate(len(table))
        self._host_tables[request_id] = host
        self.allocator.free(table, deferred=True)
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
        table = self.allocator.allocate(len(host))
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
