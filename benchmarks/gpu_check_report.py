"""The summary of benchmarks/gpu_check.sh: one record per step, its verdict,
time and headline figure, kept in ``gpu_check_<device>.json`` and rendered as
``gpu_check_<device>.md`` after every step, so a run cut off part-way still
leaves the summary of the steps it finished.

Headline figures are read from the result files the steps wrote, and only
from files written since the step started: a failed step must not show the
figure of an earlier run left in the same folder.

Standard library only (it runs between the steps, and before the install).

    python benchmarks/gpu_check_report.py init    --summary S.json --device NAME --versions V --commit C
                                                  --mode full|quick --budget SECONDS --plan KEY=NAME ...
    python benchmarks/gpu_check_report.py step    --summary S.json --key KEY --rc RC --seconds T --limit L
                                                  [--command CMD] [--result FILE] [--junit XML] [--since EPOCH]
                                                  [--skipped WHY]
    python benchmarks/gpu_check_report.py finish  --summary S.json
    python benchmarks/gpu_check_report.py pytest  PYTEST_ARGS...

``step --junit`` turns pytest's report into ``--result`` (counts and the
failed tests) first. ``finish`` prints the table and exits 0 when every step
passed, 1 otherwise. ``pytest`` runs pytest as ``python -m pytest`` would,
except that SIGTERM (what ``timeout`` sends) interrupts it like Ctrl-C: it
then still ends its session and writes its JUnit report of the tests that
ran, where a plain TERM would kill it before.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

NOT_RUN = "not run"


# -- the tests' results ------------------------------------------------------------


SLOWEST = 10  # tests and modules a test step's record lists by their time


def junit_counts(xml_path: Path) -> dict:
    """Counts and failed test ids from pytest's JUnit XML. pytest writes it at
    the session's end, also when interrupted (what ran so far)."""
    root = ET.parse(xml_path).getroot()
    counts = dict(passed=0, failed=0, errors=0, skipped=0)
    failures, interrupted, seconds, modules = [], 0, [], {}
    for case in root.iter("testcase"):
        if case.get("name") is None:  # the test an interrupt stopped: pytest leaves it nameless
            interrupted += 1
            continue
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        took = float(case.get("time") or 0.0)
        seconds.append((took, test_id))
        module = case.get("classname", "")
        modules[module] = modules.get(module, 0.0) + took
        outcome = "passed"
        for child in case:
            if child.tag == "failure":
                outcome = "failed"
            elif child.tag == "error":
                outcome = "errors"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
            if child.tag in ("failure", "error"):
                message = (child.get("message") or child.text or "").strip().splitlines()
                failures.append(dict(test=test_id, kind=child.tag, message=(message[0] if message else "")[:300]))
        counts[outcome] += 1
    # Where a step's time went (setup, call and teardown of each test, as
    # pytest times them; summed over xdist's workers, so above the wall time).
    slowest = [dict(test=t, seconds=round(s, 2)) for s, t in sorted(seconds, reverse=True)[:SLOWEST]]
    by_module = [dict(module=m, seconds=round(s, 1)) for m, s in sorted(modules.items(), key=lambda i: -i[1])]
    return dict(counts, total=sum(counts.values()), interrupted=interrupted, failures=failures,
                test_seconds=round(sum(s for s, _ in seconds), 1), slowest=slowest, modules=by_module[:SLOWEST])


def write_test_result(xml_path: Path, out: Path) -> dict:
    if xml_path.is_file():
        try:
            result = dict(junit_counts(xml_path), report=True)
        except ET.ParseError as exc:
            result = dict(report=False, error=f"unreadable pytest report: {exc}")
    else:
        result = dict(report=False, error="pytest wrote no report (killed before its session ended)")
    out.write_text(json.dumps(result, indent=2))
    return result


# -- headline figures, one reader per kind of result file ----------------------------------


def _fmt_tests(r: dict) -> tuple[str, dict]:
    if not r.get("report"):
        return r.get("error", "no report"), {}
    parts = [f"{r['passed']} passed"]
    parts += [f"{r[k]} {k}" for k in ("failed", "errors", "skipped") if r.get(k)]
    if r["total"] == 0:
        parts = ["no test ran"]
    if r.get("interrupted"):
        parts.append("cut off mid-test")
    figures = {k: r[k] for k in ("passed", "failed", "errors", "skipped", "total")}
    return ", ".join(parts), figures


def _finished_modes(r: dict, parts: list[str]):
    """(mode, figures) of each mode that finished; a failed one goes to ``parts``."""
    for mode, m in r.get("modes", {}).items():
        if "error" in m:
            parts.append(f"{mode}: error {m['error'][:80]}")
        else:
            yield mode, m


def _fmt_batch1(r: dict) -> tuple[str, dict]:
    parts, figures = [], {}
    for mode, m in _finished_modes(r, parts):
        note = ""
        if not m.get("enforce_eager", True) and not m.get("graph_replays"):
            note = ", no graph replayed"  # the graphs figure would then be eager's
        parts.append(f"{mode} {m['ms_per_token']:.2f} ms/tok ({m['vs_roofline']:.2f}x roofline{note})")
        figures[f"{mode}_ms_per_token"] = m["ms_per_token"]
        figures[f"{mode}_vs_roofline"] = m["vs_roofline"]
    if "eager_over_graphs" in r:
        parts.append(f"eager/graphs {r['eager_over_graphs']:.2f}x")
        figures["eager_over_graphs"] = r["eager_over_graphs"]
    figures["roofline_ms"] = r.get("roofline_ms")
    return "; ".join(parts) or "no mode finished", figures


def _fmt_throughput(r: dict) -> tuple[str, dict]:
    names = {"fluidserve": "fluidserve", "fluidserve_async": "fluidserve async", "hf_generate_padded": "HF generate",
             "hf_generate_batch": "HF generate_batch"}
    parts, figures = [], {}
    for name, v in r.get("results", {}).items():
        label = names.get(name, name)
        if "error" in v:
            parts.append(f"{label}: error {v['error'][:80]}")
            continue
        text = f"{label} {v['tokens_per_s']:.0f} tok/s"
        if name == "fluidserve" and not r.get("enforce_eager", True):
            text += " (graphs" + ("" if v.get("graph_replays") else ", none replayed") + ")"
        if name in r.get("speedup", {}):
            text += f" ({r['speedup'][name]:.2f}x)"
        if name == "fluidserve_async" and "fluidserve" in r.get("async_speedup", {}):
            same = v.get("same_tokens_as_fluidserve")
            text += (f" ({r['async_speedup']['fluidserve']:.2f}x the synchronous run"
                     + ("" if same is None else f", {same:.0%} same tokens") + ")")
        parts.append(text)
        figures[f"{name}_tokens_per_s"] = v["tokens_per_s"]
    figures.update({f"speedup_vs_{k}": v for k, v in r.get("speedup", {}).items()})
    figures.update({f"async_speedup_vs_{k}": v for k, v in r.get("async_speedup", {}).items()})
    return "; ".join(parts) or "no system finished", figures


def _fmt_kernels(r: dict) -> tuple[str, dict]:
    t, m = r.get("targets", {}), r.get("mixed", {})
    figures = dict(copy_gb_s=r.get("copy_gb_s"), decode_pct_of_copy=t.get("decode_pct_of_copy"),
                   prefill_vs_sdpa=t.get("prefill_vs_sdpa"), packing_speedup=m.get("speedup"))  # fmt: skip
    parts = []
    if t.get("decode_pct_of_copy") is not None:
        parts.append(f"decode {t['decode_pct_of_copy']:.1f}% of copy")
    b1 = (t.get("decode_batch1_16k_graph_pct_of_copy"), t.get("decode_batch1_16k_fused_graph_pct_of_copy"),
          t.get("decode_batch1_16k_read_flush_graph_pct_of_copy"))
    if b1[0] is not None:
        beside = [f"{pct:.1f}% {how}" for pct, how in zip(b1[1:], ("merged in the launch", "after a read flush"))
                  if pct is not None]
        parts.append(f"batch 1 at 16k {b1[0]:.1f}% in a graph" + (f" ({', '.join(beside)})" if beside else ""))
        figures.update(decode_batch1_16k_graph_pct_of_copy=b1[0], decode_batch1_16k_fused_graph_pct_of_copy=b1[1],
                       decode_batch1_16k_read_flush_graph_pct_of_copy=b1[2])
    if t.get("prefill_vs_sdpa") is not None:
        alternatives = t.get("prefill_alternatives_vs_sdpa", {})
        parts.append(f"prefill {t['prefill_vs_sdpa']:.2f}x SDPA" + (
            " (prefill tile, " + ", ".join(f"{name}: {ratio:.2f}x" for name, ratio in alternatives.items()) + ")"
            if alternatives else ""))
        if alternatives:
            figures["prefill_alternatives_vs_sdpa"] = alternatives
    if m.get("speedup") is not None:
        parts.append(f"mixed step {m['speedup']:.2f}x unpacked ({m.get('default', 'packed')} plan)")
    return "; ".join(parts), figures


def _fmt_profile(r: dict) -> tuple[str, dict]:
    parts, figures = [], {}
    for mode, m in _finished_modes(r, parts):
        idle = 1 - m["kernel_ms_per_token"] / m["wall_ms_per_token"]
        parts.append(f"{mode} GPU idle {idle:.0%} ({m['kernel_launches_per_token']:.0f} launches/tok)")
        figures[f"{mode}_gpu_idle"] = idle
        figures[f"{mode}_kernel_ms_per_token"] = m["kernel_ms_per_token"]
    return "; ".join(parts) or "no mode finished", figures


def _fmt_swap(r: dict) -> tuple[str, dict]:
    parts, figures = [], {}
    for run in r.get("runs", []):
        n = run["run"]
        parts.append(f"runs of {n}: out {run['swap_out_vs_pinned']:.0%} / in {run['swap_in_vs_pinned']:.0%} "
                     f"of pinned, step {run['step_slowdown']:.2f}x beside a swap")
        for key in ("swap_out_vs_pinned", "swap_in_vs_pinned", "step_slowdown"):
            figures[f"run{n}_{key}"] = run[key]
    return "; ".join(parts) or "no run finished", figures


def _fmt_linears(r: dict) -> tuple[str, dict]:
    parts, figures = [], {}
    c = (r.get("chain") or {}).get("modes")
    if c and "off" in c:
        kinds = [f"plain {c['off']['vs_roofline']:.3f}x roofline"]
        for mode, m in c.items():
            if mode != "off":
                kinds.append(f"{mode} {m['vs_roofline']:.3f}x ({m['speedup']:.3f}x faster"
                             + ("" if m["same_bits"] else ", NOT the same bits") + ")")  # fmt: skip
            figures.update({f"chain_{mode}_{k}": m[k] for k in ("vs_roofline", "speedup", "same_bits")})
        parts.append("a token's GEMVs in a row: " + ", ".join(kinds))
    s = r.get("summary") or {}
    if "cublas_vs_roofline" in s:
        text = f"linears of a token: cuBLAS {s['cublas_vs_roofline']:.2f}x roofline"
        if s.get("gemv_vs_roofline") is not None:
            text += f", gemv kernel {s['gemv_vs_roofline']:.2f}x"
        parts.append(text)
        figures.update({k: s[k] for k in ("cublas_vs_roofline", "gemv_vs_roofline", "best_vs_roofline")
                        if s.get(k) is not None})
    return "; ".join(parts) or "no summary", figures


def _fmt_mixed(r: dict) -> tuple[str, dict]:
    rows = r.get("rows") or []
    if not rows:
        return "no step timed", {}
    parts, figures = [], {}
    for x in rows:
        shape = f"{x['chunk']}_{x['decodes']}"
        part = f"{x['chunk']}+{x['decodes']}: eager {x['eager_over_piecewise']:.2f}x piecewise"
        figures[f"eager_over_piecewise_{shape}"] = x["eager_over_piecewise"]
        if "modules_over_eager" in x:  # the layers through the modules against their batch path
            part += f", modules {x['modules_over_eager']:.2f}x eager"
            figures[f"modules_over_eager_{shape}"] = x["modules_over_eager"]
        parts.append(part)
        if "piecewise_over_graph" in x:
            figures[f"piecewise_over_graph_{x['decodes']}"] = x["piecewise_over_graph"]
    return "; ".join(parts), figures


def _fmt_moe(r: dict) -> tuple[str, dict]:
    rows = r.get("moe") or []
    if not rows:
        return "no shape timed", {}
    parts, figures = [], {}
    for x in rows:
        key = f"{x['model']}_{x['tokens']}"
        gbs = f", {x['weight_gb_s']:.0f} GB/s" if x.get("weight_gb_s") else ""
        parts.append(f"{x['model']} x{x['tokens']}: {x['graph_ms']:.3f} ms in a graph{gbs}, "
                     f"reference {x['reference_ms'] / x['triton_ms']:.1f}x")
        figures[f"graph_ms_{key}"] = x["graph_ms"]
    for x in r.get("packed") or []:  # experts held as stored against dense bf16
        fmt = x["format"].split(",")[0]
        if x["speedup"]:
            parts.append(f"{x['model']} x{x['tokens']} {fmt}: {x['speedup']:.2f}x dense")
            figures[f"packed_speedup_{x['model']}_{x['tokens']}_{fmt}"] = x["speedup"]
    return "; ".join(parts), figures


def _fmt_int_linears(r: dict) -> tuple[str, dict]:
    """Batch 1: each packed variant's time against bf16 cuBLAS's on the same linear."""
    rows = [x for x in r.get("rows") or [] if x["rows"] == 1 and x["bits"] and "dequantize" not in x["variant"]]
    if not rows:
        return "no batch-1 row timed", {}
    parts, figures = [], {}
    for x in rows:
        key = f"{x['linear']}_{x['variant'].replace(' ', '_')}"
        parts.append(f"{x['linear']} {x['variant']}: {x['gb_s']:.0f} GB/s, {x['vs_cublas']:.2f}x bf16 cuBLAS")
        figures[f"vs_cublas_{key}"] = x["vs_cublas"]
    return "; ".join(parts), figures


def _fmt_packed(r: dict) -> tuple[str, dict]:
    """Decode ms a token packed against dequantized, per batch."""
    parts, figures = [], {}
    for row in (r.get("formats") or {}).values():
        packed, dense = row["packed"]["decode_ms"], row["dequantized"]["decode_ms"]
        for batch in sorted(packed, key=int):
            parts.append(f"batch {batch}: packed {packed[batch]:.2f} ms vs dequantized {dense[batch]:.2f} ms "
                         f"({dense[batch] / packed[batch]:.2f}x)")
            figures[f"packed_speedup_b{batch}"] = dense[batch] / packed[batch]
    return ("; ".join(parts) or "no decode timed"), figures


READERS = {"tests": _fmt_tests, "batch1_decode": _fmt_batch1, "throughput": _fmt_throughput, "kernels": _fmt_kernels,
           "linears": _fmt_linears, "profile": _fmt_profile, "swap": _fmt_swap, "mixed": _fmt_mixed,
           "moe": _fmt_moe, "int_linears": _fmt_int_linears, "packed": _fmt_packed}  # fmt: skip


def reader_for(result: Path):
    name = result.name
    if name.startswith("gpu_tests_"):
        return READERS["tests"]
    for prefix, kind in (("batch1_decode_", "batch1_decode"), ("throughput-", "throughput"), ("kernels_", "kernels"),
                         ("linear_bandwidth_", "linears"), ("gemv_chain_", "linears"), ("profile_decode_", "profile"),
                         ("swap_copy_", "swap"), ("moe_", "moe"), ("int_linear_bandwidth_", "int_linears"),
                         ("packed_weights-", "packed"),
                         ("mixed_steps_", "mixed")):
        if name.startswith(prefix):
            return READERS[kind]
    return None


def headline(result: Path | None, since: float | None) -> tuple[str, dict]:
    if result is None:
        return "", {}
    if not result.is_file():
        return f"no {result.name} written", {}
    if since is not None and result.stat().st_mtime < since:
        return f"{result.name} is from an earlier run: not read", {}
    reader = reader_for(result)
    if reader is None:
        return "", {}
    try:
        return reader(json.loads(result.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable {result.name}: {type(exc).__name__}: {exc}"[:200], {}


# -- the summary -----------------------------------------------------------------------


def verdict(rc: int, limit: int | None, seconds: int | None) -> str:
    if rc == 0:
        return "ok"
    if rc == 124:
        return f"TIMED OUT after {limit} s"
    if rc == 137:  # timeout's KILL after its grace, or the kernel's OOM killer before the limit
        timed_out = limit is None or seconds is None or seconds >= limit
        return f"TIMED OUT after {limit} s (killed)" if timed_out else "KILLED (exit 137; out of memory?)"
    return f"FAILED (exit {rc})"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def status(steps: list[dict]) -> str:
    """failed: a step failed or timed out; incomplete: none did, but some
    were skipped or never ran; ok: every step ran and passed."""
    missed = [s for s in steps if s["verdict"] == NOT_RUN or s["verdict"].startswith("skipped")]
    if any(not s["ok"] for s in steps if s not in missed):
        return "failed"
    return "incomplete" if missed else "ok"


def save(path: Path, summary: dict) -> None:
    summary["status"] = status(summary["steps"])
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, path)  # a run killed mid-write leaves the previous summary whole
    path.with_suffix(".md").write_text(markdown(summary))


def table(summary: dict) -> str:
    lines = ["| step | verdict | time | limit | headline |", "|---|---|---:|---:|---|"]
    for s in summary["steps"]:
        took = f"{s['seconds']} s" if s.get("seconds") is not None else ""
        limit = f"{s['limit_s']} s" if s.get("limit_s") is not None else ""
        text = s.get("headline", "").replace("|", "\\|")  # an error message must not split the row
        lines.append(f"| {s['name']} | {s['verdict']} | {took} | {limit} | {text} |")
    return "\n".join(lines)


def markdown(summary: dict) -> str:
    lines = [f"# GPU check on {summary['device']}", "",
             f"{summary['versions']}; commit {summary['commit']}; {summary['mode']} run, step budget "
             f"{summary['budget_s']} s. Status: **{summary['status']}**.", "", table(summary)]  # fmt: skip
    failures = [(s["name"], f) for s in summary["steps"] for f in s.get("failures", [])]
    if failures:
        lines += ["", "Failed tests:", ""]
        lines += [f"* {name}: `{f['test']}` ({f['kind']}): {f['message']}" for name, f in failures[:20]]
        if len(failures) > 20:
            lines.append(f"* ... {len(failures) - 20} more in the log")
    for s in summary["steps"]:
        if s.get("slowest"):
            lines += ["", f"{s['name']}: {s['test_seconds']:.0f} s of tests (summed over workers); by module: "
                      + ", ".join(f"`{m['module']}` {m['seconds']:.0f} s" for m in s["modules"]) + "; slowest: "
                      + ", ".join(f"`{t['test']}` {t['seconds']:.1f} s" for t in s["slowest"]) + "."]  # fmt: skip
    files = sorted({r for s in summary["steps"] for r in s.get("results", [])})
    if files:
        lines += ["", "Result files beside this one: " + ", ".join(f"`{f}`" for f in files) + "."]
    lines += ["", f"Full log: `{summary['log']}`.", ""]
    return "\n".join(lines)


def cmd_init(args: argparse.Namespace) -> int:
    steps = []
    for item in args.plan:
        key, _, name = item.partition("=")
        steps.append(dict(key=key, name=name or key, verdict=NOT_RUN, ok=False))
    summary = dict(device=args.device, versions=args.versions, commit=args.commit, mode=args.mode,
                   budget_s=args.budget, log=args.log, steps=steps)  # fmt: skip
    save(args.summary, summary)
    return 0


def cmd_step(args: argparse.Namespace) -> int:
    summary = load(args.summary)
    step = next((s for s in summary["steps"] if s["key"] == args.key), None)
    if step is None:
        step = dict(key=args.key, name=args.key)
        summary["steps"].append(step)
    result = Path(args.result) if args.result else None
    failures, timings = [], {}
    if args.junit and result is not None:
        tests = write_test_result(Path(args.junit), result)
        failures = tests.get("failures", [])
        timings = {k: tests[k] for k in ("test_seconds", "slowest", "modules") if k in tests}
    if args.skipped:
        step.update(verdict=f"skipped: {args.skipped}", ok=False, seconds=None, limit_s=args.limit)
    else:
        step.update(verdict=verdict(args.rc, args.limit, args.seconds), ok=args.rc == 0, seconds=args.seconds,
                    limit_s=args.limit)
    text, figures = headline(result, args.since) if not args.skipped else ("", {})
    written = [f for f in ([result, result.with_suffix(".md")] if result is not None else [])
               if f.is_file() and (args.since is None or f.stat().st_mtime >= args.since)]  # fmt: skip
    step.update(command=args.command, headline=text, figures=figures, failures=failures,
                results=[f.name for f in written], **timings)  # fmt: skip
    save(args.summary, summary)
    return 0


def cmd_finish(args: argparse.Namespace) -> int:
    summary = load(args.summary)
    save(args.summary, summary)
    print(f"\nGPU check on {summary['device']}: {summary['status']}\n")
    print(table(summary))
    return 0 if summary["status"] == "ok" else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command_name", required=True)
    init = sub.add_parser("init")
    init.add_argument("--device", required=True)
    init.add_argument("--versions", default="")
    init.add_argument("--commit", default="unknown")
    init.add_argument("--mode", default="full")
    init.add_argument("--budget", type=int, default=0)
    init.add_argument("--log", default="")
    init.add_argument("--plan", nargs="+", default=[], help="KEY=NAME of each step, in order")
    step = sub.add_parser("step")
    step.add_argument("--key", required=True)
    step.add_argument("--rc", type=int, default=0)
    step.add_argument("--seconds", type=int, default=None)
    step.add_argument("--limit", type=int, default=None)
    step.add_argument("--command", dest="command", default="")
    step.add_argument("--result", default=None, help="the JSON file the step writes")
    step.add_argument("--junit", default=None, help="pytest's JUnit XML, turned into --result")
    step.add_argument("--since", type=float, default=None, help="epoch the step started: older results are stale")
    step.add_argument("--skipped", default=None, help="the step did not run, and why")
    finish = sub.add_parser("finish")
    for p in (init, step, finish):
        p.add_argument("--summary", type=Path, required=True, help="gpu_check_<device>.json")
    return ap.parse_args(argv)


def run_pytest(args: list[str]) -> int:
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    # A shell that started this without job control may have it ignoring
    # SIGINT, and Python then keeps ignoring it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path[0] = os.getcwd()  # as under python -m pytest: tests import tests.server_utils
    import pytest

    return int(pytest.main(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pytest"]:
        return run_pytest(argv[1:])
    args = parse_args(argv)
    return {"init": cmd_init, "step": cmd_step, "finish": cmd_finish}[args.command_name](args)


if __name__ == "__main__":
    sys.exit(main())
