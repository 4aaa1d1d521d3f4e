"""The step's block tables as the kernels read them: the plain fill of ragged
tables, and the worker's mirror that copies only what a table gained under
its key (engine/block_tables.py), checked against the plain fill over steps
that grow, replace, reorder and drop tables."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fluidserve.engine.block_tables import BlockTableMirror, fill_block_tables
from fluidserve.kvcache.manager import KVCacheManager


@pytest.mark.parametrize("spare", [0, 3], ids=["as-wide-as-the-widest", "wider"])
@pytest.mark.parametrize("widths", [[3, 1, 4, 1, 5], [2, 2, 2], [0, 3], [1]])
def test_block_tables_fill_like_row_by_row(widths, spare):
    """Each row its own (shuffled) blocks, zero after them, whatever sat in
    the buffer before, in a buffer as wide as the widest table or wider (a
    graph bucket's)."""
    rng = random.Random(sum(widths))
    tables = [rng.sample(range(1, 100), w) for w in widths]
    out = np.full((len(tables), max(widths) + spare), -7, dtype=np.int32)
    fill_block_tables(out, tables)
    for row, blocks in zip(out, tables):
        assert row[:len(blocks)].tolist() == blocks and not row[len(blocks):].any()


def expected(tables: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(tables), width), dtype=np.int32)
    for row, blocks in zip(out, tables):
        row[:len(blocks)] = blocks
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_mirror_lays_out_every_step_as_the_plain_fill(seed):
    """Serving-like steps from a mirror that starts small (so it widens,
    reclaims and grows): tables grow in place, get replaced under a new key
    (a swap-in, a recompute), leave and come back, in shuffled row order, into
    a buffer full of garbage and sometimes wider than the widest table."""
    rng = random.Random(seed)
    mirror = BlockTableMirror(rows=2, columns=2)
    live: dict[int, list[int]] = {}  # key -> table
    next_key = 0
    for step in range(300):
        for _ in range(rng.randint(0, 3)):  # admissions
            live[next_key] = rng.sample(range(1, 10_000), rng.randint(0, 40))
            next_key += 1
        for key in list(live):
            roll = rng.random()
            if roll < 0.05:  # finished or swapped out
                del live[key]
            elif roll < 0.08:  # swapped back in / recomputed: a new table under a new key
                live[next_key] = rng.sample(range(1, 10_000), len(live.pop(key)) + rng.randint(0, 3))
                next_key += 1
            elif roll < 0.4:  # decoding into a new block
                live[key].extend(rng.sample(range(1, 10_000), rng.randint(1, 3)))
        if not live:
            continue
        keys = rng.sample(sorted(live), rng.randint(1, min(len(live), 12)))  # the step's rows, any order
        tables = [live[k] for k in keys]
        width = max(map(len, tables)) + rng.choice([0, 0, 5])
        out = np.full((len(tables), width), -7, dtype=np.int32)
        mirror.fill(out, tables, keys)
        assert (out == expected(tables, width)).all(), f"step {step}"
    assert mirror.num_rows <= 64  # reclaimed, not grown without bound
    assert mirror.rewritten_rows >= next_key - len(live)


def test_a_growing_table_is_written_once_and_extended():
    """A row seen again under its key is extended, not rewritten; a key
    never seen, or whose row was reclaimed, is written whole."""
    mirror = BlockTableMirror(rows=2, columns=4)
    a, b, c = [1, 2, 3], [4], [5, 6]
    out = np.zeros((2, 3), dtype=np.int32)
    mirror.fill(out, [a, b], [10, 11])
    assert mirror.rewritten_rows == 2
    for _ in range(5):
        a.append(a[-1] + 10)
        out = np.zeros((2, len(a)), dtype=np.int32)
        mirror.fill(out, [b, a], [11, 10])
        assert (out == expected([b, a], len(a))).all()
    assert mirror.rewritten_rows == 2
    mirror.fill(np.zeros((1, 2), dtype=np.int32), [c], [12])  # no free row: 11 and 10 are reclaimed
    assert mirror.rewritten_rows == 3
    out = np.zeros((1, len(a)), dtype=np.int32)
    mirror.fill(out, [a], [10])
    assert mirror.rewritten_rows == 4 and out[0].tolist() == a


def test_a_table_that_shrinks_under_its_key_is_refused():
    mirror = BlockTableMirror()
    mirror.fill(np.zeros((1, 3), dtype=np.int32), [[1, 2, 3]], [0])
    with pytest.raises(ValueError, match="shrank from 3 to 2"):
        mirror.fill(np.zeros((1, 3), dtype=np.int32), [[1, 2]], [0])
    with pytest.raises(ValueError, match="2 block tables but 1 table keys"):
        mirror.fill(np.zeros((2, 3), dtype=np.int32), [[1], [2]], [0])


def test_inputs_without_keys_are_copied_whole_and_leave_the_mirror_alone():
    mirror = BlockTableMirror()
    out = np.full((2, 4), -1, dtype=np.int32)
    mirror.fill(out, [[3, 1], [4, 1, 5, 9]], [])
    assert (out == expected([[3, 1], [4, 1, 5, 9]], 4)).all() and mirror.rewritten_rows == 0


def test_the_manager_keys_a_table_anew_whenever_it_is_replaced():
    """The contract the mirror relies on: under one key a device table only
    grows; admission, swap-in and recompute give a new key, never one used
    before."""
    kv = KVCacheManager(num_blocks=16, block_size=4, num_host_blocks=16)
    keys = kv.table_keys
    assert kv.admit("a", [], 6) is not None
    first, before = keys["a"], list(kv.block_tables["a"])
    assert kv.allocate("a", 13)
    assert keys["a"] == first and kv.block_tables["a"][:len(before)] == before  # grew in place
    kv.swap_out("a")
    assert "a" not in keys
    kv.release_pending()
    kv.swap_in("a")
    swapped_in = keys["a"]
    kv.free("a")
    assert kv.allocate("a", 3)  # recomputed from scratch
    assert len({first, swapped_in, keys["a"]}) == 3
    kv.check_integrity()
