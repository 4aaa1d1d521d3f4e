"""Block tables of a step laid out for the device: the worker's host mirror
of every table it has been sent, and the plain fill for inputs that come
without table keys.

A step's block tables are ragged Python lists, one per row, that the attention
kernels read as one zero-padded int32 array [S, W]. Copying them element by
element costs the host ~19 ns a block: 5.6 ms a step for 256 rows of 512 to
32k tokens in 16-token blocks, every step, though a decode step adds one block
to a row every 16 tokens at most. So the worker keeps a host copy of each
table it has seen, one row per *table key* (kvcache/manager.py: under one key
a table only grows in place; any other change gives it a new key), writes
only the blocks a row gained since it last saw the key, and gathers the
step's rows with one numpy ``take`` (a memory copy)::

    mirror (rows x C)             step's tables [S, W]
    key 7  -> row 0  [ 3 9 4 0 .. ]   take rows [2, 0] ->  [ 5 6 1 8 ]   key 12
    key 12 -> row 2  [ 5 6 1 8 .. ]                        [ 3 9 4 0 ]   key 7
                      written: 4

Rows past a table's length hold zeros, so the gather pads as the plain fill
does. Rows belong to keys until the mirror runs out: then the rows of keys
the current step does not use go back (a key that comes back is rewritten
whole), and the mirror grows only when most of its rows serve this step, so
it stays within a small multiple of the largest step.
"""

from __future__ import annotations

import itertools

import numpy as np


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
    """The worker's copy of the block tables it has been sent, by table key."""

    def __init__(self, rows: int = 64, columns: int = 64) -> None:
        self._table = np.zeros((rows, columns), dtype=np.int32)  # [rows, C], zero past each written length
        self._rows: dict[int, list[int]] = {}  # key -> [row, blocks written, step last used]
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first
        self._step = 0
        self.rewritten_rows = 0  # rows written from their first block (new keys, reclaimed ones)

    def clear(self) -> None:
        """Forget every table (the worker's cache was rebuilt)."""
        self._table.fill(0)
        self._rows.clear()
        self._free = list(range(self._table.shape[0] - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return self._table.shape[0]

    def fill(self, out: np.ndarray, tables: list[list[int]], keys: list[int]) -> None:
        """Write the step's tables into ``out`` [S, W] (W at least the longest
        table), zero-padded; ``keys[i]`` is the key of ``tables[i]``. Without
        keys (warm-up steps, inputs built by hand) the tables are copied
        whole and the mirror is left as it is."""
        if not keys:
            fill_block_tables(out, tables)
            return
        if len(keys) != len(tables):
            raise ValueError(f"{len(tables)} block tables but {len(keys)} table keys")
        self._step += 1
        rows = np.empty(len(tables), dtype=np.intp)
        for i, (key, table) in enumerate(zip(keys, tables)):
            rows[i] = self._sync(key, table)
        width = min(out.shape[1], self._table.shape[1])
        np.take(self._table[:, :width], rows, axis=0, out=out[:, :width], mode="clip")  # clip: unbuffered
        out[:, width:] = 0

    def _sync(self, key: int, table: list[int]) -> int:
        """The row holding ``table`` in full, after writing what it gained."""
        entry = self._rows.get(key)
        n = len(table)
        if entry is None:
            entry = self._rows[key] = [self._take_row(), 0, 0]
            self.rewritten_rows += 1
        row, written = entry[0], entry[1]
        if n < written:
            raise ValueError(f"block table of key {key} shrank from {written} to {n} blocks: "
                             "a table that changes other than by growing needs a new key")
        if n > written:
            if n > self._table.shape[1]:
                self._widen(n)
            # fromiter reads no further than n (the engine may be growing the list
            # for its next step) and converts ~10% faster than a slice assignment.
            self._table[row, written:n] = np.fromiter(table[written:n] if written else table, np.int32, n - written)
            entry[1] = n
        entry[2] = self._step
        return row

    def _take_row(self) -> int:
        if not self._free:
            self._reclaim()
        return self._free.pop()

    def _reclaim(self) -> None:
        """Free the rows of keys this step has not used; grow the mirror
        too when fewer than a quarter of its rows came free."""
        stale = [key for key, (_, _, last) in self._rows.items() if last != self._step]
        for key in stale:
            row, written, _ = self._rows.pop(key)
            self._table[row, :written] = 0
            self._free.append(row)
        rows = self._table.shape[0]
        if 4 * len(self._free) < rows:
            grown = np.zeros((2 * rows, self._table.shape[1]), dtype=np.int32)
            grown[:rows] = self._table
            self._table = grown
            self._free[:0] = range(2 * rows - 1, rows - 1, -1)  # after the freed rows

    def _widen(self, columns: int) -> None:
        grown = np.zeros((self._table.shape[0], max(columns, 2 * self._table.shape[1])), dtype=np.int32)
        grown[:, :self._table.shape[1]] = self._table
        self._table = grown
