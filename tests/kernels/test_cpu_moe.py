"""The CPU's experts (kernels/cpu_moe.py) against the torch reference, both
ways an expert can go: cpu_moe.c's one call a layer, and oneDNN's linear
over reordered weights. The same sum of each token's experts, to the
rounding of products summed in another order (fp32: 1e-5 relative; bf16: a
unit in the last place of the outputs, 2e-2; cpu_moe.c rounds bf16 once, at
the end, where the reference rounds each product)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from fluidserve.engine.parallel import can_prepack
from fluidserve.kernels import cpu_moe, reference

# A machine with a C compiler (CI's, the Docker image's) must build the
# kernel: a silent fall back to oneDNN would leave it untested.
needs_native = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                  reason="no C compiler to build cpu_moe.c")  # fmt: skip


def _case(tokens: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0, hidden: int = 64,
          inter: int = 48):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return x, w13, w2, ids, weights


def _packed(w13: torch.Tensor, w2: torch.Tensor, onednn: bool | None = None) -> cpu_moe.PackedExperts:
    if not can_prepack(w13):
        pytest.skip(f"oneDNN packs no {w13.dtype} weights on this CPU")
    return cpu_moe.pack(w13, w2, onednn)


def test_the_native_kernel_builds_here():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    assert cpu_moe.native_library() is not None


@needs_native
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_experts_keep_one_copy_beside_the_models(dtype, tol):
    """The layer holds its weights once beside the model's (the panels), in
    float32 and in bf16: experts past native_rows take oneDNN's linear over
    the model's own weights, and a reordered copy is made only when asked."""
    x, w13, w2, ids, weights = _case(64, 2, 1, dtype)  # ~32 rows an expert
    packed = _packed(w13, w2)
    assert packed.w13_panels is not None and packed.w13 is None and packed.w2 is None
    assert packed.gate_up.data_ptr() == w13.data_ptr() and packed.down.data_ptr() == w2.data_ptr()
    got = cpu_moe.fused_experts(x, packed, ids, weights, native_rows=3)
    torch.testing.assert_close(got, reference.fused_experts(x, w13, w2, ids, weights), rtol=tol, atol=tol)
    assert len(_packed(w13, w2, onednn=True).w13) == 2


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("onednn", [False, True])
def test_the_packed_layout_reads_back_to_the_stacked_weights(dtype, onednn):
    """Where the model gives its stacked weights up, they read back from
    the panels or the reordered copies, bit for bit (odd sizes: panels
    padded past the features and the hidden size); the stacks are read at
    the default rows only by bf16 panels (oneDNN takes experts past 32 rows
    from them)."""
    _, w13, w2, *_ = _case(1, 3, 1, dtype, hidden=70, inter=37)
    packed = _packed(w13, w2, onednn)
    gate_up, down = cpu_moe.stacked(packed, 37, 70)
    assert torch.equal(gate_up, w13) and torch.equal(down, w2)
    assert cpu_moe.reads_stacked(packed, dtype) == (dtype == torch.bfloat16 and not onednn)


@needs_native
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("native_rows", [None, 0, 3])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (7, 16, 4), (33, 4, 1)])
def test_experts_equal_the_reference(dtype, tol, native_rows, tokens, experts, top_k):
    """native_rows None (the default): every expert here through cpu_moe.c,
    the whole layer in one call; 0: all through oneDNN; 3: both in one call
    (experts of more rows through oneDNN)."""
    x, w13, w2, ids, weights = _case(tokens, experts, top_k, dtype)
    expected = reference.fused_experts(x, w13, w2, ids, weights)
    got = cpu_moe.fused_experts(x, _packed(w13, w2, onednn=True), ids, weights, native_rows=native_rows)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@needs_native
@pytest.mark.parametrize("hidden, inter", [(100, 40), (130, 24), (16, 8), (200, 72)])
def test_widths_off_the_kernels_vectors_and_panels(hidden, inter):
    """Hidden sizes that end inside a 16-lane vector or a 64-output panel,
    intermediate sizes off the vectors: the tails are summed and stored,
    and nothing past H is written."""
    x, w13, w2, ids, weights = _case(9, 6, 2, torch.float32, seed=3, hidden=hidden, inter=inter)
    got = cpu_moe.fused_experts(x, _packed(w13, w2), ids, weights)
    torch.testing.assert_close(got, reference.fused_experts(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


@needs_native
def test_the_avx2_build_equals_the_reference_too(monkeypatch, tmp_path):
    """CI's CPU has AVX-512, so the default build takes the AVX-512 tile; a
    build for AVX2 (three rows by 32 sums a pass, two passes a panel) must
    give the reference's sums too, on both paths and with rows past a pass."""
    if " avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("the CPU runs no AVX2")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    monkeypatch.setenv(cpu_moe.CACHE_ENV, str(tmp_path))
    flags = tuple("-march=haswell" if f == "-march=native" else f for f in cpu_moe.FLAGS)
    library = cpu_moe.load(cpu_moe.build(compiler, flags))
    monkeypatch.setattr(cpu_moe, "native_library", lambda: library)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x, w13, w2, ids, weights = _case(29, 6, 3, dtype, seed=11, hidden=100, inter=40)
        expected = reference.fused_experts(x, w13, w2, ids, weights)
        packed = _packed(w13, w2, onednn=True)
        for native_rows in (None, 10):
            got = cpu_moe.fused_experts(x, packed, ids, weights, native_rows=native_rows)
            torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@needs_native
def test_every_thread_count_gives_the_same_bits():
    """Each output is summed by one thread whatever the team's size: the
    results do not depend on how the items were shared out."""
    x, w13, w2, ids, weights = _case(24, 16, 4, torch.float32, seed=5, hidden=192, inter=96)
    packed = _packed(w13, w2)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_moe.fused_experts(x, packed, ids, weights))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_native
def test_experts_no_token_reaches_add_nothing():
    """Top-1 of 8 over 3 tokens: five experts take no row and cost no product."""
    x, w13, w2, _, _ = _case(3, 8, 1, torch.float32)
    ids = torch.tensor([[2], [2], [5]])
    weights = torch.ones(3, 1)
    got = cpu_moe.fused_experts(x, _packed(w13, w2), ids, weights)
    gate, up = torch.nn.functional.linear(x, w13[2]).chunk(2, dim=-1)
    torch.testing.assert_close(got[:2], torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[2])[:2],
                               rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[2]) > 0


def test_without_a_compiler_every_expert_takes_onednn(tmp_path):
    """CC names a compiler that fails: the library is not built, a warning
    says so, and the experts still equal the reference."""
    code = (
        "import logging, torch\n"
        "from fluidserve.kernels import cpu_moe, reference\n"
        "from fluidserve.engine.parallel import can_prepack\n"
        "logging.basicConfig()\n"
        "assert cpu_moe.native_library() is None\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x, w13, w2 = torch.randn(5, 32, generator=g), torch.randn(4, 48, 32, generator=g), "
        "torch.randn(4, 32, 24, generator=g)\n"
        "ids, w = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0]]), torch.full((5, 2), 0.5)\n"
        "if can_prepack(w13):\n"
        "    p = cpu_moe.pack(w13, w2)\n"
        "    assert p.w13_panels is None and len(p.w13) == 4\n"
        "    torch.testing.assert_close(cpu_moe.fused_experts(x, p, ids, w), "
        "reference.fused_experts(x, w13, w2, ids, w), rtol=1e-5, atol=1e-5)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, CC="false", **{cpu_moe.CACHE_ENV: str(tmp_path)})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
    assert "did not build" in done.stderr and "oneDNN alone" in done.stderr
    assert not list(tmp_path.glob("*.so"))


@needs_native
def test_the_library_is_built_once_into_the_cache(tmp_path):
    """A fresh cache folder: the first process compiles, the second loads
    the same file and leaves the folder as it was."""
    code = "from fluidserve.kernels import cpu_moe\nprint(cpu_moe.native_library()._name)\n"
    env = dict(os.environ, **{cpu_moe.CACHE_ENV: str(tmp_path)})
    env.pop("CC", None)
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    built = list(tmp_path.glob("cpu_moe-*.so"))
    assert [str(p) for p in built] == [first.stdout.strip()]
    stamp = built[0].stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.stdout.strip() == first.stdout.strip()
    assert built[0].stat().st_mtime_ns == stamp and len(list(tmp_path.iterdir())) == 1


@needs_native
def test_bfloat16_sums_in_float32_and_rounds_once_as_torch_does():
    """One expert a token, so the output is that pair's product: the bf16
    weights' product equals the float32 product over the same values,
    rounded to bf16 by torch (to nearest, ties to even), bit for bit."""
    x, w13, w2, ids, weights = _case(40, 8, 1, torch.bfloat16, seed=7, hidden=96, inter=40)
    got = cpu_moe.fused_experts(x, _packed(w13, w2), ids, weights)
    wide = cpu_moe.fused_experts(x.float(), cpu_moe.pack(w13.float(), w2.float()), ids, weights)
    assert torch.equal(got, wide.to(torch.bfloat16))


@needs_native
def test_an_expert_id_outside_the_layer_is_refused():
    x, w13, w2, ids, weights = _case(3, 4, 2, torch.float32)
    ids[1, 0] = 4
    with pytest.raises(ValueError, match="outside the layer's experts"):
        cpu_moe.fused_experts(x, _packed(w13, w2), ids, weights)
