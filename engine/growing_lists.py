"""GrowingLists: numpy copies of Python int lists that only ever grow, by
key, each converted only as far as it has grown.

The worker reads two kinds of such lists every step, and both can be long:
a sequence's block table (engine/block_tables.py) and a sequence's prompt
and output tokens, which the repetition, presence and frequency penalties
count (engine/token_history.py). Turning a Python list into numpy costs
~15-20 ns an element, so doing it whole every step costs the host time in
proportion to the context, for every row, every step; a step adds one block
to a table every 16 tokens and one token to a history. So each list is kept
here under a key its owner guarantees only grows (a list that changed
otherwise comes under a new key), and ``take`` converts what it gained since
the key was last seen::

    key -> store [ 3 9 4 1 . . . . ]  (room to grow)
           held  [ 3 9 4 1 ]          (the view ``take`` returns)

A caller may also hand over a list from some item on (``start``): the items
before it are the ones already held, so a sender that knows what a receiver
holds sends only the rest (the Ray executor's block tables).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np


class GrowingLists:
    """Append-only int lists as int32 numpy views, by key."""

    def __init__(self, what: str = "list") -> None:
        self.what = what  # how errors name a list ("block table")
        self._store: dict[Hashable, np.ndarray] = {}  # key -> its items, with room to grow
        self._held: dict[Hashable, np.ndarray] = {}  # key -> the view of the items it holds
        self.converted = 0  # items turned from Python ints into numpy, over the object's life

    def __len__(self) -> int:
        return len(self._held)

    @property
    def held(self) -> Mapping[Hashable, np.ndarray]:
        """Each key's view, live: for a caller's fast path that checks a
        length (never to be changed)."""
        return self._held

    def clear(self) -> None:
        self._store.clear()
        self._held.clear()

    def drop(self, key: Hashable) -> None:
        self._store.pop(key, None)
        self._held.pop(key, None)

    def take(self, key: Hashable, items: list[int], start: int = 0) -> np.ndarray:
        """The view of key's list once ``items``, the list from item
        ``start`` on, is in."""
        view = self._held.get(key)
        held = 0 if view is None else len(view)
        if start > held:
            raise ValueError(f"{self.what} {key!r} sent from item {start}, but {held} of its items are held")
        n = start + len(items)
        if n < held:
            raise ValueError(f"{self.what} {key!r} shrank from {held} to {n} items: "
                             "a list that changes other than by growing needs a new key")
        if view is not None and n == held:
            return view
        store = self._store.get(key)
        if store is None or n > len(store):
            grown = np.empty(max(n, 2 * held, 16), dtype=np.int32)
            grown[:held] = view if view is not None else ()
            store = self._store[key] = grown
        # count bounds the read: the owner may be growing the list meanwhile.
        store[held:n] = np.fromiter(items[held - start:] if held > start else items, np.int32, n - held)
        self.converted += n - held
        view = self._held[key] = store[:n]
        return view
