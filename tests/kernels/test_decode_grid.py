"""The persistent grid's size: every program resident at once
(``paged_attention.units_per_kv_head``), and ``benchmarks/decode_grid.py``'s
knobs that time it against one unit a head more and against whole rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fluidserve.kernels import paged_attention as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
try:
    import decode_grid
finally:
    sys.path.pop(0)


@pytest.mark.parametrize("sms, per_sm, heads", [(132, 3, 8), (132, 2, 8), (114, 3, 8), (132, 3, 32), (108, 4, 5),
                                                (8, 1, 32)])  # fmt: skip
def test_every_program_of_the_grid_is_resident(sms, per_sm, heads):
    """units x heads never passes the slots (SMs x programs per SM), and no
    further unit a head would fit: rounded up, an H200's decode grid (132 x 3
    over 8 heads) took 50 units, 400 programs for 396 slots, and batch-64
    decode at 16k ran 67% of copy bandwidth against 99% (decode_grid_*.md)."""
    units = pa.units_per_kv_head(sms, per_sm, heads)
    slots = sms * per_sm
    assert units >= 1
    assert units * heads <= slots or units == 1
    assert (units + 1) * heads > slots
    if (sms, per_sm, heads) == (132, 3, 8):
        assert units == 49


def _plan(batch_rows: int, context: int, **kw):
    query = torch.zeros(batch_rows, 8, 16)
    key_cache = torch.zeros(4, 16, 2, 16)
    return pa.plan_for(query, key_cache, [1] * batch_rows, [context] * batch_rows, on_host=True, **kw)


def test_decode_grid_knobs_change_the_plan_and_restore_the_planner():
    """A decode-only plan takes the units it is given (the grid one unit a
    head wider), whole_rows keeps rows whole where the planner would cut
    them into whole waves and undoes itself."""
    base = _plan(6, 1000)  # six equal rows on the interpreter's four units: cut into waves
    assert base.num_units == pa.INTERPRETER_UNITS and base.max_splits > 0
    assert _plan(6, 1000, num_units=pa.INTERPRETER_UNITS + 1).num_units == pa.INTERPRETER_UNITS + 1
    with decode_grid.whole_rows():
        assert _plan(6, 1000).max_splits == 0
    again = _plan(6, 1000)
    assert again.num_units == base.num_units and again.max_splits == base.max_splits
    assert torch.equal(again.work, base.work)


def test_decode_grid_report_renders():
    point = dict(ms=1.0, pct_of_copy=98.91, splits=3, units=49)
    record = dict(device="NVIDIA H200", copy_gb_s=4226.0,
                  rows=[dict(batch=64, context=16384, resident_units=49, resident_waves=point,
                             resident_whole=dict(point, pct_of_copy=80.8, splits=0),
                             one_more_waves=dict(point, pct_of_copy=67.0), one_more_whole=point)])  # fmt: skip
    text = decode_grid.markdown(record)
    assert "| 64 | 16,384 | 49 | 98.9% (3 splits) | 80.8% (0 splits) | 67.0% (3 splits) | 98.9% (3 splits) |" in text
