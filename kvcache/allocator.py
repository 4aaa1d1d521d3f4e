"""BlockAllocator: the free list and reference counts of one pool of KV blocks.

Ints only, no torch: the scheduler, the simulator and the tests use it as is.

A block freed while an in-flight copy still reads it (the source of a swap)
must not be handed out again before that copy is done, or the next owner's
writes could race the copy. ``free(..., deferred=True)`` parks such blocks as
*pending*; ``release_pending()`` returns them to the free list once the step
that issued the copy has completed.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Raised when more blocks are asked for than are free."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
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
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        if self._refcount[block] < 1:
            raise ValueError(f"block {block} is free")
        self._refcount[block] += 1

    def free(self, blocks: list[int], deferred: bool = False) -> None:
        """Drop one reference to each block; a block whose last reference
        goes is free at once, or pending when ``deferred``."""
        dest = self._pending if deferred else self._free
        for b in blocks:
            if self._refcount[b] < 1:
                raise ValueError(f"double free of block {b}")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                dest.append(b)

    def release_pending(self) -> int:
        """The copies reading pending blocks are done: make them reusable."""
        n = len(self._pending)
        self._free.extend(self._pending)
        self._pending.clear()
        return n

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def check_integrity(self) -> None:
        free = set(self._free)
        pending = set(self._pending)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert len(pending) == len(self._pending), "a block is pending twice"
        assert not free & pending, f"blocks both free and pending: {sorted(free & pending)[:8]}"
        for b, rc in enumerate(self._refcount):
            assert rc >= 0, f"block {b} has negative refcount {rc}"
            idle = b in free or b in pending
            assert (rc == 0) == idle, f"block {b}: refcount {rc} but free={b in free} pending={b in pending}"
