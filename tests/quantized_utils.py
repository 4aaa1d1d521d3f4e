"""Quantized checkpoints for the tests, written as each format's own
writer writes them: a tiny random model's decoder linears as float8 beside
their scales (FP8, compressed-tensors) or as integer codes packed in int32
words with a scale and zero point per group (GPTQ, AWQ), and the plain
checkpoint of the weights each stands for, computed from the codes, never
by unpacking them. ``benchmarks/quantized_formats_vs_gptqmodel.py`` reads
the same checkpoints with GPTQModel's own readers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from fluidserve.engine.quantization import quantize_fp8
from fluidserve.engine.tiny_model import save_byte_tokenizer, tiny_config

# AutoAWQ's writer puts columns 0, 2, 4, 6, 1, 3, 5, 7 of each eight from the low nibble up.
AWQ_WRITE_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_NIBBLES = [AWQ_WRITE_ORDER.index(j) for j in range(8)]
MIXTRAL_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def random_model(arch: str = "llama") -> torch.nn.Module:
    """A tiny transformers model of ``arch`` with weights large enough that rounding them moves its tokens."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() >= 2 else p.uniform_(0.8, 1.2)
    return model.eval()


def fp8_stands_for(q: torch.Tensor, scale: torch.Tensor, grain) -> torch.Tensor:
    """What a float8 weight stands for, written out independently of the
    engine's loader: each element times the scale that covers it."""
    if grain in ("tensor", "channel"):
        return q.float() * scale.float()
    out = q.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * grain[0]:(i + 1) * grain[0], j * grain[1]:(j + 1) * grain[1]] *= scale[i, j]
    return out


def fp8(grain, scale_suffix: str, static: bool = False):
    """A writer's quantizer: a weight as float8 and its scale (and an unread activation scale)."""
    def quantize(name: str, weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
        q, scale = quantize_fp8(weight, grain)
        tensors = {name: q, name + scale_suffix: scale}
        if static:
            tensors[name.replace(".weight", ".input_scale")] = torch.ones(1)
        return tensors, fp8_stands_for(q, scale, grain)
    return quantize


def write_quantized(model: torch.nn.Module, path: Path, quantize, quantization_config: dict | None,
                    reference: Path | None = None) -> None:
    """``model`` as a quantized checkpoint in ``path`` (every decoder
    linear's weight through ``quantize``, each expert's too, Mixtral's
    ``w1``/``w3``/``w2`` among them; embeddings, norms, biases, routers and
    the head as they are) and, in ``reference``, the plain checkpoint of
    the weights it stands for. The tensors are those ``save_pretrained``
    writes."""
    plain_dir = reference or path.with_name(path.name + "-plain")
    model.save_pretrained(plain_dir)
    saved = load_file(str(plain_dir / "model.safetensors"))
    tensors, plain = {}, {}
    for name, value in saved.items():
        if ".layers." in name and (name.endswith("_proj.weight") or MIXTRAL_EXPERT.search(name)):
            written, plain[name] = quantize(name, value)
            tensors.update(written)
        else:
            tensors[name] = plain[name] = value
    for folder, weights, qc in ((path, tensors, quantization_config), (plain_dir, plain, None)):
        folder.mkdir(exist_ok=True)
        config = json.loads((plain_dir / "config.json").read_text())
        config.pop("quantization_config", None)
        if qc is not None:
            config["quantization_config"] = qc
        (folder / "config.json").write_text(json.dumps(config))
        save_file(weights, str(folder / "model.safetensors"))
        save_byte_tokenizer(folder)


def pack_words(values: torch.Tensor, bits: int, dim: int, nibbles=None) -> torch.Tensor:
    """Integers packed into int32 words along ``dim``, as GPTQ's and AWQ's
    writers pack them: value ``i`` of a word at bit ``bits * i`` (AWQ's
    columns: value ``j`` at ``bits * nibbles[j]``)."""
    per_word = 32 // bits
    moved = values.to(torch.int64).movedim(dim, -1)
    groups = moved.reshape(*moved.shape[:-1], -1, per_word)
    positions = torch.tensor(nibbles if nibbles is not None else range(per_word), dtype=torch.int64)
    words = (groups << (bits * positions)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same bits, signed
    return words.movedim(-1, dim).contiguous()


def packed_int(method: str, bits: int, group_size: int, act_order: bool = False, zeros_less_one: bool = True,
               shared_order: bool = True):
    """A writer's quantizer for GPTQ and AWQ: asymmetric ``bits``-bit codes,
    a float16 scale and a zero point per group of input features (groups
    of shuffled features with ``act_order``, as GPTQ's desc_act writes
    them, named by ``g_idx``), packed as each format packs them. GPTQ
    orders features by its input's statistics, so linears over the same
    input (q/k/v, an expert's gate and up) share an order, and each expert
    sees its own tokens, so has its own; ``shared_order=False`` gives each
    weight its own."""
    top = (1 << bits) - 1

    def quantize(name: str, weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
        outputs, features = weight.shape
        size = group_size if group_size > 0 else features
        expert = re.search(r"\.experts\.(\d+)\.", name)
        seed = features if shared_order else features * outputs
        gen = torch.Generator().manual_seed(seed + (1000 * (1 + int(expert[1])) if expert else 0))
        group = (torch.randperm(features, generator=gen) if act_order else torch.arange(features)) // size
        groups = int(group.max()) + 1
        w = weight.t()  # [in, out]
        lo = torch.stack([w[group == g].amin(0) for g in range(groups)]).clamp(max=0)
        hi = torch.stack([w[group == g].amax(0) for g in range(groups)]).clamp(min=0)
        scales = ((hi - lo) / top).clamp(min=1e-6).half()
        zeros = (-lo / scales.float()).round().clamp(0, top).to(torch.int64)
        codes = ((w / scales.float()[group]).round() + zeros[group]).clamp(0, top).to(torch.int64)
        plain = ((codes - zeros[group]).float() * scales.float()[group]).t().contiguous()
        prefix = name.removesuffix(".weight")
        if method == "awq":
            tensors = {".qweight": pack_words(codes, bits, 1, AWQ_NIBBLES),
                       ".qzeros": pack_words(zeros, bits, 1, AWQ_NIBBLES)}
        else:
            stored = (zeros - 1) & top if zeros_less_one else zeros
            tensors = {".qweight": pack_words(codes, bits, 0), ".qzeros": pack_words(stored, bits, 1),
                       ".g_idx": group.to(torch.int32)}
        tensors[".scales"] = scales
        return {prefix + k: v for k, v in tensors.items()}, plain
    return quantize
