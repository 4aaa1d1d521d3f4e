"""KVCacheManager: per-request block tables over two pools of KV blocks, the
device pool and the host pool (FastServe §4.2's two tiers).

Pure Python. The scheduler asks ``can_allocate``/``allocate`` before it puts a
request's tokens into a step, and ``swap_out``/``swap_in`` to move a whole
request between the tiers. Memory itself is never touched here: a move
returns plain (source block, destination block) pairs that travel in the
StepPlan to the worker's cache engine, which does the copies: device-to-host
ones first, then host-to-device ones, then the forward.

Where a request's KV lives::

    resident (device table)    the request can run; its host table is empty
    swapped  (host table)      KV only on the host; it must be swapped in to run

A block freed by a move is the *source* of a copy that has not run yet, so
it stays pending (not reusable, and not shared: it may stay indexed) until
``release_pending()``, which the scheduler calls when the step that carried
the copy has finished.

With prefix caching, full blocks are shared: ``admit`` starts a request's
table with the longest chain of cached blocks its keys find (see
prefix_cache.py) and allocates only the rest; ``cache_blocks`` indexes a
request's blocks as they fill. A shared block's reference count is the
number of tables holding it; freed blocks keep their content (and their
index entry) until the allocator hands them out again, LRU first.

With a host pool as well, the cache spans both tiers. A cached block freed on
the device is *demoted*: copied to a host block (``demote``, a bounded number
a step) and indexed there, so when the device reuses it the prefix survives
on the host; a host hit at admission is brought back by a swap-in copy, not
recomputed. A swap-out indexes its host copies the same way and shares host
blocks that already hold a block's content instead of copying it again; a
swap-in shares device blocks that hold it. Host blocks are LRU like device
ones: free host blocks keep their content until they are handed out.

Incremental checkpointing (ConServe §4.4): ``checkpoint`` copies a resident
request's newly full blocks to the host while it keeps running (a full block
never changes again), so a later swap-out copies only what is not
checkpointed yet and frees the rest of its device blocks at once, and
``drop_to_checkpoint`` takes it off the device at no copy cost at all (what
came after the checkpoint is recomputed).

A device table only ever grows in place (``allocate`` extends it); every
other change replaces it with a new list (admission, swap-in) under a new
*table key*, an integer never reused in the process. So a reader that has copied the first
``n`` blocks of the table under a key needs only the blocks after ``n`` the
next time it sees that key: the worker's block-table mirror
(engine/block_tables.py) relies on it, and forgets a key once
``take_retired_keys`` says its table went.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from fluidserve.kvcache.allocator import BlockAllocator
from fluidserve.kvcache.prefix_cache import PrefixIndex


# Table keys are unique in the process, not just in a manager: a worker that a
# rebuilt scheduler feeds must never see an old key for a new table.
_TABLE_KEYS = itertools.count()


@dataclass
class PrefixCacheStats:
    query_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of which found cached on the device
    host_query_tokens: int = 0  # of which looked up on the host (not found on the device)
    host_hit_tokens: int = 0  # of which found on the host (brought back by copy)
    evicted_blocks: int = 0  # cached device blocks handed out for other content
    demoted_blocks: int = 0  # cached device blocks copied to the host when freed
    host_evicted_blocks: int = 0  # cached host blocks handed out for other content


@dataclass
class Admission:
    """What ``admit`` gave a request."""

    cached_tokens: int  # prompt tokens whose KV it starts with, both tiers
    host_tokens: int  # of which come back from the host this step
    swap_in: list[tuple[int, int]]  # (host block, device block) copies that bring them


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = False, cache_on_host: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.host = BlockAllocator(num_host_blocks) if num_host_blocks else None
        self._tables: dict[str, list[int]] = {}  # device blocks of resident requests
        self._table_keys: dict[str, int] = {}  # the key of each device table (grows in place, else a new key)
        self._retired: list[int] | None = None  # keys whose tables went, once take_retired_keys is called
        self._host_tables: dict[str, list[int]] = {}  # host blocks of swapped requests
        self.prefix = PrefixIndex() if enable_prefix_caching else None
        # cache_on_host=False keeps the cache device-only (a baseline to compare).
        self.host_prefix = PrefixIndex() if enable_prefix_caching and self.host and cache_on_host else None
        self.prefix_stats = PrefixCacheStats()
        self._num_indexed: dict[str, int] = {}  # leading blocks of a table already offered to the index
        self._host_keys: dict[str, list[int | None]] = {}  # keys of a swapped request's host blocks
        self._demotable: dict[int, None] = {}  # freed cached device blocks the host lacks, LRU first
        self._read_now: set[int] = set()  # device blocks a swap-out copy reads this step
        self._checkpoints: dict[str, list[int]] = {}  # host copies of a resident table's leading blocks

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
        table = self._tables.get(request_id)
        if table is None:
            table = self._set_table(request_id, [])
        if need:
            table.extend(self._allocate(need))
        return True

    def _allocate(self, n: int) -> list[int]:
        """Fresh blocks for new content: any cached prefix they held is gone
        from the device (it may live on in the host tier)."""
        blocks = self.allocator.allocate(n)
        if self.prefix is not None:
            for b in blocks:
                self.prefix_stats.evicted_blocks += self.prefix.evict(b)
                self._demotable.pop(b, None)
        return blocks

    def _host_allocate(self, n: int) -> list[int]:
        blocks = self.host.allocate(n)
        if self.host_prefix is not None:
            for b in blocks:
                self.prefix_stats.host_evicted_blocks += self.host_prefix.evict(b)
        return blocks

    def _device_copy(self, key: int | None) -> int | None:
        """The device block holding ``key``'s content that a table may take
        now: not one a copy of this step still reads (it stays indexed, and
        can be taken once the copy is done)."""
        if key is None or self.prefix is None:
            return None
        block = self.prefix.lookup(key)
        return None if block is None or self.allocator.is_pending(block) else block

    def _host_copy(self, key: int | None) -> int | None:
        """The host block holding ``key``'s content that a copy may read now
        (not one a copy of this step is still writing)."""
        if key is None or self.host_prefix is None:
            return None
        block = self.host_prefix.lookup(key)
        return None if block is None or self.host.is_pending(block) else block

    def _share(self, alloc: BlockAllocator, block: int) -> None:
        """Take one more reference to a block that holds wanted content."""
        if alloc.is_free(block):
            alloc.reuse(block)
        else:
            alloc.incref(block)

    def _read_host(self, block: int) -> None:
        """A copy reads ``block`` this step: a free one is parked pending so
        it cannot be handed out meanwhile (and becomes most recently used)."""
        if self.host.is_free(block):
            self.host.reuse(block)
            self.host.free([block], deferred=True)

    # -- prefix caching ------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        return self.prefix is not None

    def _hits(self, keys: list[int], num_tokens: int, host: bool = True) -> list[tuple[int, bool]]:
        """(block, on host) of the longest cached chain of ``keys``, each on
        the device where it is there, else on the host (with ``host``),
        leaving at least one of ``num_tokens`` to compute (something must be
        sampled from, and a shared block is never written)."""
        if self.prefix is None:
            return []
        limit = min(len(keys), (num_tokens - 1) // self.block_size)
        hits = []
        for key in keys[:limit]:
            block = self._device_copy(key)
            if block is not None:
                hits.append((block, False))
                continue
            block = self._host_copy(key) if host else None
            if block is None:
                break
            hits.append((block, True))
        return hits

    def cached_prefix_tokens(self, keys: list[int], num_tokens: int) -> int:
        """Tokens of a prompt that admission would find cached now, either tier."""
        return len(self._hits(keys, num_tokens)) * self.block_size

    def _blocks_to_admit(self, hits: list[tuple[int, bool]], num_tokens: int) -> int:
        on_device = [b for b, on_host in hits if not on_host]
        return self.blocks_for(num_tokens) - len(on_device) + sum(map(self.allocator.is_free, on_device))

    def admission_floor(self, keys: list[int], num_tokens: int, stop: int = -1) -> int:
        """A floor under ``admission``'s blocks at the cost of two lookups: as
        if every block it could share were on the device and in use. Those
        are the blocks of ``keys`` before ``stop`` when that key is in
        neither tier, for the walk of hits ends there (``stop``: where an
        earlier walk ended), else all of ``keys``."""
        if self.prefix is None:
            return self.blocks_for(num_tokens)
        shared = min(len(keys), (num_tokens - 1) // self.block_size)
        if 0 <= stop < shared and self._device_copy(keys[stop]) is None and self._host_copy(keys[stop]) is None:
            shared = stop
        return self.blocks_for(num_tokens) - shared

    def admission(self, keys: list[int], num_tokens: int) -> tuple[int, int]:
        """Free device blocks admitting a new request of ``num_tokens`` would
        use: new blocks for what is not cached on the device (host hits come
        back into new blocks), plus cached device blocks that are free; and
        where the walk of ``keys`` ended (``admission_floor``'s ``stop``)."""
        hits = self._hits(keys, num_tokens)
        return self._blocks_to_admit(hits, num_tokens), len(hits)

    def admit(self, request_id: str, keys: list[int], num_tokens: int, host: bool = True) -> Admission | None:
        """Give a request with no KV a table for ``num_tokens`` tokens, sharing
        its cached prefix (host hits, with ``host``, are copied back into new
        device blocks by the returned swap-ins); None (and no change) when the
        device pool cannot supply the rest."""
        if self._tables.get(request_id) or request_id in self._host_tables:
            raise ValueError(f"request {request_id!r} already holds KV")
        hits = self._hits(keys, num_tokens, host)
        if self._blocks_to_admit(hits, num_tokens) > self.allocator.num_free:
            return None
        # Device hits first: a fresh block for a host hit must not evict a
        # free cached block the chain shares further on.
        for block, on_host in hits:
            if not on_host:
                self._share(self.allocator, block)
        table: list[int] = []
        copies: list[tuple[int, int]] = []
        indexed = None  # leading blocks already in the device index
        for i, (block, on_host) in enumerate(hits):
            if on_host:
                indexed = i if indexed is None else indexed
                self._read_host(block)
                dst = self._allocate(1)[0]
                copies.append((block, dst))
                table.append(dst)
            else:
                table.append(block)
        table += self._allocate(self.blocks_for(num_tokens) - len(hits))
        self._set_table(request_id, table)
        # Copied-back blocks are indexed once the step has run (cache_blocks):
        # until the copy lands, no other request may read them.
        self._num_indexed[request_id] = len(hits) if indexed is None else indexed
        if keys and self.prefix is not None:
            self.prefix_stats.query_tokens += num_tokens
            self.prefix_stats.hit_tokens += (len(hits) - len(copies)) * self.block_size
            self.prefix_stats.host_hit_tokens += len(copies) * self.block_size
            if host and self.host_prefix is not None:
                self.prefix_stats.host_query_tokens += num_tokens - (len(hits) - len(copies)) * self.block_size
        return Admission(len(hits) * self.block_size, len(copies) * self.block_size, copies)

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

    @property
    def num_swapped(self) -> int:
        """Requests whose KV is on the host (swapped out or checkpointed and dropped)."""
        return len(self._host_tables)

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._host_tables

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    @property
    def block_tables(self) -> Mapping[str, list[int]]:
        """Every resident request's device block table, live: for a caller
        that reads a thousand of them a step (never to be changed)."""
        return self._tables

    @property
    def table_keys(self) -> Mapping[str, int]:
        """The key of every resident request's device table, live: a new key
        whenever the request gets a new table; under one key the table only
        grows."""
        return self._table_keys

    def take_retired_keys(self) -> list[int]:
        """The keys whose tables went (freed, swapped out, dropped to their
        checkpoint) since the last call; recorded from the first call on, so
        a manager nobody asks (the simulator's) keeps none."""
        retired, self._retired = self._retired or [], []
        return retired

    def _set_table(self, request_id: str, table: list[int]) -> list[int]:
        self._tables[request_id] = table
        self._table_keys[request_id] = next(_TABLE_KEYS)
        return table

    def _drop_table(self, request_id: str) -> list[int]:
        """Take the request's device table (empty if it has none) out of the
        manager: its key and index progress go with it."""
        key = self._table_keys.pop(request_id, None)
        if key is not None and self._retired is not None:
            self._retired.append(key)
        self._num_indexed.pop(request_id, None)
        return self._tables.pop(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request's KV occupies, in whichever tier it is."""
        return len(self._tables.get(request_id) or self._host_tables.get(request_id, ()))

    def free(self, request_id: str) -> int:
        """Release every block of the request in both tiers; returns how many.
        Called between steps (finish, abort) or for a recompute preemption of
        a request with no copy in flight, so the blocks are free at once."""
        table = self._drop_table(request_id)
        self._release_device(table)
        host = self._host_tables.pop(request_id, []) + self._checkpoints.pop(request_id, [])
        self._host_keys.pop(request_id, None)
        if host:
            self.host.free(host)  # indexed ones stay cached on the host
        return len(table) + len(host)

    def _release_device(self, table: list[int]) -> None:
        """Drop a table's references to its device blocks, which no copy of
        this step reads any more or once it has run."""
        # A block a copy of this step still reads (shared with a request
        # swapped out now) is free only once the copy is done.
        self.allocator.free([b for b in table if b not in self._read_now])
        self.allocator.free([b for b in table if b in self._read_now], deferred=True)
        if self.host_prefix is not None:
            for b in table:  # cached content the host lacks: worth a copy before it is reused
                key = self.prefix.key_of(b)
                if key is not None and self.allocator.is_free(b) and self.host_prefix.lookup(key) is None:
                    self._demotable[b] = None

    # -- incremental checkpointing ------------------------------------------
    def num_checkpointed(self, request_id: str) -> int:
        return len(self._checkpoints.get(request_id, ()))

    def checkpoint(self, request_id: str, num_computed_tokens: int, limit: int | float) -> list[tuple[int, int]]:
        """Copy up to ``limit`` of a resident request's full, computed blocks
        not checkpointed yet to the host, in table order: the (device block,
        host block) copies. A block the host already caches is shared there
        instead. The request keeps running on its device blocks."""
        table = self._tables.get(request_id)
        if self.host is None or not table:
            return []
        ckpt = self._checkpoints.setdefault(request_id, [])
        full = min(len(table), num_computed_tokens // self.block_size)
        copies: list[tuple[int, int]] = []
        while len(ckpt) < full and len(copies) < limit:
            block = table[len(ckpt)]
            key = self.prefix.key_of(block) if self.prefix is not None else None
            shared = self._host_copy(key)
            if shared is not None:
                self._share(self.host, shared)
                ckpt.append(shared)
                continue
            if not self.host.can_allocate(1):
                break
            dst = self._host_allocate(1)[0]
            if key is not None and self.host_prefix is not None:
                self.host_prefix.insert(key, dst)
            self._read_now.add(block)
            ckpt.append(dst)
            copies.append((block, dst))
        if not ckpt:
            del self._checkpoints[request_id]
        return copies

    def drop_to_checkpoint(self, request_id: str) -> int:
        """Take a resident request off the device at no copy cost: its
        checkpointed blocks become its host table, every device block is
        released now, and what came after the checkpoint is lost. Returns the
        tokens the checkpoint keeps (the request recomputes from there)."""
        ckpt = self._checkpoints.pop(request_id)
        table = self._drop_table(request_id)
        keys = [self.prefix.key_of(b) if self.prefix is not None else None for b in table[:len(ckpt)]]
        self._release_device(table)
        self._host_tables[request_id] = ckpt
        self._host_keys[request_id] = keys
        return len(ckpt) * self.block_size

    def swap_out_blocks(self, request_id: str) -> int:
        """Blocks a swap-out of the request would copy (its checkpoint aside)."""
        return len(self._tables.get(request_id, ())) - self.num_checkpointed(request_id)

    def demote(self, limit: int | float) -> list[tuple[int, int]]:
        """Copy up to ``limit`` freed cached device blocks to the host, least
        recently freed first (the next the device hands out): the (device
        block, host block) pairs of this step's copies. The device block stays
        cached but is held until the copy has run; the host block is cached
        (free, indexed) from then on."""
        pairs: list[tuple[int, int]] = []
        if self.host_prefix is None:
            return pairs
        while self._demotable and len(pairs) < limit:
            block = next(iter(self._demotable))
            del self._demotable[block]
            key = self.prefix.key_of(block)
            if key is None or not self.allocator.is_free(block) or self.host_prefix.lookup(key) is not None:
                continue
            if not self.host.can_allocate(1):
                self._demotable[block] = None
                break
            host = self._host_allocate(1)[0]
            self.host.free([host], deferred=True)  # written by this step's copy
            self.host_prefix.insert(key, host)
            self.allocator.hold(block)
            pairs.append((block, host))
        self.prefix_stats.demoted_blocks += len(pairs)
        return pairs

    # -- moves between tiers -------------------------------------------------
    def can_swap_out(self, request_id: str) -> bool:
        return self.host is not None and self.host.can_allocate(self.swap_out_blocks(request_id))

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move a resident request's KV to the host: the (device block, host
        block) copies. A block whose content the host already caches is shared
        there, not copied. Device blocks a copy reads stay pending until it has
        run; the rest are free at once."""
        if not self.can_swap_out(request_id):
            raise ValueError(f"host pool cannot hold request {request_id!r}")
        table = self._drop_table(request_id)
        keys = [self.prefix.key_of(b) for b in table] if self.prefix is not None else [None] * len(table)
        host = self._checkpoints.pop(request_id, [])  # leading blocks already there
        checkpointed = len(host)
        copies: list[tuple[int, int]] = []
        for i, (block, key) in enumerate(zip(table, keys)):
            shared = None if i < checkpointed else self._host_copy(key)
            if i < checkpointed or shared is not None:
                if shared is not None:
                    self._share(self.host, shared)
                    host.append(shared)
                # Free at once unless another swap-out of this step reads it.
                self.allocator.free([block], deferred=block in self._read_now)
            else:
                dst = self._host_allocate(1)[0]
                host.append(dst)
                copies.append((block, dst))
                self._read_now.add(block)
                self.allocator.free([block], deferred=True)
                if key is not None and self.host_prefix is not None:
                    self.host_prefix.insert(key, dst)
        self._host_tables[request_id] = host
        self._host_keys[request_id] = keys
        return copies

    def can_swap_in(self, request_id: str, num_tokens: int = 0) -> bool:
        """Whether the device pool can take the request back, grown to hold
        ``num_tokens`` tokens."""
        n = max(len(self._host_tables.get(request_id, ())), self.blocks_for(num_tokens))
        return self.allocator.can_allocate(n)

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move a swapped request's KV back to the device: the (host block,
        device block) copies. A block whose content the device caches is
        shared, not copied (the request regains its share of a common
        prefix). Its host blocks stay pending until the copies have run, and
        cached on the host after."""
        host = self._host_tables[request_id]
        if not self.allocator.can_allocate(len(host)):
            raise ValueError(f"device pool cannot take request {request_id!r} back ({len(host)} blocks)")
        del self._host_tables[request_id]
        keys = self._host_keys.pop(request_id, None) or [None] * len(host)
        # Shared blocks first, so a fresh block cannot evict one of them.
        shared = [self._device_copy(key) for key in keys]
        for block in shared:
            if block is not None:
                self._share(self.allocator, block)
        table: list[int] = []
        copies: list[tuple[int, int]] = []
        indexed = None
        for i, (src, block) in enumerate(zip(host, shared)):
            if block is not None:
                table.append(block)
                continue
            indexed = i if indexed is None else indexed
            dst = self._allocate(1)[0]
            table.append(dst)
            copies.append((src, dst))
        self._set_table(request_id, table)
        self._num_indexed[request_id] = len(table) if indexed is None else indexed
        self.host.free(host, deferred=True)
        return copies

    def release_pending(self) -> None:
        """The step whose copies read the pending blocks has completed."""
        self.allocator.release_pending()
        self._read_now.clear()
        if self.host:
            self.host.release_pending()

    # -- invariants ----------------------------------------------------------
    def check_integrity(self) -> None:
        """Every block is owned by exactly one table of its tier, pending, or
        free; no request lives in both tiers; refcounts match ownership."""
        both = self._tables.keys() & self._host_tables.keys()
        assert not both, f"requests in both tiers: {sorted(both)[:4]}"
        assert self._table_keys.keys() == self._tables.keys(), "a device table without its key, or a key without one"
        assert self._checkpoints.keys() <= self._tables.keys(), "a checkpoint of a request not resident"
        for rid, ckpt in self._checkpoints.items():
            assert len(ckpt) <= len(self._tables[rid]), f"{rid}: checkpoint longer than its table"
        pools = [(self.allocator, self._tables, "device")]
        if self.host:
            host_owners = {**self._host_tables, **{(r, "checkpoint"): c for r, c in self._checkpoints.items()}}
            pools.append((self.host, host_owners, "host"))
        else:
            assert not self._host_tables, "host tables without a host pool"
        if self.prefix is not None:
            for key, block in self.prefix.items():
                assert self.prefix.key_of(block) == key, f"index disagrees on block {block}"
        if self.host_prefix is not None:
            for key, block in self.host_prefix.items():
                assert self.host_prefix.key_of(block) == key, f"host index disagrees on block {block}"
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


# -- slots ----------------------------------------------------------------------


def slot_of(table: list[int], position: int, block_size: int) -> int:
    """The KV slot (block * block_size + offset) of a token position."""
    return table[position // block_size] * block_size + position % block_size


def slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV slots of positions ``start .. end - 1``."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
