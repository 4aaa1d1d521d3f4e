"""Prefix caching: content keys of full KV blocks, and the index from a key
to the block that holds it (one index per tier: kvcache/manager.py keeps a
device index and, with a host pool, a host index).

A full block's key hashes its tokens together with its parent's key (the
block before it in the sequence), so equal keys mean an equal prefix up to
and including that block. Only full blocks get keys: a partial block is
still being written. A request's ``cache_salt`` (vLLM's) and its LoRA
adapter pick the root its first block hangs from (``salted_root``):
requests share cached blocks only with requests of the same salt, so one
tenant cannot time another's prompts through the cache, and of the same
adapter, whose KV differs from every other's.

The index only points at blocks; what keeps a block alive is its reference
count in the allocator. A block whose count drops to 0 stays in the index
while it sits on the free list (least recently freed first) or waits there
for a copy to finish, and is dropped from it when the allocator hands it out
for other content.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT_KEY = 0  # the parent of a sequence's first block


def salted_root(salt: str | None, adapter: int | None = None) -> int:
    """The parent of the first block of a request with this ``cache_salt``,
    generating with the LoRA adapter of cache key ``adapter`` (None: the
    base model, whose KV no adapter's matches)."""
    if adapter is not None:
        return hash(("lora", adapter, salt))
    return ROOT_KEY if salt is None else hash(("cache_salt", salt))


def block_keys(token_ids: Sequence[int], block_size: int, keys: list[int] | None = None,
               root: int = ROOT_KEY) -> list[int]:
    """Keys of every full block of ``token_ids``; with ``keys`` (the keys of
    a prefix of it), only the missing ones are computed and appended."""
    keys = [] if keys is None else keys
    for start in range(len(keys) * block_size, len(token_ids) - block_size + 1, block_size):
        keys.append(chain_key(keys[-1] if keys else root, token_ids[start:start + block_size]))
    return keys


def chain_key(parent: int, block_tokens: Sequence[int]) -> int:
    """The key of a full block of ``block_tokens`` after the block ``parent``."""
    return hash((parent, tuple(block_tokens)))


class PrefixIndex:
    """key -> block of one pool, and back."""

    def __init__(self) -> None:
        self._block: dict[int, int] = {}
        self._key: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._block)

    def lookup(self, key: int) -> int | None:
        return self._block.get(key)

    def insert(self, key: int, block: int) -> None:
        """Index ``block`` under ``key``, unless the key is already held (an
        equal block computed twice keeps the first) or the block is."""
        if key not in self._block and block not in self._key:
            self._block[key] = block
            self._key[block] = key

    def evict(self, block: int) -> bool:
        """The block's content is about to change: drop it from the index."""
        key = self._key.pop(block, None)
        if key is None:
            return False
        del self._block[key]
        return True

    def items(self):
        return self._block.items()

    def key_of(self, block: int) -> int | None:
        return self._key.get(block)
