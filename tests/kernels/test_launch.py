"""kernels/launch.py: a relaunch reuses a compiled kernel only for
arguments Triton would have compiled the same binary for.

On CPU the key is checked against Triton's own binder (built for an sm_90
target, as the JIT path builds it on a GPU), for every kernel we wrap; on a
GPU a relaunch is compared bit for bit with Triton's launch."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from fluidserve.kernels import activation, cache_ops, fused_norm, gemv, launch, moe, paged_attention, rope_cache
from fluidserve.kernels.launch import Relaunch, arg_class

BACKEND = make_backend(GPUTarget("cuda", 90, 32))
MODULES = (activation, cache_ops, fused_norm, gemv, moe, paged_attention, rope_cache)
WRAPPED = {f"{m.__name__}.{name}": v for m in MODULES
           for name, v in vars(m).items() if isinstance(v, Relaunch)}  # fmt: skip
INTS = [0, 1, 2, 3, 15, 16, 17, 32, 48, 4096, 4097, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
        -(2**31), -(2**31) - 16, 2**40 + 1, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]  # fmt: skip
FLOATS = [0.0, 1.0, 0.5, 1e-6, -3.25]


def _tensors() -> list[torch.Tensor]:
    """Tensors of several dtypes, at aligned and unaligned addresses."""
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8):
        base = torch.zeros(64, dtype=dtype)
        out += [base, base[1:], base[4:], base[8:], base[16:], torch.nn.Parameter(base.float(), requires_grad=False)]
    return out


def _jit(fn) -> JITFunction:
    """The JIT function behind a kernel (the interpreter wraps the same Python)."""
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn, **fn.kwargs)


def _pool(name: str) -> list:
    if name.endswith("_ptr"):
        return _tensors()
    return FLOATS if name in ("eps", "qk_scale") else INTS


def test_an_arg_class_is_at_least_as_fine_as_tritons_specialisation():
    values = INTS + FLOATS + _tensors() + [True, False, None]
    for specialize, align in itertools.product((True, False), repeat=2):
        by_class: dict[tuple, set] = {}
        for v in values:
            c = arg_class(v, specialize, align)
            assert c is not None, v
            by_class.setdefault(c, set()).add(native_specialize_impl(BACKEND, v, False, specialize, align))
        mixed = {c: specs for c, specs in by_class.items() if len(specs) > 1}
        assert not mixed, (specialize, align, mixed)
    assert arg_class(True) != arg_class(1)  # equal and equally hashed in Python; i1 against a constant 1 in Triton
    assert arg_class(object()) is None  # unknown: the JIT path


def test_the_host_grid_helpers_answer_as_tritons():
    # The wrappers size grids and blocks with these instead of Triton's
    # ConstexprFunctions (host time per layer); a block size that differed
    # would compile a different kernel.
    for n in range(1, 5000):
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 1024):
            assert launch.cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert launch.next_power_of_2(2**40 + 1) == triton.next_power_of_2(2**40 + 1) == 2**41


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_every_wrapped_kernel_takes_the_fast_path_and_its_key_refines_the_binder(name):
    jit = _jit(WRAPPED[name].fn)
    relaunch = Relaunch(jit)
    runtime = [p for p in jit.params if not p.is_constexpr]
    assert relaunch._arity == len(runtime), "runtime parameters must lead"
    binder = create_function_from_signature(jit.signature, jit.params, BACKEND)
    constexprs = {p.name: 16 for p in jit.params if p.is_constexpr}
    base = [_pool(p.name)[4] for p in runtime]  # one valid call: every pool's fifth entry
    for i, p in enumerate(runtime):
        seen: dict[tuple, tuple] = {}
        for v in _pool(p.name):
            args = base[:i] + [v] + base[i + 1:]
            key = relaunch.key(args, dict(constexprs, num_warps=4))
            spec = binder(*args, **constexprs, num_warps=4)[1]
            assert seen.setdefault(key, spec) == spec, f"{p.name}={v!r}: one key, two specialisations"
    key = relaunch.key(base, dict(constexprs, num_warps=4))
    assert key != relaunch.key(base, dict(constexprs, num_warps=8))
    # Another layer's tensors (other storage, same dtype and alignment) share the key: the point of keeping it.
    other = [torch.zeros(64, dtype=v.dtype) if isinstance(v, torch.Tensor) else v for v in base]
    assert relaunch.key(other, dict(constexprs, num_warps=4)) == key
    assert relaunch.key([object(), *base[1:]], dict(constexprs, num_warps=4)) is None  # unknown type: JIT path
    # 1, 1.0 and True are equal and hash alike in Python; Triton makes a constant, an fp32 and an i1 of them.
    i = next(i for i, p in enumerate(runtime) if not p.name.endswith("_ptr"))
    keys = {relaunch.key(base[:i] + [v] + base[i + 1:], constexprs) for v in (1, 1.0, True)}
    assert len(keys) == 3
    assert relaunch.key(base[:-1], constexprs) is None  # a runtime argument by name: the JIT path


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="relaunching needs a GPU")


def _gemv_call(kernel, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(n, gemv.BLOCK_N),)](
        x, w, out, out, out, out, n, k, w.stride(0), 0.0, HAS_BIAS=False, HAS_RESIDUAL=False,
        ROUND_BEFORE_RESIDUAL=False, GATED=False, NORM=False, BLOCK_N=gemv.BLOCK_N, BLOCK_K=gemv.block_k(k),
        BLOCK_D=1, num_warps=gemv.NUM_WARPS,
    )  # fmt: skip
    return out


@needs_cuda
def test_a_relaunch_computes_what_tritons_launch_computes():
    torch.manual_seed(0)
    dev, dtype = "cuda", torch.bfloat16
    w = torch.randn(512, 256, dtype=dtype, device=dev)
    buf = torch.randn(1, 260, dtype=dtype, device=dev)
    relaunch = Relaunch(gemv._gemv_kernel)
    aligned = [torch.randn(1, 256, dtype=dtype, device=dev) for _ in range(3)]
    for i, x in enumerate(aligned):
        assert torch.equal(_gemv_call(relaunch, x, w), _gemv_call(gemv._gemv_kernel, x, w))
        assert relaunch.cached() == 1, i  # the first call compiled through Triton; the others reused it
    unaligned = buf[:, 1:257]  # two bytes off: Triton compiles another binary for it
    assert unaligned.data_ptr() % 16
    assert torch.equal(_gemv_call(relaunch, unaligned, w), _gemv_call(gemv._gemv_kernel, unaligned, w))
    assert relaunch.cached() == 2


@needs_cuda
def test_a_relaunch_is_captured_by_a_cuda_graph():
    w = torch.randn(256, 128, device="cuda")
    x = torch.randn(1, 128, device="cuda")
    relaunch = Relaunch(gemv._gemv_kernel)
    _gemv_call(relaunch, x, w)  # compile and keep it, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _gemv_call(relaunch, x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _gemv_call(gemv._gemv_kernel, x, w))


def test_no_launch_hook_is_set_by_default_and_one_set_is_seen():
    # Triton 3.5 on keeps each hook in a HookChain that is never None: an
    # "is not None" test sent every launch down Triton's path.
    runtime = triton.knobs.runtime
    assert not launch.launch_hooks_set(), (runtime.launch_enter_hook, runtime.launch_exit_hook)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        chain = getattr(runtime, name)
        if hasattr(chain, "add"):
            chain.add(print)
            try:
                assert launch.launch_hooks_set(), name
            finally:
                chain.remove(print)
            assert not launch.launch_hooks_set()
        setattr(runtime, name, print)  # a plain callable, as Triton before 3.5 held it
        try:
            assert launch.launch_hooks_set(), name
        finally:
            setattr(runtime, name, chain)
    assert not launch.launch_hooks_set()


@needs_cuda
def test_a_launch_hook_or_the_switch_sends_calls_through_triton():
    """A profiler's launch hook sees every launch: relaunching steps aside."""
    w = torch.randn(256, 128, device="cuda")
    x = torch.randn(1, 128, device="cuda")
    relaunch = Relaunch(gemv._gemv_kernel)
    _gemv_call(relaunch, x, w)
    assert relaunch.cached() == 1
    seen = []
    chain = triton.knobs.runtime.launch_enter_hook
    triton.knobs.runtime.launch_enter_hook = seen.append
    try:
        _gemv_call(relaunch, x, w)
    finally:
        triton.knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 1
    was_on = launch.set_enabled(False)
    try:
        fresh = Relaunch(gemv._gemv_kernel)
        assert torch.equal(_gemv_call(fresh, x, w), _gemv_call(gemv._gemv_kernel, x, w))
        assert fresh.cached() == 0
    finally:
        launch.set_enabled(was_on)


class _Param:
    def __init__(self, name: str, is_constexpr: bool = False) -> None:
        self.name, self.is_constexpr, self.default = name, is_constexpr, None


class _Compiled:
    """A kept kernel whose launcher takes other arguments than a relaunch passes."""

    function, packed_metadata = 0, ()

    def run(self, *args):
        raise TypeError("function takes exactly 12 arguments")


class _Kernel:
    """Stands in for a JIT kernel: records Triton's-path launches."""

    __name__ = "_kernel"
    params = [_Param("x_ptr"), _Param("n"), _Param("BLOCK", True)]

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            return _Compiled()

        return launch


def test_a_launcher_that_refuses_a_relaunch_turns_relaunching_off(caplog):
    # A Triton whose launcher wants other arguments must cost the process the fast path, not its launches.
    kernel = _Kernel()
    relaunch = Relaunch(kernel)
    relaunch._device, relaunch._stream = (lambda: 0), (lambda device: 0)
    args, kwargs = (torch.zeros(4), 3), {"BLOCK": 16}
    was_on = launch.set_enabled(True)
    try:
        relaunch.relaunch((1,), args, kwargs)  # the miss: Triton's path, whose kernel is kept
        assert (kernel.launches, relaunch.cached()) == (1, 1)
        with caplog.at_level("WARNING", logger="fluidserve.kernels"):
            relaunch.relaunch((1,), args, kwargs)
        assert kernel.launches == 2, "the refused relaunch must still launch, through Triton"
        assert not launch._enabled and "refused the relaunch" in caplog.text
        assert relaunch.key(args, kwargs) is None  # from here on every call takes Triton's path
    finally:
        launch.set_enabled(was_on)


class _Recorded:
    """A kept kernel whose launcher records what it is handed."""

    function, packed_metadata = 0, ()

    def __init__(self) -> None:
        self.runs: list[tuple] = []

    def run(self, *args) -> None:
        self.runs.append(args)


class _RecordingKernel(_Kernel):
    def __init__(self) -> None:
        super().__init__()
        self.compiled = _Recorded()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            return self.compiled

        return launch


def _ids(call: tuple) -> list:
    return [id(a) if isinstance(a, torch.Tensor) else a for a in call]


def test_a_kept_launcher_hands_the_launcher_what_a_relaunch_hands_it():
    """``Relaunch.kept``: a site's launcher of the kernel its first call
    ran (past the device test, which CPU tensors fail, with Triton's driver
    stood in for). Its launch is the relaunch's, argument for argument, on
    the stream current at the call; with a launch hook set, relaunching
    off or another device current it takes ``launch``'s path, as a
    relaunch does."""
    kernel = _RecordingKernel()
    relaunch = Relaunch(kernel)
    streams = iter(range(100, 200))
    devices = [0]
    relaunch._device, relaunch._stream = (lambda: devices[0]), (lambda device: next(streams))
    kwargs = {"BLOCK": 16}
    launcher = relaunch._keep((2, 3), (torch.zeros(4), 3), kwargs)
    assert launcher is not None and kernel.launches == 1  # the first call: Triton's path, its kernel kept
    rows = (torch.ones(4), 3)
    relaunch.relaunch((2, 3), rows, kwargs)
    launcher(rows)
    relaunched, kept = kernel.compiled.runs
    assert _ids(kept[:3] + kept[4:]) == _ids(relaunched[:3] + relaunched[4:])  # all but the stream
    assert _ids(kept[9:]) == _ids(rows) + [16] and kept[:3] == (2, 3, 1)
    assert kept[3] == relaunched[3] + 1  # asked at each launch
    hook = triton.knobs.runtime.launch_enter_hook
    for leave in ("hook", "off", "device"):
        if leave == "hook":
            triton.knobs.runtime.launch_enter_hook = print
        elif leave == "off":
            was_on = launch.set_enabled(False)
        else:
            devices[0] = 1
        try:
            launcher(rows)  # CPU tensors: launch's path is Triton's
        finally:
            triton.knobs.runtime.launch_enter_hook = hook
            devices[0] = 0
            if leave == "off":
                launch.set_enabled(was_on)
        assert (kernel.launches, len(kernel.compiled.runs)) == (2 + ("hook", "off", "device").index(leave), 2), leave
    assert relaunch._keep((2,), (torch.zeros(4), object()), kwargs) is None  # an argument the key does not know
    # what a site calls usual, beside the dtypes: every changing tensor on a 16-byte boundary
    base = torch.zeros(16)
    assert launch.aligned(base, base[4:]) and not launch.aligned(base, base[1:]) and not launch.aligned(base[2:])


def test_row_tiling_passes_a_gpus_launch_one_row_count_for_every_batch(monkeypatch):
    """A row-wise kernel's launch (rope with the KV write, RMSNorm, SiLU-mul)
    on a GPU takes a row a program and is passed a row count of 0 whatever
    the batch, so its relaunch key and Triton's specialisation stay one per
    shape; off CUDA up to ``INTERPRETER_ROWS`` rows a program and the count
    that masks the rest, and one a program gets 0 there too."""
    from types import SimpleNamespace

    from fluidserve.kernels import launch

    monkeypatch.setattr(launch, "INTERPRETER_ROWS", 16)  # the engine's (the kernel tests run the GPU's shapes)
    for rows in (1, 2, 16, 37, 8192):
        assert launch.row_tiling(SimpleNamespace(is_cuda=True, shape=(rows, 64))) == (1, 0)
    assert [launch.row_tiling(torch.empty(rows, 4)) for rows in (0, 1, 3, 16, 37)] == [
        (1, 0), (1, 0), (4, 3), (16, 16), (16, 37)]
    monkeypatch.setattr(launch, "INTERPRETER_ROWS", 1)
    assert launch.row_tiling(torch.empty(37, 4)) == (1, 0)
