"""The packed MoE experts' GEMMs (kernels/moe.py over
``reference.PackedExperts``) compiled for sm_90 at every activation dtype,
no GPU: whether each launch compiles under this Triton, and what it
spills. kernel_bench.py --compile-only reports bf16 alone; the GPU machines
run Triton 3.6, so run this under both it and the Triton CI installs.

    env -u TRITON_INTERPRET python benchmarks/moe_packed_compile_dtypes.py

A Qwen3-30B-A3B layer (128 experts, 8 a token, hidden 2048, intermediate
768) at 1, 512 and 4096 tokens (blocks of 16, 32 and 64 rows), in five
stored formats, with x in bf16, fp16 and fp32. Writes
``benchmarks/results/moe_packed_compile_dtypes-triton<version>.{json,md}``.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

import torch

import kernel_bench as kb

RESULTS = Path(__file__).resolve().parent / "results"
# (label, bits, group size (None: act-order / gathered), float8 dtype or None)
FORMATS = [("int4, groups of 128", 4, 128, None), ("int8, groups of 128", 8, 128, None),
           ("int8, act-order", 8, None, None), ("e4m3, blocks of 128", 8, 128, torch.float8_e4m3fn),
           ("e5m2, gathered", 8, None, torch.float8_e5m2)]  # fmt: skip
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOKENS = [1, 512, 4096]


def packed(experts: int, n: int, k: int, bits: int, group_size: int | None, fp8: torch.dtype | None):
    """Empty experts of the real shapes: the launches are compiled, not run."""
    from fluidserve.kernels.reference import PackedExperts

    groups = k // 128
    if fp8 is not None:
        return PackedExperts(torch.empty((experts, n, k), dtype=fp8), torch.empty((experts, n, groups)), None,
                             torch.empty((experts, k), dtype=torch.int32), 8, group_size)  # fmt: skip
    return PackedExperts(torch.empty((experts, n, k * bits // 32), dtype=torch.int32),
                         torch.empty((experts, n, groups)), torch.empty((experts, n, groups), dtype=torch.uint8),
                         torch.empty((experts, k), dtype=torch.int32), bits, group_size)  # fmt: skip


def sweep() -> list[dict]:
    from fluidserve.kernels import moe

    _, experts, top_k, hidden, inter = kb.MOE_SHAPES[0]
    rows = []
    for dtype in DTYPES:
        for label, bits, group_size, fp8 in FORMATS:
            w13 = packed(experts, 2 * inter, hidden, bits, group_size, fp8)
            w2 = packed(experts, hidden, inter, bits, group_size, fp8)
            for tokens in TOKENS:
                ids = torch.randint(0, experts, (tokens, top_k))
                x = torch.empty((tokens, hidden), dtype=dtype)
                call = partial(moe.fused_experts, x, w13, w2, ids, torch.rand(tokens, top_k))
                for fn, kernel_args, constexprs, options in kb._launches_of(call):
                    if fn is not moe._expert_gemm_kernel:
                        continue
                    row = dict(dtype=str(dtype).removeprefix("torch."), format=label, tokens=tokens,
                               gemm="gate/up" if constexprs["GATED"] else "down",
                               tile="x".join(str(constexprs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")))
                    try:
                        res = kb._compile_offline(fn, kernel_args, constexprs, (), options)
                        row.update(compiled=True, registers=res["registers"], stack_bytes=res["stack_bytes"])
                    except Exception as e:  # a compiler failure is the finding, not a crash of the sweep
                        row.update(compiled=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    rows.append(row)
                    print(row, flush=True)
    return rows


def markdown(rows: list[dict], version: str) -> str:
    failed = [r for r in rows if not r["compiled"]]
    lines = [f"# Packed MoE experts compiled for sm_90 at each dtype: Triton {version}", "",
             "`env -u TRITON_INTERPRET python benchmarks/moe_packed_compile_dtypes.py`: the gate/up and down "
             "GEMMs of a Qwen3-30B-A3B layer over packed experts, as `moe.fused_experts` launches them, at 1, "
             "512 and 4096 tokens; no GPU. Stack bytes are registers spilled to memory.", ""]
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dtype]
        spilling = [r for r in mine if r.get("stack_bytes")]
        lines.append(f"* {dtype}: {len(mine)} launches, {sum(not r['compiled'] for r in mine)} failed to compile, "
                     f"{len(spilling)} spill" + (f" ({min(r['stack_bytes'] for r in spilling)}-"
                                                 f"{max(r['stack_bytes'] for r in spilling)} stack bytes)"
                                                 if spilling else ""))
    lines += ["", "| dtype | format | tokens | GEMM | tile | compiled | registers | stack B |",
              "|---|---|---:|---|---|---|---:|---:|"]
    lines += [f"| {r['dtype']} | {r['format']} | {r['tokens']} | {r['gemm']} | {r['tile']} | "
              f"{'yes' if r['compiled'] else 'no: ' + r['error']} | {r.get('registers', '–')} | "
              f"{r.get('stack_bytes', '–')} |" for r in rows]
    if failed:
        lines += ["", f"{len(failed)} launches failed to compile."]
    return "\n".join(lines) + "\n"


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("this compiles; unset TRITON_INTERPRET", file=sys.stderr)
        return 1
    import triton

    rows = sweep()
    stem = RESULTS / f"moe_packed_compile_dtypes-triton{triton.__version__}"
    Path(f"{stem}.json").write_text(json.dumps(dict(triton=triton.__version__, launches=rows), indent=2))
    Path(f"{stem}.md").write_text(markdown(rows, triton.__version__))
    print(f"wrote {stem}.json and {stem}.md")
    return 1 if any(not r["compiled"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
