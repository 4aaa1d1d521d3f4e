"""How close batch-1 decode's matrix-vector products come to the HBM
roofline: each linear of a Llama-3-8B-shaped layer (fused QKV, output,
fused gate/up, down) and the LM head, with one row of activations, timed as
a CUDA graph replays it (the engine's decode path) after an L2 flush;
cuBLAS also at 2, 4 and 8 rows (a small decode batch reads the same weight),
beside a Triton candidate for them (one small tensor-core product per step,
each program reading its rows of the weight once).

Variants, each on the same weight and input:

* ``F.linear``: what the engine runs (cuBLAS, weight [out, in]);
* ``addmm_``: the output and down projections as the engine runs them,
  accumulating into the residual in place;
* ``triton BLOCK_NxBLOCK_K/warps``: kernels/gemv.py's kernel (one program
  per ``BLOCK_N`` output rows, reading its rows of the weight once, in
  order) at each launch shape; the engine runs it inside decode graphs at
  ``gemv.BLOCK_N`` x ``gemv.MAX_BLOCK_K`` / ``gemv.NUM_WARPS``;
* for gate/up, the engine's GEMV followed by the SiLU-mul kernel against the
  one launch the engine runs (the activation in the GEMV's epilogue, the
  same bits): these two rows include the activation and stay out of the
  per-token sums of the linears.

The chain (``--parts chain``, first): a decode token's GEMVs as the
engine's batch-1 layer launches them (qkv with the RMSNorm, o adding the
residual, gate/up with the norm and the SiLU-mul, down into the residual;
each reading the one before's output), every layer's and then the LM
head's, captured in one CUDA graph twice: launched plainly, and as
programmatic dependents (kernels/gemv.py, ``FLUIDSERVE_GEMV_PDL``), which
start while the launch before drains. Replays alternate between the two;
both give the same bits (checked). No L2 flush: the weights are 15 GB.

A row's bandwidth is the weight's bytes over its time, against the
device-to-device copy measured in the same run; the per-token figures add
up every layer's linears and the LM head: with cuBLAS, with the kernel at
the engine's launch shape, and with each linear's fastest variant. Triton
outputs are checked against ``F.linear`` (bf16, relative to the output's
largest magnitude).

    python benchmarks/linear_bandwidth.py [--preset llama3-8b] [--parts chain sweep] [--out benchmarks/results]

Writes ``gemv_chain_<device>.json`` and ``.md`` (the chain) and
``linear_bandwidth_<device>.json`` and ``.md`` (the sweep). Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fluidserve.kernels import gemv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dummy_models import PRESETS, save_results  # noqa: E402
from kernel_bench import RESULTS_DIR, copy_bandwidth_gbs, device_slug, graph_ms  # noqa: E402

# Two warps never won on an H100 (and collapsed at 32x512); the engine's launch shape is among these.
TRITON_CONFIGS = [(bn, bk, 4) for bn in (4, 8, 16, 32) for bk in (128, 256, 512)]
MORE_ROWS = (2, 4, 8)
# gate_up rows that include the activation (kept out of the linears' sums).
SILU_APART, SILU_FUSED = "engine GEMV, then SiLU-mul", "gate/up GEMV + SiLU-mul, one launch"
SKINNY_CONFIGS = [(bn, bk) for bn in (16, 32, 64) for bk in (128, 256)]


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # y[m, n] = sum_k x[m, k] w[n, k] for a few rows m: each program reads
    # its BLOCK_N rows of the weight once, for every row of x, through one
    # small tensor-core product per step (BLOCK_M >= 16 pads the rows).
    rows = tl.arange(0, BLOCK_M)
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k + cols)[None, :], mask=rows[:, None] < M, other=0.0)
        w = tl.load(w_ptr + outs[:, None].to(tl.int64) * stride_wn + (k + cols)[None, :], mask=outs[:, None] < N,
                    other=0.0, eviction_policy="evict_first")  # fmt: skip
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rows[:, None] * stride_ym + outs[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (outs[None, :] < N))  # fmt: skip


def triton_skinny(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """``x W^T`` for 2-16 rows of x, a candidate for small decode batches."""
    (m, k), n = x.shape, w.shape[0]
    if m > 16 or k % block_k or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"triton_skinny: x {tuple(x.shape)}, w {tuple(w.shape)}, BLOCK_K {block_k}")
    _skinny_kernel[(triton.cdiv(n, block_n),)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                               BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)  # fmt: skip
    return out


def triton_gemv(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int, num_warps: int
) -> torch.Tensor:
    if not gemv.supports(x, w, None, None) or w.shape[1] % block_k:
        raise ValueError(f"triton_gemv: x {tuple(x.shape)}, w {tuple(w.shape)}, BLOCK_K {block_k}")
    return gemv.launch(x, w, None, None, out=out, block_n=block_n, k_step=block_k, num_warps=num_warps)


def layer_shapes(cfg: dict) -> list[tuple[str, int, int, int]]:
    """(name, out, in, calls per token) of each linear a decode token runs."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    return [("qkv", (hq + 2 * hkv) * d, h, layers), ("o", h, hq * d, layers),
            ("gate_up", 2 * inter, h, layers), ("down", h, inter, layers),
            ("lm_head", cfg["vocab_size"], h, 1)]  # fmt: skip


def bench_shape(name: str, n: int, k: int, copy_gbs: float) -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, w)
    scale = ref.abs().max().item()
    nbytes = w.numel() * w.element_size()
    rows = []

    def row(variant: str, fn, err: float | None = None, m: int = 1) -> None:
        ms = graph_ms(fn, reps=10)
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append(dict(linear=name, out=n, inp=k, variant=variant, rows=m, ms=ms, gb_s=gbs,
                         pct_copy=100 * gbs / copy_gbs, rel_err=err))  # fmt: skip
        print(
            f"  {name:8s} {variant:22s} {ms * 1e3:8.1f} us  {gbs:6.0f} GB/s  {100 * gbs / copy_gbs:5.1f}% of copy"
            + ("" if err is None else f"  rel err {err:.1e}"),
            flush=True,
        )

    row("F.linear", lambda: F.linear(x, w))
    if name in ("o", "down"):
        residual = torch.zeros(1, n, device="cuda", dtype=torch.bfloat16)
        row("addmm_", lambda: residual.addmm_(x, w.t()))
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    for bn, bk, warps in TRITON_CONFIGS:
        if k % bk:
            continue
        label = f"triton {bn}x{bk}/{warps}"
        try:
            triton_gemv(x, w, out, bn, bk, warps)
            err = ((out.float() - ref.float()).abs().max() / scale).item()
            row(label, lambda bn=bn, bk=bk, warps=warps: triton_gemv(x, w, out, bn, bk, warps), err)
        except Exception as exc:  # a config that fails to compile is recorded, the rest still run
            rows.append(dict(linear=name, out=n, inp=k, variant=label, error=f"{type(exc).__name__}: {exc}"[:300]))
            print(f"  {name:8s} {label:22s} {rows[-1]['error']}", flush=True)
    if name == "gate_up":  # the engine's gate/up GEMV with the SiLU-mul after it, and in its epilogue
        from fluidserve.kernels import activation

        apart = activation.silu_and_mul(gemv.gemv(x, w))
        act = torch.empty(1, n // 2, device="cuda", dtype=torch.bfloat16)
        fused = gemv.launch(x, w, None, None, out=act, gated=True)
        err = ((fused.float() - apart.float()).abs().max() / apart.abs().max()).item()  # 0: the same bits
        row(SILU_APART, lambda: activation.silu_and_mul(gemv.launch(x, w, None, None, out=out)))
        row(SILU_FUSED, lambda: gemv.launch(x, w, None, None, out=act, gated=True), err)
    # cuBLAS at a few more rows, the same weight read for a small decode
    # batch: what a kernel for those batches would have to beat.
    for m in MORE_ROWS:
        xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row(f"F.linear, {m} rows", lambda xm=xm: F.linear(xm, w), m=m)
        ref_m = F.linear(xm, w)
        out_m = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        for bn, bk in SKINNY_CONFIGS:
            label = f"triton dot {bn}x{bk}, {m} rows"
            try:
                triton_skinny(xm, w, out_m, bn, bk)
                err = ((out_m.float() - ref_m.float()).abs().max() / ref_m.abs().max()).item()
                row(label, lambda xm=xm, out_m=out_m, bn=bn, bk=bk: triton_skinny(xm, w, out_m, bn, bk), err, m=m)
            except Exception as exc:  # recorded; the rest still run
                rows.append(dict(linear=name, out=n, inp=k, variant=label, rows=m,
                                 error=f"{type(exc).__name__}: {exc}"[:300]))  # fmt: skip
                print(f"  {name:8s} {label:22s} {rows[-1]['error']}", flush=True)
    return rows


def chain_weights(cfg: dict, layers: int) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor, torch.Tensor]:
    """Random bf16 weights of ``layers`` decoder layers' linears, norm
    weights (one for every norm) and the LM head."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5

    torch.manual_seed(1)
    per_layer = [(w((hq + 2 * hkv) * d, h), w(h, hq * d), w(2 * inter, h), w(h, inter)) for _ in range(layers)]
    norm = 1 + 0.1 * torch.randn(h, device="cuda", dtype=torch.bfloat16)
    return per_layer, norm, w(cfg["vocab_size"], h)


def token_chain(x: torch.Tensor, per_layer, norm: torch.Tensor, lm_head: torch.Tensor, mode: str,
                eps: float = 1e-5) -> torch.Tensor:  # fmt: skip
    """One decode token's GEMVs in the engine's order and fusions
    (engine/models/llama.py, the row path), attention left out: the o
    projection reads the q part of the qkv output in its place. ``mode``:
    how they launch (``gemv.DEPENDENT_MODES``)."""
    hq_d = per_layer[0][1].shape[1]
    for qkv_w, o_w, gate_up_w, down_w in per_layer:
        qkv = gemv.launch(x, qkv_w, None, None, norm=(norm, eps), dependent=mode)
        h = gemv.launch(qkv[:, :hq_d], o_w, None, x, out=torch.empty_like(x), round_before_residual=True,
                        dependent=mode)  # fmt: skip
        act = gemv.launch(h, gate_up_w, None, None, gated=True, norm=(norm, eps), dependent=mode)
        x = gemv.launch(act, down_w, None, h, dependent=mode)  # h + MLP, over h
    return gemv.launch(x, lm_head, None, None, norm=(norm, eps), dependent=mode)


CHAIN_MODES = {"off": "plain", "on": "programmatic dependents (`FLUIDSERVE_GEMV_PDL=1`)",
               "l2": "dependents, 64 KiB of each program's rows fetched into L2 first (`FLUIDSERVE_GEMV_PDL=l2`)"}


def bench_chain(cfg: dict, copy_gbs: float, rounds: int = 10) -> dict:
    """The token chain captured once per ``CHAIN_MODES`` launch kind;
    median replay time of each (each round replays every kind, in an order
    that turns round by round), against the weights' bytes at the copy
    bandwidth."""
    import statistics

    layers = cfg["num_hidden_layers"]
    per_layer, norm, lm_head = chain_weights(cfg, layers)
    nbytes = sum(t.numel() * t.element_size() for ws in per_layer for t in ws) + lm_head.numel() * 2
    x = torch.randn(1, cfg["hidden_size"], device="cuda", dtype=torch.bfloat16)
    graphs, outs = {}, {}
    for mode in CHAIN_MODES:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            token_chain(x, per_layer, norm, lm_head, mode)  # compiled outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs[mode] = token_chain(x, per_layer, norm, lm_head, mode)
        graphs[mode] = graph
    modes = list(CHAIN_MODES)
    times = {mode: [] for mode in modes}
    for i in range(rounds + 1):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[mode].replay()
            end.record()
            end.synchronize()
            if i:  # the first round warms up
                times[mode].append(start.elapsed_time(end))
    roofline_ms = nbytes / (copy_gbs * 1e9) * 1e3
    result = dict(layers=layers, weight_gb=nbytes / 1e9, roofline_ms=roofline_ms, rounds=rounds,
                  launches=4 * layers + 1, modes={})  # fmt: skip
    plain_ms = statistics.median(times["off"])
    for mode in modes:
        ms = statistics.median(times[mode])
        result["modes"][mode] = dict(ms=ms, vs_roofline=ms / roofline_ms, speedup=plain_ms / ms,
                                     same_bits=torch.equal(outs[mode], outs["off"]))  # fmt: skip
        print(f"  chain of {4 * layers + 1} GEMVs ({nbytes / 1e9:.2f} GB), {mode}: {ms:.3f} ms "
              f"({ms / roofline_ms:.3f}x roofline, {plain_ms / ms:.3f}x plain); same bits: "
              f"{result['modes'][mode]['same_bits']}", flush=True)
    return result


def summarize(rows: list[dict], shapes: list[tuple[str, int, int, int]], copy_gbs: float) -> dict:
    """Per-token time of every linear as the engine runs it (F.linear, and
    addmm_ where the residual is fused) and with each linear's fastest
    variant, against those weights' bytes at the copy bandwidth."""
    ok = [r for r in rows if "ms" in r and r.get("rows", 1) == 1 and r["variant"] not in (SILU_APART, SILU_FUSED)]
    calls = {name: c for name, _, _, c in shapes}
    weight_bytes = sum(2 * n * k * c for _, n, k, c in shapes)
    cublas_ms = best_ms = 0.0
    best = {}
    for name, *_ in shapes:
        mine = [r for r in ok if r["linear"] == name]
        ran = next(r for r in mine if r["variant"] == ("addmm_" if name in ("o", "down") else "F.linear"))
        fastest = min(mine, key=lambda r: r["ms"])
        best[name] = fastest["variant"]
        cublas_ms += calls[name] * ran["ms"]
        best_ms += calls[name] * fastest["ms"]
    roofline_ms = weight_bytes / (copy_gbs * 1e9) * 1e3
    shape = engine_shape()
    gemv_rows = {r["linear"]: r["ms"] for r in ok if r["variant"] == shape}
    gemv_ms = sum(calls[name] * gemv_rows[name] for name in calls) if len(gemv_rows) == len(calls) else None
    return dict(weight_gb=weight_bytes / 1e9, roofline_ms=roofline_ms, cublas_ms=cublas_ms, best_ms=best_ms,
                cublas_vs_roofline=cublas_ms / roofline_ms, best_vs_roofline=best_ms / roofline_ms,
                best_variant=best, gemv_variant=shape, gemv_ms=gemv_ms,
                gemv_vs_roofline=None if gemv_ms is None else gemv_ms / roofline_ms,
                small_batches=small_batches(rows, calls, roofline_ms), silu=silu_fusion(rows, calls))  # fmt: skip


def silu_fusion(rows: list[dict], calls: dict[str, int]) -> dict | None:
    """The gate/up GEMV and the SiLU-mul per token: two launches against one."""
    ms = {r["variant"]: r["ms"] for r in rows if r.get("linear") == "gate_up" and "ms" in r}
    if SILU_APART not in ms or SILU_FUSED not in ms:
        return None
    return dict(apart_ms=calls["gate_up"] * ms[SILU_APART], fused_ms=calls["gate_up"] * ms[SILU_FUSED])


def small_batches(rows: list[dict], calls: dict[str, int], roofline_ms: float) -> dict[str, dict]:
    """Per row count above one: a token step's linears with cuBLAS and with
    each linear's fastest Triton candidate, against the batch-1 roofline
    (the weights are read once either way)."""
    out = {}
    for m in sorted({r.get("rows", 1) for r in rows} - {1}):
        mine = [r for r in rows if r.get("rows", 1) == m and "ms" in r]
        cublas = {r["linear"]: r["ms"] for r in mine if r["variant"].startswith("F.linear")}
        triton_best = {name: min((r["ms"] for r in mine if r["linear"] == name and r["variant"].startswith("triton")),
                                 default=None) for name in calls}  # fmt: skip
        if len(cublas) < len(calls) or None in triton_best.values():
            continue
        c = sum(calls[name] * cublas[name] for name in calls)
        t = sum(calls[name] * min(cublas[name], triton_best[name]) for name in calls)
        out[str(m)] = dict(cublas_ms=c, best_ms=t, cublas_vs_roofline=c / roofline_ms, best_vs_roofline=t / roofline_ms)
    return out


def engine_shape() -> str:
    """The variant label of the launch shape the engine's decode graphs use."""
    return f"triton {gemv.BLOCK_N}x{gemv.MAX_BLOCK_K}/{gemv.NUM_WARPS}"


def chain_markdown(report: dict) -> str:
    c = report["chain"]
    lines = [f"# A token's GEMVs in a row, plain and as dependent launches: {report['device']}", "",
             f"{report['preset']}-shaped weights, bf16, one row of activations; device-to-device copy "
             f"{report['copy_gb_s']:.0f} GB/s; {report['versions']}. {c['launches']} launches ({c['layers']} layers x "
             f"qkv, o, gate/up, down; then the LM head), {c['weight_gb']:.2f} GB of weights, roofline "
             f"{c['roofline_ms']:.3f} ms; median of {c['rounds']} graph replays each, the kinds taking turns.", "",
             "| launches | ms | x roofline | x plain's speed | the plain chain's bits |", "|---|---:|---:|---:|---|"]
    for mode, m in c["modes"].items():
        lines.append(f"| {CHAIN_MODES.get(mode, mode)} | {m['ms']:.3f} | {m['vs_roofline']:.3f} | "
                     f"{m['speedup']:.3f} | {'yes' if m['same_bits'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        f"# Batch-1 linears against the HBM roofline: {report['device']}",
        "",
        f"{report['preset']}-shaped weights, bf16, one row of activations, each call timed as a CUDA graph "
        f"replays it after an L2 flush; device-to-device copy {report['copy_gb_s']:.0f} GB/s. Relative error: "
        "max |triton - F.linear| over max |F.linear|.",
        "",
        "| linear | out x in | variant | us | GB/s | % of copy | rel err |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        if "ms" not in r:
            lines.append(f"| {r['linear']} | {r['out']} x {r['inp']} | {r['variant']} | failed: {r['error']} | | | |")
            continue
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        lines.append(
            f"| {r['linear']} | {r['out']} x {r['inp']} | {r['variant']} | {r['ms'] * 1e3:.1f} | "
            f"{r['gb_s']:.0f} | {r['pct_copy']:.1f} | {err} |"
        )
    lines += [
        "",
        f"Per token, every linear ({s['weight_gb']:.2f} GB of weights, roofline {s['roofline_ms']:.2f} ms): "
        f"with cuBLAS (F.linear, addmm_ where the residual is fused) **{s['cublas_ms']:.2f} ms "
        f"({s['cublas_vs_roofline']:.2f}x)**; "
        + (
            ""
            if s.get("gemv_ms") is None
            else f"with the kernel at the engine's launch shape ({s['gemv_variant']}) "
            f"**{s['gemv_ms']:.2f} ms ({s['gemv_vs_roofline']:.2f}x)**; "
        )
        + f"each linear's fastest variant {s['best_ms']:.2f} ms ({s['best_vs_roofline']:.2f}x): "
        + ", ".join(f"{k} {v}" for k, v in s["best_variant"].items())
        + ".",
        "",
    ]
    if s.get("silu"):
        f = s["silu"]
        lines += [f"The gate/up GEMV with the SiLU-mul in its epilogue, per token: **{f['fused_ms']:.3f} ms** in one "
                  f"launch against {f['apart_ms']:.3f} ms for the GEMV then the activation kernel "
                  f"({f['apart_ms'] / f['fused_ms']:.2f}x).", ""]  # fmt: skip
    for m, b in (s.get("small_batches") or {}).items():
        lines += [f"{m} rows: every linear with cuBLAS {b['cublas_ms']:.2f} ms ({b['cublas_vs_roofline']:.2f}x the "
                  f"batch-1 roofline); with the faster of cuBLAS and the Triton candidate per linear "
                  f"{b['best_ms']:.2f} ms ({b['best_vs_roofline']:.2f}x).", ""]  # fmt: skip
    return "\n".join(lines)


PARTS = ("chain", "sweep")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="chain: a token's GEMVs in a row, plain and as dependent launches; sweep: each linear at "
                        "each launch shape")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("linear_bandwidth: needs a CUDA device", file=sys.stderr)
        return 1
    cfg = PRESETS[args.preset]
    copy_gbs = copy_bandwidth_gbs()
    torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    print(f"linear_bandwidth: {device}, copy {copy_gbs:.0f} GB/s", flush=True)
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    head = dict(device=device, preset=args.preset, copy_gb_s=copy_gbs, versions=versions)
    slug = device_slug(device)
    if "chain" in args.parts:
        record = dict(head, chain=bench_chain(cfg, copy_gbs))
        torch.cuda.empty_cache()  # 15 GB of weights and the graphs
        save_results(args.out / f"gemv_chain_{slug}", record, chain_markdown(record))
    if "sweep" in args.parts:
        shapes = layer_shapes(cfg)
        rows = []
        for name, n, k, _ in shapes:
            rows += bench_shape(name, n, k, copy_gbs)
            torch.cuda.empty_cache()  # the last shape's weight
        record = dict(head, rows=rows, summary=summarize(rows, shapes, copy_gbs))
        save_results(args.out / f"linear_bandwidth_{slug}", record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
