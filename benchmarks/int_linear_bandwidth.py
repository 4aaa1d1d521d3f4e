"""Weight-only int4/int8 linears (kernels/int_linear.py) and float8 ones
(kernels/fp8_linear.py) against bf16 at a Llama-3-8B layer's shapes: how
much of the quantized weight's smaller read turns into time at decode's
few rows.

For each linear (fused qkv, o, fused gate/up, down), rows M in 1, 4, 16,
and 4 and 8 bits with groups of 128 (random codes, scales and zeros):

* ``int_linear``: the fused kernel, plain groups (``group_size=128``: a
  word's scale and zero read once per word);
* ``int_linear act-order``: the same with the groups in random order,
  each code's scale and zero gathered through ``g_idx``;
* ``dequantize + matmul``: the many-row plan, the weight dequantized into a
  bf16 buffer, then cuBLAS;
* ``fp8 e4m3 fp8_linear``: the float8 kernel, 128-wide blocks' scales
  (a scale a row and block: G = K / 128, ``group_size=128``, read once per
  row and block); ``fp8 e4m3 dequantize + matmul`` as the int one (random
  finite e4m3 bytes and scales);
* ``bf16 GEMV``: ``ops.linear`` on the bf16 weight at one row
  (kernels/gemv.py where the engine runs it);
* ``int4 GEMV``, ``fp8 e4m3 GEMV`` (one row): ``ops.linear`` on the packed
  weight (``reference.PackedLinear``), which at one row runs the batch-1
  GEMV over the codes, the kernel a packed decoder layer's six launches
  use (its norms, SiLU-mul and residual adds fused as a dense layer's);
  against ``int_linear`` at one row it says what the fusions cost or save
  in the product itself;
* ``bf16 cuBLAS``: ``F.linear`` on the bf16 weight.

Times are medians of CUDA-event-timed CUDA graph replays, each call after
an L2 flush (``kernel_bench.graph_ms``). GB/s is the weight's bytes over
the time: the packed words for the int rows (scales and zeros left out:
5 bytes a group of 128), 1 byte an element for fp8 (scales left out: 4
bytes a row's block of 128), 2 bytes an element for bf16. ``vs cuBLAS`` is
the bf16 ``F.linear`` time over the row's. Each fused output is checked
against dequantize + matmul (largest difference over the largest output).

    python benchmarks/int_linear_bandwidth.py [--out benchmarks/results]

Writes ``int_linear_bandwidth_<device>.json`` and ``.md``. Needs CUDA: on
a machine without it the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dummy_models import device_slug, save_results  # noqa: E402
from kernel_bench import RESULTS_DIR, graph_ms  # noqa: E402

# (name, N, K) of a Llama-3-8B decoder layer's linears
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = (1, 4, 16)
BITS = (4, 8)
GROUP = 128
DEVICE = "cuda"


def packed_weight(n: int, k: int, bits: int, act_order: bool) -> tuple[torch.Tensor, ...]:
    """Random packed operands on the GPU: any int32 word is a valid packing."""
    groups = k // GROUP
    codes = torch.randint(-(2**31), 2**31, (n, k * bits // 32), dtype=torch.int32, device=DEVICE)
    scales = torch.rand(n, groups, device=DEVICE) * 2e-3 + 1e-3
    zeros = torch.randint(0, 1 << bits, (n, groups), dtype=torch.uint8, device=DEVICE)
    g_idx = torch.arange(k, device=DEVICE) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(k, device=DEVICE)]
    return codes, scales, zeros, g_idx.to(torch.int32)


def fp8_weight(n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Random e4m3 operands on the GPU with 128-wide blocks' scales: any
    byte but the two NaNs (S.1111.111) is a finite e4m3 value."""
    bits = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=DEVICE)
    bits[(bits & 0x7F) == 0x7F] = 0x7E
    scales = torch.rand(n, k // GROUP, device=DEVICE) * 2e-3 + 1e-3
    g_idx = (torch.arange(k, device=DEVICE) // GROUP).to(torch.int32)
    return bits.view(torch.float8_e4m3fn), scales, g_idx


def bench_shape(name: str, n: int, k: int) -> list[dict]:
    from fluidserve.kernels import fp8_linear, int_linear, ops
    from fluidserve.kernels.reference import PackedLinear

    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * k**-0.5
    rows = []

    def row(m: int, bits: int | None, variant: str, fn, nbytes: int, err: float | None = None) -> dict:
        us = graph_ms(fn, reps=20, runs=15) * 1e3
        r = dict(linear=name, n=n, k=k, rows=m, bits=bits, variant=variant, us=us, gb_s=nbytes / (us * 1e-6) / 1e9,
                 rel_err=err)  # fmt: skip
        rows.append(r)
        print(f"  {name:8s} M={m:<3d} {variant:26s} {us:9.1f} us {r['gb_s']:7.0f} GB/s"
              + ("" if err is None else f"  rel err {err:.1e}"), flush=True)  # fmt: skip
        return r

    for m in ROWS:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        cublas = row(m, None, "bf16 cuBLAS", lambda x=x: F.linear(x, w), w.numel() * 2)
        if m == 1:
            row(m, None, "bf16 GEMV (ops.linear)", lambda x=x: ops.linear(x, w), w.numel() * 2)
        for bits in BITS:
            for act_order in (False, True):
                codes, scales, zeros, g_idx = packed_weight(n, k, bits, act_order)
                nbytes = codes.numel() * 4
                group_size = None if act_order else GROUP
                args = (codes, scales, zeros, g_idx, bits)
                buffer = torch.empty(n, k, device=DEVICE, dtype=torch.bfloat16)

                def unpacked(x=x, args=args, buffer=buffer, group_size=group_size) -> torch.Tensor:
                    return torch.matmul(x, int_linear.dequantize(*args, torch.bfloat16, buffer,
                                                                 group_size=group_size).t())  # fmt: skip

                def fused(x=x, args=args, group_size=group_size) -> torch.Tensor:
                    return int_linear.int_linear(x, *args, group_size=group_size)

                expected = unpacked()
                err = ((fused().float() - expected.float()).abs().max() / expected.float().abs().max()).item()
                label = f"int{bits} int_linear" + (" act-order" if act_order else "")
                row(m, bits, label, fused, nbytes, err)
                if not act_order:
                    row(m, bits, f"int{bits} dequantize + matmul", unpacked, nbytes)
                if m == 1:
                    packed = PackedLinear(codes, scales, zeros, g_idx, bits, group_size)
                    err = ((ops.linear(x, packed).float() - expected.float()).abs().max()
                           / expected.float().abs().max()).item()  # fmt: skip
                    row(m, bits, f"int{bits} GEMV" + (" act-order" if act_order else ""),
                        lambda x=x, packed=packed: ops.linear(x, packed), nbytes, err)  # fmt: skip
                del codes, scales, zeros, g_idx, buffer
        fp8_args = fp8_weight(n, k)
        buffer = torch.empty(n, k, device=DEVICE, dtype=torch.bfloat16)

        def fp8_unpacked(x=x, args=fp8_args, buffer=buffer) -> torch.Tensor:
            return torch.matmul(x, fp8_linear.dequantize(*args, torch.bfloat16, buffer, group_size=GROUP).t())

        def fp8_fused(x=x, args=fp8_args) -> torch.Tensor:
            return fp8_linear.fp8_linear(x, *args, group_size=GROUP)

        expected = fp8_unpacked()
        err = ((fp8_fused().float() - expected.float()).abs().max() / expected.float().abs().max()).item()
        row(m, 8, "fp8 e4m3 fp8_linear", fp8_fused, n * k, err)
        row(m, 8, "fp8 e4m3 dequantize + matmul", fp8_unpacked, n * k)
        if m == 1:
            packed = PackedLinear(fp8_args[0], fp8_args[1], None, fp8_args[2], 8, GROUP)
            err = ((ops.linear(x, packed).float() - expected.float()).abs().max() / expected.float().abs().max()).item()
            row(m, 8, "fp8 e4m3 GEMV", lambda x=x, packed=packed: ops.linear(x, packed), n * k, err)
        del fp8_args, buffer
        for r in rows:
            if r["rows"] == m:
                r["vs_cublas"] = cublas["us"] / r["us"]
    return rows


def markdown(record: dict) -> str:
    lines = [f"# Weight-only int and fp8 linears at Llama-3-8B shapes, {record['device']}", "",
             f"{record['versions']}; {record['time']}. Median of CUDA-event-timed graph replays, each call after an "
             "L2 flush. GB/s: the weight's bytes over the time (the packed words for int, scales and zeros left "
             "out; 1 byte an element for fp8, scales left out; 2 bytes an element for bf16). vs cuBLAS: bf16 "
             "`F.linear`'s time over the row's (above 1 is faster). Groups of 128 (fp8: a scale a row and "
             "128-wide block); act-order: groups in random order, gathered per code. rel err: the fused kernel "
             "against dequantize + matmul.", "",
             "| linear | N x K | rows | variant | us | GB/s | vs cuBLAS | rel err |",
             "|---|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in record["rows"]:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        lines.append(f"| {r['linear']} | {r['n']} x {r['k']} | {r['rows']} | {r['variant']} | {r['us']:.1f} "
                     f"| {r['gb_s']:.0f} | {r['vs_cublas']:.2f} | {err} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("int_linear_bandwidth: needs a CUDA GPU (none found); nothing measured.", file=sys.stderr)
        return 2
    import triton

    device = torch.cuda.get_device_name()
    print(f"int_linear_bandwidth: {device}", flush=True)
    rows = []
    for name, n, k in SHAPES:
        rows += bench_shape(name, n, k)
        torch.cuda.empty_cache()  # the last shape's weights
    record = dict(device=device, time=time.strftime("%Y-%m-%d %H:%M:%S"),
                  versions=f"torch {torch.__version__}, triton {triton.__version__}", rows=rows)  # fmt: skip
    save_results(args.out / f"int_linear_bandwidth_{device_slug(device)}", record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
