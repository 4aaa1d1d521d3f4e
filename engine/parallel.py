"""Tensor parallelism, Megatron-style: the process group one worker belongs to,
and the layers that hold one rank's shard of a weight.

A model built with ``TensorParallel(rank, size, group)`` keeps, on each rank:

* column-parallel linears (q/k/v, gate/up, fc1): ``size``-th of the output
  rows, so each rank computes its own heads / its slice of the MLP; no
  communication;
* row-parallel linears (o_proj, down_proj, out_proj, fc2): ``size``-th of the
  input columns; each rank multiplies its slice and one all-reduce sums the
  partial products (the bias is added once, after the sum);
* a vocab-parallel embedding: ``size``-th of the vocabulary rows; a rank
  looks up the ids it owns, zeroes the rest, and an all-reduce assembles the
  rows; and a vocab-parallel LM head whose partial logits are gathered on
  rank 0 only, the one rank that samples.

So a decoder layer costs two all-reduces of ``[num_tokens, hidden]``.

With ``size == 1`` every layer is exactly ``nn.Linear`` / ``nn.Embedding``:
same parameter names, same shapes, same arithmetic, no communication.

Each sharded parameter carries a ``ShardSpec`` saying which slice of the
checkpoint tensor it holds; the loader (engine/loader.py) reads just that.
Linears over the same input are fused (q/k/v, gate/up): the fused parameter
carries one ``Piece`` per checkpoint tensor, each with its own shard.

On the CPU every linear runs oneDNN's kernel on a weight reordered once,
after loading (``prepack_linears``); elsewhere, and on the CPU's Triton
lane, ``kernels.ops.linear`` (cuBLAS, or a Triton GEMV for one row inside a
decode graph).
"""

from __future__ import annotations

import collections
import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from fluidserve.kernels import ops

if TYPE_CHECKING:
    from fluidserve.engine.lora import LoRAWeights
    from fluidserve.engine.quantization import GroupedCodes
    from fluidserve.kernels.reference import PackedExperts, PackedLinear


# gloo's all-reduce of a small tensor makes several round trips between the
# ranks: 1.3 ms for 64 floats between two processes on one machine, where an
# all-gather of the same tensor and a local sum take 0.5 ms (0.9 against 1.4 ms
# at 65,536 floats; past 262,144 the all-reduce wins). A decode step's
# all-reduces are [batch, hidden]: at hidden 4096, batches up to 16.
GATHER_SUM_MAX_NUMEL = 65536


@dataclass(frozen=True)
class TensorParallel:
    """Where this worker sits in its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None when size == 1
    # Small all-reduces as an all-gather and a sum in rank order (gloo, on
    # the CPU): every rank adds the same parts in the same order, so every
    # rank holds the same bits, as an all-reduce leaves them.
    gather_small_sums: bool = False

    @property
    def is_first(self) -> bool:
        """Rank 0 gathers the logits and samples."""
        return self.rank == 0

    def divide(self, n: int, what: str) -> int:
        """``n / size``, or a ValueError naming the model dimension that does not split."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} must divide the model's {what} ({n})")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place."""
        if self.size == 1:
            return x
        if self.gather_small_sums and x.numel() <= GATHER_SUM_MAX_NUMEL and x.is_contiguous():
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
            total = parts[0]
            for part in parts[1:]:
                total += part
            x.copy_(total)
        else:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along ``dim`` on rank 0; None on the
        others. Only rank 0 samples, so the others need no copy."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim) if parts is not None else None


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str,
                         timeout_s: float = 600.0) -> TensorParallel:
    """Join the group of ``size`` workers meeting at ``init_method``
    (``tcp://host:port``). Blocks until all of them have joined."""
    if size == 1:
        return TensorParallel()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    return TensorParallel(rank, size, dist.group.WORLD, gather_small_sums=backend == "gloo")


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -- shards of checkpoint tensors ------------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """Which slice of the full tensor a parameter holds: along ``dim``, the
    ``index``-th run of ``size`` elements out of ``full``. The last shard of a
    dimension that does not divide (the vocabulary) is zero-padded to
    ``size``, so every rank's parameter has one shape."""

    dim: int
    index: int
    size: int
    full: int

    @property
    def start(self) -> int:
        return self.index * self.size

    @property
    def stop(self) -> int:
        return min(self.start + self.size, self.full)

    def full_shape(self, shard_shape: torch.Size) -> tuple[int, ...]:
        shape = list(shard_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def pad(self, part: torch.Tensor) -> torch.Tensor:
        """Zero-pad a slice of length ``stop - start`` up to ``size``."""
        missing = self.size - part.shape[self.dim]
        if missing <= 0:
            return part
        pad_shape = list(part.shape)
        pad_shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(pad_shape)], dim=self.dim)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return self.pad(full.narrow(self.dim, self.start, self.stop - self.start))


_SHARD_ATTR = "tp_shard"


def shard_spec(param: nn.Parameter) -> ShardSpec | None:
    """The slice a parameter holds; None for a replicated (whole) parameter."""
    return getattr(param, _SHARD_ATTR, None)


def new_param(shape: tuple[int, ...], spec: ShardSpec | None, device: str | None = None) -> nn.Parameter:
    """An uninitialised parameter holding ``spec``'s slice (whole: None),
    which the loader fills from the checkpoint right after construction
    (``device``: where, if not the default)."""
    param = nn.Parameter(torch.empty(shape, device=device))
    if spec is not None:
        setattr(param, _SHARD_ATTR, spec)
    return param


# Whether linears and stacked experts built now leave their weights
# unallocated (on the meta device) until ``realize_linears``: a model whose
# weights will hold a quantized checkpoint's codes never takes the device
# memory of their dense weights.
_deferred = False


@contextmanager
def deferred_linear_weights(on: bool = True) -> Iterator[None]:
    """Build linears and stacked experts with their weights on the meta device (``on``)."""
    global _deferred
    before, _deferred = _deferred, on
    try:
        yield
    finally:
        _deferred = before


def linear_weight(shape: tuple[int, ...], spec: ShardSpec | None) -> nn.Parameter:
    """A linear's weight: ``new_param``, on the meta device while deferred."""
    return new_param(shape, spec, "meta" if _deferred else None)


# -- layers ----------------------------------------------------------------------


# Whether oneDNN packs weights of a dtype on this CPU, found by trying once.
_PREPACKS: dict[torch.dtype, bool] = {}


def can_prepack(weight: torch.Tensor) -> bool:
    # oneDNN's CPU linear runs fp32 and bf16 (fp16 has no fast path on most
    # CPUs); a meta or CUDA weight keeps F.linear.
    if not (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()):
        return False
    ok = _PREPACKS.get(weight.dtype)
    if ok is None:
        # Its bf16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and
        # refuses other CPUs (an AVX2-only one): those keep F.linear.
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=weight.dtype))
            ok = True
        except RuntimeError:
            ok = False
        _PREPACKS[weight.dtype] = ok
    return ok


class HeldWeights(nn.Module):
    """A module whose weights the loader may hold as a quantized checkpoint
    stores them (``--quantized-weights packed``): a linear's ``weight``, the
    stacked experts' ``gate_up_proj`` and ``down_proj``. ``code_params``
    names each such parameter and the attribute of the ``QuantizedWeight``
    that replaces it; the parameter is then a stand-in of its shape, dtype
    and device that holds no memory (what the layers' checks read)."""

    code_params: dict[str, str] = {"weight": "quantized_weight"}
    # Whether the weights may be held as the checkpoint's codes: not where a
    # module reads the dense weight itself (the MoE router's fp32 scores).
    takes_quantized_weight = True

    def __init__(self) -> None:
        super().__init__()
        for attr in self.code_params.values():
            setattr(self, attr, None)  # a submodule once set: a class attribute would hide it

    def held_codes(self) -> dict[str, QuantizedWeight]:
        """Each parameter held as the checkpoint's codes, by its name."""
        return {leaf: getattr(self, attr) for leaf, attr in self.code_params.items()
                if getattr(self, attr) is not None}  # fmt: skip

    def deferred(self) -> bool:
        """Whether ``deferred_linear_weights`` left the weights unallocated."""
        return any(getattr(self, leaf).device.type == "meta" for leaf in self.code_params)

    def to_quantized(self, device: torch.device) -> None:
        """Hold each weight as the checkpoint's codes (``QuantizedWeight``,
        filled by the loader) on ``device`` instead of a dense tensor, which
        is dropped. A stacked weight [E, rows, features] holds each expert's."""
        for leaf, attr in self.code_params.items():
            dense = getattr(self, leaf)
            experts = dense.shape[0] if dense.dim() == 3 else None
            setattr(self, attr, QuantizedWeight(dense.shape[-2], dense.shape[-1], shard_spec(dense),
                                                fused_pieces(dense), device, experts))  # fmt: skip
            delattr(self, leaf)
            # Not a parameter: one element, expanded.
            setattr(self, leaf, torch.empty((), dtype=dense.dtype, device=device).expand(dense.shape))

    # Whether the dense weights were given up once a packed copy held them (``drop_dense``).
    dense_dropped = False

    def drop_dense(self) -> None:
        """Give up each dense weight for a stand-in of its shape, dtype,
        device and shard holding one NaN (so a stray read shows): for
        weights a packed copy holds, that nothing else reads."""
        for leaf in self.code_params:
            dense = getattr(self, leaf)
            stand_in = torch.full((), float("nan"), dtype=dense.dtype, device=dense.device).expand(dense.shape)
            param = nn.Parameter(stand_in, requires_grad=False)
            for attr in (_SHARD_ATTR, _PIECES_ATTR):
                if hasattr(dense, attr):
                    setattr(param, attr, getattr(dense, attr))
            setattr(self, leaf, param)
        self.dense_dropped = True

    def dense_values(self) -> dict[str, torch.Tensor]:
        """Each dense weight's values by its name; where given up, read back
        from the packed copy, exactly."""
        return {leaf: getattr(self, leaf) for leaf in self.code_params}

    def realize(self, device: torch.device) -> None:
        """Allocate the weights ``deferred_linear_weights`` left on the meta device."""
        for leaf in self.code_params:
            dense = getattr(self, leaf)
            if dense.device.type != "meta":
                continue
            param = nn.Parameter(torch.empty(dense.shape, dtype=dense.dtype, device=device))
            for attr in (_SHARD_ATTR, _PIECES_ATTR):
                if hasattr(dense, attr):
                    setattr(param, attr, getattr(dense, attr))
            setattr(self, leaf, param)


class _PrepackedLinear(HeldWeights):
    """A linear whose weight, on the CPU, is reordered once into oneDNN's
    blocked layout (``prepack``, called after the weights are loaded) and run
    by oneDNN's linear: 1.1-2x faster than ``F.linear`` at every batch size
    measured (benchmarks/cpu_linear.py). The packed copy is a plain
    attribute, outside ``state_dict``. Once packed, the weight as loaded is
    dropped where nothing else reads it (``prepack(keep_dense=False)``):
    every product then runs on the packed copy, and keeping both would hold
    the linears' weights twice. The parameter becomes a stand-in of the
    same shape, dtype, device and shard that holds no memory (NaN, so a
    stray read shows); ``dense_weight`` reads the values back."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    _packed: torch.Tensor | None = None
    # Adapter slots (engine/lora.py), with --enable-lora: a step with
    # adapter rows adds their low-rank products to every product here.
    lora: "LoRAWeights | None" = None
    # The weight as the checkpoint stores it (``--quantized-weights packed``:
    # GPTQ/AWQ integers, float8), in place of the dense one (``HeldWeights``):
    # every product then runs on these (``ops.linear`` and the fused ops
    # over a ``PackedLinear``: the batch-1 GEMV, else ``ops.packed_linear``).
    quantized_weight: "QuantizedWeight | None"

    def _fused_weight(self) -> torch.Tensor | PackedLinear | None:
        """The weight the fused launches (norm, activation and residual in
        the batch-1 GEMV, ``ops.norm_linear`` and kin) read: the dense one,
        or the checkpoint's codes (``PackedLinear``); None where they step
        aside: a weight oneDNN reordered, or adapter products to add
        (``_adapted``), which they have no place for."""
        if self._packed is not None or self._adapted():
            return None
        return self.weight if self.quantized_weight is None else self.quantized_weight.packed()

    def prepack(self, keep_dense: bool = True) -> None:
        """Pack the weight as it is now; later changes to it are not seen
        (the loader packs once, after the last write). Without
        ``keep_dense``, the weight as loaded is dropped once packed: for a
        weight no other module shares or reads (``prepack_linears``)."""
        if self.dense_dropped:
            return  # packed already, from values the stand-in no longer holds
        self._packed = None
        if self.quantized_weight is not None:
            self.quantized_weight.settle()
            return
        # The Triton lane (FLUIDSERVE_KERNELS=triton) runs the GPU's linears,
        # the batch-1 kernel included, so it keeps the weight as loaded.
        if can_prepack(self.weight) and ops.kernel_path(self.weight.device) != "triton":
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            if not keep_dense:
                self.drop_dense()

    def dense_weight(self) -> torch.Tensor:
        """The weight's values [out, in]: the parameter, or where it was
        dropped, a dense copy read back from the packed one (exact)."""
        return self._packed.to_dense() if self.dense_dropped else self.weight

    def dense_values(self) -> dict[str, torch.Tensor]:
        return {"weight": self.dense_weight()}

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None,
                path: ops.KernelPath | None = None) -> torch.Tensor:  # fmt: skip
        """``x W^T + bias``, plus ``residual`` [T, out] in the same kernel
        where it can be: oneDNN's add post-op on the CPU, elsewhere a GEMM
        that accumulates into the residual in place (so the caller must own
        it). x: [T, in]."""
        if self.quantized_weight is not None:
            y = ops.linear(x, self.quantized_weight.packed(), bias, residual, path)
        elif self._packed is not None and x.device.type == "cpu" and (x.dtype == self._packed.dtype
                                                                      or self.dense_dropped):
            rows = x
            if x.dtype != self._packed.dtype:
                # Rows of another dtype (none the models send) take the packed
                # weight's: the dense weight that would take them is gone.
                dtype = self._packed.dtype
                rows, residual = x.to(dtype), None if residual is None else residual.to(dtype)
            if residual is not None:
                y = torch.ops.mkldnn._linear_pointwise.binary(rows, residual, self._packed, bias, "add")
            else:
                y = torch.ops.mkldnn._linear_pointwise(rows, self._packed, bias, "none", [], "")
            if y.dtype != x.dtype:
                y = y.to(x.dtype)
        else:
            y = ops.linear(x, self.weight, bias, residual, path)
        return y if self.lora is None else self.lora.add_to(x, y)

    def _adapted(self) -> bool:
        """This step adds adapter products here: the fused launches, which
        have no place for them, give way to the plain product."""
        return self.lora is not None and self.lora.active


class QuantizedWeight(nn.Module):
    """A weight held as a quantized checkpoint keeps it, as
    kernels/int_linear.py and kernels/fp8_linear.py read it: per output row,
    ``scales`` (fp32) [rows, groups] over groups of input features,
    ``g_idx`` [features] int32 each feature's group, and the codes:

    * GPTQ/AWQ integers: ``codes`` [rows, features / (32 / bits)] int32,
      each word ``32 / bits`` input features' codes from the lowest bits up,
      and ``zeros`` (uint8) [rows, groups]; the weight is ``(codes -
      zeros[:, g_idx]) * scales[:, g_idx]``;
    * float8: ``codes`` [rows, features] in the checkpoint's float8, no zero
      points; the weight is ``codes * scales[:, g_idx]`` (a block's scale
      repeated over its rows, its columns a group).

    Either rounded once to the model's dtype: the dequantized checkpoint's
    weight, bit for bit. The loader fills it piece by piece (``load``), as
    it fills a fused dense weight: the pieces and shard are the dense
    weight's; the first piece decides the kind. Stacked experts
    (``experts``: E) hold every tensor above with a leading [E] dimension,
    ``g_idx`` [E, features] included, since each expert's act-order is its
    own (kernels/reference.py, ``PackedExperts``)."""

    def __init__(self, rows: int, features: int, spec: ShardSpec | None, pieces: tuple[Piece, ...] | None,
                 device: torch.device, experts: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.rows, self.features, self.bits, self.experts = rows, features, 0, experts
        self.spec, self.pieces, self.device = spec, pieces, device
        for name in ("codes", "zeros", "scales", "g_idx"):
            self.register_buffer(name, None)
        # k // group_size is every feature's group (a checkpoint without
        # act-order): the kernels read a scale once per word, not per code.
        self.group_size: int | None = None
        self._ordered: list[bool] = []  # stacked experts: whether each expert's g_idx is set
        self._view: PackedLinear | PackedExperts | None = None  # ``packed``'s, until the codes change

    @property
    def float8(self) -> bool:
        return self.codes is not None and self.codes.dtype.is_floating_point

    def kind(self) -> str:
        """``float8_e4m3fn`` or ``float8_e5m2``, or ``int4`` / ``int8``."""
        return str(self.codes.dtype).removeprefix("torch.") if self.float8 else f"int{self.bits}"

    def settle(self) -> None:
        """After the last ``load``: whether the groups are plain runs (a few
        device syncs). A row-parallel shard of a plain checkpoint holds a run
        of groups from the middle (its input features): those groups alone
        are kept, renumbered from 0, so its kernels read scales per word too.
        Stacked experts' groups are plain where every expert's are the same
        plain runs."""
        from fluidserve.kernels import reference

        self._view = None
        if self.g_idx is None:
            return
        low, high = int(self.g_idx.min()), int(self.g_idx.max()) + 1
        shifted = self.g_idx - low
        first = shifted if self.experts is None else shifted[0]
        self.group_size = reference.plain_group_size(first)
        if self.experts is not None and not torch.equal(shifted, first.expand_as(shifted)):
            self.group_size = None
        if self.group_size is not None and (low, high) != (0, self.scales.shape[-1]):
            self.g_idx = shifted
            self.scales = self.scales[..., low:high].contiguous()
            if self.zeros is not None:
                self.zeros = self.zeros[..., low:high].contiguous()

    def load(self, offset: int, part: GroupedCodes, name: str, expert: int | None = None) -> None:
        """Rows ``[offset, offset + part rows)`` (of ``expert``'s weight, where
        stacked) from ``part``: its kind and groups must be those of every
        other part (a fused q/k/v of act-order GPTQ shares its input's
        order; an expert's gate and up share theirs)."""
        from fluidserve.kernels import reference

        self._view = None
        rows, groups = part.codes.shape[0], part.scales.shape[1]
        if part.codes.shape[1] != self.features:
            raise ValueError(f"weight {name}: codes of {part.codes.shape[1]} features for a weight of "
                             f"{self.features}")
        if self.codes is None:
            self._allocate(part)
        elif part.kind() != self.kind() or groups != self.scales.shape[-1]:
            raise ValueError(f"weight {name}: its codes or groups differ from the other weights held with it "
                             "(another format or group size): serve it with --quantized-weights dequantized")
        g_idx = part.g_idx.to(device=self.device, dtype=torch.int32)
        if self.experts is not None and not self._ordered[expert]:
            self.g_idx[expert] = g_idx  # an expert's first part sets its order
            self._ordered[expert] = True
        elif not torch.equal(g_idx, self.g_idx if self.experts is None else self.g_idx[expert]):
            raise ValueError(f"weight {name}: its groups of input features are ordered apart from the other "
                             "weights fused with it (act-order GPTQ with another order): serve it with "
                             "--quantized-weights dequantized")
        at = slice(offset, offset + rows) if self.experts is None else (expert, slice(offset, offset + rows))
        with torch.no_grad():
            codes = part.codes.to(self.device)
            self.codes[at] = codes if self.float8 else reference.int_pack(codes, self.bits)
            if self.zeros is not None:
                self.zeros[at] = part.zeros
            self.scales[at] = part.scales

    def _allocate(self, part: GroupedCodes) -> None:
        groups, self.bits = part.scales.shape[1], part.bits
        lead = () if self.experts is None else (self.experts,)
        if part.zeros is None:  # float8
            self.codes = torch.zeros(*lead, self.rows, self.features, dtype=part.codes.dtype, device=self.device)
        else:
            per_word = 32 // part.bits
            if self.features % per_word:
                raise ValueError(f"{part.bits}-bit weights pack {per_word} input features a word; "
                                 f"{self.features} do not divide")
            self.codes = torch.zeros(*lead, self.rows, self.features // per_word, dtype=torch.int32,
                                     device=self.device)  # fmt: skip
            self.zeros = torch.zeros(*lead, self.rows, groups, dtype=torch.uint8, device=self.device)
        self.scales = torch.zeros(*lead, self.rows, groups, dtype=torch.float32, device=self.device)
        if self.experts is None:
            self.g_idx = part.g_idx.to(device=self.device, dtype=torch.int32).contiguous()
        else:
            self.g_idx = torch.zeros(self.experts, self.features, dtype=torch.int32, device=self.device)
            self._ordered = [False] * self.experts

    def packed(self) -> PackedLinear | PackedExperts:
        """The codes as the kernels take them: a linear's for ``ops.linear``
        and kin, stacked experts' for ``ops.fused_experts``; made once
        (every layer's product asks, every step), until ``load`` or
        ``settle`` changes the codes."""
        if self._view is None:
            from fluidserve.kernels.reference import PackedExperts, PackedLinear

            held = PackedLinear if self.experts is None else PackedExperts
            self._view = held(self.codes, self.scales, self.zeros, self.g_idx, self.bits, self.group_size)
        return self._view

    def dense_elements(self) -> int:
        """The elements of the dense weight these codes stand for."""
        return (self.experts or 1) * self.rows * self.features

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.zeros, self.scales, self.g_idx)
                   if t is not None)


def realize_linears(model: nn.Module, held: set[str], device: torch.device) -> None:
    """After ``deferred_linear_weights``: the linears and stacked experts
    named in ``held`` hold their weights as the checkpoint's codes
    (``to_quantized``), every other deferred weight is allocated."""
    for name, module in model.named_modules():
        if not isinstance(module, HeldWeights) or not module.deferred():
            continue
        if name in held:
            module.to_quantized(device)
        else:
            module.realize(device)


def trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's
    ``malloc_trim``; elsewhere nothing). Weights of a few MB live in the
    heap, not in mappings of their own (glibc maps only blocks past a
    threshold it raises as large blocks are freed), so the weights a linear
    drops once packed leave holes the process keeps resident: on SmolLM2
    in fp32, 38 MiB of the 405 dropped."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def loaded_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` by name, with the values the loader
    wrote: a weight dropped once packed read back from its packed copy."""
    read_back = {f"{name}.{leaf}" if name else leaf: values
                 for name, m in model.named_modules() if isinstance(m, HeldWeights) and m.dense_dropped
                 for leaf, values in m.dense_values().items()}  # fmt: skip
    return {name: read_back.get(name, param) for name, param in model.named_parameters()}


def prepack_linears(model: nn.Module) -> None:
    """Pack every linear of ``model`` for the CPU (a no-op elsewhere), and
    have every other module with a ``prepack`` (a decoder layer that reads
    its weights once for the batch-1 row path) take the weights as they are
    now."""
    modules = list(model.modules())
    # A linear gives up its weight as loaded once packed, unless another
    # module holds the same parameter (an LM head tied to the embedding) or
    # it reads the values itself (a router's float32 scores).
    holders = collections.Counter(id(p) for m in modules for p in m._parameters.values() if p is not None)
    for module in modules:
        if isinstance(module, _PrepackedLinear):
            module.prepack(keep_dense=holders[id(module.weight)] > 1 or not module.takes_quantized_weight)
    for module in modules:  # after the linears: these may read what they packed
        if not isinstance(module, _PrepackedLinear) and callable(getattr(type(module), "prepack", None)):
            module.prepack()
    if any(isinstance(m, HeldWeights) and m.dense_dropped for m in modules):
        trim_heap()


class ColumnParallelLinear(_PrepackedLinear):
    """``y = x W^T + b`` with W's output rows split: this rank holds rows
    ``[index * out/num_shards, (index+1) * out/num_shards)`` and computes that
    slice of y. ``num_shards``/``index`` default to the group's size/rank; the
    KV projections pass their own when there are fewer KV heads than ranks
    (each rank then holds one whole KV head, replicated across ranks)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 num_shards: int | None = None, index: int | None = None) -> None:
        super().__init__()
        num_shards = tp.size if num_shards is None else num_shards
        index = tp.rank if index is None else index
        if out_features % num_shards:
            raise ValueError(f"output features {out_features} do not split into {num_shards} shards")
        local = out_features // num_shards
        spec = ShardSpec(0, index, local, out_features) if num_shards > 1 else None
        self.in_features, self.out_features = in_features, local
        self.weight = linear_weight((local, in_features), spec)  # [out / shards, in]
        if bias:
            self.bias = new_param((local,), spec)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)  # [T, out / shards]


@dataclass(frozen=True)
class Part:
    """One checkpoint linear inside a fused one: its module name in the
    checkpoint (``q_proj``), its full output features, and how it splits
    across ranks (``num_shards``/``index`` as ColumnParallelLinear takes them)."""

    name: str
    out_features: int
    num_shards: int | None = None
    index: int | None = None


@dataclass(frozen=True)
class Piece:
    """Where one checkpoint tensor lives in a fused parameter: rows
    ``[offset, offset + rows)`` hold ``spec``'s slice of the checkpoint's
    ``<prefix>.<name>.<weight|bias>`` (the whole tensor when ``spec`` is None)."""

    name: str
    offset: int
    rows: int
    spec: ShardSpec | None
    # A stacked parameter's piece (experts, [E, rows, in]): the index along
    # its first dimension that holds this tensor, and the tensor's checkpoint
    # name relative to the parameter's module (``3.gate_proj.weight``).
    expert: int | None = None
    key: str | None = None


_PIECES_ATTR = "tp_pieces"


def fused_pieces(param: nn.Parameter) -> tuple[Piece, ...] | None:
    """The checkpoint tensors stacked in a fused parameter; None for any other."""
    return getattr(param, _PIECES_ATTR, None)


def stacked_param(shape: tuple[int, ...], pieces: tuple[Piece, ...]) -> nn.Parameter:
    """A parameter that holds many checkpoint tensors (one expert's each
    along its first dimension), loaded where its ``pieces`` say; on the
    meta device while deferred, as a linear's weight."""
    param = new_param(shape, None, "meta" if _deferred else None)
    setattr(param, _PIECES_ATTR, pieces)
    return param


class MergedColumnParallelLinear(_PrepackedLinear):
    """Several column-parallel linears over the same input, stacked into one
    weight (q/k/v, gate/up): one matrix product instead of two or three.

    Each part splits across ranks on its own, so a rank's weight is its
    shard of every part, stacked in order::

        tp=2, Hq=8, Hk=2:  rank 0 rows: q heads 0-3 | k head 0 | v head 0
                           rank 1 rows: q heads 4-7 | k head 1 | v head 1

    Checkpoint names stay as they are: the loader writes ``q_proj.weight``
    into the rows its ``Piece`` names (engine/loader.py)."""

    def __init__(self, in_features: int, parts: list[Part], bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        pieces, offset = [], 0
        for part in parts:
            num_shards = tp.size if part.num_shards is None else part.num_shards
            index = tp.rank if part.index is None else part.index
            if part.out_features % num_shards:
                raise ValueError(f"{part.name}: output features {part.out_features} do not split into "
                                 f"{num_shards} shards")
            local = part.out_features // num_shards
            spec = ShardSpec(0, index, local, part.out_features) if num_shards > 1 else None
            pieces.append(Piece(part.name, offset, local, spec))
            offset += local
        self.in_features, self.out_features = in_features, offset
        self.sizes = [p.rows for p in pieces]  # this rank's output features of each part
        self.weight = linear_weight((offset, in_features), None)  # [sum of parts / shards, in]
        setattr(self.weight, _PIECES_ATTR, tuple(pieces))
        if bias:
            self.bias = new_param((offset,), None)
            setattr(self.bias, _PIECES_ATTR, tuple(pieces))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)  # [T, sum of parts / shards]; split by self.sizes

    def forward_silu_and_mul(self, x: torch.Tensor, path: ops.KernelPath | None = None) -> torch.Tensor:
        """``silu(gate) * up`` of a gate/up pair, [T, in] -> [T, inter / tp]:
        at batch 1 on the Triton lane one launch (the activation in the
        GEMV's epilogue, ``ops.linear_silu_and_mul``), elsewhere the product
        then the activation."""
        self._check_gated()
        weight = self._fused_weight()
        if weight is None:
            return ops.silu_and_mul(self._linear(x, self.bias), path)
        return ops.linear_silu_and_mul(x, weight, self.bias, path)

    def forward_normed(self, x: torch.Tensor, norm: nn.Module, gated: bool = False,
                       path: ops.KernelPath | None = None) -> torch.Tensor:  # fmt: skip
        """``forward(norm(x))`` (``gated``: ``forward_silu_and_mul`` of it),
        x left as it is: one launch where the batch-1 GEMV runs (the norm in
        its prologue, ``ops.norm_linear``). ``norm``: an RMSNorm."""
        if gated:
            self._check_gated()
        weight = self._fused_weight()
        if weight is None:
            normed = norm(x, path)
            return self.forward_silu_and_mul(normed, path) if gated else self.forward(normed)
        return ops.norm_linear(x, norm.weight, norm.eps, weight, self.bias, gated, path)

    def _check_gated(self) -> None:
        if len(self.sizes) != 2 or self.sizes[0] != self.sizes[1]:
            raise ValueError(f"silu_and_mul needs two equal parts (gate, up), this linear has {self.sizes}")


class RowParallelLinear(_PrepackedLinear):
    """``y = x W^T + b`` with W's input columns split: this rank holds
    columns ``[rank * in/size, ...)`` and receives the matching slice of x
    (the output of a column-parallel layer). One all-reduce sums the partial
    products; the bias is replicated and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        local = tp.divide(in_features, "row-parallel input features")
        spec = ShardSpec(1, tp.rank, local, in_features) if tp.size > 1 else None
        self.in_features, self.out_features = local, out_features
        self.weight = linear_weight((out_features, local), spec)  # [out, in / size]
        if bias:
            self.bias = new_param((out_features,), None)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                path: ops.KernelPath | None = None) -> torch.Tensor:  # fmt: skip
        """``x W^T + b`` [T, out], plus ``residual`` when given: fused into
        the product on one rank (in place over it off the CPU, so the caller
        must own it); added after the all-reduce on several, in the order
        the unfused layer adds. ``path``: the step's ``ops.kernel_path``
        (None: asked per call)."""
        if self.tp.size == 1:
            return self._linear(x, self.bias, residual, path)  # nn.Linear's arithmetic
        y = self.tp.all_reduce(self._linear(x, None, path=path))  # [T, out]
        y = y if self.bias is None else y + self.bias
        return y if residual is None else y.add_(residual)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor,
                    path: ops.KernelPath | None = None) -> torch.Tensor:  # fmt: skip
        """``forward(x) + residual`` as a new tensor, residual left as it is,
        rounded as that separate add rounds: one launch where the batch-1
        GEMV runs on one rank (``ops.linear_add``)."""
        weight = self._fused_weight() if self.tp.size == 1 else None
        if weight is not None:
            return ops.linear_add(x, weight, residual, self.bias, path)
        return self.forward(x).add_(residual)


def _vocab_shard(vocab: int, tp: TensorParallel) -> tuple[int, ShardSpec | None]:
    """Rows per rank (the vocabulary rounded up to a multiple of the group)."""
    if tp.size == 1:
        return vocab, None
    per_rank = -(-vocab // tp.size)
    return per_rank, ShardSpec(0, tp.rank, per_rank, vocab)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows. Each rank looks up the ids in
    its range, zeroes the rows of the ids it does not own, and an all-reduce
    assembles every token's row (exactly one rank contributes it)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.rows, spec = _vocab_shard(num_embeddings, tp)
        self.start = tp.rank * self.rows
        self.weight = new_param((self.rows, embedding_dim), spec)  # [vocab / size, dim]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        foreign = (local < 0) | (local >= self.rows)  # [T]
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)  # [T, dim]
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(_PrepackedLinear):
    """The output projection split by vocabulary rows, like the embedding (so
    tied weights stay one shared shard). Partial logits are gathered on rank
    0, the padding rows cut off; the other ranks get None."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        rows, spec = _vocab_shard(vocab_size, tp)
        self.weight = linear_weight((rows, hidden), spec)  # [vocab / size, hidden]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self._linear(hidden, None)  # [S, vocab / size]
        full = self.tp.gather_first(logits, dim=-1)  # [S, padded vocab] on rank 0
        return None if full is None else full[:, : self.vocab_size]
