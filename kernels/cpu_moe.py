"""The mixture-of-experts experts on the CPU: ``fused_experts`` with
reference.fused_experts's sums, two ways in one call.

An expert's product on the CPU reads its weights from memory every step
(a few hundred KB to tens of MB each; the cache holds few), so a step's
time is the bytes of the experts its tokens reach over the bandwidth it
gets. A decode step reaches many experts with a few rows each, and there
torch's dispatch and oneDNN's fork and join per product, not the bytes,
set the time. So the experts go through ``cpu_moe.c``: one call a layer,
the thread team forked once, each panel of weights streamed once past all
of its expert's rows. bf16 experts of more than ``NATIVE_ROWS`` rows (a
prefill's) go through oneDNN's linear over the model's own weights, whose
bf16 dot products make better use of the arithmetic once rows reuse each
weight many times; where cpu_moe.c is not built, every expert goes through
oneDNN's linear over weights reordered into its blocked layout.

``cpu_moe.c`` is compiled on first use for this CPU (``cc -march=native``)
into a cache folder and loaded with ctypes; where no compiler or OpenMP is
found, every expert takes the oneDNN path. ``FLUIDSERVE_CPU_MOE=onednn``
sends every expert there too (to compare)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fluidserve.kernels.reference import pairs_by_expert

logger = logging.getLogger("fluidserve.kernels")

NATIVE_ENV = "FLUIDSERVE_CPU_MOE"
CACHE_ENV = "FLUIDSERVE_CACHE_DIR"
# The most rows an expert may have and go through cpu_moe.c; the others take
# oneDNN's linear over the model's own weights (no copy). In float32
# cpu_moe.c kept up with oneDNN's reordered weights up to 2048 tokens of 8
# experts each (64 experts of 192 features, hidden 512; benchmarks/
# cpu_moe.py's --native-rows sweep). In bf16 it widens every weight to
# float32, where oneDNN's bf16 dot products run twice as many products an
# instruction: past a few dozen rows an expert (a prefill's) they are up to
# 2x faster.
NATIVE_ROWS = {torch.float32: math.inf, torch.bfloat16: 32}
PANEL = 64  # cpu_moe.c's PANEL: the outputs of a panel of weights
_SOURCE = Path(__file__).with_name("cpu_moe.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared",
          # vectorized sums in any order (not -ffast-math: that would also
          # flush denormals for the whole process)
          "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")  # fmt: skip


@dataclass(frozen=True)
class PackedExperts:
    """A layer's experts laid out for the two paths: cpu_moe.c's panels,
    and oneDNN's reordered weights an expert (each None where not made),
    beside the model's stacked weights, which oneDNN's linear takes where
    no reordered copy is made."""

    # The model's; stand-ins of their shape where it gave them up (no product reads them: ``reads_stacked``).
    gate_up: torch.Tensor  # [E, 2N, H]
    down: torch.Tensor  # [E, H, N]
    w13: list[torch.Tensor] | None  # per expert, [2N, H] reordered
    w2: list[torch.Tensor] | None  # per expert, [H, N] reordered
    w13_panels: torch.Tensor | None  # [E, ceil(N / 32), H, PANEL]
    w2_panels: torch.Tensor | None  # [E, ceil(H / PANEL), N, PANEL]


def _panels(w: torch.Tensor, width: int) -> torch.Tensor:
    """[E, out, K] -> [E, ceil(out / width), K, width]: each run of
    ``width`` outputs contiguous input by input, the outputs past ``out``
    zero."""
    experts, out, k = w.shape
    padded = -(-out // width) * width
    w = F.pad(w, (0, 0, 0, padded - out))
    return w.view(experts, padded // width, width, k).transpose(2, 3)


def panels(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_moe.c's layout of a layer's stacked weights ([E, 2N, H], [E, H, N]):
    gate/up panels of 32 gate outputs then the same 32 features' up outputs,
    down panels of PANEL outputs."""
    half = PANEL // 2
    gate, up = gate_up.detach().chunk(2, dim=1)
    w13 = torch.cat([_panels(gate, half), _panels(up, half)], dim=-1).contiguous()
    return w13, _panels(down.detach(), PANEL).contiguous()


def reads_stacked(packed: PackedExperts, dtype: torch.dtype) -> bool:
    """Whether ``fused_experts`` (its default rows) reads the model's
    stacked weights: where no reordered copies were made, for the experts
    of more than ``NATIVE_ROWS`` rows (bf16)."""
    return packed.w13 is None and NATIVE_ROWS.get(dtype, 0) < math.inf


def _unpanel(p: torch.Tensor, out: int) -> torch.Tensor:
    """``_panels``' inverse: [E, P, K, width] -> [E, out, K]."""
    experts, count, k, width = p.shape
    return p.transpose(2, 3).reshape(experts, count * width, k)[:, :out]


def stacked(packed: PackedExperts, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked weights ([E, 2N, H], [E, H, N]) read back from the panels
    or the reordered copies, exactly: N = ``inter``, H = ``hidden``."""
    if packed.w13 is not None:
        return torch.stack([w.to_dense() for w in packed.w13]), torch.stack([w.to_dense() for w in packed.w2])
    half = PANEL // 2
    w13 = packed.w13_panels
    gate_up = torch.cat([_unpanel(w13[..., :half], inter), _unpanel(w13[..., half:], inter)], dim=1)
    return gate_up, _unpanel(packed.w2_panels, hidden)


def pack(gate_up: torch.Tensor, down: torch.Tensor, onednn: bool | None = None) -> PackedExperts:
    """A layer's stacked weights ([E, 2N, H] and [E, H, N]) for
    ``fused_experts``: cpu_moe.c's panels where it is built and takes the
    dtype, oneDNN's reordered copies where it is not (``onednn``: make them
    all the same)."""
    native = native_library() is not None and gate_up.dtype in NATIVE_ROWS
    if onednn is None:
        onednn = not native
    with torch.no_grad():
        w13 = [torch.ops.mkldnn._reorder_linear_weight(w.detach()) for w in gate_up] if onednn else None
        w2 = [torch.ops.mkldnn._reorder_linear_weight(w.detach()) for w in down] if onednn else None
        return PackedExperts(gate_up.detach(), down.detach(), w13, w2,
                             *(panels(gate_up, down) if native else (None, None)))  # fmt: skip


def _cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fluidserve"


def _cpu_key() -> str:
    """What -march=native compiles for: the CPU's model and its flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def build(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """cpu_moe.c compiled (once for its source, the compiler, the flags and
    this CPU) into the cache folder: the library's path."""
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join(s.encode() if isinstance(s, str) else s for s in (
        source, compiler, version, " ".join(flags), _cpu_key(), torch.__version__))).hexdigest()[:16]  # fmt: skip
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"fluidserve-{os.getuid()}"):
        target = folder / f"cpu_moe-{key}.so"
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError:
            continue
        try:
            done = subprocess.run([compiler, *flags, "-o", partial, str(_SOURCE)], capture_output=True, text=True,
                                  timeout=300)  # fmt: skip
            if done.returncode:
                raise OSError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
            os.replace(partial, target)  # whole or not at all, for processes building at once
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return target
    raise OSError(f"no writable folder for the compiled experts (tried {_cache_dir()})")


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """cpu_moe.c compiled and loaded, or None (oneDNN for every expert)."""
    if os.environ.get(NATIVE_ENV, "").strip().lower() == "onednn":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler: the CPU's MoE experts run through oneDNN alone")
        return None
    try:
        return load(build(compiler))
    except (OSError, subprocess.SubprocessError) as err:
        logger.warning("the CPU's MoE kernel did not build (%s): its experts run through oneDNN alone", err)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A built library, its entry points typed."""
    # torch has loaded its OpenMP runtime (libgomp.so.1) by now: the library
    # links against the same soname, so its team is torch's own.
    library = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.fluidserve_moe.restype = library.fluidserve_moe_routed.restype = ctypes.c_int
    library.fluidserve_moe.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int, p]
    library.fluidserve_moe_routed.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int,
                                              i64, p]  # fmt: skip
    return library


def fused_experts(
    x: torch.Tensor,  # [T, H]
    packed: PackedExperts,
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    native_rows: float | None = None,
) -> torch.Tensor:
    """[T, H] of x's dtype: reference.fused_experts over packed weights,
    the experts of at most ``native_rows`` rows (NATIVE_ROWS for x's dtype
    by default; 0: none) through cpu_moe.c. Each expert's rows come in the
    order the reference gives them (slot, then token), each pair's product
    is weighted, and each token's products are added in increasing expert
    id, as the reference adds them.

    Where no expert has more rows, cpu_moe.c takes the whole layer from the
    router's choice: it sorts the pairs, and sums each token's products in
    float32, rounded once. Otherwise the pairs are sorted here, the
    products of both paths land in one buffer, and one ``index_add_`` over
    the pairs sorted by expert adds them in that order."""
    if not topk_ids.numel():
        return torch.zeros_like(x)
    if native_rows is None:
        native_rows = NATIVE_ROWS.get(x.dtype, 0)
    native = packed.w13_panels is not None and native_rows > 0
    experts = len(packed.gate_up)
    if native:  # the whole layer in one call where no expert has more rows
        # (the operands held in names: the call reads them through pointers)
        out, xf = torch.empty_like(x), x.float().contiguous()
        ids, weights = topk_ids.to(torch.int64).contiguous(), topk_weights.float().contiguous()
        done = native_library().fluidserve_moe_routed(
            xf.data_ptr(), packed.w13_panels.data_ptr(), packed.w2_panels.data_ptr(), ids.data_ptr(),
            weights.data_ptr(), *ids.shape, experts, x.shape[1], packed.w2_panels.shape[2],
            int(x.dtype == torch.bfloat16), torch.get_num_threads(), min(native_rows, ids.numel()), out.data_ptr())
        _check(done, topk_ids)
        if done == 0:
            return out
    out = torch.zeros_like(x)
    order, counts, tok = pairs_by_expert(topk_ids, experts)
    weights = topk_weights.t().reshape(-1).index_select(0, order)
    ys = x.new_empty(tok.numel(), x.shape[1])
    few = _native(x, packed, counts, tok, weights, ys, native_rows) if native else set()
    start = 0
    for expert, n in enumerate(counts):
        if n and expert not in few:
            end = start + n
            gate, up = _linear(x[tok[start:end]], packed.w13, packed.gate_up, expert).chunk(2, dim=-1)
            y = _linear(F.silu(gate) * up, packed.w2, packed.down, expert)
            ys[start:end] = y * weights[start:end, None]
        start += n
    return out.index_add_(0, tok, ys.to(out.dtype))


def _linear(x: torch.Tensor, reordered: list[torch.Tensor] | None, stacked: torch.Tensor, expert: int) -> torch.Tensor:
    """oneDNN's linear over the expert's reordered copy, or its weights as the model holds them."""
    if reordered is None:
        return F.linear(x, stacked[expert])
    return torch.ops.mkldnn._linear_pointwise(x, reordered[expert], None, "none", [], "")


def _check(done: int, topk_ids: torch.Tensor) -> None:
    if done == -1:
        raise MemoryError(f"the CPU's MoE kernel found no memory for {topk_ids.numel()} (token, expert) pairs")
    if done == -2:
        raise ValueError("an expert id outside the layer's experts")


def _native(x: torch.Tensor, packed: PackedExperts, counts: list[int], tok: torch.Tensor, weights: torch.Tensor,
            ys: torch.Tensor, native_rows: int) -> set[int]:  # fmt: skip
    """The experts of at most native_rows rows through cpu_moe.c, their
    weighted products written into ys; returns those experts."""
    few = sorted((e for e, n in enumerate(counts) if 0 < n <= native_rows), key=lambda e: -counts[e])
    if not few:
        return set()
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    starts_t = torch.tensor(starts, dtype=torch.int64)
    order_t = torch.tensor(few, dtype=torch.int64)
    xf = x.float().contiguous()
    pair_weight = weights.float().contiguous()
    hidden, inter = x.shape[1], packed.w2_panels.shape[2]
    _check(native_library().fluidserve_moe(
        xf.data_ptr(), packed.w13_panels.data_ptr(), packed.w2_panels.data_ptr(), tok.data_ptr(), starts_t.data_ptr(),
        pair_weight.data_ptr(), order_t.data_ptr(), len(few), tok.numel(), hidden, inter,
        int(x.dtype == torch.bfloat16), torch.get_num_threads(), ys.data_ptr()), tok)
    return set(few)
