"""BlockAllocator: the free list and reference counts of one pool of KV blocks.

Ints only, no torch: the scheduler, the simulator and the tests use it as is.

The free list is ordered, least recently freed first, and any block can be
taken out of it by id (``reuse``): a free block may still hold a cached
prefix (kvcache/prefix_cache.py), and a cache hit takes it back, while
``allocate`` hands out the least recently freed, i.e. evicts LRU first.

A block freed while an in-flight copy still reads it (the source of a swap)
must not be handed out again before that copy is done, or the next owner's
writes could race the copy. ``free(..., deferred=True)`` parks such blocks as
*pending*; ``release_pending()`` returns them to the free list once the step
that issued the copy has completed.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    """Raised when more blocks are asked for than are free."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # Insertion order = LRU first. An OrderedDict, not a dict: taking the
        # first key of a plain dict again and again walks over the holes its
        # earlier deletions left (O(deleted) per call until it resizes, 11 us
        # a block at 1024 running requests); popitem(last=False) is O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._pending: list[int] = []  # refcount 0, not yet reusable
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (pending ones excluded)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks owned by someone, or still being read by a copy."""
        return self.num_blocks - len(self._free)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        pop, refcount = self._free.popitem, self._refcount
        blocks = [pop(last=False)[0] for _ in range(n)]
        for b in blocks:
            refcount[b] = 1
        return blocks

    def is_free(self, block: int) -> bool:
        return block in self._free

    def is_pending(self, block: int) -> bool:
        return self._refcount[block] == 0 and block not in self._free

    def reuse(self, block: int) -> None:
        """Take a free block back by id (a prefix-cache hit), refcount 1."""
        del self._free[block]
        self._refcount[block] = 1

    def hold(self, block: int) -> None:
        """Park a free block as pending without an owner: a copy is about to
        read it (its content is being kept elsewhere), so it must not be
        handed out before ``release_pending``."""
        del self._free[block]
        self._pending.append(block)

    def incref(self, block: int) -> None:
        if self._refcount[block] < 1:
            raise ValueError(f"block {block} is free")
        self._refcount[block] += 1

    def free(self, blocks: list[int], deferred: bool = False) -> None:
        """Drop one reference to each block; a block whose last reference
        goes is free at once, or pending when ``deferred``."""
        for b in blocks:
            if self._refcount[b] < 1:
                raise ValueError(f"double free of block {b}")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if deferred:
                    self._pending.append(b)
                else:
                    self._free[b] = None

    def release_pending(self) -> int:
        """The copies reading pending blocks are done: make them reusable."""
        n = len(self._pending)
        self._free.update(dict.fromkeys(self._pending))
        self._pending.clear()
        return n

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def check_integrity(self) -> None:
        free = set(self._free)
        pending = set(self._pending)
        assert len(pending) == len(self._pending), "a block is pending twice"
        assert not free & pending, f"blocks both free and pending: {sorted(free & pending)[:8]}"
        for b, rc in enumerate(self._refcount):
            assert rc >= 0, f"block {b} has negative refcount {rc}"
            idle = b in free or b in pending
            assert (rc == 0) == idle, f"block {b}: refcount {rc} but free={b in free} pending={b in pending}"
