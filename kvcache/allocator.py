"""BlockAllocator: the free list and reference counts of one pool of KV blocks.

Ints only, no torch: the scheduler, the simulator and the tests use it as is.
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
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

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

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refcount[b] < 1:
                raise ValueError(f"double free of block {b}")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, rc in enumerate(self._refcount):
            assert rc >= 0, f"block {b} has negative refcount {rc}"
            assert (rc == 0) == (b in free), f"block {b}: refcount {rc} but free={b in free}"
