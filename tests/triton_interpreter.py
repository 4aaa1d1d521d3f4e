"""Triton's interpreter, made to patch ``triton.language`` once a launch.

Under ``TRITON_INTERPRET=1`` every call of a ``@triton.jit`` function from
inside a kernel (our helpers such as ``_dot`` and ``_attend_keys``, and
``tl.zeros``, ``tl.cdiv`` and the rest of ``triton.language.standard``)
re-patches the language: ``inspect.getmembers`` over ``tl``, ``tl.tensor``
and ``tl.math`` and a wrapper set on each builtin, about 0.4 ms a
call, in every program of the grid. The kernel's launch has already patched
those modules and keeps them patched until it ends, so the scan finds nothing
new; Triton also never restores what the inner calls patch.

``install`` changes two methods of the interpreter: a launch notes which
language modules it has patched, and a device-function call patches only a
module not yet patched in that launch (``tl.core``, which ``tl.standard``'s
functions see but a kernel module usually does not), restoring it when the
launch ends. The kernels run the same code on the same values; the engine
lane's tests (tests/engine/test_gpu_path_on_cpu.py) take about a quarter less time.

It also keeps the answers of ``_get_np_dtype``, the numpy dtype of a Triton
type, which the interpreter asks at almost every op and which builds a
table of nineteen types (hashing each) to answer: a type's numpy dtype
never changes, so each scalar type's is worked out once.

And it hands ``tl.dot`` its operands in row-major order. The interpreter
multiplies with ``np.matmul``, which gives BLAS a transposed operand (a
``tl.trans`` view, a tile loaded column-wise) as a transposed product, and
OpenBLAS sums small products of each transpose in an order of its own on
some CPUs (its AVX-512 small-matrix kernels): the same tiles then round
apart by a last bit, where a GPU's matrix instructions sum them one way
whatever the layout. The tests that show two kernels give the same bits
(a packed weight's tiles against the dense weight's) would pass on one CPU
and fail on another; in row-major order every CPU sums them one way.

A Triton whose interpreter differs from the one this was written against
(3.6 and 3.9: ``GridExecutor.__call__`` patches the kernel's language for the
launch, ``InterpretedFunction.__call__`` calls ``_patch_lang(self.fn)`` then
``self.rewrite()``) is left as it is, and ``install`` says why (pytest's
header shows it).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

import numpy as np

_EXPECTED_CALL = ("_patch_lang(self.fn)", "self.rewrite()")


def install() -> str | None:
    """Patch the interpreter; None when done, else why it was left alone."""
    try:
        from triton.runtime import interpreter
    except ImportError as e:
        return f"triton.runtime.interpreter does not import ({e})"
    for name in ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang", "tl"):
        if not hasattr(interpreter, name):
            return f"triton.runtime.interpreter has no {name}"
    grid_call, device_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    if getattr(device_call, "_patches_once", False):
        return None
    try:
        source = inspect.getsource(device_call)
    except (OSError, TypeError) as e:
        return f"the interpreter's device-function call has no source ({e})"
    if not all(part in source for part in _EXPECTED_CALL):
        return "the interpreter's device-function call is not the one this patch replaces"
    lang = interpreter.tl
    local = threading.local()  # the interpreter is one thread's at a time; a launch's state is too
    langs_of: dict = {}

    def langs(fn) -> frozenset[int]:
        key = langs_of.get(fn)
        if key is None:  # what _patch_lang patches: the language modules among the function's globals
            key = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is lang or v is lang.core)
        return key

    def launch(self, *args, **kwargs):
        if getattr(local, "patched", None) is not None:  # a launch inside a launch: the outer one owns the state
            return grid_call(self, *args, **kwargs)
        local.patched, local.scopes = set(langs(self.fn)), []
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            for scope in reversed(local.scopes):
                scope.restore()
            local.patched = local.scopes = None

    def call(self, *args, **kwargs):
        patched = getattr(local, "patched", None)
        if patched is None:
            interpreter._patch_lang(self.fn)  # outside a launch: as Triton does
        elif not (needed := langs(self.fn)) <= patched:
            local.scopes.append(interpreter._patch_lang(self.fn))
            patched |= needed
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    call._patches_once = True
    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = call
    if callable(getattr(interpreter, "_get_np_dtype", None)):
        interpreter._get_np_dtype = _remembered(interpreter._get_np_dtype, lang)
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_dot"):
        return "triton.runtime.interpreter has no InterpreterBuilder.create_dot to hand row-major operands"
    builder.create_dot = _row_major(builder.create_dot)
    return None


def _row_major(create_dot):
    """``create_dot`` over C-contiguous copies of operands that are not (the
    module's docstring): the same products, summed one way on every CPU."""

    def row_major(operand):
        data = operand.data
        return operand if data.flags.c_contiguous else dataclasses.replace(operand, data=np.ascontiguousarray(data))

    def dot(self, a, b, *rest):
        return create_dot(self, row_major(a), row_major(b), *rest)

    return dot


def _remembered(np_dtype_of, lang):
    """``np_dtype_of`` answered once a scalar type, by name (Triton's types
    are equal when their names are). A block's answer is its element's; a
    pointer's, or a block of them, is left to ``np_dtype_of``, which answers
    those before it builds its table."""
    known: dict[str, object] = {}

    def np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, lang.block_type) else tt_dtype
        if isinstance(scalar, lang.pointer_type):
            return np_dtype_of(tt_dtype)
        found = known.get(scalar.name)
        if found is None:
            found = known[scalar.name] = np_dtype_of(scalar)
        return found

    np_dtype.original = np_dtype_of
    return np_dtype
