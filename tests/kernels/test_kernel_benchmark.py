"""benchmarks/kernel_bench.py before its first GPU run: the decode, prefill and
mixed sweeps run end to end on tiny shapes (in the interpreter without CUDA,
with a call count standing in for the GPU timer), launch no new kernel
variant after the start-up warm-up, and render their report."""

from __future__ import annotations

import importlib.util
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from fluidserve.kernels import paged_attention as pa

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_bench.py"


@pytest.fixture
def bench(monkeypatch, device):
    spec = importlib.util.spec_from_file_location("fluidserve_bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    calls = []

    def one_call(fn, flush: str = "write") -> float:  # the GPU timers' stand-in: run once, recorded
        with pa.recording_variants():
            fn()
        calls.append(fn)
        flushes.append(flush)
        return 1.0

    flushes: list[str] = []

    monkeypatch.setattr(module, "bench_ms", one_call)
    monkeypatch.setattr(module, "graph_ms", one_call)  # and the in-graph timer's
    monkeypatch.setattr(module, "make_cache_batch", partial(module.make_cache_batch, device=device))
    module.calls, module.flushes = calls, flushes
    return module


def test_sweeps_run_and_add_no_variant_after_warmup(bench, device, monkeypatch):
    shape = bench.Shape(num_kv_heads=2, group=2, head_dim=32, block_size=16, dtype=torch.float32)
    probe = bench.make_cache_batch(shape, [1], [16])
    monkeypatch.setattr(pa._VARIANTS, "keys", {"attention": set(), "merge": set()})  # this test's keys only
    with pa.recording_variants():
        pa.warmup(probe["query"], probe["key_cache"])
    default = pa.variant_keys()
    bench.warm_alternatives(probe["query"], probe["key_cache"])
    warm = pa.variant_keys()
    # the fused merge's, the prefill tile as one tile's (32 keys: the same class as 64) and the fp8 cache's
    assert len(warm["attention"]) == len(default["attention"]) + 3
    report = dict(
        device="test", config={}, copy_gb_s=100.0,
        # 300 keys at batch 1 is the one point the default plan splits (two pieces on the interpreter's units)
        decode=bench.bench_decode(shape, [1, 3], [40, 200], 100.0) + bench.bench_decode(shape, [1], [300], 100.0),
        prefill=bench.bench_prefill(shape, [50]),
        mixed=bench.bench_mixed(shape, chunk=40, decodes=4, contexts=(20, 300), split_keys=64),
    )  # fmt: skip
    assert pa.variant_keys() == warm
    # decode points launched, in a graph after a write flush and after a read flush, in a graph over an fp8
    # cache, and in a graph split at 64 keys (every point is a short step),
    # the split point again with the merge fused (launched and in a graph), ours + SDPA + ours with the
    # prefill tile at 32 keys a step and as one tile, packed in one and two launches, unpacked, split unpacked,
    # and both packed plans again with each alternative prefill tile
    assert len(bench.calls) == 5 * 5 + 2 + 4 * 1 + 4 + 2 * 2
    assert bench.flushes.count("read") == 5  # one a decode point
    assert all(r["read_flush_graph_pct_of_copy"] == r["graph_pct_of_copy"] for r in report["decode"])
    assert pa.TILES == pa.Tiles()  # the alternative prefill tiles only inside their timing
    # 40 keys stay whole (0: no split), 200 keys in four 64-key pieces
    assert [r["short_split_splits"] for r in report["decode"]] == [0, 4, 0, 4, 5]
    assert [r["splits"] for r in report["decode"]] == [0, 0, 0, 0, 2]
    split = report["decode"][-1]
    assert [r for r in report["decode"] if "fused_graph_ms" in r] == [split]
    assert split["fused_graph_pct_of_copy"] == split["graph_pct_of_copy"]  # same bytes, same stand-in time
    for plan in ("unpacked", "split_unpacked"):
        assert report["mixed"][plan]["units"] == report["mixed"][plan]["items"]  # one program per item
    assert report["mixed"]["split_unpacked"]["max_splits"] > 1 >= report["mixed"]["unpacked"]["max_splits"]
    assert "decode_units" in report["mixed"]["separate"] and "decode_units" not in report["mixed"]["packed"]
    assert report["mixed"]["default"] == "packed"  # 4 short decodes: one launch
    report["variants"] = dict(warmup_s=0.0, keys_after_warmup=pa.num_variants(), keys_after_sweep=pa.num_variants(),
                              triton_after_warmup=None, triton_after_sweep=None, occupancy=[])  # fmt: skip
    # The target's own point (batch 1, 16k keys), too long for the interpreter: as the sweep records it.
    report["decode"].append(dict(split, context=16384, pct_of_copy=20.0, graph_pct_of_copy=46.0,
                                 fused_graph_pct_of_copy=52.0, read_flush_graph_pct_of_copy=61.0))  # fmt: skip
    report["targets"] = bench.targets(report)
    text = bench.markdown(report)
    assert ("decode at 16k context, batch 1: 20.0% launched, 46.0% in a graph (target >= 70%); with the split-K "
            "merge in the attention launch (`Tiles.fused_merge`): 52.0% in a graph; in a graph after a read flush: "
            "61.0%") in text
    b3 = next(r for r in report["decode"] if (r["batch"], r["context"]) == (3, 200))
    assert f"| 3 | 200 | 1.0000 | 1.0000 | {b3['read_flush_graph_pct_of_copy']:.1f} | 1.00x |" in text  # write, read
    assert "| 3 | 200 |" in text and "The engine's plan (packed (LPT" in text and "in a graph" in text
    assert "decode tiles in a launch of their own" in text
    assert "split at 64 keys" in text and "| 3 | 200 | 1 | 1.0000 | 4 | 1.0000 | 1.00x |" in text
    assert "| 1 | 300 | 2 | 1.0000 | 1.0000 | 1.0000 | 1.0000 | 1.00x |" in text  # merge kernel / fused
    # the prefill row with its timings at 32 keys a step and as one tile
    assert "| 50 | 1.000 | " in text and text.count("| 1.000 | 1.00x | 1.000 | 1.00x |") == 1, text
    assert "| 32 keys a step: ms | vs SDPA | one tile of rows: ms | vs SDPA |" in text
    assert ("prefill at the longest length: 1.00x SDPA's speed (target >= 1.0x); prefill tile, 32 keys a step: "
            "1.00x; prefill tile, one tile of rows: 1.00x") in text
    section = text.split("## Mixed batch")[1].splitlines()
    mixed = {line.split(" | ")[0]: line for line in section if line.startswith("|")}
    assert mixed["| packed (LPT + split-K), one launch"].endswith("| 1.000 | 1.000 |")  # each alternative too
    assert mixed["| packed, decode tiles in a launch of their own"].endswith("| 1.000 | 1.000 |")
    assert mixed["| unpacked"].endswith("| – | – |")


def test_decode_bytes_per_token_of_llama3_8b(bench):
    """The roofline's numerator: Llama-3-8B's weights less its embedding
    table (8.03e9 - 0.525e9 parameters) in bf16, plus the KV of the context."""
    cfg = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256)  # fmt: skip
    weights = bench.decode_bytes_per_token(cfg, 0)
    assert 14.9e9 < weights < 15.1e9
    assert bench.decode_bytes_per_token(cfg, 1000) - weights == 2 * 2 * 32 * 1000 * 8 * 128


def test_loop_counts_read_each_innermost_loop_of_the_sass(bench):
    """The compile report's per-key-loop columns: an outer loop holding an
    inner one counts only the inner one's instructions (its spills, tensor-
    core products and barriers, predicated or not); straight-line code
    counts nowhere; loops come in address order."""
    sass = """
        /*0000*/                   LDL R1, [R2] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88 ;
        /*0040*/                   STL [R1], R3 ;
        /*0050*/              @!P0 LDL.64 R4, [R1+0x8] ;
        /*0060*/                   BAR.ARV 0x1, 0x100 ;
        /*0070*/               @P1 BRA 0x10 ;
        /*0080*/                   HMMA.16816.F32.BF16 R8, R12, R14, R8 ;
        /*0090*/                   LDL R6, [R1] ;
        /*00a0*/                   BRA 0x80 ;
        /*00b0*/                   BRA 0x0 ;
        /*00c0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
    """
    assert bench.loop_counts(sass) == {"spills": [2, 1], "tensor_ops": [2, 1], "barriers": [2, 0]}
    assert bench.loop_counts("/*0000*/ EXIT ;") == {"spills": [], "tensor_ops": [], "barriers": []}


def test_decode_variant_compiles_for_hopper_without_spilling(offline_compile):
    """``--compile-only`` needs no GPU: compiled for sm_90, the decode-only
    variant of a Llama-3-8B head keeps its tile in registers (no stack
    bytes: a spill would be read back on every step of the key loop), three
    programs to an SM: at the compiler's own register count (Triton 3.9:
    147; 3.6, the GPU machines': 160), or under the cap
    ``Tiles.max_registers`` offers a compiler that takes more. With the
    merge fused into it, its key loop still spills nothing, at no fewer
    programs; five pipeline stages double-buffer its K and V without
    spilling."""
    call = "_compile_attention(8, 16, torch.bfloat16, 128, 4, False{})"
    row = offline_compile(call.format(""))
    assert row["variant"] == "decode-only" and row["num_warps"] == 4
    assert row["stack_bytes"] == 0 and row["local_bytes"] == 0
    capped = row if row["programs_per_sm"] >= 3 else offline_compile(call.format(", max_registers=168"))
    assert capped["programs_per_sm"] >= 3 and capped["stack_bytes"] == 0 and capped["registers"] <= 168
    fused = offline_compile(call.format(", fused_merge=True"))
    assert fused["loop_spills"][0] == 0 and fused["local_bytes"] == 0  # the key loop comes first
    assert fused["programs_per_sm"] >= row["programs_per_sm"]
    # The key loop reads K and V through the block table: at Triton's
    # default depth the pipeline keeps one buffer of each (every load waited
    # for before the next is issued); at Tiles.decode_num_stages=5, two.
    piped = offline_compile(call.format(", decode_num_stages=5"))
    assert row["tile_buffers"] == 1 and piped["tile_buffers"] == 2, (row, piped)
    assert piped["stack_bytes"] == 0 and piped["programs_per_sm"] >= 2


def test_decode_variant_over_an_fp8_cache_compiles_for_hopper_without_spilling(offline_compile):
    """--kv-cache-dtype fp8 on sm_90: the decode-only variant widens K and V
    to bf16 in its key loop and still keeps its tile in registers, three
    programs to an SM, with its K/V tile buffered in shared memory as the
    bf16 cache's is (the count reads fp8 tile types too)."""
    row = offline_compile("_compile_attention(8, 16, torch.bfloat16, 128, 4, False, "
                             "cache_dtype=torch.float8_e4m3fn)")
    assert row["cache_dtype"] == "float8_e4m3fn" and row["stack_bytes"] == 0 and row["local_bytes"] == 0
    assert row["programs_per_sm"] >= 3 and row["tile_buffers"] == 1 and row["loop_spills"] == [0]


def test_partials_move_16_bytes_an_instruction_and_the_merge_waits_at_no_barrier(offline_compile):
    """Compiled for sm_90: the split buffers' row strides are known
    multiples of 16 elements, so the decode tile writes its partials with
    16-byte stores and the merge kernel reads them with 16-byte loads
    (unknown alignment gives 4-byte ones, four times the instructions), and
    the merge's loops run no barrier (its sums over the pieces are reduced
    after them) nor spill."""
    decode = offline_compile("_compile_attention(8, 16, torch.bfloat16, 128, 4, False)")
    merge = offline_compile("_compile_merge(8, 16, torch.bfloat16, 128, 4)")
    # The decode tile: 16-byte loads of Q and stores of its output either
    # way (2 + 2), and its partial [16, 128] fp32 (16 values a thread) in
    # 4 more; the merge: a chunk of [32, 128] fp32, 8 a thread.
    assert decode["wide_accesses"] >= 8 and merge["wide_accesses"] >= 8, (decode, merge)
    assert merge["loop_barriers"] and not any(merge["loop_barriers"]) and not any(merge["loop_spills"]), merge
    assert merge["stack_bytes"] == 0


def test_alternative_prefill_tiles_spill_less_in_their_key_loops(offline_compile):
    """The mixed variant of a Llama-3-8B head compiled for sm_90: at 64
    keys a step the 128-row prefill tile's key loops reload spilled
    registers on every iteration. The alternatives kernel_bench.py times on
    a GPU spill less in every key loop: 32 keys a step
    (``Tiles.prefill_block_n``) nothing in the loop over the keys every row
    sees; the tile in two halves of its rows (``Tiles.prefill_halves``) at
    the same tensor-core instructions an iteration and programs per SM
    (Triton 3.6: 135 and 101 spill instructions in the prefill tile's
    loops, 3 and 20 in halves; 3.9: 66 and 68, 17 and 45)."""
    default, alt, halves = (offline_compile(f"_compile_attention(8, 16, torch.bfloat16, 128, 4, True{extra})")
                            for extra in (", prefill_halves=1", ", prefill_halves=1, prefill_block_n=32",
                                          ", prefill_halves=2"))
    assert default["prefill_block_n"] == 64 and alt["prefill_block_n"] == 32 and alt["block_n"] == 64
    # prefill tile unmasked, masked; decode tile
    assert len(default["loop_spills"]) == len(alt["loop_spills"]) == len(halves["loop_spills"]) == 3
    assert default["loop_spills"][0] > 0 and alt["loop_spills"][0] == 0
    for other in (alt, halves):
        assert all(a < d for a, d in zip(other["loop_spills"], default["loop_spills"])), (default, other)
    assert halves["loop_tensor_ops"] == default["loop_tensor_ops"], (default, halves)
    assert halves["programs_per_sm"] == default["programs_per_sm"] and halves["stack_bytes"] < default["stack_bytes"]
    # Every key loop multiplies on the tensor cores: a loop without them
    # would have fallen back to FMAs.
    assert all(n > 0 for n in default["loop_tensor_ops"] + alt["loop_tensor_ops"]), (default, alt)


def test_batch1_gemvs_compile_for_hopper_without_spilling(offline_compile):
    """The engine's GEMV launches (plain, with the RMSNorm in the prologue,
    gate/up with the SiLU-mul, both) compiled for sm_90: no spills, and
    registers for three programs of four warps per SM (64K registers), so
    what they fuse costs the projection none of the loads it keeps in
    flight. The same four as programmatic dependents, with their first
    weight step loaded ahead (and, in the "l2" mode, a bulk prefetch of
    more into L2): the same, and the grid-dependency wait in their code."""
    report = offline_compile("gemv_compile_report()")
    rows = [r for r in report if "(the engine's)" in r["variant"]]
    assert len(rows) == 4, [r["variant"] for r in rows]
    plain = [r["variant"].removesuffix(" (the engine's)") for r in rows]
    for mode, suffix in (("on", ", dependent launch"), ("l2", ", dependent launch, L2 prefetch")):
        assert [r["variant"].removesuffix(suffix) for r in report if r["mode"] == mode] == plain
    for row in rows + [r for r in report if r["dependent"]]:
        assert row["stack_bytes"] == 0 and row["local_bytes"] == 0, row
        assert row["registers"] * 128 * 3 <= 65536, row
        # the wait for the launch before is in the dependent launches' code, and only there; the L2
        # prefetch in the l2 mode's, for the up rows too where gated
        assert row["grid_dependency"] is row["dependent"], row
        gated = "gate/up" in row["variant"]
        assert row["l2_prefetches"] == (0 if row["mode"] != "l2" else 2 if gated else 1), row


def test_a_decode_mode_sets_its_switches_for_its_block_only(bench):
    """The eager variants the batch-1 benchmark times flip a process switch
    for their engine alone, and hand the engine only engine settings."""
    import dummy_models

    from fluidserve.kernels import launch, ops

    before = (ops._eager_row_kernels, launch._enabled)
    with dummy_models.decode_mode("eager-cublas") as settings:
        assert settings == dict(enforce_eager=True, async_scheduling=False)
        assert ops._eager_row_kernels is False and launch._enabled == before[1]
    with dummy_models.decode_mode("eager-no-relaunch") as settings:
        assert "relaunch" not in settings and launch._enabled is False and ops._eager_row_kernels == before[0]
    with pytest.raises(RuntimeError), dummy_models.decode_mode("eager-cublas"):
        raise RuntimeError("an engine that failed to start")
    assert (ops._eager_row_kernels, launch._enabled) == before
    with dummy_models.decode_mode("graphs") as settings:
        assert settings == dummy_models.DECODE_MODES["graphs"]
    from fluidserve.kernels import gemv

    with dummy_models.decode_mode("graphs-async-pdl") as settings:
        assert settings == dummy_models.DECODE_MODES["graphs-async"] and gemv._dependent_mode == "on"
    with dummy_models.decode_mode("graphs-async-pdl-l2-attention") as settings:
        assert settings == dummy_models.DECODE_MODES["graphs-async"] and gemv._dependent_mode == "l2"
        assert pa.TILES.launch_dependents and not pa.TILES.fused_merge
    assert gemv._dependent_mode == "off" and not pa.TILES.launch_dependents
    with dummy_models.decode_mode("graphs-fused-merge") as settings:
        assert settings == dummy_models.DECODE_MODES["graphs"] and pa.TILES.fused_merge
    assert pa.TILES == pa.Tiles()
    from fluidserve.engine import cuda_graphs

    with dummy_models.decode_mode("graphs-async-always-merge") as settings:
        assert settings == dummy_models.DECODE_MODES["graphs-async"] and cuda_graphs._direct_plans is False
    assert cuda_graphs._direct_plans is True


@pytest.mark.parametrize("mode", ["graphs-drafts", "graphs-async-drafts", "graphs-async-drafts-piecewise"])
def test_the_draft_modes_build_engines_that_draft(bench, tiny_model, make_llm, mode):
    """The batch-1 benchmark's modes with n-gram drafts hand the engine
    settings it takes (on the CPU here, where decode graphs and piecewise
    graphs run their buckets eagerly), and its greedy text drafts and keeps
    some: the figure the GPU run reports is one of drafting."""
    import dummy_models

    from fluidserve.engine import SamplingParams

    with dummy_models.decode_mode(mode) as settings:
        assert settings["speculative_config"] == dummy_models.NGRAM_DRAFTS
        llm = make_llm(tiny_model("llama"), **settings)
    llm.generate([[5 + (37 * i) % 250 for i in range(32)]], SamplingParams(temperature=0.0, max_tokens=48,
                                                                            ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0
