"""benchmarks/attention_tuning.py before its GPU run: every launch shape it
sweeps is one the kernel module takes (a misspelt field would turn the
point into an error row and spend the GPU's minutes on nothing), and its
report names each shape's changes and ranks them against the default."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fluidserve.kernels import paged_attention as pa

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def tuning(monkeypatch):
    """The script, loaded as it runs: its ``from kernel_bench import`` and
    ``from dummy_models import`` find the benchmarks beside it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    for name in ("kernel_bench", "attention_tuning"):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)  # put back as it was after the test
        spec.loader.exec_module(module)
    return module


def test_every_swept_shape_is_a_launch_shape_of_the_kernel(tuning):
    points = tuning.DECODE_POINTS
    assert len(points) == len({tuple(sorted(c.items())) for c in points})
    decode = [{k: v for k, v in cfg.items() if k != "units_scale"} for cfg in points]
    assert len(tuning.PREFILL_SHAPES) == len({tuple(sorted(c.items())) for c in tuning.PREFILL_SHAPES})
    for cfg in [*tuning.PREFILL_SHAPES, *decode]:
        with pa.tiles(**cfg) as tiles:
            assert all(getattr(tiles, k) == v for k, v in cfg.items())
    assert pa.TILES == pa.Tiles()
    # The warps a point records are the ones its prefill tile runs: a 64-row tile takes the narrow warps.
    assert tuning.prefill_shape(dict(prefill_rows=64, wide_warps=8))["warps"] == pa.Tiles().narrow_warps
    assert tuning.prefill_shape(dict(wide_warps=8, mixed_max_registers=128)) == dict(
        changes="wide_warps=8, mixed_max_registers=128", prefill_rows=128, block_n=64, warps=8, num_stages=None,
        mixed_max_registers=128, halves=2)  # fmt: skip
    assert tuning.prefill_shape(dict(prefill_halves=1))["halves"] == 1


def test_the_report_ranks_each_length_against_the_default(tuning):
    def prefill(changes: dict, ms: float | None = None, error: str | None = None) -> dict:
        measured = dict(error=error) if error else dict(ms=ms, tflops=1.0, vs_sdpa=1.0 / ms, max_abs_diff=0.0)
        return dict(kind="prefill", len=8192, sdpa_ms=1.0, sdpa_backend="flash", **tuning.prefill_shape(changes),
                    **measured)  # fmt: skip

    rows = [prefill({}, 1.2), prefill(dict(prefill_block_n=32), 0.96),
            prefill(dict(wide_warps=8, mixed_max_registers=128), error="OutOfResources: shared"),
            prefill(dict(prefill_halves=1), 1.0)]
    report = dict(device="Fake GPU", copy_gb_s=4000.0, budget_s=150.0, skipped=0, rows=rows)
    md = tuning.markdown(report)
    assert "* prefill 8192: prefill_block_n=32: 1.04x SDPA (1.25x the default's speed)" in md
    assert "| 8192 | 128 | 2 | 32 | 4 | default | – | 0.960 |" in md
    assert "| 8192 | 128 | 1 | 64 | 4 | default | – | 1.000 |" in md
    assert "OutOfResources: shared" in md


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("head_major", [False, True])
def test_the_decode_floors_read_sums_every_key_and_value_once(tuning, device, paged, head_major):
    # The floor's reads stand for the attention's: each of a sequence's keys
    # and values read exactly once, split over units as the attention splits
    # them (a short last unit included), through the block table or in
    # order, in the engine's layout or head-major.
    import torch

    shape = tuning.Shape(num_kv_heads=2, group=1, head_dim=16, block_size=16, dtype=torch.float32)
    batch = tuning.make_cache_batch(shape, [1], [100], device=device)
    want = tuning.kv_read_reference(batch, 100, paged, head_major)
    for units, block_n in ((1, 16), (3, 16), (4, 32)):
        got = tuning.kv_read(batch, 100, units, block_n, paged, head_major)
        assert got.shape == (units, 2, 16)
        torch.testing.assert_close(got.sum(0), want, rtol=1e-5, atol=1e-4)
    # Each read covers its own elements of the cache: the other order or layout sums to something else.
    for other in (tuning.kv_read_reference(batch, 100, not paged, head_major),
                  tuning.kv_read_reference(batch, 100, paged, not head_major)):
        assert (want - other).abs().max() > 1.0


def test_the_report_puts_the_attention_beside_its_reads_alone(tuning):
    rows = [dict(kind="floor", read="empty kernel", graph_ms=0.0021),
            dict(kind="floor", read="through the block table", context=16384, units_scale=2, block_n=64, paged=True,
                 units=66, graph_ms=0.020, pct_of_copy=78.5, rel_err=1e-6),
            dict(kind="floor", read="blocks in order", context=16384, units_scale=1, block_n=128, paged=False,
                 units=33, graph_ms=0.018, pct_of_copy=88.0, read_flush_graph_ms=0.016, read_flush_pct_of_copy=99.0,
                 rel_err=1e-6)]  # fmt: skip
    md = tuning.markdown(dict(device="Fake GPU", copy_gb_s=4000.0, budget_s=150.0, skipped=0, rows=rows))
    assert "* reading 16384 keys alone, through the block table: 78.5% of copy (64 keys per iteration, units x2)" in md
    assert ("* reading 16384 keys alone, blocks in order: 88.0% of copy (128 keys per iteration, units x1); "
            "after a read flush 99.0%") in md
    assert "* one empty kernel in a graph: 2.1 us" in md
    assert "| 16384 | through the block table | 64 | 66 | 0.0200 | 78.5 | – | – | 1.0e-06 |" in md  # an older sweep's
    assert "| 16384 | blocks in order | 128 | 33 | 0.0180 | 88.0 | 0.0160 | 99.0 | 1.0e-06 |" in md
