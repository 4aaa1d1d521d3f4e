"""KVCacheManager: per-request block tables over one device block pool.

Pure Python. The scheduler asks ``can_allocate``/``allocate`` before it puts a
request's tokens into a step; the engine reads ``block_table`` to build the
slot mapping. Memory itself is never touched here: decisions that move KV
(swap, checkpoint) leave as plain ``dict[int, int]`` maps in the StepPlan.
"""

from __future__ import annotations

from .allocator import BlockAllocator


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._tables: dict[str, list[int]] = {}

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

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks ``request_id`` still needs to hold ``num_tokens`` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.allocator.can_allocate(self.num_new_blocks(request_id, num_tokens))

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens; False (and
        no change) when the pool cannot supply the blocks."""
        need = self.num_new_blocks(request_id, num_tokens)
        if not self.allocator.can_allocate(need):
            return False
        table = self._tables.setdefault(request_id, [])
        if need:
            table.extend(self.allocator.allocate(need))
        return True

    def holds(self, request_id: str) -> bool:
        return bool(self._tables.get(request_id))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> int:
        """Release every block of the request; returns how many."""
        table = self._tables.pop(request_id, [])
        self.allocator.free(table)
        return len(table)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        owned: dict[int, int] = {}
        for rid, table in self._tables.items():
            for b in table:
                owned[b] = owned.get(b, 0) + 1
        for b, n in owned.items():
            assert self.allocator.refcount(b) == n, (
                f"block {b}: owned by {n} tables, refcount {self.allocator.refcount(b)}"
            )
        assert len(owned) == self.allocator.num_used, (
            f"{self.allocator.num_used} blocks in use but {len(owned)} owned by a table"
        )
