"""Launching a compiled Triton kernel again without Triton's per-call binding.

``JITFunction.run`` works out, on every call, each argument's
specialisation (a pointer's dtype and 16-byte alignment; an int's width and
whether it is 1 or a multiple of 16), hashes it with the options into its
cache key, checks the kernel's globals and builds launch metadata, and only
then calls the launcher. An eager decode step launches six to nine Triton
kernels per decoder layer, so that work is a large share of the host time
the eager step pays (profile_decode_*.md: ``jit.py run`` and
``native_specialize_impl`` among the top entries).

``Relaunch`` wraps a kernel and keeps the ``CompiledKernel`` Triton returns
from a launch, under a key of what Triton's specialisation reads (the
constexprs and options as given, the arguments' types, each tensor's dtype
and 16-byte alignment) and of each scalar's exact value; when a later call
has the same key it calls that kernel's launcher directly. Every layer of
a step launches a kernel with the same key (its weights differ, their
dtype and alignment do not), so only a step's first layer pays Triton's
path. The key is at least as fine as Triton's specialisation
(tests/kernels/test_launch.py checks it against Triton's own binder for
every kernel we wrap), so a relaunch never runs a binary compiled on
assumptions its arguments break. Triton's process-wide compile knobs
(debug, instrumentation) are taken as fixed for the process.

Off the fast path (Triton's interpreter, CPU tensors, a launch hook such
as a profiler's, a Triton older than 3.4, ROCm, runtime
arguments passed by name, or ``FLUIDSERVE_TRITON_RELAUNCH=0``) a call is
Triton's own ``kernel[grid](...)``. A launcher that refuses a relaunch's
arguments (a Triton whose launcher changed) turns relaunching off for the
process, with a warning, and that call goes through Triton.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import torch
import triton

RELAUNCH_ENV = "FLUIDSERVE_TRITON_RELAUNCH"

logger = logging.getLogger("fluidserve.kernels")

# Read once: the switch is for comparing the two paths (benchmarks set it
# through ``set_enabled``), not for flipping per request.
_enabled = os.environ.get(RELAUNCH_ENV, "1").strip() != "0"

# Triton 3.4 moved the launch hooks to ``triton.knobs``; the launcher's
# arguments have been these since 3.3. Older Triton, and ROCm (whose
# launcher this has not been run against), take the JIT path.
_knobs = getattr(triton, "knobs", None)
_SUPPORTED = _knobs is not None and torch.version.hip is None

_I32 = 1 << 31
_I64 = 1 << 63


# A launch's grid and block sizes, worked out on the host. Triton's own
# ``triton.cdiv`` and ``triton.next_power_of_2`` are ConstexprFunctions
# (Triton 3.5 on): about 2 us a call unwrapping constexprs, several calls
# per decoder layer of an eager step; these are plain integer arithmetic.


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, as ``triton.cdiv``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (n >= 1), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length()


# Rows (tokens) one program of a row-wise kernel takes off CUDA: rope with
# the KV write, RMSNorm and SiLU-mul run a program a row on a GPU. Triton's
# interpreter runs a program's ops on whole tiles (numpy arrays) and pays its
# own cost per op, about the same for a tile of one row as of sixteen, so a
# 32-token prefill chunk costs two programs' ops instead of 32. Each row's
# arithmetic is the same either way. The kernel tests run one a program
# (tests/kernels/conftest.py).
INTERPRETER_ROWS = 16


def row_tiling(t: torch.Tensor) -> tuple[int, int]:
    """(rows one program takes, the row count the kernel is passed) of a
    row-wise kernel over ``t``'s rows ([rows, ...]): one row a program on a
    GPU, up to ``INTERPRETER_ROWS`` elsewhere. The count masks the rows past
    the last; a program of one row never reads it, and gets 0, so every
    batch size launches one compiled kernel under one relaunch key (a count
    would be a new key per batch size, and Triton compiles a variant for a
    count of 1 and for multiples of 16)."""
    rows = 1 if t.is_cuda else min(INTERPRETER_ROWS, next_power_of_2(max(t.shape[0], 1)))
    return rows, t.shape[0] if rows > 1 else 0


def _hook_set(hook: Any) -> bool:
    # Triton 3.5 on holds each launch hook in a HookChain, never None: an
    # empty chain is no hook (the launcher would call it and it would call
    # nothing). Earlier, a hook is a plain callable or None.
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_hooks_set() -> bool:
    """Whether a launch hook (a profiler's, Proton's) is set: then every
    launch must go through Triton, for the hook to see it."""
    runtime = _knobs.runtime
    return _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)


class Site:
    """One call site of a kernel whose launches differ only in tensors of
    the same dtypes: its grid, constexprs, scalars and argument types are
    the caller's own (a prepared GEMV, a step's rope). A call the caller
    finds ``usual`` (its changing tensors of the dtypes it was made for,
    each 16-byte aligned) goes to the launcher ``Relaunch.kept`` handed the
    first usual call, with no key worked out; any other takes the key,
    and leaves that launcher as it is."""

    __slots__ = ("_relaunch", "_grid", "_kwargs", "_fast")

    def __init__(self, relaunch: Relaunch, grid: Sequence[int], kwargs: dict[str, Any]) -> None:
        self._relaunch, self._grid, self._kwargs = relaunch, grid, kwargs
        self._fast: Callable[[tuple], None] | None = None

    def __call__(self, args: tuple, usual: bool) -> None:
        if usual and self._fast is not None:
            self._fast(args)
            return
        fast = self._relaunch.kept(self._grid, args, self._kwargs)
        if usual:
            self._fast = fast


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether every one of ``tensors`` starts on a 16-byte boundary (what
    Triton specialises a pointer on, beside its dtype)."""
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    return not bits & 15


def cache_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple:
    """What a launch worked out once for a step (``StepAttention``,
    ``StepRopeAndCache``) reads of a layer's KV caches: another layer's
    caches may take it where this is the same."""
    return (key_cache.shape, key_cache.stride(), key_cache.dtype, key_cache.device, value_cache.shape,
            value_cache.stride(), value_cache.dtype)  # fmt: skip


def set_enabled(on: bool) -> bool:
    """Turn relaunching on or off for this process; returns the old setting."""
    global _enabled
    old, _enabled = _enabled, bool(on)
    return old


def arg_class(value: Any, specialize: bool = True, align: bool = True) -> tuple | None:
    """Triton's class of a runtime argument: what its specialisation
    depends on, or None for a type this module does not know. Ints: the
    width Triton picks (i32, i64, u64) and, unless the parameter is
    ``do_not_specialize``, whether the value is 1 (baked in as a constant)
    or a multiple of 16. Pointers: the dtype and, unless
    ``do_not_specialize_on_alignment``, 16-byte alignment. The attention's
    record of compiled variants keys on it (paged_attention.
    specialization_key); a relaunch keys finer, on exact scalars."""
    kind = type(value)
    if kind is bool:  # before int: True == 1 hashes as 1
        return ("u1",)
    if kind is int:
        width = 0 if -_I32 <= value < _I32 else 1 if -_I64 <= value < _I64 else 2
        if not specialize:
            return ("i", width)
        return ("i", width, value == 1, value % 16 == 0)
    if kind is float:
        return ("f",)
    if value is None:
        return ("none",)
    if isinstance(value, torch.Tensor):
        return ("p", value.dtype, align and value.data_ptr() % 16 == 0)
    return None


_SCALARS = frozenset((int, float, bool, type(None)))
# A kernel kept per key; past this many (a scalar argument that never
# repeats) the cache starts again rather than grow.
MAX_KEPT = 256


def _getter(positions: tuple[int, ...]) -> Callable[[Sequence[Any]], tuple]:
    if len(positions) > 1:
        return itemgetter(*positions)
    if positions:
        return lambda args, i=positions[0]: (args[i],)
    return lambda args: ()


def _relaunchable(args: Sequence[Any]) -> bool:
    """Whether a call may take the cached path: a Triton that has it, CUDA
    tensors, and no launch hook (which must see every launch)."""
    first = args[0] if args else None
    return (_SUPPORTED and isinstance(first, torch.Tensor) and first.device.type == "cuda"
            and not launch_hooks_set())  # fmt: skip


def _grid3(grid: Sequence[int]) -> tuple[int, int, int]:
    return grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1


class Relaunch:
    """``Relaunch(kernel)[grid](*runtime_args, **constexprs_and_options)``
    behaves as ``kernel[grid](...)`` and returns the ``CompiledKernel``
    (None on the interpreter). Runtime arguments go by position, in the
    kernel's order; constexprs and launch options by name.

    The key holds the constexprs and options as given, the arguments'
    Python types, every scalar's exact value (finer than Triton's class of
    it, and as cheap to take: a kernel's scalars are strides and sizes that
    repeat) and every tensor's dtype and 16-byte alignment, which is all
    Triton's specialisation of a tensor reads."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._compiled: dict[tuple, tuple[Any, tuple]] = {}
        # Per tuple of argument types: getters of the tensors and of the
        # scalars, or None for a type this module does not know.
        self._splits: dict[tuple[type, ...], tuple[Callable, Callable] | None] = {}
        params = getattr(fn, "params", None)  # a JITFunction's; the interpreter's wrapper has none
        self._arity: int | None = None
        self._constexprs: tuple[tuple[str, Any], ...] = ()
        if params is not None:
            n = sum(1 for p in params if not p.is_constexpr)
            if all(not p.is_constexpr for p in params[:n]):  # runtime parameters first, constexprs after
                self._arity = n
                self._constexprs = tuple((p.name, p.default) for p in params[n:])
        self._device: Callable[[], int] | None = None
        self._stream: Callable[[int], int] | None = None

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple | None:
        """The cache key of a call, or None where it must take the JIT path."""
        if len(args) != self._arity or not _enabled:
            return None
        types = tuple(map(type, args))
        split = self._splits.get(types, False)
        if split is False:
            split = self._splits[types] = self._split(types)
        if split is None:
            return None
        tensors_of, scalars_of = split
        tensors = tensors_of(args)
        return (types, tuple(kwargs.items()), scalars_of(args), tuple([t.dtype for t in tensors]),
                tuple([t.data_ptr() & 15 == 0 for t in tensors]))  # fmt: skip

    @staticmethod
    def _split(types: tuple[type, ...]) -> tuple[Callable, Callable] | None:
        tensors = tuple(i for i, t in enumerate(types) if issubclass(t, torch.Tensor))
        scalars = tuple(i for i, t in enumerate(types) if t in _SCALARS)
        if len(tensors) + len(scalars) != len(types):
            return None
        return _getter(tensors), _getter(scalars)

    def launch(self, grid: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if not _relaunchable(args):
            return self.fn[grid](*args, **kwargs)
        return self.relaunch(grid, args, kwargs)

    def relaunch(self, grid: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """The cached path, for arguments ``launch`` found eligible: the
        kept kernel's launcher if the key holds one, else Triton's launch,
        whose kernel is kept."""
        return self._relaunch(grid, args, kwargs)[0]

    def _relaunch(self, grid: Sequence[int], args: Sequence[Any],
                  kwargs: dict[str, Any]) -> tuple[Any, tuple[int, tuple] | None]:  # fmt: skip
        # ``relaunch``'s work: the kernel that ran and, where it is kept
        # under a key (relaunching on, every argument of a known type),
        # the device it is loaded on and the constexprs its launcher takes.
        if self._device is None:
            from triton.runtime import driver

            self._device, self._stream = driver.active.get_current_device, driver.active.get_current_stream
        try:
            key = self.key(args, kwargs)
            if key is not None:
                key = (self._device(), *key)  # a kernel is loaded on the device current when it was compiled
            entry = self._compiled.get(key) if key is not None else None
        except TypeError:  # an unhashable constexpr: Triton's path copes
            key = entry = None
        if entry is None:
            compiled = self.fn[grid](*args, **kwargs)
            if key is None or compiled is None:
                return compiled, None
            tail = tuple(kwargs.get(name, default) for name, default in self._constexprs)
            if len(self._compiled) >= MAX_KEPT:
                self._compiled.clear()
            self._compiled[key] = (compiled, tail)
            return compiled, (key[0], tail)
        compiled, tail = entry
        try:
            # The JIT path's call, less its launch metadata and hooks (None: no hook is set).
            compiled.run(*_grid3(grid), self._stream(key[0]), compiled.function, compiled.packed_metadata, None,
                         None, None, *args, *tail)  # fmt: skip
        except TypeError as exc:
            # The launcher parses its arguments before it launches anything:
            # a TypeError is a Triton whose launcher takes other arguments
            # than these. Triton's own path still launches; relaunching stops.
            set_enabled(False)
            name = getattr(self.fn, "__name__", self.fn)
            logger.warning("relaunching Triton kernels is off for this process: %s's launcher refused the "
                           "relaunch (%s); every launch takes Triton's path", name, exc)
            return self.fn[grid](*args, **kwargs), None
        return compiled, (key[0], tail)

    def kept(self, grid: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any]) -> Callable[[tuple], None] | None:
        """Launch as ``launch`` does, and return a launcher of the kernel
        that ran, for later calls of one site whose runtime arguments
        differ from these only in tensors of the same dtypes and 16-byte
        alignment: the caller's promise (``gemv.PreparedGemv``: its
        weights, scalars and constexprs are its own, and it checks its
        rows' dtype and alignment). ``launcher(args)`` launches on the
        current stream without working out a key; where a launch hook is
        set, relaunching is off or another device is current, it takes
        ``launch``'s path. None where this call could not relaunch (the
        interpreter, CPU tensors, a launch hook, relaunching off, an
        argument of a type the key does not know)."""
        if not _relaunchable(args):
            self.fn[grid](*args, **kwargs)
            return None
        return self._keep(grid, args, kwargs)

    def _keep(self, grid: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any]) -> Callable[[tuple], None] | None:
        # ``kept`` past its device test: the relaunch, then its kernel bound.
        compiled, kept = self._relaunch(grid, args, kwargs)
        if kept is None:
            return None
        (device, tail), (g0, g1, g2) = kept, _grid3(grid)
        function, metadata, current, stream = compiled.function, compiled.packed_metadata, self._device, self._stream

        def launcher(call_args: tuple) -> None:
            if not _enabled or launch_hooks_set() or current() != device:
                self.launch(grid, call_args, kwargs)
                return
            # Relaunch.relaunch's call, which the launcher took from this site's first call.
            compiled.run(g0, g1, g2, stream(device), function, metadata, None, None, None, *call_args, *tail)

        return launcher

    def cached(self) -> int:
        """How many compiled variants the fast path holds."""
        return len(self._compiled)
