"""GPTQ and AWQ checkpoints read by GPTQModel's own readers against ours:
the same weights, to the bit?

The test suite's GPTQ and AWQ checkpoints (``tests/quantized_utils.py``:
a tiny Qwen2-shaped model, every decoder linear packed as each format's
writer packs it) are dequantized by the engine's loader and by GPTQModel's
readers: its safetensors converter for GPTQ (``convert_gptq_file``, which
undoes the original format's zero points stored less one) and its
AutoAWQ-derived ``dequantize_gemm`` for AWQ. And codes packed by its
``pack_awq`` (AutoAWQ's packer) are read back by ours. GPTQModel builds
CUDA extensions when installed, so the suite does not install it; this
script imports those pure-torch readers from an unpacked source tree
(``pip download gptqmodel --no-deps`` and untar it; it needs
``threadpoolctl``), or from an installed ``gptqmodel``.

    python benchmarks/quantized_formats_vs_gptqmodel.py --gptqmodel-src /path/to/gptqmodel-7.7.0

Writes ``benchmarks/results/quantized_formats_vs_gptqmodel{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import tempfile
import types
from pathlib import Path

import torch

from dummy_models import save_results

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CASES = {
    "GPTQ 4-bit, act-order, groups of 32, original format": (
        "gptq", dict(bits=4, group_size=32, act_order=True),
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}),
    "GPTQ 8-bit, groups of 32, gptq_v2": (
        "gptq", dict(bits=8, group_size=32, zeros_less_one=False),
        {"quant_method": "gptq", "bits": 8, "group_size": 32, "checkpoint_format": "gptq_v2"}),
    "AWQ 4-bit GEMM, groups of 32": (
        "awq", dict(bits=4, group_size=32),
        {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}),
}


def gptqmodel_readers(src: str | None):
    """GPTQModel's ``model_dequant`` and AWQ ``packing_utils`` modules, imported
    without the package's ``__init__`` (which loads its compiled kernels)."""
    if src is None:
        return (importlib.import_module("gptqmodel.utils.model_dequant"),
                importlib.import_module("gptqmodel.quantization.awq.utils.packing_utils"))
    root = Path(src) / "gptqmodel"
    for name, path in (("gptqmodel", root), ("gptqmodel.utils", root / "utils"),
                       ("gptqmodel.quantization", root / "quantization")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    # Stand-ins for the two helpers that pull in its logger's and device probes' dependencies.
    logger = types.ModuleType("gptqmodel.utils.logger")
    logger.setup_logger = lambda *a, **k: logging.getLogger("gptqmodel")
    probes = types.ModuleType("gptqmodel.utils.torch")
    probes.HAS_NPU = False
    sys.modules.update({"gptqmodel.utils.logger": logger, "gptqmodel.utils.torch": probes})
    return (importlib.import_module("gptqmodel.utils.model_dequant"),
            importlib.import_module("gptqmodel.quantization.awq.utils.packing_utils"))


def main(argv: list[str] | None = None) -> int:
    from quantized_utils import packed_int, random_model, write_quantized
    from safetensors.torch import load_file

    from fluidserve.engine import loader
    from fluidserve.engine.quantization import PackedIntCheckpoint, checkpoint_quantization

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gptqmodel-src", default=None, help="an unpacked GPTQModel source tree (default: installed)")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    dequant, awq_packing = gptqmodel_readers(args.gptqmodel_src)
    version = Path(args.gptqmodel_src).name if args.gptqmodel_src else importlib.import_module("gptqmodel").__version__
    record = dict(benchmark="quantized_formats_vs_gptqmodel", gptqmodel=version, cases={},
                  command=" ".join(["benchmarks/quantized_formats_vs_gptqmodel.py", *sys.argv[1:]]))
    model = random_model("qwen2")
    with tempfile.TemporaryDirectory() as tmp:
        for label, (method, kwargs, qc) in CASES.items():
            folder = Path(tmp) / method / str(len(record["cases"]))
            write_quantized(model, folder, packed_int(method, **kwargs), qc)
            fmt = checkpoint_quantization(loader.load_hf_config(folder))
            ours = {n: v for n, v in loader._dequantized(folder, fmt, torch.device("cpu"))
                    if n.endswith("_proj.weight")}
            if method == "gptq":
                converted = dequant.convert_gptq_file(folder / "model.safetensors", torch.float32, qc, "cpu")
                theirs = {n: v for n, v in converted.items() if n.endswith("_proj.weight")}
            else:
                raw = load_file(str(folder / "model.safetensors"))
                theirs = {k.removesuffix(".qweight") + ".weight": awq_packing.dequantize_gemm(
                    v, raw[k.replace("qweight", "qzeros")], raw[k.replace("qweight", "scales")].float(), 4,
                    qc["group_size"]).t() for k, v in raw.items() if k.endswith(".qweight")}
            same_names = sorted(ours) == sorted(theirs)
            diff = max((ours[n] - theirs[n]).abs().max().item() for n in ours) if same_names else None
            record["cases"][label] = dict(tensors=len(ours), same_names=same_names, max_abs_diff=diff,
                                          elements=sum(v.numel() for v in ours.values()))
            print(label, record["cases"][label], flush=True)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 32), dtype=torch.int32, generator=gen)
    zeros = torch.randint(0, 16, (2, 32), dtype=torch.int32, generator=gen)
    qweight, qzeros = awq_packing.pack_awq(codes, zeros, 4)
    _, weight = PackedIntCheckpoint("awq", 4, 32).dequantize(
        "x.qweight", qweight, {"x.qzeros": qzeros, "x.scales": torch.ones(2, 32)})
    record["pack_awq_read_back"] = bool(torch.equal(weight.t(), (codes - zeros.repeat_interleave(32, 0)).float()))
    save_results(RESULTS / f"quantized_formats_vs_gptqmodel{args.tag}", record, to_markdown(record))
    return 0


def to_markdown(r: dict) -> str:
    lines = [f"# GPTQ and AWQ checkpoints: GPTQModel's readers against ours ({r['gptqmodel']})", "",
             f"Command: `{r['command']}`. The test suite's checkpoints of a tiny Qwen2-shaped model "
             "(`tests/quantized_utils.py`), every decoder linear packed; each weight dequantized to float32 by "
             "the engine's loader and by GPTQModel's reader.", "",
             "| checkpoint | weights | elements | same weight names | max abs difference |",
             "|---|---:|---:|---|---:|"]
    for label, c in r["cases"].items():
        diff = "–" if c["max_abs_diff"] is None else f"{c['max_abs_diff']:g}"
        lines.append(f"| {label} | {c['tensors']} | {c['elements']} | {'yes' if c['same_names'] else 'no'} "
                     f"| {diff} |")
    lines += ["", f"Codes packed by GPTQModel's `pack_awq` (AutoAWQ's packer), read back by ours exactly: "
              f"{'yes' if r['pack_awq_read_back'] else 'no'}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
