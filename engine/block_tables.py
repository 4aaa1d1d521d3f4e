"""Block tables of a step laid out for the device: the worker's host mirror
of every live table it has been sent, and the plain fill for inputs that
come without table keys.

A step's block tables are ragged Python lists, one per row, that the attention
kernels read as one zero-padded int32 array [S, W]. Copying them element by
element costs the host ~19 ns a block: 5.6 ms a step for 256 rows of 512 to
32k tokens in 16-token blocks, every step, though a decode step adds one block
to a row every 16 tokens at most. So the worker keeps a numpy copy of each
table it has seen (engine/growing_lists.py), by *table key*
(kvcache/manager.py: under one key a table only grows in place; any other
change gives it a new key and retires the old one), converts only the blocks
a table gained since it last saw the key, and lays out the step with a copy
per row::

    mirror                               step's tables [S, W]
    key 7  -> [ 3 9 4 . . . ]  n = 3       [ 5 6 1 8 ]   key 12
    key 12 -> [ 5 6 1 8 . . ]  n = 4       [ 3 9 4 0 ]   key 7

An input may carry a table from some block on (``ModelInput.table_starts``):
the blocks before it are the ones the worker already holds under that key.
That is how the Ray executor sends tables (engine/executor/ray.py): a
decode step crosses to each rank with the blocks its rows gained, not whole
tables. So the worker may never forget a key on its own; a key's copy goes
when the engine says the table is gone (``ModelInput.retired_keys``, sent
with the next step), and the mirror holds the resident requests' tables and
those that went since the last step, no more.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from fluidserve.engine.batch import ModelInput
from fluidserve.engine.growing_lists import GrowingLists


def fill_block_tables(out: np.ndarray, tables: list[list[int]]) -> None:
    """Write ragged block tables into ``out`` [S, W], zero-padded, with a
    fixed number of numpy calls: no Python-level work per row but a length."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))  # [S]
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    if lens.min(initial=out.shape[1]) == out.shape[1]:  # every table as wide as the widest: no padding
        out.reshape(-1)[:] = flat
        return
    out.fill(0)
    # Row r's blocks fill its first lens[r] columns: a mask of those cells
    # takes the concatenated tables in order (a boolean assignment runs in
    # row-major order), a fraction of the time of scattering them to
    # computed (row, column) indices.
    out[np.arange(out.shape[1]) < lens[:, None]] = flat


class BlockTableMirror:
    """The worker's copy of the live block tables it has been sent, by key.
    ``sync`` takes a step's input in (once per input, however often it is
    laid out); ``fill`` writes the step's tables where the kernels read them."""

    def __init__(self) -> None:
        self._tables = GrowingLists("block table")
        self._synced: ModelInput | None = None
        self._rows: list[np.ndarray] = []  # the synced step's tables (views), in row order
        self._plain: list[list[int]] | None = None  # the synced step's tables, when it came without keys
        self.width = 0  # the synced step's longest table

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def converted_blocks(self) -> int:
        """Blocks turned from Python ints into the mirror's, over its life."""
        return self._tables.converted

    def clear(self) -> None:
        """Forget every table (the worker's cache was rebuilt)."""
        self._tables.clear()
        self._synced, self._rows, self._plain = None, [], None

    def sync(self, inp: ModelInput) -> int:
        """Take in the step's tables (retired keys first); returns the
        longest table's length. The worker takes each input in as it
        arrives, and the step's layout asks again: a keyed input already
        taken in is not gone through twice."""
        if inp is self._synced and inp.table_keys:
            return self.width
        for key in inp.retired_keys:
            self._tables.drop(key)
        tables, keys = inp.block_tables, inp.table_keys
        if not keys:
            self._synced, self._rows, self._plain = inp, [], tables
            self.width = inp.longest_table()
            return self.width
        if len(keys) != len(tables):
            raise ValueError(f"{len(tables)} block tables but {len(keys)} table keys")
        held, take, rows = self._tables.held, self._tables.take, []
        for key, table, start in zip(keys, tables, inp.table_starts or itertools.repeat(0)):
            view = held.get(key)
            # Most rows of a decode step gained nothing: their view stands.
            rows.append(view if view is not None and len(view) == start + len(table) else take(key, table, start))
        self._synced, self._rows, self._plain = inp, rows, None
        self.width = max(map(len, rows), default=0)
        return self.width

    def fill(self, out: np.ndarray) -> None:
        """The synced step's tables into ``out`` [S, W >= width], zero-padded."""
        if self._plain is not None:
            fill_block_tables(out, self._plain)
            return
        out.fill(0)
        for i, blocks in enumerate(self._rows):
            out[i, :len(blocks)] = blocks


class BlockTableSender:
    """The sending side of the mirror, for an executor whose workers live in
    other processes: what it has sent of each key's table, so a step sends
    each table from the first block the workers lack (``table_starts``).
    Every worker must take every input it sends, in order."""

    def __init__(self) -> None:
        self._sent: dict[int, int] = {}  # key -> blocks the workers hold

    def clear(self) -> None:
        """The workers forgot every table (their caches were rebuilt)."""
        self._sent.clear()

    def wire(self, inp: ModelInput) -> ModelInput:
        """``inp`` with each table cut to what the workers lack (the same
        input when it has no keys)."""
        if not inp.table_keys:
            return inp
        sent = self._sent
        for key in inp.retired_keys:
            sent.pop(key, None)
        starts, tails = [], []
        for key, table in zip(inp.table_keys, inp.block_tables):
            start, n = sent.get(key, 0), len(table)
            starts.append(start)
            tails.append(table[start:n])
            sent[key] = n
        return dataclasses.replace(inp, block_tables=tails, table_starts=starts)
