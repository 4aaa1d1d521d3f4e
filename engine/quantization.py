"""What a checkpoint's ``quantization_config`` means to the loader.

Quantized checkpoints load by dequantizing each weight as it is read, in
fp32, into the model's dtype (rounded once); the model then runs on those
weights as on any other checkpoint's: weights held in the model's dtype,
activations never quantized (activation and KV-cache scales go unread).
With ``--quantized-weights packed`` a linear's weight is unpacked instead
(``GroupedCodes``: its codes with a scale a row a group) and kept as
stored, every product dequantizing it to the same bits.

* FP8: transformers' and DeepSeek's ``fp8`` (``weight`` in float8 beside a
  ``weight_scale_inv`` per block, or a ``weight_scale`` per tensor in vLLM's
  older serialization) and compressed-tensors' ``float-quantized`` FP8
  (``weight_scale`` per tensor, output channel or block).
* 4- and 8-bit integers with a scale and zero point per group of input
  features: GPTQ (``qweight`` packed along the input features, ``qzeros``
  along the outputs, ``scales``, ``g_idx``; the original format stores each
  zero point less one, ``checkpoint_format: gptq_v2`` as it is) and AWQ's
  GEMM layout (4-bit, both packed along the outputs in AWQ's interleaved
  order).

Every other method is refused by name when the engine starts: a quantized
tensor copied into a float parameter without its scale would serve
garbage, and a packed integer one would not even fit its shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from fluidserve.engine.config import QUANTIZATION_ALIASES, QUANTIZATION_METHODS

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_NAMES = ("F8_E4M3", "F8_E5M2")  # safetensors' names of the two
# A float8 weight's scale, beside it: `X.weight` -> `X.weight_scale_inv` or `X.weight_scale`.
SCALE_SUFFIXES = ("_scale_inv", "_scale")
# Tensors of an FP8 checkpoint nothing reads: activation scales (static
# activation quantization) and KV-cache scales.
UNREAD_SUFFIXES = ("input_scale", "activation_scale", "output_scale", "k_scale", "v_scale")


class CheckpointFormat(Protocol):
    """A quantized checkpoint's weight format, as the loader applies it."""

    method: str

    def describe(self) -> str: ...

    def is_aux(self, name: str) -> bool:
        """A tensor read ahead (a scale, a zero point) and never loaded itself."""

    def quantized(self, name: str, source) -> bool:
        """Whether ``source`` is a quantized weight (a tensor or a safetensors slice)."""

    def dequantize(self, name: str, tensor: torch.Tensor, aux: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        """The weight's name and value in fp32, from its quantized tensor and the aux tensors beside it."""

    def unpack(self, name: str, tensor: torch.Tensor, aux: dict[str, torch.Tensor]) -> tuple[str, GroupedCodes]:
        """The weight's name and its codes with a scale a row a group (a linear's 2-D weight)."""


@dataclass(frozen=True)
class Fp8Checkpoint:
    """An FP8 checkpoint's weight format: its method and, for block scales,
    the block of ``[rows, cols]`` each scale covers (None: the scale's shape
    says, one per tensor or one per output row)."""

    method: str
    block: tuple[int, int] | None = None

    def describe(self) -> str:
        grain = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per-tensor or per-channel scales"
        return f"{self.method} (float8 weights, {grain})"

    def is_aux(self, name: str) -> bool:
        return is_scale(name)

    def quantized(self, name: str, source) -> bool:
        return is_fp8(source)

    def dequantize(self, name: str, tensor: torch.Tensor, aux: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        return name, self.scaled(name, tensor, self._scale(name, aux))

    def unpack(self, name: str, tensor: torch.Tensor, aux: dict[str, torch.Tensor]) -> tuple[str, GroupedCodes]:
        """A linear's float8 weight [rows, cols] with its scale as a scale a
        row a group of columns (``GroupedCodes``): one group of all columns
        for a scale per tensor or per row, a block's columns a group for
        block scales, each block's scale on each of its rows. The same
        products ``scaled`` forms."""
        scale = self._scale(name, aux).to(device=tensor.device, dtype=torch.float32)
        if tensor.dim() != 2:
            raise ValueError(f"weight {name}: a {tuple(tensor.shape)} float8 tensor is no linear's weight")
        rows, cols = tensor.shape
        if scale.numel() == 1 or tuple(scale.shape) in ((rows, 1), (rows,)):
            per_row = scale.reshape(-1, 1).expand(rows, 1).contiguous()
            return name, GroupedCodes(tensor, None, per_row, torch.zeros(cols, dtype=torch.int32,
                                                                         device=tensor.device), 8)
        grid = tuple(scale.shape) if scale.dim() == 2 else ()
        block = self.block or _block_of(grid, rows, cols)
        if block is None or grid != (-(-rows // block[0]), -(-cols // block[1])):
            self.scaled(name, tensor, scale)  # raises, naming the shapes
        per_row = scale.repeat_interleave(block[0], dim=0)[:rows].contiguous()
        g_idx = (torch.arange(cols, device=tensor.device) // block[1]).to(torch.int32)
        return name, GroupedCodes(tensor, None, per_row, g_idx, 8)

    def _scale(self, name: str, aux: dict[str, torch.Tensor]) -> torch.Tensor:
        scale = scale_of(name, aux)
        if scale is None:
            raise ValueError(f"weight {name}: float8 without its scale ({name}_scale_inv or {name}_scale)")
        return scale

    def scaled(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``weight`` (float8, ``[..., rows, cols]``) times ``scale``, in fp32."""
        values, scale = weight.to(torch.float32), scale.to(torch.float32)
        if scale.numel() == 1:
            return values * scale.reshape(())
        if weight.dim() < 2:
            raise ValueError(f"weight {name}: a {tuple(weight.shape)} float8 tensor takes one scale, not "
                             f"{tuple(scale.shape)}")
        rows, cols = weight.shape[-2:]
        lead = tuple(weight.shape[:-2])
        if tuple(scale.shape) in (lead + (rows, 1), lead + (rows,)):  # one per output row
            return values * scale.reshape(lead + (rows, 1))
        grid = tuple(scale.shape[-2:]) if scale.dim() >= 2 else ()
        block = self.block or _block_of(grid, rows, cols)
        if block is None or grid != (-(-rows // block[0]), -(-cols // block[1])) or scale.shape[:-2] != lead:
            raise ValueError(f"weight {name}: scale of shape {tuple(scale.shape)} fits neither one scale, "
                             f"one per row nor {self.block or 'whole'} blocks of a {tuple(weight.shape)} weight")
        full = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)
        return values * full[..., :cols]


def _block_of(grid: tuple[int, ...], rows: int, cols: int) -> tuple[int, int] | None:
    """The block a scale grid implies where it divides the weight evenly."""
    if len(grid) != 2 or rows % grid[0] or cols % grid[1]:
        return None
    return rows // grid[0], cols // grid[1]


# AWQ's GEMM layout keeps output feature j of each eight in nibble
# AWQ_NIBBLE[j] of its word (AutoAWQ writes columns 0, 2, 4, 6, 1, 3, 5, 7
# from the low nibble up).
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
_PACKED_AUX = (".qzeros", ".scales", ".g_idx")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integers of ``bits`` bits packed into int32 words along ``dim`` (0 or
    1), the lowest bits first, as int32: the packed linears' own unpacking
    (``reference.int_unpack``, along a row's words), applied to the rows or
    the columns."""
    from fluidserve.kernels import reference

    words = packed.to(torch.int32)
    if dim == 0:
        return reference.int_unpack(words.t(), bits).t()
    return reference.int_unpack(words, bits)


@dataclass(frozen=True)
class PackedIntCheckpoint:
    """GPTQ and AWQ: ``bits``-bit integers with a scale and a zero point per
    group of ``group_size`` input features (-1: one group); ``zeros_less_one``:
    the original GPTQ format, each zero point stored less one."""

    method: str
    bits: int
    group_size: int
    zeros_less_one: bool = False

    def describe(self) -> str:
        groups = f"groups of {self.group_size}" if self.group_size > 0 else "one group a row"
        return f"{self.method} ({self.bits}-bit weights, {groups})"

    def is_aux(self, name: str) -> bool:
        return name.endswith(_PACKED_AUX)

    def quantized(self, name: str, source) -> bool:
        return name.endswith(".qweight")

    def dequantize(self, name: str, tensor: torch.Tensor, aux: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        weight_name, codes = self.unpack(name, tensor, aux)
        return weight_name, codes.dequantize()

    def unpack(self, name: str, tensor: torch.Tensor, aux: dict[str, torch.Tensor]) -> tuple[str, GroupedCodes]:
        """The weight's name and its codes, zero points, scales and groups
        (``GroupedCodes``), rows as output features: what both the dequantized
        weight and the packed one (``--quantized-weights packed``) are made of."""
        prefix = name.removesuffix(".qweight")
        missing = [prefix + s for s in (".qzeros", ".scales") if prefix + s not in aux]
        if missing:
            raise ValueError(f"weight {name}: {self.method} without {', '.join(missing)}")
        packed_zeros, scales = aux[prefix + ".qzeros"], aux[prefix + ".scales"].to(torch.float32)
        mask = (1 << self.bits) - 1
        if self.method == "awq":  # [in, out / 8] words, AWQ's order within each
            order = torch.arange(tensor.shape[1] * 8, device=tensor.device).view(-1, 8)[:, list(AWQ_NIBBLE)]
            codes = unpack_int32(tensor, self.bits, dim=1)[:, order.flatten()]
            zeros = unpack_int32(packed_zeros, self.bits, dim=1)[:, order.flatten()]
        else:  # GPTQ: [in / per_word, out] words; zeros [groups, out / per_word]
            codes = unpack_int32(tensor, self.bits, dim=0)
            zeros = unpack_int32(packed_zeros, self.bits, dim=1)
            if self.zeros_less_one:  # stored as zero - 1 in its bits: zero 0 wrote all ones
                zeros = (zeros + 1) & mask
        features, outputs = codes.shape
        if scales.shape[1] != outputs or zeros.shape[1] < outputs or zeros.shape[0] != scales.shape[0]:
            raise ValueError(f"weight {name}: scales {tuple(scales.shape)} and zero points {tuple(zeros.shape)} "
                             f"do not fit {features} x {outputs} weights")
        size = self.group_size if self.group_size > 0 else features
        group = aux.get(prefix + ".g_idx")
        if group is None:
            group = torch.arange(features, device=tensor.device) // size
        group = group.to(device=tensor.device, dtype=torch.int32)
        if group.shape != (features,) or int(group.max()) >= scales.shape[0] or int(group.min()) < 0:
            raise ValueError(f"weight {name}: {scales.shape[0]} groups of scales for groups "
                             f"{int(group.min())}..{int(group.max())} of {features} input features")
        return prefix + ".weight", GroupedCodes(codes.t().to(torch.uint8).contiguous(),
                                                zeros[:, :outputs].t().to(torch.uint8).contiguous(),
                                                scales.t().contiguous(), group, self.bits)


@dataclass(frozen=True)
class GroupedCodes:
    """A quantized weight unpacked, rows as output features: ``codes`` [out,
    in] (GPTQ's and AWQ's integers as uint8, or float8 values) and, per
    group of input features, ``scales`` (and for integers ``zeros``) [out,
    groups]; ``g_idx`` [in] says each input feature's group (in order for
    most checkpoints, any order for act-order GPTQ). The weight is ``(codes -
    zeros[:, g_idx]) * scales[:, g_idx]`` in fp32, float8's ``codes *
    scales[:, g_idx]`` (a block's scale on each of its rows, its columns a
    group).

    The loader cuts it as it cuts a weight (rows of a fused checkpoint
    tensor, a tensor-parallel shard), then either dequantizes it or keeps
    it whole in a linear's quantized weight (engine/parallel.py,
    ``QuantizedWeight``)."""

    codes: torch.Tensor  # [out, in] uint8, or float8
    zeros: torch.Tensor | None  # [out, groups] uint8; None for float8
    scales: torch.Tensor  # [out, groups] float32
    g_idx: torch.Tensor  # [in] int32
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def kind(self) -> str:
        """``float8_e4m3fn`` or ``float8_e5m2``, or ``int4`` / ``int8`` (``QuantizedWeight.kind``)."""
        return str(self.codes.dtype).removeprefix("torch.") if self.zeros is None else f"int{self.bits}"

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in fp32."""
        group = self.g_idx.long()
        if self.zeros is None:
            return self.codes.float() * self.scales[:, group]
        return (self.codes.float() - self.zeros.float()[:, group]) * self.scales[:, group]

    def rows(self, index: torch.Tensor | slice) -> GroupedCodes:
        """Output features ``index`` (a slice, or row indices), every group kept."""
        zeros = None if self.zeros is None else self.zeros[index]
        return GroupedCodes(self.codes[index], zeros, self.scales[index], self.g_idx, self.bits)

    def narrow(self, dim: int, start: int, length: int) -> GroupedCodes:
        """``Tensor.narrow``'s cut: rows (dim 0), or input features (dim 1),
        which keep every group's scale and zero point (a shard's features
        may come from any group under act-order)."""
        if dim == 0:
            return self.rows(slice(start, start + length))
        return GroupedCodes(self.codes[:, start:start + length], self.zeros, self.scales,
                            self.g_idx[start:start + length], self.bits)

    def index_select(self, dim: int, index: torch.Tensor) -> GroupedCodes:
        if dim != 0:
            raise ValueError("GroupedCodes reorders output features only")
        return self.rows(index.to(self.codes.device))

    def pad_rows(self, rows: int) -> GroupedCodes:
        """Zero rows after the last up to ``rows`` (a vocabulary shard's padding): weights of 0."""
        missing = rows - self.codes.shape[0]
        if missing <= 0:
            return self

        def grow(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.cat([t, t.new_zeros((missing, t.shape[1]))])

        return GroupedCodes(grow(self.codes), grow(self.zeros), grow(self.scales), self.g_idx, self.bits)


def check_packed_weights(quantization: CheckpointFormat | None, config) -> None:
    """Refuse ``--quantized-weights packed`` where it cannot hold: an
    unquantized checkpoint, or LoRA adapters (their slots sit on dense
    linears)."""
    if quantization is None:
        raise ValueError("quantized_weights: 'packed' holds a quantized checkpoint's codes, and this checkpoint is "
                         "not quantized (serve it with --quantized-weights dequantized)")
    if getattr(config, "enable_lora", False):
        raise ValueError("quantized_weights: 'packed' with --enable-lora is not supported (adapters add to "
                         "dense linears): serve with --quantized-weights dequantized")


def _packed_int(method: str, config: dict) -> PackedIntCheckpoint:
    bits, group_size = config.get("bits"), config.get("group_size", 128)
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or config.get("zero_point", True) is not True:
            raise ValueError(f"quantization_config: AWQ {bits}-bit, version {version!r}, zero_point "
                             f"{config.get('zero_point', True)} is not supported (4-bit GEMM with zero points is)")
        return PackedIntCheckpoint("awq", 4, int(group_size))
    fmt = str(config.get("checkpoint_format") or "gptq").lower()
    if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config: GPTQ {bits}-bit, checkpoint_format {fmt!r} is not supported "
                         "(4- and 8-bit, gptq or gptq_v2, are)")
    return PackedIntCheckpoint("gptq", bits, int(group_size), zeros_less_one=fmt == "gptq")


def _as_dict(config) -> dict | None:
    if config is None or isinstance(config, dict):
        return config
    return config.to_dict() if hasattr(config, "to_dict") else vars(config)


def _compressed_tensors(config: dict) -> Fp8Checkpoint:
    """compressed-tensors' FP8 (``float-quantized``: RedHatAI's and
    llm-compressor's FP8 checkpoints); its integer formats are refused."""
    fmt = config.get("format")
    groups = config.get("config_groups") or {}
    blocks = set()
    for group_name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        kind, bits = weights.get("type"), weights.get("num_bits")
        if kind != "float" or bits != 8:
            raise ValueError(f"quantization_config: compressed-tensors group {group_name!r} quantizes weights to "
                             f"{bits}-bit {kind}: only 8-bit float (FP8) checkpoints are supported")
        if weights.get("strategy") == "block":
            blocks.add(tuple(weights.get("block_structure") or ()))
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config: compressed-tensors format {fmt!r} is not supported (FP8 "
                         "checkpoints, format 'float-quantized', are)")
    if len(blocks) > 1 or any(len(b) != 2 for b in blocks):
        raise ValueError(f"quantization_config: block structures {sorted(blocks)} are not supported (one "
                         "[rows, cols] block for every group)")
    return Fp8Checkpoint("compressed-tensors", next(iter(blocks), None))


def checkpoint_quantization(hf_config, requested: str | None = None) -> CheckpointFormat | None:
    """The weight format ``config.json``'s ``quantization_config`` declares,
    or None for an unquantized checkpoint. ``requested`` (``--quantization``)
    must name the checkpoint's own method: weights are never quantized at
    load; vLLM's Marlin names (``gptq_marlin``, ``awq_marlin``) name theirs.
    Raises ValueError naming what is not supported."""
    requested = QUANTIZATION_ALIASES.get(requested, requested)
    config = _as_dict(getattr(hf_config, "quantization_config", None))
    if not config:
        if requested is not None:
            raise ValueError(f"quantization: {requested!r} asks for a quantized checkpoint, and this one declares "
                             "no quantization_config (weights are not quantized at load; serve a quantized "
                             "checkpoint)")
        return None
    method = str(config.get("quant_method", "")).lower()
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization_config: {method or 'an unnamed'} checkpoints are not supported "
                         f"(supported: {', '.join(QUANTIZATION_METHODS)})")
    if requested is not None and requested != method:
        raise ValueError(f"quantization: {requested!r} does not match the checkpoint's quant_method {method!r}")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method in ("gptq", "awq"):
        return _packed_int(method, config)
    block = config.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"quantization_config: weight_block_size {block!r} is not [rows, cols]")
    return Fp8Checkpoint("fp8", tuple(block) if block is not None else None)


def quantize_fp8(weight: torch.Tensor, grain: str | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[rows, cols]`` as float8 (e4m3) and its scale, weight ~
    float8 x scale: one scale for ``grain`` "tensor", one a row for
    "channel", else one a block of ``grain`` = (rows, cols), the last blocks
    cut short where they overhang, each mapping its largest magnitude to
    e4m3's 448. What an FP8 checkpoint's writer computes (the tests' and
    benchmarks' checkpoints); the engine never quantizes at load."""
    weight = weight.to(torch.float32)
    top = torch.finfo(torch.float8_e4m3fn).max
    if grain == "tensor":
        scale = weight.abs().max().clamp(min=1e-12) / top
        return (weight / scale).to(torch.float8_e4m3fn), scale.reshape(1)
    if grain == "channel":
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / top
        return (weight / scale).to(torch.float8_e4m3fn), scale
    rows, cols = weight.shape
    grid = (-(-rows // grain[0]), -(-cols // grain[1]))
    padded = weight.new_zeros(grid[0] * grain[0], grid[1] * grain[1])
    padded[:rows, :cols] = weight
    blocks = padded.reshape(grid[0], grain[0], grid[1], grain[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / top
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def is_fp8(source) -> bool:
    """Whether a checkpoint tensor (a tensor or a safetensors slice) holds float8."""
    if isinstance(source, torch.Tensor):
        return source.dtype in FP8_DTYPES
    return source.get_dtype() in _FP8_NAMES


def is_scale(name: str) -> bool:
    return name.endswith(tuple("weight" + s for s in SCALE_SUFFIXES)) or name.endswith(UNREAD_SUFFIXES)


def scale_of(name: str, scales: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The scale beside weight ``name`` (``X.weight`` -> ``X.weight_scale_inv`` or ``X.weight_scale``)."""
    return next((scales[name + s] for s in SCALE_SUFFIXES if name + s in scales), None)
