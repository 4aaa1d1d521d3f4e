"""The batch-1 linear kernel (kernels/gemv.py) and ``ops.linear``, which
runs it: against the product in float64, with and without a bias and a
residual, fp32 in the interpreter and fp16/bf16 too on a GPU; which inputs
it takes; and on a GPU that eager calls and a captured decode graph run
it, and that eager calls keep cuBLAS with the row kernels switched off."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from fluidserve.kernels import gemv, ops
from fluidserve.kernels.launch import cdiv

DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if torch.cuda.is_available() else [])
# (atol, rtol) against float64 of unit-variance inputs scaled by K^-1/2
# (outputs ~1): fp32 is reduction order alone; half types one rounding of
# the output (2^-11, 2^-8 relative), plus the residual's magnitude.
CLOSE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def operands(device, dtype, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
    x = torch.randn(1, k, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    residual = torch.randn(1, n, generator=gen).to(device, dtype)
    return x, w, bias, residual


def exact(x, w, bias=None, residual=None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(37, 64), (96, 1536), (5, 48)])  # ragged rows; BLOCK_K 64, 512, 16
def test_gemv_matches_the_product_with_bias_and_residual(device, dtype, n, k):
    x, w, bias, residual = operands(device, dtype, n, k, seed=n * k)
    atol, rtol = CLOSE[dtype]
    for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
        into = None if r is None else r.clone()
        y = gemv.gemv(x, w, b, into)
        assert y.shape == (1, n) and y.dtype == dtype
        torch.testing.assert_close(y.double(), exact(x, w, b, r), atol=atol, rtol=rtol)
        if r is not None:
            assert y.data_ptr() == into.data_ptr()  # accumulated in place, as addmm_ does


def test_gemv_refuses_what_it_cannot_run(device):
    x, w, bias, residual = operands(device, torch.float32, 32, 64, seed=1)
    assert gemv.supports(x, w, None, None)
    refused = [
        (torch.cat([x, x]), w, None, None),  # two rows
        (x[:, :40], w[:, :40], None, None),  # K = 40, no power-of-two step >= 16 divides it
        (x.double(), w, None, None),  # dtypes differ
        (x, w.t().contiguous().t(), None, None),  # weight rows not contiguous
        (x, w, bias[:16], None),  # bias of the wrong length
        (x, w, None, residual.t().contiguous()[:16].t()),  # residual too short
    ]
    for args in refused:
        assert not gemv.supports(*args)
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv.gemv(torch.cat([x, x]), w)


def test_ops_linear_runs_the_gemv_for_one_row_on_the_triton_lane(device, monkeypatch):
    """On CPU tensors with FLUIDSERVE_KERNELS=triton (CI's GPU-path lane),
    one row takes the kernel and more rows keep torch; the residual is
    accumulated in place either way, and a bias with a residual is rounded
    before the add, as the unfused sum is."""
    if device == "cuda":
        pytest.skip("on a GPU the graph test below covers the dispatch")
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    x, w, bias, residual = operands(device, torch.float32, 48, 64, seed=2)
    torch.testing.assert_close(ops.linear(x, w), gemv.gemv(x, w), atol=0, rtol=0)
    into = residual.clone()
    assert ops.linear(x, w, None, into).data_ptr() == into.data_ptr()
    torch.testing.assert_close(into, gemv.gemv(x, w, None, residual.clone()), atol=0, rtol=0)
    torch.testing.assert_close(ops.linear(x, w, bias, residual), gemv.gemv(x, w, bias) + residual, atol=0, rtol=0)
    two = torch.cat([x, -x])
    torch.testing.assert_close(ops.linear(two, w, bias), F.linear(two, w, bias), atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_captured_graph_and_eager_run_the_gemv_and_the_switch_keeps_cublas(dtype):
    """A Llama-3-8B-sized output projection with its residual: eager and
    inside a captured graph ``ops.linear`` is the kernel's result to the
    bit; with the eager row kernels off, eager it is ``addmm_``'s; all
    within one rounding of the exact product."""
    x, w, _, residual = operands(torch.device("cuda"), dtype, 4096, 4096, seed=3)
    torch.testing.assert_close(ops.linear(x, w, None, residual.clone()), gemv.gemv(x, w, None, residual.clone()),
                               atol=0, rtol=0)  # fmt: skip
    was_on = ops.set_eager_row_kernels(False)
    try:
        eager = ops.linear(x, w, None, residual.clone())
    finally:
        ops.set_eager_row_kernels(was_on)
    torch.testing.assert_close(eager, residual.clone().addmm_(x, w.t()), atol=0, rtol=0)
    into = residual.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compile) outside the capture
        gemv.gemv(x, w, None, residual.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.linear(x, w, None, into)
    into.copy_(residual)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(into, gemv.gemv(x, w, None, residual.clone()), atol=0, rtol=0)
    atol, rtol = CLOSE[dtype]
    for y in (into, eager):
        torch.testing.assert_close(y.double(), exact(x, w, None, residual), atol=atol, rtol=rtol)


# -- the gate/up projection with SiLU-mul in its epilogue ----------------------------


# bf16 in the interpreter too: where the fused epilogue rounds is what fp32 cannot show
@pytest.mark.parametrize("dtype", sorted({*DTYPES, torch.bfloat16}, key=str))
@pytest.mark.parametrize("inter,k", [(37, 64), (96, 1536), (5, 48)])  # ragged halves; BLOCK_K 64, 512, 16
def test_gated_gemv_is_the_projection_then_the_activation_to_the_bit(device, dtype, inter, k):
    """One launch gives what the gate/up GEMV followed by the SiLU-mul
    kernel gives, bit for bit (the MLP's tokens cannot change with the
    fusion), and that is silu(gate) * up of the exact product within the
    dtype's rounding."""
    from fluidserve.kernels import activation

    x, w, _, _ = operands(device, dtype, 2 * inter, k, seed=inter + k)
    fused = gemv.gemv_silu_and_mul(x, w)
    assert fused.shape == (1, inter) and fused.dtype == dtype
    torch.testing.assert_close(fused, activation.silu_and_mul(gemv.gemv(x, w)), atol=0, rtol=0)
    gate, up = exact(x, w).chunk(2, dim=-1)
    atol, rtol = CLOSE[dtype]
    torch.testing.assert_close(fused.double(), F.silu(gate) * up, atol=atol, rtol=rtol)


def test_gated_gemv_refuses_what_it_cannot_run(device):
    x, w, _, _ = operands(device, torch.float32, 33, 64, seed=4)
    assert not gemv.supports_gated(x, w)  # 33 rows do not halve
    with pytest.raises(ValueError, match="even number of weight rows"):
        gemv.gemv_silu_and_mul(x, w)
    assert not gemv.supports_gated(torch.cat([x, x]), w[:32])


def test_ops_linear_silu_and_mul_is_one_launch_for_one_row_on_the_triton_lane(device, monkeypatch):
    """On the Triton lane one row takes the gated GEMV, one launch; more
    rows, or a bias, keep the product and the activation apart. Every
    route gives the unfused ops' result to the bit."""
    if device == "cuda":
        pytest.skip("on a GPU the graph test below covers the dispatch")
    from fluidserve.kernels import activation

    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    x, w, bias, _ = operands(device, torch.float32, 96, 64, seed=5)
    launches = []
    for kernel in (gemv._gemv_kernel, activation._silu_and_mul_kernel):
        # In the instance's dict, which the undo empties again: a method restored by setattr would stay there,
        # hiding the class's run from later tests that patch it (op_counts' launch counter).
        monkeypatch.setitem(vars(kernel), "run", (lambda run, name: lambda *a, **k: launches.append(name) or run(
            *a, **k))(kernel.run, kernel.fn.__name__))
    unfused = ops.silu_and_mul(ops.linear(x, w))
    assert launches == ["_gemv_kernel", "_silu_and_mul_kernel"]
    launches.clear()
    torch.testing.assert_close(ops.linear_silu_and_mul(x, w), unfused, atol=0, rtol=0)
    assert launches == ["_gemv_kernel"]
    two = torch.cat([x, -x])
    torch.testing.assert_close(ops.linear_silu_and_mul(two, w), ops.silu_and_mul(F.linear(two, w)), atol=0, rtol=0)
    torch.testing.assert_close(ops.linear_silu_and_mul(x, w, bias), ops.silu_and_mul(ops.linear(x, w, bias)),
                               atol=0, rtol=0)  # fmt: skip


# -- the batch-1 layer's other fusions: the RMSNorm in the prologue, an unfused add ----


@pytest.mark.parametrize("dtype", sorted({*DTYPES, torch.bfloat16}, key=str))
@pytest.mark.parametrize("n,k", [(74, 64), (96, 1536), (10, 48)])  # even rows, for the gated launch too
def test_gemv_with_the_norm_in_its_prologue_is_the_norm_then_the_gemv(device, dtype, n, k):
    """``norm=``: the row RMS-normalised as kernels/fused_norm.py does it,
    then multiplied; plain and gated. In the interpreter the same bits as
    the two (three) launches; compiled, the sum of squares may be taken in
    another order, so within a rounding of the output."""
    from fluidserve.kernels import activation, fused_norm

    x, w, bias, _ = operands(device, dtype, n, k, seed=n + k)
    x = x * 3  # a norm that is not ~1
    gen = torch.Generator().manual_seed(k)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(device, dtype)
    normed = fused_norm.rms_norm(x.clone(), norm_weight, 1e-5)[0]
    exact_bits = device == "cpu"
    atol, rtol = (0, 0) if exact_bits else CLOSE[dtype]
    for b in (None, bias):
        fused = gemv.launch(x, w, b, None, norm=(norm_weight, 1e-5))
        torch.testing.assert_close(fused, gemv.gemv(normed, w, b), atol=atol, rtol=rtol)
    fused = gemv.launch(x, w, None, None, norm=(norm_weight, 1e-5), gated=True)
    torch.testing.assert_close(fused, activation.silu_and_mul(gemv.gemv(normed, w)), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", sorted({*DTYPES, torch.bfloat16}, key=str))
def test_gemv_adding_a_residual_as_a_separate_add_leaves_it_as_it_is(device, dtype):
    """``round_before_residual`` into a fresh ``out``: the product rounded,
    then the residual added, as the residual-add kernel adds
    (kernels/fused_norm.py), bit for bit; the residual is untouched."""
    from fluidserve.kernels import fused_norm

    x, w, _, residual = operands(device, dtype, 96, 1536, seed=7)
    kept = residual.clone()
    out = gemv.launch(x, w, None, residual, out=torch.empty_like(residual), round_before_residual=True)
    assert torch.equal(residual, kept) and out.data_ptr() != residual.data_ptr()
    apart = fused_norm.rms_norm(gemv.gemv(x, w), torch.ones(96, dtype=dtype, device=device), 1e-5, residual)[1]
    torch.testing.assert_close(out, apart, atol=0, rtol=0)
    assert not torch.equal(out, gemv.gemv(x, w, None, residual.clone())) or dtype == torch.float32  # one rounding


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_captured_graph_runs_the_gated_gemv_to_the_bit(dtype):
    """A Llama-3-8B-sized gate/up projection (2 x 14336 rows): captured, the
    one launch equals the GEMV and the SiLU-mul kernel run apart, bit for
    bit, eager too; with the eager row kernels off, eager keeps cuBLAS and
    the activation kernel."""
    from fluidserve.kernels import activation

    x, w, _, _ = operands(torch.device("cuda"), dtype, 2 * 14336, 4096, seed=6)
    apart = activation.silu_and_mul(gemv.gemv(x, w))
    torch.testing.assert_close(ops.linear_silu_and_mul(x, w), apart, atol=0, rtol=0)
    was_on = ops.set_eager_row_kernels(False)
    try:
        eager = ops.linear_silu_and_mul(x, w)
    finally:
        ops.set_eager_row_kernels(was_on)
    torch.testing.assert_close(eager, ops.silu_and_mul(F.linear(x, w)), atol=0, rtol=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compile) outside the capture
        gemv.gemv_silu_and_mul(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear_silu_and_mul(x, w)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, apart, atol=0, rtol=0)


# -- dependent launch: the first weight step loaded ahead, the wait on sm_90 ----------


def _every_launch(x, w, bias, residual, norm_weight, **how):
    """Each launch the engine makes, on these operands: plain, with a bias,
    accumulating a residual in place, the residual as a separate add, the
    RMSNorm in the prologue, gate/up with the SiLU-mul, and both."""
    norm = (norm_weight, 1e-5)
    return [
        gemv.launch(x, w, None, None, **how),
        gemv.launch(x, w, bias, None, **how),
        gemv.launch(x, w, None, residual.clone(), **how),
        gemv.launch(x, w, None, residual, out=torch.empty_like(residual), round_before_residual=True, **how),
        gemv.launch(x, w, None, None, norm=norm, **how),
        gemv.launch(x, w, None, None, gated=True, **how),
        gemv.launch(x, w, None, None, gated=True, norm=norm, **how),
    ]


@pytest.mark.parametrize("dtype", sorted({*DTYPES, torch.bfloat16}, key=str))
def test_a_prepared_gemv_launches_what_launch_does(device, dtype):
    """``PreparedGemv``, a launch worked out once for a weight (the row
    layer's four GEMVs): each kind ``launch`` makes gives its bits, on
    two rows in turn (the preparation holds no row), into the caller's
    output or over the residual; a residual passed where none was
    prepared, or none where one was, is refused rather than dropped."""
    n, k = 96, 1536
    x, w, bias, residual = operands(device, dtype, n, k, seed=5)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(6))).to(device, dtype)
    norm = (norm_weight, 1e-5)
    kinds = [(dict(), dict()), (dict(bias=bias), dict()), (dict(residual=True), dict(residual=True)),
             (dict(residual=True, round_before_residual=True), dict(residual=True, round_before_residual=True)),
             (dict(norm=norm), dict(norm=norm)), (dict(gated=True), dict(gated=True)),
             (dict(gated=True, norm=norm), dict(gated=True, norm=norm))]  # fmt: skip
    for row in (x, torch.flip(x, dims=(1,)).contiguous()):
        for prepared_with, launched_with in kinds:
            prepared = gemv.PreparedGemv(w, **prepared_with)
            launched = dict(launched_with)
            add = residual if launched.pop("residual", False) else None
            expected = gemv.launch(row, w, prepared_with.get("bias"), None if add is None else add.clone(),
                                   **launched)  # fmt: skip
            out = torch.empty(1, prepared.n, dtype=dtype, device=device)
            assert prepared(row, out, add) is out and prepared.n == expected.shape[1]
            torch.testing.assert_close(out, expected, atol=0, rtol=0)
            if add is not None:  # in place over the residual, as the down projection runs
                over = add.clone()
                torch.testing.assert_close(prepared(row, over, over), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="without a residual"):
        gemv.PreparedGemv(w)(x, torch.empty_like(residual), residual)
    with pytest.raises(ValueError, match="with a residual"):
        gemv.PreparedGemv(w, residual=True)(x, torch.empty_like(residual))


def test_a_prepared_gemv_launches_aligned_rows_of_its_dtype_through_its_kept_launcher(monkeypatch):
    """On a GPU a prepared GEMV's first launch with 16-byte aligned rows of
    its weight's dtype keeps ``Relaunch.kept``'s launcher, and later such
    launches go to it with the arguments the first had (its own tensors
    and scalars, the call's rows); rows off 16 bytes, or of another dtype,
    take the key again and leave the kept launcher as it is. The relaunch
    is stood in for here (a CPU tensor never relaunches)."""
    x, w, _, residual = operands("cpu", torch.float32, 32, 64, seed=2)
    calls = []

    def kept(grid, args, kwargs):  # the launcher says which call kept it
        calls.append(("kept", [id(a) if isinstance(a, torch.Tensor) else a for a in args]))
        return lambda args, n=len(calls): calls.append((f"fast {n}", [id(a) if isinstance(a, torch.Tensor) else a
                                                                      for a in args]))  # fmt: skip

    monkeypatch.setattr(gemv._GEMV, "kept", kept)
    prepared = gemv.PreparedGemv(w, residual=True)
    out = torch.empty_like(residual)
    prepared(x, out, residual)
    prepared(x, out, residual)
    assert [kind for kind, _ in calls] == ["kept", "fast 1"] and calls[0][1] == calls[1][1]
    assert calls[0][1][:6] == [id(x), id(w), id(out), id(residual), id(out), id(out)]  # no bias, no norm: out stands in
    off = torch.zeros(1, 65)[:, 1:]
    prepared(off, out, residual)  # 4 bytes off
    prepared(x.double(), out, residual)
    prepared(x, out, residual)
    assert [kind for kind, _ in calls[2:]] == ["kept", "kept", "fast 1"]  # the first call's launcher still


@pytest.mark.parametrize("dtype", sorted({*DTYPES, torch.bfloat16}, key=str))
@pytest.mark.parametrize("n,k", [(74, 64), (96, 1536), (10, 48)])  # one K step of 64; three of 512; three of 16
def test_the_first_weight_step_loaded_ahead_gives_the_same_bits(device, dtype, n, k):
    """``prefetch``, the order a dependent launch takes (the first K step's
    weight loaded before x is read, then the rest in the loop): every
    launch the engine makes gives the loop's bits, with one K step or
    several."""
    x, w, bias, residual = operands(device, dtype, n, k, seed=3 * n + k)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(n))).to(device, dtype)
    looped = _every_launch(x, w, bias, residual, norm_weight, dependent=False)
    ahead = _every_launch(x, w, bias, residual, norm_weight, dependent=False, prefetch=True)
    for a, b in zip(looped, ahead, strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


def test_dependent_launch_stays_off_where_the_device_cannot(device):
    """Switched on (either mode), a GEMV launches as a dependent only on a
    CUDA device of compute capability 9 or more: never on CPU tensors (the
    interpreter has no grid dependency control, so such a launch would
    fail). The switch takes the modes by name, or True and False, refuses
    any other, and is the process's until set back."""
    x, w, _, _ = operands(device, torch.float32, 32, 64, seed=8)
    on_sm90 = device == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    was = gemv.set_dependent_launch("l2")
    try:
        for mode in ("on", "l2"):
            assert gemv.set_dependent_launch(mode == "on" or mode) in ("on", "l2")
            assert gemv.dependent_launch(x) == (mode if on_sm90 else "off")
            assert gemv.dependent_launch(x.cpu()) == "off"
            torch.testing.assert_close(gemv.gemv(x, w), gemv.launch(x, w, None, None, dependent="off"), atol=0,
                                       rtol=0)  # fmt: skip
        with pytest.raises(ValueError, match="one of off, on, l2"):
            gemv.set_dependent_launch("always")
    finally:
        assert gemv.set_dependent_launch(was) == "l2"
    assert gemv.dependent_launch(x) == "off"


def test_the_l2_prefetch_keeps_a_program_within_its_share_of_l2():
    """The "l2" mode's launches, recorded rather than run (the interpreter
    has no bulk prefetch): each program fetches at most L2_PREFETCH_BYTES,
    the gated launch counting its up rows too, in L2_PARTS parts of whole
    16-byte pieces, never past K; a weight whose rows do not start 16-byte
    aligned, or a K too short for one piece a part, gets the dependent
    launch without the prefetch."""
    from fluidserve.kernels.launch import Relaunch

    seen = []

    def record(self, grid, args, kwargs):
        seen.append(kwargs)

    def options(x, w, **how):
        seen.clear()
        real, Relaunch.launch = Relaunch.launch, record
        try:
            gemv.launch(x, w, None, None, dependent="l2", **how)
        finally:
            Relaunch.launch = real
        (kwargs,) = seen
        assert kwargs["launch_pdl"] and kwargs["GDC"] and kwargs["PREFETCH"]
        return kwargs

    for dtype in (torch.bfloat16, torch.float32):
        elem = torch.empty((), dtype=dtype).element_size()
        for n, k, gated in [(64, 4096, False), (64, 14336, False), (64, 4096, True), (32, 1536, True)]:
            x, w = torch.zeros(1, k, dtype=dtype), torch.zeros(n, k, dtype=dtype)
            kw = options(x, w, gated=gated)
            rows = kw["BLOCK_N"] * (2 if gated else 1)
            assert 0 < kw["L2_K"] <= k and rows * kw["L2_K"] * elem <= gemv.L2_PREFETCH_BYTES
            assert kw["L2_PART_BYTES"] % 16 == 0 and kw["L2_PART_BYTES"] * gemv.L2_PARTS == kw["L2_K"] * elem
        assert "L2_K" not in options(torch.zeros(1, 16, dtype=dtype), torch.zeros(64, 16, dtype=dtype))
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    assert options(x, torch.zeros(64, 4096, dtype=torch.bfloat16))["L2_K"] == 2048  # 64 KiB over 16 rows of bf16
    wide = torch.zeros(64, 4100, dtype=torch.bfloat16)[:, :4096]  # rows 8200 bytes apart: not 16-byte aligned
    assert "L2_K" not in options(x, wide)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90")  # fmt: skip
def test_a_chain_of_dependent_launches_waits_for_each_input_eager_and_captured():
    """Dependent launches start before the launch before them ends, so a
    GEMV that read its input before that launch had written it would read
    what the memory held before. A chain of a Llama-3-8B layer's GEMVs, each
    reading the output (and adding into the residual) of the one before,
    eager and replayed from a captured graph, launched as dependents in
    either mode, gives the bits of the same chain launched plainly. Two
    inputs alternate, so every buffer holds the
    other input's values when it is rewritten: a read before the wait
    shows."""
    dtype, device = torch.bfloat16, torch.device("cuda")
    gen = torch.Generator().manual_seed(9)
    hidden, inter, layers = 4096, 14336, 4
    ws = [[(torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
           for n, k in ((hidden, hidden), (2 * inter, hidden), (hidden, inter))] for _ in range(layers)]
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    inputs = [torch.randn(1, hidden, generator=gen).to(device, dtype) for _ in range(2)]

    def chain(dependent: str, h: torch.Tensor) -> torch.Tensor:
        for o, gate_up, down in ws:
            a = gemv.launch(h, o, None, h, out=torch.empty_like(h), round_before_residual=True, dependent=dependent)
            act = gemv.launch(a, gate_up, None, None, gated=True, norm=(norm_weight, 1e-5), dependent=dependent)
            h = gemv.launch(act, down, None, a, dependent=dependent)  # into a, in place
        return h

    plain = [chain("off", x.clone()) for x in inputs]
    assert not torch.equal(plain[0], plain[1])
    for mode in ("on", "l2"):
        for i in (0, 1, 0):  # the allocator hands the last chain's buffers on
            torch.testing.assert_close(chain(mode, inputs[i].clone()), plain[i], atol=0, rtol=0)
        static = inputs[0].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(mode, static.clone())  # compiled outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(mode, static)
        for i in (0, 1, 0, 1):
            static.copy_(inputs[i])
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, plain[i], atol=0, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="compiled, a tile's size decides the order of its row sums")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_interpreters_bigger_tiles_give_the_gpus_bits(dtype, monkeypatch):
    """Off CUDA a GEMV launches ``INTERPRETER_BLOCK_N`` rows a program
    (Triton's interpreter pays per op, not per row); its bits are those of
    the GPU's launch shape: plain, with bias and residual, with the residual
    rounded apart, normed, and gated (8 rows of each half a program on a
    GPU), over ragged rows (the last tile part empty) and three K steps."""
    n, k = 150, 1536
    x, w, bias, residual = operands("cpu", dtype, n, k, seed=9)
    norm = ((1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(2))).to(dtype), 1e-5)
    cases = [dict(), dict(bias=bias, residual=residual), dict(residual=residual, round_before_residual=True),
             dict(norm=norm), dict(gated=True), dict(gated=True, norm=norm)]
    for case in cases:
        kw = {"bias": None, "residual": None, **case}
        if kw["residual"] is not None:
            kw["out"] = torch.empty_like(residual)
        gated = "gated" in case
        runs = {}
        for rows in (128, None):
            specs = []
            with monkeypatch.context() as patch:
                patch.setattr(gemv, "INTERPRETER_BLOCK_N", rows)
                patch.setattr(gemv, "_spec", lambda *a, f=gemv._spec: specs.append(f(*a)) or specs[-1])
                runs[rows] = gemv.launch(x, w, **kw).clone()
            runs[rows, "grid"] = specs[0][1]
        assert runs[128, "grid"] == ((1,) if gated else (2,)), case
        assert runs[None, "grid"] == ((cdiv(n // 2, gemv.BLOCK_N // 2),) if gated else (cdiv(n, gemv.BLOCK_N),))
        assert torch.equal(runs[128], runs[None]), case
