"""The step's block tables as the kernels read them: the plain fill of ragged
tables, and the worker's mirror that converts only what a table gained under
its key (engine/block_tables.py), whole tables or tails from the sending
side, checked against the plain fill over steps that grow, replace, retire,
reorder and resend tables."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fluidserve.engine.batch import ModelInput
from fluidserve.engine.block_tables import BlockTableMirror, BlockTableSender, fill_block_tables
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


def laid_out(mirror: BlockTableMirror, inp: ModelInput, spare: int = 0) -> np.ndarray:
    width = mirror.sync(inp)
    out = np.full((len(inp.block_tables), width + spare), -7, dtype=np.int32)
    mirror.fill(out)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tails", [False, True], ids=["whole-tables", "tails-sent"])
def test_the_mirror_lays_out_every_step_as_the_plain_fill(seed, tails):
    """Serving-like steps: tables grow in place, get replaced under a new key
    (a swap-in, a recompute) with the old one retired, leave and come back,
    in shuffled row order, into a buffer full of garbage and sometimes wider
    than the widest table; whole, or cut by the sending side to what the
    worker lacks (as the Ray executor sends them), some steps sent twice (a
    paused step resumed)."""
    rng = random.Random(seed)
    mirror, sender = BlockTableMirror(), BlockTableSender()
    live: dict[int, list[int]] = {}  # key -> table
    retired: list[int] = []
    next_key = 0
    for step in range(300):
        for _ in range(rng.randint(0, 3)):  # admissions
            live[next_key] = rng.sample(range(1, 10_000), rng.randint(0, 40))
            next_key += 1
        for key in list(live):
            roll = rng.random()
            if roll < 0.05:  # finished or swapped out
                del live[key]
                retired.append(key)
            elif roll < 0.08:  # swapped back in / recomputed: a new table under a new key
                live[next_key] = rng.sample(range(1, 10_000), len(live.pop(key)) + rng.randint(0, 3))
                retired.append(key)
                next_key += 1
            elif roll < 0.4:  # decoding into a new block
                live[key].extend(rng.sample(range(1, 10_000), rng.randint(1, 3)))
        if not live:
            continue
        keys = rng.sample(sorted(live), rng.randint(1, min(len(live), 12)))  # the step's rows, any order
        tables = [live[k] for k in keys]
        inp = ModelInput(block_tables=tables, table_keys=keys, retired_keys=retired)
        retired = []
        for _ in range(2 if rng.random() < 0.1 else 1):
            spare = rng.choice([0, 0, 5])
            out = laid_out(mirror, sender.wire(inp) if tails else inp, spare)
            assert (out == expected(tables, out.shape[1])).all(), f"step {step}"
    assert len(mirror) <= len(live)  # retired keys hold nothing


def test_only_the_blocks_a_table_gained_are_converted():
    mirror = BlockTableMirror()
    a, b = [1, 2, 3], [4]
    laid_out(mirror, ModelInput(block_tables=[a, b], table_keys=[10, 11]))
    assert mirror.converted_blocks == 4
    for _ in range(5):
        a.append(a[-1] + 10)
        out = laid_out(mirror, ModelInput(block_tables=[b, a], table_keys=[11, 10]))
        assert (out == expected([b, a], len(a))).all()
    assert mirror.converted_blocks == 9
    a += [50, 60]  # sent as the Ray executor sends: from a block the worker holds on
    out = laid_out(mirror, ModelInput(block_tables=[a[7:]], table_keys=[10], table_starts=[7]))
    assert out[0].tolist() == a and mirror.converted_blocks == 11


def test_a_table_that_shrinks_or_skips_blocks_is_refused():
    mirror = BlockTableMirror()
    mirror.sync(ModelInput(block_tables=[[1, 2, 3]], table_keys=[0]))
    with pytest.raises(ValueError, match="block table 0 shrank from 3 to 2"):
        mirror.sync(ModelInput(block_tables=[[1, 2]], table_keys=[0]))
    with pytest.raises(ValueError, match="block table 0 sent from item 4, but 3 of its items are held"):
        mirror.sync(ModelInput(block_tables=[[9]], table_keys=[0], table_starts=[4]))
    with pytest.raises(ValueError, match="block table 5 sent from item 1, but 0 of its items"):
        mirror.sync(ModelInput(block_tables=[[9]], table_keys=[5], table_starts=[1]))
    with pytest.raises(ValueError, match="2 block tables but 1 table keys"):
        mirror.sync(ModelInput(block_tables=[[1], [2]], table_keys=[0]))


def test_retired_keys_are_forgotten_even_by_a_step_of_copies_only():
    mirror = BlockTableMirror()
    mirror.sync(ModelInput(block_tables=[[1, 2], [3]], table_keys=[0, 1]))
    assert len(mirror) == 2
    mirror.sync(ModelInput(retired_keys=[0, 7]))  # 7: never sent (its table went before it ran)
    assert len(mirror) == 1
    with pytest.raises(ValueError, match="but 0 of its items are held"):
        mirror.sync(ModelInput(block_tables=[[5]], table_keys=[0], table_starts=[2]))


def test_inputs_without_keys_are_copied_whole_and_leave_the_mirror_alone():
    mirror = BlockTableMirror()
    out = laid_out(mirror, ModelInput(block_tables=[[3, 1], [4, 1, 5, 9]]), spare=2)
    assert (out == expected([[3, 1], [4, 1, 5, 9]], 6)).all() and len(mirror) == 0


def test_the_sender_cuts_each_table_to_what_the_workers_lack():
    sender = BlockTableSender()
    a = [1, 2, 3]
    first = sender.wire(ModelInput(block_tables=[a], table_keys=[4]))
    assert first.block_tables == [[1, 2, 3]] and first.table_starts == [0]
    a.append(9)
    inp = ModelInput(block_tables=[a], table_keys=[4])
    assert sender.wire(inp).block_tables == [[9]] and sender.wire(inp).block_tables == [[]]
    assert inp.block_tables == [[1, 2, 3, 9]]  # the engine's input is left whole
    again = sender.wire(ModelInput(block_tables=[[7]], table_keys=[4], retired_keys=[4]))
    assert again.block_tables == [[7]] and again.table_starts == [0]  # retired, then sent as new


def test_the_manager_keys_a_table_anew_whenever_it_is_replaced():
    """The contract the mirror relies on: under one key a device table only
    grows; admission, swap-in and recompute give a new key, never one used
    before, and every key whose table went is retired once."""
    kv = KVCacheManager(num_blocks=16, block_size=4, num_host_blocks=16)
    keys = kv.table_keys
    assert kv.take_retired_keys() == []
    assert kv.admit("a", [], 6) is not None
    first, before = keys["a"], list(kv.block_tables["a"])
    assert kv.allocate("a", 13)
    assert keys["a"] == first and kv.block_tables["a"][:len(before)] == before  # grew in place
    kv.swap_out("a")
    assert "a" not in keys and kv.take_retired_keys() == [first]
    kv.release_pending()
    kv.swap_in("a")
    swapped_in = keys["a"]
    kv.free("a")
    assert kv.allocate("a", 3)  # recomputed from scratch
    assert len({first, swapped_in, keys["a"]}) == 3
    assert kv.take_retired_keys() == [swapped_in] and kv.take_retired_keys() == []
    kv.check_integrity()
