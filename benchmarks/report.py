"""Builds docs/benchmarks.md and its plots from the JSON in benchmarks/results/.

    python benchmarks/report.py

Rewrites docs/benchmarks.md and docs/*.png; the same results always give the
same files (sorted inputs, fixed number formats, no timestamps in the PNGs).
Every section reads one benchmark's files: its table, the hardware and the
command come from the JSON, or, where an older script did not save the
command there, from the markdown the same run wrote beside it. A results file
no section claims still gets a generic section, so nothing measured goes
missing from the page.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))  # the sections import the benchmarks' own texts
DOCS = REPO / "docs"
# The co-serving simulator saves no cost model in its JSON; it always runs
# scheduler.cost_model.default_cost_model().
SIM_DEFAULT = "simulated: Llama-3-8B on one H100 (roofline cost model)"

# One colour per system, policy or design across every plot, so a reader
# matches lines between figures without reading each legend.
COLORS = {
    "fluidserve": "tab:blue", "vllm": "tab:orange", "transformers": "tab:green", "baseline": "tab:gray",
    "fcfs": "tab:gray", "fixed-priority": "tab:olive", "mlfq": "tab:purple", "skip-join-mlfq": "tab:blue",
    "skip-join-mlfq α=3s": "tab:cyan",
    "fcfs + recompute": "tab:gray", "skip-join + recompute": "tab:purple",
    "skip-join + reactive swap": "tab:orange", "skip-join + proactive swap": "tab:blue",
    "skip-join + proactive swap, loans off": "tab:blue", "skip-join + proactive swap, slack 1.25": "tab:cyan",
    "skip-join + proactive swap, KV loans (max_tokens <= 32; default flags)": "tab:green",
    "naive (one queue)": "tab:red", "priority": "tab:orange", "priority + budget": "tab:olive",
    "+ checkpointing": "tab:cyan", "+ layer-wise preemption (full)": "tab:blue",
    "full (+ layer preemption, checkpointing)": "tab:blue",
}


# -- reading -------------------------------------------------------------------------------


def load(stem: str) -> dict | None:
    path = RESULTS / f"{stem}.json"
    return json.loads(path.read_text()) if path.exists() else None


def loaded(*stems: str) -> Iterator[tuple[str, dict]]:
    """(stem, results) of each of ``stems`` that has a results file."""
    for stem in stems:
        d = load(stem)
        if d:
            yield stem, d


def md_command(stem: str) -> str | None:
    """The command line a run wrote into its markdown (for JSON that lacks it)."""
    path = RESULTS / f"{stem}.md"
    if not path.exists():
        return None
    m = re.search(r"Command: `([^`]+)`|`(python3? benchmarks/[^`]+)`", path.read_text())
    return (m.group(1) or m.group(2)).strip() if m else None


def md_hardware(stem: str) -> str | None:
    """The CPU a run named in its markdown (for JSON that lacks it)."""
    path = RESULTS / f"{stem}.md"
    m = re.search(r"on the CPU \(([^)]+\))", path.read_text()) if path.exists() else None
    return f"CPU ({m.group(1)}" if m else None


def command(stem: str, d: dict) -> str | None:
    cmd = d.get("command") or (d.get("meta") or {}).get("command") or md_command(stem)
    if not cmd:
        return None
    cmd = re.sub(r"\s+--out(-dir)?\s+\S+", "", cmd.strip())  # where the run wrote its files, not what it ran
    cmd = re.sub(r"--vllm-python \S+", "--vllm-python VLLM_VENV/bin/python", cmd)
    return cmd if cmd.startswith("python") else "python " + cmd


def hardware(d: dict) -> str | None:
    dev, meta = d.get("device"), d.get("meta") or {}
    if isinstance(dev, dict):
        parts = [dev.get("cpu"), f"{dev['cores']} cores" if dev.get("cores") else None,
                 f"torch {dev['torch']}" if dev.get("torch") else None]
        return ", ".join(p for p in parts if p)
    if isinstance(dev, str) and dev not in ("cpu", "cuda"):
        return dev + (f", torch {d['torch']}" if d.get("torch") else "")
    if meta.get("cost_model"):
        return f"simulated: {meta['cost_model']}"
    if "roofline" in str(meta.get("device", "")):
        return f"simulated: {meta['model']} on {meta['device']}"
    if meta.get("machine"):
        cpus = f", {meta['cpus']} cores" if meta.get("cpus") else ""
        torch = f", torch {meta['torch']}" if meta.get("torch") else ""
        return f"CPU ({meta['machine']}{cpus}{torch})"
    if d.get("cpu_count"):
        return f"CPU, {d['cpu_count']} cores"
    return None


# -- formatting ----------------------------------------------------------------------------


def num(x: Any, digits: int = 3) -> str:
    """A number to ``digits`` significant figures, thousands grouped; blanks stay blank."""
    if x is None or x == "":
        return ""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if x != x:  # NaN: the run had nothing to measure there
        return "n/a"
    if isinstance(x, int) or abs(x) >= 10 ** (digits - 1):
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def pct(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def table(header: list[str], rows: list[list[Any]], align: str | None = None) -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    cells = [[c if isinstance(c, str) else num(c) for c in r] for r in rows]
    return ["| " + " | ".join(header) + " |", sep] + ["| " + " | ".join(r) + " |" for r in cells] + [""]


def provenance(stem: str, d: dict, hw: str | None = None) -> list[str]:
    """Where a table's figures come from: the file, the hardware (``hw`` where
    the file does not say), the command."""
    parts = [f"`benchmarks/results/{stem}.json`"]
    hw, cmd = hardware(d) or hw, command(stem, d)
    if hw:
        parts.append(f"hardware: {hw}")
    if cmd:
        parts.append(f"command: `{cmd}`")
    return ["- " + "; ".join(parts), ""]


def plain_log(ax: plt.Axes) -> None:
    """Log-axis ticks as plain numbers (20, 50, 100), not powers of ten."""
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    # Minor ticks labelled at 2, 3 and 5 only: every one of them crowds a short axis.
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:e}"[0] in "235" else ""))
    ax.tick_params(axis="y", which="minor", labelsize=7)


WRITTEN: set[str] = set()  # plots of this run; main removes any other docs/*.png


def save_plot(fig: plt.Figure, name: str) -> str:
    DOCS.mkdir(exist_ok=True)
    WRITTEN.add(name)
    fig.tight_layout()
    fig.savefig(DOCS / name, dpi=100, metadata={"Software": None})  # no version stamp: same input, same bytes
    plt.close(fig)
    return f"![{name[:-4]}]({name})"


# -- the simulator: scheduling, swapping, prefix cache -------------------------------------


def scheduling(_: str) -> tuple[list[str], list[str]]:
    d = load("scheduling")
    policies = list(dict.fromkeys(r["policy"] for r in d["rows"]))
    experiments = list(dict.fromkeys(r["experiment"] for r in d["rows"]))
    xname = {"sharegpt-ratio": "in/out ratio", "azure-code-trace": "replay speed"}
    out = ["Policies on the same jobs, FastServe §6.3: mean normalized latency (end-to-end time per output "
           "token, ms) per policy; `α=3s` is skip-join MLFQ with a 3 s starvation limit. Load is the arrival "
           "rate over the saturated FCFS throughput of the same length mix; `cap16` limits a step to 16 "
           "requests (FastServe's fixed batch size); the ratio rows scale ShareGPT's input/output lengths; "
           "the Azure rows replay the code trace faster.", ""]
    out += provenance("scheduling", d)
    rows = []
    for exp in experiments:
        sub = [r for r in d["rows"] if r["experiment"] == exp]
        for x in sorted({r["x"] for r in sub}):
            at = {r["policy"]: r["mean_norm_latency_s"] * 1e3 for r in sub if r["x"] == x}
            best = min(at, key=at.get)
            rows.append([exp, f"{xname.get(exp, 'load')} {x:g}", *(num(at.get(p)) for p in policies),
                         best, ratio(at["fcfs"] / at["skip-join-mlfq"])])
    out += table(["experiment", "point", *policies, "best", "fcfs / skip-join"], rows,
                 "ll" + "r" * len(policies) + "lr")
    cpu = d.get("scheduler_cpu_s_per_step") or {}
    if cpu:
        sizes = sorted({int(n) for v in cpu.values() for n in v})
        out += ["Scheduler CPU time per step (schedule + update, decoding requests), ms:", ""]
        out += table(["policy", *(f"{n} requests" for n in sizes)],
                     [[p, *(cpu[p].get(str(n), 0) * 1e3 for n in sizes)] for p in cpu])

    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    for ax, exp in zip(axes.flat, experiments):
        sub = [r for r in d["rows"] if r["experiment"] == exp]
        for p in policies:
            pts = sorted((r["x"], r["mean_norm_latency_s"] * 1e3) for r in sub if r["policy"] == p)
            ax.plot(*zip(*pts), marker="o", label=p, color=COLORS.get(p))
        ax.set_title(exp, fontsize=10)
        ax.set_xlabel({"sharegpt-ratio": "input/output length ratio",
                       "azure-code-trace": "replay speed"}.get(exp, "load (fraction of capacity)"))
        ax.set_ylabel("mean normalized latency (ms/token)")
        ax.set_yscale("log")
        plain_log(ax)
        if exp in xname:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Scheduling policies, latency vs load ({d['meta']['cost_model']}, simulated)", fontsize=11)
    return out, [save_plot(fig, "scheduling.png")]


def swapping(_: str) -> tuple[list[str], list[str]]:
    d = load("swapping")
    from swapping import ALONE, output_left, where_the_mean_goes

    shares = where_the_mean_goes(d["rows"])
    left = output_left(d["meta"])
    # The first seed's runs: the other seeds run the main variants at the highest load only.
    first = d["meta"].get("seeds", [0])[0]
    d = d | {"rows": [r for r in d["rows"] if r.get("seed", first) == first and r["variant"] != ALONE]}
    presets = list(dict.fromkeys(r["preset"] for r in d["rows"]))
    # The variants every preset ran (the sweeps run on some only); the full set is in the results file.
    variants = [v for v in dict.fromkeys(r["variant"] for r in d["rows"])
                if all(any(r["variant"] == v and r["preset"] == p for r in d["rows"]) for p in presets)]
    proactive = next(v for v in variants if v.startswith("skip-join + proactive swap"))
    out = ["Two KV tiers, FastServe §4.2, on memory-bound presets: mean normalized latency (ms/token) per "
           "variant; `fcfs + recompute` is vLLM's behaviour. Sweeps of the token-deadline settings: "
           "`benchmarks/results/swapping.md`.", ""]
    out += provenance("swapping", d, "simulated: roofline cost model of each preset's model and GPU")
    rows = []
    for preset in presets:
        sub = [r for r in d["rows"] if r["preset"] == preset]
        for x in sorted({r["x"] for r in sub}):
            at = {r["variant"]: r for r in sub if r["x"] == x}
            base, best = at["fcfs + recompute"], at[proactive]
            rows.append([preset, f"{x:g}", *(num(at[v]["mean_norm_latency_s"] * 1e3) for v in variants),
                         ratio(base["mean_norm_latency_s"] / best["mean_norm_latency_s"]),
                         f"{num(base['p99_ttft_s'])} → {num(best['p99_ttft_s'])}",
                         f"{num(base['p99_tpot_s'] * 1e3)} → {num(best['p99_tpot_s'] * 1e3)}",
                         f"{best['stall_share']:.1%}"])
    out += table(["preset", "load", *variants, "proactive vs fcfs + recompute", "P99 TTFT s (fcfs → proactive)",
                  "P99 TPOT ms (fcfs → proactive)", "proactive swap stall / run"], rows,
                 "ll" + "r" * (len(variants) + 4))
    fig, axes = plt.subplots(1, len(presets), figsize=(4 * len(presets), 3.8))
    for ax, preset in zip(axes, presets):
        for v in variants:
            pts = sorted((r["x"], r["mean_norm_latency_s"] * 1e3) for r in d["rows"]
                         if r["preset"] == preset and r["variant"] == v)
            ax.plot(*zip(*pts), marker="o", label=v, color=COLORS.get(v))
        ax.set_title(preset, fontsize=9)
        ax.set_xlabel("replay speed" if "azure" in preset else "load (fraction of capacity)")
        ax.set_ylabel("mean normalized latency (ms/token)")
        ax.set_yscale("log")
        plain_log(ax)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Two-tier KV: recompute vs proactive swapping (simulated)", fontsize=11)
    for part in (shares, left):  # subsections of this one
        if part:
            part[0] = "#" + part[0]
    return out + [""] + shares + [""] + left, [save_plot(fig, "swapping.png")]


def token_budget(_: str) -> tuple[list[str], list[str]]:
    d = load("token_budget")
    from token_budget import FINDINGS

    out = ["The two-tier comparison at each step token budget (`--max-num-batched-tokens`), both sides on the same "
           "arrivals: fcfs + recompute against itself at 2048, the default flags against fcfs + recompute at 2048 "
           "and at the same budget. Each cell: mean normalized latency / P99 TTFT (higher is better) / P99 TPOT "
           "(lower is better), medians of the seeds' ratios. Per-run figures: "
           "`benchmarks/results/token_budget.json`.", ""]
    out += provenance("token_budget", d, "simulated: roofline cost model of each preset's model and GPU")
    three = " / ".join
    rows = [[r["preset"], d["presets"][r["preset"]]["knee_tokens"], r["budget"],
             *(three(ratio(x) for x in r[k]) for k in ("fcfs_vs_fcfs_base", "default_vs_fcfs_base",
                                                       "default_vs_fcfs_same"))]
            for r in d["summary"]]
    out += table(["preset", "knee (tokens)", "budget", "fcfs + recompute vs itself at 2048",
                  "default vs fcfs + recompute at 2048", "default vs fcfs + recompute, same budget"], rows, "lrrlll")
    return out + [" ".join(FINDINGS.split()), ""], []


def ttft_tail(_: str) -> tuple[list[str], list[str]]:
    d = load("ttft_tail")
    from ttft_tail import FINDINGS, medians

    out = ["Skip-join's P99 TTFT where memory does not bind, over many seeds, against fcfs + recompute "
           "(higher is better): FastServe's skip-join alone, and with the first-token guard that bounds each "
           "prompt's first token by first-come-first-served's (`--mlfq-first-token-slack`, 0 by default). "
           "Per-seed figures: `benchmarks/results/ttft_tail.md`.", ""]
    out += provenance("ttft_tail", d, "simulated: roofline cost model")
    rows = [[preset, variant, *(ratio(statistics.median(c)) for c in cols),
             f"{sum(v >= 1.0 for v in cols[1])} of {len(cols[1])}"] for preset, variant, cols in medians(d["rows"])]
    out += table(["preset", "variant", "mean TTFT", "P99 TTFT", "mean norm", "P99 TPOT (this / fcfs)",
                  "seeds with P99 TTFT no worse"], rows, "llrrrrr")
    return out + [" ".join(FINDINGS.split()), ""], []


def prefix_cache_sim(_: str) -> tuple[list[str], list[str]]:
    d = load("prefix_cache_sim")
    m = d["meta"]
    out = [f"Prefix caching across both tiers: {m['groups']} tenants' {m['prefix_tokens']}-token system prompts "
           f"(Zipf popularity) before ShareGPT prompts, {m['pool']:g} of the device KV pool, skip-join MLFQ with "
           "proactive swapping.", ""]
    out += provenance("prefix_cache_sim", d)
    base = {r["load"]: r["mean_ttft_s"] for r in d["rows"] if r["variant"] == "cache off"}
    out += table(["load", "variant", "mean TTFT (s)", "P99 TTFT (s)", "req/s", "device hits", "host hits",
                  "mean TTFT vs cache off"],
                 [[f"{r['load']:g}", r["variant"], r["mean_ttft_s"], r["p99_ttft_s"], r["throughput_rps"],
                   pct(r.get("device_hit_rate")), pct(r.get("host_hit_rate")),
                   ratio(base[r["load"]] / r["mean_ttft_s"])]
                  for r in d["rows"]], "ll" + "r" * 6)
    return out, []


# -- co-serving ----------------------------------------------------------------------------


def coserving(_: str) -> tuple[list[str], list[str]]:
    seeds = [("coserving", load("coserving"))] + [(f"coserving-seed{s}", load(f"coserving-seed{s}")) for s in (1, 2, 3)]
    seeds = [(stem, d) for stem, d in seeds if d]
    out = ["ConServe's designs on the same jobs, one added at a time: a standing offline backlog beside online "
           "requests (Gamma arrivals, CV 4, at half the saturated rate) on Llama-3-8B / one H100 (roofline, "
           "simulated). Each cell: online P99 TTFT and P99 TPOT as multiples of online-only, and the offline "
           "tokens computed in the online window as a share of the idle capacity (1 - load) the backlog alone "
           "would fill. One column per online trace (seed).", ""]
    for stem, d in seeds:
        out += provenance(stem, d, SIM_DEFAULT)
    designs = [r["design"] for r in seeds[0][1]["rows"]]
    rows = []
    for design in designs:
        cells = []
        for _, d in seeds:
            ref = d["rows"][0]
            r = next(r for r in d["rows"] if r["design"] == design)
            parts = []
            if "p99_ttft_s" in r:
                parts.append(f"{r['p99_ttft_s'] / ref['p99_ttft_s']:.2f}x / {r['p99_tpot_s'] / ref['p99_tpot_s']:.2f}x")
            if "offline_share_of_idle" in r:
                parts.append(pct(r["offline_share_of_idle"]))
            cells.append(", ".join(parts))
        rows.append([design, *cells])
    out += table(["design", *(f"seed {d.get('seed', 0)}" for _, d in seeds)], rows, "l" + "r" * len(seeds))
    return out, [coserving_plot(seeds)]


def coserving_real(_: str) -> tuple[list[str], list[str]]:
    out = ["The real engine on a CPU (preset `cpu-deep`: 16 layers, hidden 256, random weights, fp32), driven "
           "through AsyncEngine as the server drives it: 96 offline prompts of 1024 tokens from t = 0, 20 online "
           "requests arriving as a Poisson process (mean gap 1.5 s). The budget's SLOs are 1.1x the online-only "
           "run's P99s. Ratios are medians over rounds, each paired with its own round's online-only run; "
           "`share of idle` is the offline throughput in the online window over what the offline-only run "
           "makes in the idle capacity.", ""]
    for stem, what in (("coserving_real", "The full design, safepoints every half layer"),
                       ("coserving_real-safepoints", "Safepoints every layer against every half layer"),
                       ("coserving_real-designs", "Every design, safepoints every layer"),
                       ("coserving_real-loans", "The full design with KV loans on (the default) and off")):
        d = load(stem)
        if not d:
            continue
        threads = d["args"].get("real_threads")
        out += [f"**{what}** ({len(d.get('rounds') or [1])} rounds):", ""]
        out += provenance(stem, d, md_hardware(stem) or (f"CPU, torch on {threads} thread" if threads else None))
        rows = []
        for r in d["rows"]:
            online = "p99_ttft_s" in r
            rows.append([r["design"],
                         num(r["p99_ttft_s"] * 1e3) if online else "", ratio(r.get("ttft_ratio")) if online else "",
                         num(r["p99_tpot_s"] * 1e3) if online else "", ratio(r.get("tpot_ratio")) if online else "",
                         num(r["offline_tokens_per_s"]) if r.get("offline_tokens_per_s") else "",
                         pct(r.get("offline_share_of_idle")),
                         num(r.get("steps_abandoned", 0)), num(r.get("steps_resumed", 0)),
                         num(r.get("abandoned_tokens", 0))])
        out += table(["design", "P99 TTFT (ms)", "vs online only", "P99 TPOT (ms)", "vs online only",
                      "offline tok/s", "share of idle", "steps interrupted", "resumed", "tokens recomputed"], rows)
    return out, []


def coserving_plot(seeds: list[tuple[str, dict]]) -> str:
    """Online tail against offline share, one point per design and run. The
    one-queue design (and, on the real engine, priority alone) sits tens to
    hundreds of times above the rest, so the y axis is logarithmic."""
    fig, (sim, real) = plt.subplots(1, 2, figsize=(12, 5.6))
    for (stem, d), marker in zip(seeds, "osD^"):
        ref = d["rows"][0]
        for r in d["rows"]:
            if "p99_ttft_s" in r and "offline_share_of_idle" in r:
                sim.scatter(100 * r["offline_share_of_idle"], r["p99_ttft_s"] / ref["p99_ttft_s"], marker=marker,
                            color=COLORS.get(r["design"]), s=45,
                            label=r["design"] if stem == seeds[0][0] else None)
    sim.set_title("simulated: Llama-3-8B / H100; marker = online trace (4 seeds)", fontsize=9)
    runs = (("coserving_real-designs", "o", "every design"), ("coserving_real-safepoints", "s", "safepoint A/B"),
            ("coserving_real", "D", "full design"))
    for stem, marker, what in runs:
        d = load(stem)
        if not d:
            continue
        for r in d["rows"]:
            if "ttft_ratio" in r and "offline_share_of_idle" in r:
                design, _, every = r["design"].partition(", safepoints every ")
                label = design.split(" (")[0] + (f", safepoints every {every.split()[0]} layer" if every else "")
                real.scatter(100 * r["offline_share_of_idle"], r["ttft_ratio"], marker=marker, s=45,
                             color=COLORS.get(design), alpha=0.6 if every.startswith("1 ") else 1.0,
                             label=f"{label} [{what}, {len(d.get('rounds') or [1])} rounds]")
    real.set_title("real engine on a CPU (cpu-deep), medians over rounds", fontsize=9)
    for ax in (sim, real):
        ax.set_xlabel("offline throughput, % of the idle capacity")
        ax.set_ylabel("online P99 TTFT / online only")
        ax.set_yscale("log")
        plain_log(ax)
        ax.axhline(1.1, color="k", lw=0.8, ls="--")
        ax.axvline(90, color="k", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.suptitle("Co-serving: online tail vs offline share (dashed: 1.1x TTFT; dotted: 90% of idle)", fontsize=11)
    return save_plot(fig, "coserving.png")


# -- against other servers -----------------------------------------------------------------


def vs_online(_: str) -> tuple[list[str], list[str]]:
    from vs_vllm import RANDOM_MODEL

    files = [(s, load(s)) for s in ONLINE_STEMS]
    files = [(s, d) for s, d in files if d]
    out = ["Streamed chat requests (Poisson arrivals) against each server in turn, same model and weights "
           "(unless named, a random-weight Llama of 4 layers, hidden 512, GQA, vocab 32k), fp32, every server "
           "warmed first. `sustained` is the highest offered rate whose P99 TTFT stayed within the bound "
           "(with every lower rate).", ""]
    for stem, d in files:
        load_ = d.get("load", {})
        model = d.get("model", RANDOM_MODEL)  # older records name none: the random model
        real = f" on {Path(model).name} (greedy to its end of turn)" if model != RANDOM_MODEL else ""
        out += [f"**{', '.join(sorted(d['servers']))}**{real}, {load_.get('num_requests', '?')} requests per rate:",
                ""]
        out += provenance(stem, d)
        rows = [[num(p["rate"]), p["system"], p["request_throughput"], p["ttft_ms"]["p99"], p["tpot_ms"]["p99"],
                 p.get("goodput_req_s"), p.get("failed", 0)]
                for p in sorted(d["points"], key=lambda p: (p["rate"], p["system"]))]
        out += table(["offered req/s", "server", "served req/s", "P99 TTFT (ms)", "P99 TPOT (ms)",
                      "goodput req/s", "failed"], rows, "rl" + "r" * 5)
        if d.get("sustained"):
            systems = sorted(d["servers"])
            out += table(["P99 TTFT bound (ms)", *(f"{s} sustained req/s" for s in systems)],
                         [[num(float(b)), *(num(v[s]) if v.get(s) is not None else "none" for s in systems)]
                          for b, v in d["sustained"].items()])
    fig, axes = plt.subplots(len(files), 2, figsize=(11, 3.8 * len(files)), squeeze=False)
    for (stem, d), (served, ttft) in zip(files, axes):
        for system in sorted(d["servers"]):
            pts = sorted((p["rate"], p["request_throughput"], p["ttft_ms"]["p99"])
                         for p in d["points"] if p["system"] == system)
            rates, got, tail = zip(*pts)
            served.plot(rates, got, marker="o", label=system, color=COLORS.get(system))
            ttft.plot(rates, tail, marker="o", label=system, color=COLORS.get(system))
        top = max(p["rate"] for p in d["points"])
        served.plot([0, top], [0, top], color="k", lw=0.6, ls=":", label="offered")
        served.set_ylabel("served req/s")
        ttft.set_ylabel("P99 TTFT (ms)")
        ttft.set_yscale("log")
        plain_log(ttft)
        for ax in (served, ttft):
            ax.set_xlabel("offered req/s")
            ax.set_title(stem, fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    hw = hardware(files[0][1]) if files else ""
    fig.suptitle(f"Online serving against peers ({hw})", fontsize=11)
    return out, [save_plot(fig, "vs_peers_online.png")]


def real_model(stem: str) -> tuple[list[str], list[str]]:
    d = load(stem)
    out = ["A real model (SmolLM2-135M-Instruct: BPE tokenizer, chat template, end-of-turn token) through "
           "`fluidserve serve`: greedy chat replies, whole and streamed, against transformers' `generate` "
           f"on the same chat template. {d['matched']} of {len(d['rows'])} equal.", ""]
    out += provenance(stem, d, "CPU")
    out += table(["prompt", "same text", "stream same", "finish", "tokens (ours / transformers)"],
                 [[r["prompt"], "yes" if r["same"] else "no", "yes" if r["stream_same"] else "no", r["finish_reason"],
                   f"{r['completion_tokens']} / {r['expected_tokens']}"] for r in d["rows"]])
    if d.get("preemption"):  # runs recorded before the preemption pass have none
        out += ["The same prompts at once, on device KV for one sequence, each reply against transformers':", ""]
        out += table(["preemption", "flags", "replies equal", "preemptions", "KV blocks in use after"],
                     [[mode, f"`{' '.join(run['flags'])}`", f"{run['matched']} of {run['requests']}",
                       run["preemptions"], run["blocks_in_use_after"]] for mode, run in d["preemption"].items()])
    return out, []


OFFLINE_STEMS = ("vs_vllm-offline-cpu", "vs_vllm-prefix-cpu", "vs_vllm-offline-cpu-smollm2-small-batches",
                 "vs_vllm-offline-cpu-smollm2-small-batches-one-thread")


def vs_offline(_: str) -> tuple[list[str], list[str]]:
    from vs_vllm import RANDOM_MODEL

    out = ["Offline generation, each system with its defaults, same model and weights (unless named, 4 layers, "
           "hidden 512, GQA, vocab 32k), greedy, `ignore_eos`; output tokens per second (best of repeats) and per "
           "CPU-second (the process tree's user + system time). The prefix rows put a 1024-token shared system prompt "
           "before every request, prefix caching on in both.", ""]
    plots = []
    for stem, d in loaded(*OFFLINE_STEMS):
        what = "prefix caching on in both" if "prefix" in stem else "no prefix sharing"
        if d.get("model", RANDOM_MODEL) != RANDOM_MODEL:
            threads = d.get("threads", {}).get("fluidserve")
            what = (f"a real model ({Path(d['model']).name}, its own weights in both), small batches, fluidserve on "
                    f"{threads} torch thread{'s' if threads != 1 else ''}")
        out += [f"**Against vLLM {d.get('vllm_version', '')}'s CPU build**, {what}:", ""] + provenance(stem, d)
        if d.get("note"):
            out += [d["note"], ""]
        rows = [[p["dtype"], f"{p['requests']} x {p['output_len']}", p["best_tokens_per_s"]["vllm"],
                 p["best_tokens_per_s"]["fluidserve"], f"**{p['ratio_of_best']['fluidserve']:.2f}**",
                 f"{p['cpu_ratio_of_best']['fluidserve']:.2f}"] for p in d["points"]]
        out += table(["dtype", "requests x output tokens", "vLLM tok/s", "fluidserve tok/s", "fluidserve / vLLM",
                      "per CPU-second"], rows, "ll" + "r" * 4)
    thr = load("throughput-cpu-cpu-small")
    if thr:
        out += [f"**Against Hugging Face transformers** (`generate` on a padded batch, `generate_batch` with its "
                f"continuous batching), {thr['num_prompts']} prompts of ShareGPT lengths x"
                f"{thr['prompt_lengths']['scale']:g}, {thr['output_len']} output tokens each, "
                f"preset {thr['preset']}, {thr['dtype']}:", ""]
        out += provenance("throughput-cpu-cpu-small", thr)
        out += table(["system", "output tok/s", "req/s", "fluidserve speed-up"],
                     [[k, v["tokens_per_s"], v["requests_per_s"], ratio(thr["speedup"].get(k, 1.0))]
                      for k, v in thr["results"].items()])
    off = load("vs_vllm-offline-cpu")
    if off or thr:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
        if off:
            short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
            labels = [f"{short.get(p['dtype'], p['dtype'])}\n{p['requests']}x{p['output_len']}" for p in off["points"]]
            xs = range(len(labels))
            for i, system in enumerate(("vllm", "fluidserve")):
                axes[0].bar([x + (i - 0.5) * 0.38 for x in xs], [p["best_tokens_per_s"][system] for p in off["points"]],
                            width=0.38, label=system, color=COLORS[system])
            axes[0].set_xticks(list(xs), labels, fontsize=8)
            axes[0].set_ylabel("output tok/s")
            axes[0].set_title(f"vs vLLM's CPU build ({hardware(off)})", fontsize=9)
            axes[0].legend(fontsize=8)
        if thr:
            names = list(thr["results"])
            axes[1].bar(range(len(names)), [thr["results"][n]["tokens_per_s"] for n in names],
                        color=[COLORS["fluidserve"] if n == "fluidserve" else COLORS["transformers"] for n in names])
            axes[1].set_xticks(range(len(names)), [n.replace("hf_", "").replace("_", "\n") for n in names], fontsize=8)
            axes[1].set_ylabel("output tok/s")
            axes[1].set_title(f"vs transformers ({thr['preset']})", fontsize=9)
        for ax in axes:
            ax.grid(alpha=0.3, axis="y")
        fig.suptitle("Offline throughput against peers", fontsize=11)
        plots.append(save_plot(fig, "vs_peers_offline.png"))
    return out, plots


LONG_PROMPT_STEMS = ["long_prompt", "long_prompt-one-openmp-team"]


def long_prompt(_: str) -> tuple[list[str], list[str]]:
    out = []
    for stem in LONG_PROMPT_STEMS:
        d = load(stem)
        if not d:
            continue
        note = d.get("note", "")
        out += [f"Time to first token of a lone {d['prompt_len']}-token prompt, median of {d['repeats']}: through "
                "`fluidserve serve` (streamed, `max_tokens=1`), through `LLM.generate`, and one transformers "
                "forward over the same prompt." + (f" {note[:1].upper()}{note[1:]}." if note else ""), ""]
        out += provenance(stem, d)
        ref = d["median_s"]["transformers forward"]
        out += table(["path", "median (s)", "vs transformers forward"],
                     [[k, v, ratio(v / ref)] for k, v in d["median_s"].items()])
    return out, []


def omp_teams(stem: str) -> tuple[list[str], list[str]]:
    d = load(stem)
    whats = list(d["rows"][0]["median_ms"]["alone"])
    out = [f"CPU steps of {d['model']} (fp32, stepped on a second thread as `fluidserve serve` does), by where "
           "the engine was built, how long idle OpenMP threads spin, and whether `--yield-busy-cores` moves the "
           f"thread count: decode ms per step over {d['tokens']} tokens, the prefill of one "
           f"{d['prompt_tokens']}-token prompt in ms, medians of {d['repeats']} runs, each configuration in a "
           "fresh process; each cell alone / beside one process spinning on a core.", ""]
    out += provenance(stem, d)
    out += table(["configuration", "built on", *whats],
                 [[r["config"], f"{r['built_on']} thread",
                   *(f"{r['median_ms']['alone'][w]:.1f} / {r['median_ms']['beside a busy process'][w]:.1f}"
                     for w in whats)] for r in d["rows"]], "ll" + "r" * len(whats))
    return out, []


def replica_team(stem: str) -> tuple[list[str], list[str]]:
    d = load(stem)
    ms = d["ms_per_token"]
    floor = statistics.median(next(iter(ms.values())))
    out = [f"One data-parallel replica (a Ray actor) decoding one request of {d['model']} (fp32) on "
           f"{d['threads']} torch threads, {d['tokens']} greedy tokens, by the thread its engine was built on; "
           "the same engine in-process on an `EngineThread` is the floor. ms per token, each round a fresh "
           "process.", ""] + provenance(stem, d)
    out += table(["system", "ms/token, each round", "vs in-process"],
                 [[name, " / ".join(f"{x:.1f}" for x in got), ratio(statistics.median(got) / floor)]
                  for name, got in ms.items()], "lrr")
    return out, []


def busy_neighbour(stem: str) -> tuple[list[str], list[str]]:
    d = load(stem)
    duty = d.get("duty_ms")
    kind = ("spinning on a core" if not duty else
            f"computing {num(duty[0])} ms and sleeping {num(duty[1])} ms in turn")
    trials = all("thread_trials" in p for p in d["points"])
    out = [f"`fluidserve serve` on {d['model']} (fp32) with `--yield-busy-cores` (the default) and with "
           f"`--no-yield-busy-cores`, both alive in one run, {d['num_requests']} streamed chats at "
           f"{num(d['rate'])} req/s each, alone and beside {d['neighbours']} process(es) {kind}; "
           "thread changes: `fluidserve_cpu_thread_changes_total` over the load"
           + (" (trials: `fluidserve_cpu_thread_trials_total`)." if trials else "."), ""]
    out += provenance(stem, d)
    out += table(["server", "busy beside", "round", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "out tok/s",
                  "thread changes" + (" (trials)" if trials else "")],
                 [[p["server"], p["neighbours"], p.get("round", 0) + 1,
                   f"{p['ttft_ms']['p50']:.0f} / {p['ttft_ms']['p99']:.0f}",
                   f"{p['tpot_ms']['p50']:.1f} / {p['tpot_ms']['p99']:.1f}", p["output_token_throughput"],
                   num(p["thread_changes"]) + (f" ({num(p['thread_trials'])})" if trials else "")]
                  for p in d["points"]], "lrrrrrr")
    return out, []


def core_waits(stem: str) -> tuple[list[str], list[str]]:
    d = load(stem)
    med = statistics.median
    n = d["ceiling"]
    out = [f"What `--yield-busy-cores` reads: the cores' worth of this process's threads runnable but not running "
           f"(`/proc/self/task/*/schedstat`), and what each thread count costs. {d['model']} (fp32), decode at "
           f"batch {d.get('batch', 1)} stepped on a second thread with idle threads spinning 10,000 rounds, "
           "beside each neighbour (medians).", ""] + provenance(stem, d)
    out += table(["neighbour", f"ms/token, {n} threads", f"waiting, {n} threads", "ms/token, 1 thread",
                  f"neighbour's load (cores), beside {n} / 1"],
                 [[r["neighbour"], f"{med(r[f'decode_ms_{n}']):.1f}", f"{med(r[f'waiting_{n}']):.2f}",
                   f"{med(r['decode_ms_1']):.1f}",
                   f"{med(r[f'others_busy_{n}']):.2f} / {med(r['others_busy_1']):.2f}"] for r in d["fixed"]],
                 "lrrrr")
    out += ["", "The switch, each setting in a fresh process (decode ms/token and the prefill's ms, on / off):", ""]
    trials = all("thread_trials" in on for on in d["switch"]["on"])
    out += table(["neighbour", "decode, on / off", "prefill, on / off", "threads after (on)"]
                 + (["thread changes (trials), on"] if trials else []),
                 [[on["neighbour"], f"{med(on['decode_ms']):.1f} / {med(off['decode_ms']):.1f}",
                   f"{med(on['prefill_ms']):.0f} / {med(off['prefill_ms']):.0f}", on["threads_after"]]
                  + ([f"{on['thread_changes']} ({on['thread_trials']})"] if trials else [])
                  for on, off in zip(d["switch"]["on"], d["switch"]["off"])], "lrrrr" if trials else "lrrr")
    if d.get("server"):
        out += ["", "`fluidserve serve --no-yield-busy-cores` with the load generator streaming chats from the "
                "same cores: its threads' waiting per 0.2 s window.", ""]
        out += table(["client rate", "waiting, mean", "median", "largest window", "median TPOT (ms)"],
                     [[f"{num(r['rate'])} req/s", f"{statistics.mean(r['windows']):.2f}",
                       f"{med(r['windows']):.2f}", f"{max(r['windows']):.2f}", f"{r['tpot_ms_p50']:.1f}"]
                      for r in d["server"]], "rrrrr")
    return out, []


# -- engine costs on the CPU ---------------------------------------------------------------


def step_overhead(stem: str) -> tuple[list[str], list[str]]:
    d = load(stem)
    parts = ["schedule", "build_input", "process_outputs", "update", "bookkeeping", "execute"]
    out = [f"Engine bookkeeping per decode step (tiny model, {d['prompt_len']}-token prompts, {d['output_len']} "
           "output tokens), ms per step: the scheduler, the input build, output processing and the scheduler's "
           "update in the engine thread's CPU time, `execute` (the forward) in wall time. `generate`: "
           "final-only outputs (`LLM.generate`); `streamed`: every step's outputs read, as the server reads them.",
           ""] + provenance(stem, d)
    out += table(["requests", "mode", *parts],
                 [[r["concurrency"], r["mode"], *(f"{r[p]:.2f}" for p in parts)] for r in d["rows_ms"]],
                 "rl" + "r" * len(parts))
    return out, []


def sched_step_cost(_: str) -> tuple[list[str], list[str]]:
    out = ["Scheduler CPU time per step with requests decoding behind a shared 512-token prefix, the tree "
           "the run measured against an older commit, each in its own process, interleaved (median of 5 "
           "processes, each the median of 200 steps); with requests queued behind them, a host tier and a "
           "device pool that holds about the decoding ones: each step tries to admit every queued request.", ""]
    for stem, d in loaded("sched_step_cost", "sched_step_cost-1024", "sched_step_cost-64-queued-2000"):
        names = re.search(r"--names (\S+) (\S+)", d.get("command", ""))
        label = {".": "the run's tree"}
        if names:
            label.update({p: n for p, n in zip([k for k in d["rows"] if k != "."], names.groups()[1:])})
        out += provenance(stem, d)
        queued = f" + {d['queued']} queued" if d.get("queued") else ""
        out += table([f"{d['active']} requests{queued}", "cache off (ms)", "cache on (ms)"],
                     [[label.get(k, k), v["cache_off_ms"], v["cache_on_ms"]] for k, v in d["rows"].items()])
    return out, []


def gc_pauses(stem: str) -> tuple[list[str], list[str]]:
    d = load(stem)
    out = [f"{d['requests']} streamed requests on the tiny model, three ways alternating: Python's collector "
           "as is, the heap frozen with the default young threshold, and frozen as the engine runs.", ""]
    out += provenance(stem, d)
    out += table(["heap", "wall ms per step", "slowest step (ms)", "full collections", "their ms",
                  "young collections", "their ms"],
                 [[r["way"], r["wall_ms_per_step"], r["slowest_step_ms"], r["collections"][2],
                   r["collection_ms"][2], r["collections"][0] + r["collections"][1],
                   r["collection_ms"][0] + r["collection_ms"][1]] for r in d["rows"]])
    return out, []


def cpu_kernels(_: str) -> tuple[list[str], list[str]]:
    out = []
    d = load("cpu_decode_groups")
    if d:
        out += ["**Decode attention, a bucket's rows a few at a time** (at most "
                f"{d['group_elements']:,} K elements gathered per call) against one gather and one call per "
                "bucket, one thread, best of runs:", ""] + provenance("cpu_decode_groups", d)
        out += table(["rows", "context", "KV heads x group x head dim", "dtype", "one call (ms)", "grouped (ms)",
                      "speed-up"],
                     [[r["rows"], r["context"], f"{r['kv_heads']} x {r['group']} x {r['head_dim']}", r["dtype"],
                       r["best_ms"]["one call"], r["best_ms"]["grouped"], ratio(r["speedup"])] for r in d["kernel"]],
                     "rrll" + "r" * 3)
        e = d["engine"]["median_step_ms"]
        out += [f"Engine (`cpu-deep`, 12 requests decoding at about 1k tokens of context): median decode step "
                f"{num(e['one call'])} ms one call, {num(e['grouped'])} ms grouped "
                f"({ratio(d['engine']['speedup'])}).", ""]
    d = load("cpu_chunked_prefill")
    if d:
        out += ["**A prompt chunk over a cached prefix**: the prefix and the chunk's own keys in two unmasked "
                "flash calls merged by log-sum-exp, against one call with a [chunk, context] mask:", ""]
        out += provenance("cpu_chunked_prefill", d)
        out += table(["chunk", "prefix", "dtype", "one masked call (ms)", "two calls (ms)", "speed-up",
                      "max abs diff"],
                     [[r["chunk"], r["prefix"], r["dtype"], r["best_ms"]["one masked call"], r["best_ms"]["two calls"],
                       ratio(r["speedup"]), f"{r['max_abs_diff']:.1e}"] for r in d["kernel"]], "rrl" + "r" * 4)
    d = load("cpu_short_rows")
    if d:
        out += [f"**Short rows bucketed like decodes** (up to {d['max_folded_queries']} queries a row: a verifying "
                "step's token and drafts), against one chunk's calls per row, one thread, best of runs; the same "
                "rows as single-token decodes beside them:", ""] + provenance("cpu_short_rows", d)
        out += table(["rows", "context", "queries a row", "KV heads x group x head dim", "dtype", "chunks (ms)",
                      "bucketed (ms)", "speed-up", "as decodes (ms)", "bucketed / decodes"],
                     [[r["rows"], r["context"], r["queries"], f"{r['kv_heads']} x {r['group']} x {r['head_dim']}",
                       r["dtype"], r["best_ms"]["chunks"], r["best_ms"]["folded"], ratio(r["speedup"]),
                       r["best_ms"]["decodes"], ratio(r["over_decodes"])] for r in d["kernel"]], "rrrll" + "r" * 5)
        e = d["engine"]["median_step_ms"]
        out += [f"Engine (`cpu-deep`, 12 requests at about 300 tokens of context, each verifying 4 drafts a step): "
                f"median step {num(e['chunks'])} ms as chunks, {num(e['folded'])} ms bucketed "
                f"({ratio(d['engine']['speedup'])}).", ""]
    d = load("shared_prefix_decode")
    if d:
        out += ["**Shared-prefix decode buckets**: a prefix family gets its own bucket only where the copies it "
                "saves outweigh a bucket's fixed cost (the rule), against every family apart and none apart "
                "(plan + 4 layers, 256 rows):", ""] + provenance("shared_prefix_decode", d)
        out += table(["rows sharing", "shared blocks", "every family apart (ms)", "none apart (ms)", "rule (ms)"],
                     [[r["family"], r["shared_blocks"], r["every family apart"]["ms"], r["none apart"]["ms"],
                       r["rule"]["ms"]] for r in d["kernel"]])
        e = d["engine"]
        out += [f"`LLM.generate`, {e['requests']} requests, each {e['prompt_len']}-token prompt sent by "
                f"{e['family']}: median decode step "
                + ", ".join(f"{k} {num(v['decode_step_ms'])} ms" for k, v in e.items() if isinstance(v, dict))
                + ".", ""]
    d = load("cpu_linear")
    if d:
        ways = list(d["rows"][0]["ms"])
        out += ["**Linear layers of one decoder layer** (hidden 512, GQA, MLP 1536), ms per layer, "
                f"{d['threads']} thread:", ""] + provenance("cpu_linear", d)
        out += table(["dtype", "tokens", *ways],
                     [[r["dtype"], r["tokens"], *(r["ms"].get(w) for w in ways)] for r in d["rows"]],
                     "lr" + "r" * len(ways))
        out += table(["end to end", "packed tok per CPU-s", "F.linear tok per CPU-s", "packed / F.linear"],
                     [[e["dtype"], e["median"]["packed"], e["median"]["F.linear"], ratio(e["packed_over_f_linear"])]
                      for e in d["engine"]])
    return out, []


def grammar(_: str) -> tuple[list[str], list[str]]:
    out = []
    d = load("grammar_mask")
    if d:
        m = d["meta"]
        out += [f"**Mask cost, xgrammar against llguidance**: {m['concurrency']} concurrent JSON-schema requests, "
                f"{m['steps']} decode steps, one next-token bitmask per request per step (1t / 2t: threads).",
                ""] + provenance("grammar_mask", d)
        out += table(["library", "vocab", "fill ms/step (median)", "p90", "new matcher (µs)",
                      "compile ms (per schema)"],
                     [[r["backend"], r["vocab_size"], r["fill_ms_per_step_median"], r["fill_ms_per_step_p90"],
                       r["new_matcher_us"], ", ".join(num(v) for v in r["compile_ms"].values())]
                      for r in d["results"]], "lrrrrl")
    for stem, d in loaded("structured_overhead-cpu", "structured_overhead-cpu-small"):
        m = d["meta"]
        out += [f"**JSON mode against unconstrained decoding**, {m['model']}, {m['concurrency']} concurrent "
                f"requests of {m['tokens_per_request']} tokens, {m['rounds']} alternating rounds:", ""]
        out += provenance(stem, d)
        out += table(["JSON / unconstrained, tok per CPU-s", "paired rounds' median", "per wall second",
                      "grammar share of decode time"],
                     [[f"{d['json_over_unconstrained_cpu']:.3f}", f"{d['json_over_unconstrained_cpu_paired']:.3f}",
                       f"{d['json_over_unconstrained_wall']:.3f}", f"{d['grammar_share_of_json_decode_wall']:.1%}"]],
                     "rrrr")
    d = load("grammar_mask_apply-cpu")
    if d:
        out += [f"**Masks onto a step's logits** (vocabulary {d['vocab']}), by where the constrained rows sit "
                "among the step's sampling rows: `TokenMask.apply` (a view of consecutive rows; for rows apart, "
                "each mask row moved to its logits row's place) beside gathering the constrained logits rows, "
                f"masking them and writing them back; median of {d['rounds']} alternating rounds.", ""]
        out += provenance("grammar_mask_apply-cpu", d)
        out += table(["sampling rows", "constrained", "placed", "apply µs", "gathered µs", "gathered / apply"],
                     [[r["rows"], r["constrained"], "consecutive" if r["consecutive"] else "apart", r["engine_us"],
                       r["gathered_us"], ratio(r["gathered_over_engine"])] for r in d["results"]], "rrlrrr")
    d = load("prompt_logprobs-cpu")
    if d:
        out += [f"**prompt_logprobs**: {d['num_prompts']} prompts of {d['prompt_len']} tokens, 1 output token, "
                f"preset {d['preset']}, {d['dtype']}; the LM head alone over the same positions takes "
                f"{num(d['lm_head_only_s'])} s.", ""] + provenance("prompt_logprobs-cpu", d)
        out += table(["variant", "time (s)", "prompt tok/s", "time vs none"],
                     [[r["variant"], r["median_s"], r["prompt_tok_per_s"], ratio(r["time_vs_none"])]
                      for r in d["rows"]])
    return out, []


def kv_real(_: str) -> tuple[list[str], list[str]]:
    out = []
    d = load("prefix_cache")
    if d:
        s, t = d["summary"], d["rows"].get("tenants", {})
        out += [f"**Prefix caching on the real engine** (preset {d['meta']['preset']}), cache off then on in one "
                "process:", ""] + provenance("prefix_cache", d)
        rows = [["shared system prompt", s["shared_mean_ttft_off_s"] * 1e3, s["shared_mean_ttft_on_s"] * 1e3,
                 ratio(s["shared_mean_ttft_off_s"] / s["shared_mean_ttft_on_s"])],
                ["multi-turn chat resending its history", s["multi_turn_mean_ttft_off_s"] * 1e3,
                 s["multi_turn_mean_ttft_on_s"] * 1e3,
                 ratio(s["multi_turn_mean_ttft_off_s"] / s["multi_turn_mean_ttft_on_s"])]]
        if "device only" in t and "device + host" in t:
            a, b = t["device only"]["mean_ttft_s"], t["device + host"]["mean_ttft_s"]
            rows.append([f"tenants cycling through a {t['device only']['num_kv_blocks']}-block device pool "
                         "(device only → with the host tier)", a * 1e3, b * 1e3, ratio(a / b)])
        out += table(["workload", "mean TTFT before (ms)", "mean TTFT after (ms)", "speed-up"], rows)
    from swap_serving import split_table, ttft_by_prompt

    kept = "seeds 0-6, every request's figures kept"
    more = "the same load on " + kept
    at_load = "ShareGPT lengths x0.2 at 0.9 of what fcfs + recompute serves, measured first; " + kept
    for name, what in (("swap_serving", "ShareGPT lengths x0.2 near capacity"),
                       ("swap_serving-default-seeds-0-6", more),
                       ("swap_serving-load-0.9-seeds-0-6", at_load),
                       ("swap_serving-load-0.9-baseline-again", at_load + "; fcfs + recompute run twice per seed, "
                        "the second run's ratios to the first are what a figure moves between two runs of one "
                        "server"),
                       ("swap_serving_chat", "closed-loop conversations resending their history"),
                       ("swap_serving_chat-default-seeds-0-6", more)):
        d = load(name)
        if d and "summary" in d:
            seeds = sorted({r["seed"] for r in d["rows"]})
            out += [f"**Two KV tiers on the real engine** (CPU server, 64 device blocks, {what}; seeds "
                    f"{', '.join(map(str, seeds))}, medians of the ratios paired by seed):", ""] + provenance(name, d)
            heads = ["variant", "mean norm (fcfs / this)", "P99 TTFT (fcfs / this)", "P99 TPOT (this / fcfs)"]
            keys = ["mean_norm", "p99_ttft", "p99_tpot"]
            if all("pooled_requests" in s for s in d["summary"]):  # every seed's requests together
                heads += ["pooled: mean norm", "pooled: P99 TTFT", "pooled: P99 TPOT", "requests"]
                keys += ["pooled_mean_norm", "pooled_p99_ttft", "pooled_p99_tpot"]
            out += table(heads, [[s["variant"], *(ratio(s[k]) for k in keys),
                                  *([s["pooled_requests"]] if "pooled_requests" in s else [])]
                                 for s in d["summary"]])
            both = [s for s in d["summary"] if "pooled_both_requests" in s]
            if both:
                out += ["Against both fcfs + recompute runs' requests pooled:", ""]
                out += table(["variant", "mean norm", "P99 TTFT", "P99 TPOT"],
                             [[s["variant"], *(ratio(s[f"pooled_both_{k}"]) for k in ("mean_norm", "p99_ttft",
                                                                                     "p99_tpot"))] for s in both])
            split = ttft_by_prompt(d["rows"], d["meta"]["load_flags"])
            if split:
                out += [f"Where its TTFT goes, every seed's requests together: prompts cut to {split[0]['cap']} "
                        "tokens and the shorter rest:", ""]
                out += table(*split_table(split))
    d = load("preemption")
    if d:
        sr = d["single_rank"]
        out += [f"**What a layer safepoint costs** (preset {d['preset']}): one check on one rank "
                f"{num(sr['check_s'] * 1e9)} ns ({num(sr['in_forward_check_s'] * 1e9)} ns inside a forward); "
                f"one vote under tensor parallelism 2 (a gloo all-reduce of one int) {num(d['tp2_vote_s'] * 1e3)} ms; "
                "a Ray step call with the interrupt's control thread "
                + ratio(d["ray_call_s"]["actor with a control thread"] / d["ray_call_s"]["plain actor"])
                + " of a plain actor's.", ""] + provenance("preemption", d)
        out += table(["step", "layers per safepoint", "layer (ms)", "checks / step, one rank", "votes / step, TP 2",
                      "longest wait (ms)"],
                     [[r["shape"], r["k"], r["layer_ms"], f"{r['check_share']:.4%}", f"{r['vote_share']:.2%}",
                       r["worst_wait_ms"]] for r in d["rows"]], "lrrrrr")
    return out, []


def frontend(_: str) -> tuple[list[str], list[str]]:
    out = []
    d = load("serve_overhead")
    if d:
        out += [f"**Frontend overhead**: {d['model']}, the server against the same engine called in-process "
                f"(engine on {d['torch_threads']} torch thread; the client shares the cores).", ""]
        out += provenance("serve_overhead", d)
        out += table(["load", "req/s", "output tok/s"],
                     [[k.replace("_", " "), v["req_per_s"], v["out_tok_per_s"]] for k, v in d["capacity"].items()])
        out += table(["concurrent requests", "ms per token, direct", "ms per token, via HTTP/SSE",
                      "added ms per token"],
                     [[c, d["direct"][c]["tpot_ms"], d["server"][c]["tpot_ms_mean"], d["added_ms_per_token"][c]]
                      for c in d["direct"]])
    for stem in sorted(p.stem for p in RESULTS.glob("serve_bench-*.json")):
        d = load(stem)
        a = d["args"]
        out += [f"**`fluidserve bench`** against the tiny model ({a['dataset']} lengths x{a['length_scale']:g}, "
                f"{a['arrival']} arrivals, CV {a['cv']:g}, {a['request_rate']:g} req/s, {a['num_requests']} "
                "requests):", ""] + provenance(stem, d)
        out += table(["served req/s", "output tok/s", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "SLO attainment"],
                     [[d["request_throughput"], d["output_token_throughput"],
                       f"{num(d['ttft_ms']['p50'])} / {num(d['ttft_ms']['p99'])}",
                       f"{num(d['tpot_ms']['p50'])} / {num(d['tpot_ms']['p99'])}", pct(d["slo_attainment"])]])
    for stem in sorted(p.stem for p in RESULTS.glob("ray_overhead-*.json")):
        d = load(stem)
        s = d["settings"]
        out += [f"**Ray executor against the local one**, preset {d['preset']} ({d['dtype']}), "
                f"{s['num_prompts']} prompts x {s['output_len']} tokens, {s['threads']} torch thread per worker:",
                ""] + provenance(stem, d)
        batches = sorted({b for v in d["vs_local"].values() for b in v["step_overhead_ms"]}, key=int)
        out += table(["executor", "throughput vs local", *(f"extra ms per decode step, batch {b}" for b in batches)],
                     [[k, ratio(v["tokens_per_s_ratio"]), *(v["step_overhead_ms"].get(b) for b in batches)]
                      for k, v in d["vs_local"].items()])
    return out, []


def launch_overhead(_: str) -> tuple[list[str], list[str]]:
    out = ["Host time of one Triton launch before its launcher: Triton's JIT path against a relaunch of the kernel "
           "it compiled for the same arguments (kernels/launch.py), side by side, with Triton's driver stood in "
           "for; the arguments are of each kernel's arity and kinds. The real launches on a GPU are in "
           "[On a GPU](#on-a-gpu) once timed.", ""]
    for stem, d in loaded("launch_overhead", "launch_overhead-triton3.6"):
        out += [f"**Triton {d['triton']}**", ""] + provenance(stem, d)
        out += table(["kernel", "JIT path us", "relaunch us", "JIT / relaunch"],
                     [[r["kernel"], r["jit_us"], r["relaunch_us"], ratio(r["jit_us"] / r["relaunch_us"])]
                      for r in d["rows"]], "lrrr")
        out += [f"A batch-1 eager decoder layer's six launches: {d['batch1_layer_jit_us']:.0f} us on the JIT path, "
                f"{d['batch1_layer_relaunch_us']:.0f} us relaunched; {d['llama3_8b_token_saving_ms']:.2f} ms less "
                "host time per Llama-3-8B token (32 layers).", ""]
    return out, []


def plan_host_time(stem: str) -> tuple[list[str], list[str]]:
    d = load(stem)
    if d is None:
        return [], []
    first, *rest = d["trees"]
    out = (["Host time of the attention planner and of a step's inputs per step (Llama-3-8B shapes on an "
           "H100/H200, 33 units per KV head): the tree the run measured against older commits, each in its own "
           "process, interleaved; thread CPU time, the median of the processes' medians, in brackets the "
           "lowest process's. Eager: `paged_attention.plan_for`; graph: `cuda_graphs.plan_decode`, before every "
           "decode graph replay; inputs: `ModelRunner.prepare` of an eager step on the Triton kernels' path "
           "(plan and block tables included); graph step: `Bucket.write` of a graph-replayed decode step.", ""]
           + provenance(stem, d))

    def cell(r: dict, n: str) -> str:
        low = r.get("lowest", {}).get(n)
        return f"{r[n]:.3f}" + (f" ({low:.3f})" if low is not None else "")

    def ratios(r: dict, n: str) -> str:
        low = r.get("lowest", {})
        return ratio(r[n] / r[first]) + (f" ({ratio(low[n] / low[first])})" if n in low else "")

    out += table(["step", *(f"{n} (ms)" for n in d["trees"]), *(f"{n} / {first}" for n in rest)],
                 [[r["shape"], *(cell(r, n) for n in d["trees"]), *(ratios(r, n) for n in rest)]
                  for r in d["rows"]])
    return out, []


def kernels_compile(stem: str) -> tuple[list[str], list[str]]:
    d = load(stem)
    out = [f"The Triton kernels compiled for sm_90 without a GPU (Triton {d['triton']}): registers, "
           "spills (stack bytes) and local memory from the cubin, occupancy from an H100 SM's limits, per "
           "key-loop iteration a thread's spill, tensor-core (HGMMA, HMMA) and barrier (BAR) instructions, and "
           "the most copies of a K/V tile the software pipeline buffers (1: no load overlaps the arithmetic); "
           "the timings on a GPU are in [On a GPU](#on-a-gpu).", ""]
    out += [f"- `benchmarks/results/{stem}.json`", ""]
    attention = [v for v in d["variants"] if v.get("kernel", "attention") == "attention"]
    out += table(["dtype", "head dim", "group", "variant", "keys per step (decode / prefill tile)", "warps",
                  "registers", "stack bytes", "shared bytes", "local bytes", "programs/SM",
                  *(f"{name} per key-loop iteration" for name in ("spills", "tensor-core", "barriers")),
                  "tile buffers"],
                 [[v["dtype"], v["head_dim"], v["group"], v["variant"] + (" (sweep)" if v.get("tuned") else ""),
                   f"{v.get('block_n', '–')} / {v.get('prefill_block_n', v.get('block_n', '–'))}", v["num_warps"],
                   v["registers"], v.get("stack_bytes", "–"), v["shared_bytes"], v["local_bytes"],
                   v["programs_per_sm"],
                   *(" / ".join(map(str, v.get(key, []))) or "–"
                     for key in ("loop_spills", "loop_tensor_ops", "loop_barriers")), v.get("tile_buffers", "–")]
                  for v in attention],
                 "lrrl" + "r" * 11)
    gemv = [v for v in d["variants"] if v.get("kernel") == "gemv"]
    if gemv:
        out += ["The batch-1 GEMV (kernels/gemv.py, bf16, residual fused) at the engine's launch shape and "
                "others `linear_bandwidth.py` timed (BLOCK_N x BLOCK_K / warps); stack and local bytes are spills.",
                ""]
        out += table(["launch shape", "registers", "shared bytes", "stack bytes", "local bytes"],
                     [[v["variant"], v["registers"], v["shared_bytes"], v["stack_bytes"], v["local_bytes"]]
                      for v in gemv], "lrrrr")
    others = [v for v in d["variants"] if v.get("kernel") not in (None, "attention", "gemv")]
    if others:
        out += ["The layer's other kernels with the arguments their wrappers pass at a Llama-3-8B decode token "
                "(bf16): RMSNorm, SiLU-mul, rope with the KV write, the cache write, the swap's block copies.", ""]
        out += table(["kernel", "launch", "warps", "registers", "shared bytes", "stack bytes", "local bytes"],
                     [[v["kernel"], v["variant"], v["num_warps"], v["registers"], v["shared_bytes"],
                       v["stack_bytes"], v["local_bytes"]] for v in others], "llrrrrr")
    return out, []


def plan_model(_: str) -> tuple[list[str], list[str]]:
    out = []
    for path in sorted(RESULTS.glob("plan_model_*.json")):
        stem = path.stem
        d = load(stem)
        out += [f"**{d['device']}.** `benchmarks/plan_model.py` fits a model of an attention plan's time (items "
                "costed by kind, the busiest unit, a floor per launch) to the stored timings: a decode tile runs "
                f"{ratio(d['decode_slowdown_in_mixed_variant'])} the decode-only variant's time per key in the mixed "
                f"variant; prediction error median {d['median_abs_error']:.1%}, largest {d['max_abs_error']:.1%} over "
                f"{len(d['rows'])} timed plans. The two-launch plan's times here are its predictions.", ""]
        out += [f"- `benchmarks/results/{stem}.json`", ""]
        out += table(["mixed step", "decode keys", "packed ms", "unpacked ms", "two launches, predicted ms",
                      "vs packed", "vs unpacked", "two launches, measured ms"],
                     [[s["shape"], s["decode_keys"], s["packed_ms"], s["unpacked_ms"], s["two_launch_predicted_ms"],
                       ratio(s["vs_packed"]), ratio(s["vs_unpacked"]),
                       s.get("two_launch_measured_ms") or "not yet timed"] for s in d["two_launch"]],
                     "lrrrrrrr")
    return out, []


GPU_STEMS = ["gpu_check_*", "batch1_decode_*", "mixed_steps_nvidia*", "linear_bandwidth_*", "gemv_chain_*",
             "throughput-nvidia*",
             "kernels_nvidia*", "profile_decode_nvidia*", "attention_tuning_*", "op_counts-nvidia*", "swap_copy_*",
             "launch_overhead-nvidia*", "int_linear_bandwidth_*", "gpu_tests_*"]


def embedded(patterns: list[str]) -> list[str]:
    """Each result's own markdown as its script wrote it, headings pushed
    two levels down."""
    out = []
    for pattern in patterns:
        for path in sorted(RESULTS.glob(f"{pattern}.md")):
            text = re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", path.read_text(), flags=re.M)
            out += [f"- `benchmarks/results/{path.name}`", "", text.strip(), ""]
    return out


def gpu(_: str) -> tuple[list[str], list[str]]:
    """Every GPU run's own markdown; the test reports (JSON only) are summed
    up by the GPU check's table."""
    return ["The GPU runs, each as its script wrote it (`bash benchmarks/gpu_check.sh` runs them in one call "
            "on a CUDA machine).", "", *embedded(GPU_STEMS[:-1])], []


OP_COUNT_STEMS = ["op_counts", "op_counts-batch1-fusions", "op_counts-host", "op_counts-host-*"]


def op_counts(_: str) -> tuple[list[str], list[str]]:
    return ["`benchmarks/op_counts.py`: the torch ops, kernel launches and host syncs of an eager decode step "
            "per decoder layer, and the step's time, this tree against another in alternating runs.", "",
            *embedded(OP_COUNT_STEMS)], []


def quantized_checkpoints(_: str) -> tuple[list[str], list[str]]:
    return ["`benchmarks/fp8_checkpoint.py`: FP8 checkpoints written from a real model (transformers' `fp8` "
            "blocks and compressed-tensors' per-channel scales) served against the original, in one run: their "
            "size, start-up, greedy replies and the likelihood they give the original's replies, and transformers' "
            "own load of one. `benchmarks/quantized_formats_vs_gptqmodel.py`: the suite's GPTQ and AWQ "
            "checkpoints read by GPTQModel's readers against ours. `benchmarks/packed_weights.py`: GPTQ and AWQ "
            "checkpoints of a real model, and a random Qwen3-MoE's GPTQ experts (`--moe`), served with their "
            "weights packed (`--quantized-weights packed`) against dequantized, in one run: the bytes held, the "
            "replies, the decode time. `benchmarks/packed_host_time.py`: the host work of a packed batch-1 "
            "eager decode step on the GPU path against the dequantized one's.", "",
            *embedded(QUANTIZED_STEMS)], []


QUANTIZED_STEMS = ["fp8_checkpoint", "quantized_formats_vs_gptqmodel", "packed_weights-*", "packed_host_time"]


def kv_cache_dtype(_: str) -> tuple[list[str], list[str]]:
    return ["`benchmarks/kv_cache_dtype.py`: an fp8 KV cache (`--kv-cache-dtype`) against the model's dtype "
            "on a real model, in one run: its replies, a burst against a fixed KV budget, and the CPU attention "
            "call's cost.", "", *embedded(["kv_cache_dtype"])], []


def speculative(_: str) -> tuple[list[str], list[str]]:
    return ["`benchmarks/speculative.py`: n-gram speculative decoding (`--speculative-config`) against none on "
            "a real model, each setting in one process, and vLLM's n-gram drafting over the same prompts: output "
            "tokens a second at batch 1 and in a burst, where replies repeat the prompt and where they do not; "
            "then drafts chosen per step (the default, `speculative-adaptive`) beside every draft verified and "
            "beside a batch-size cut-off, with a burst of both kinds of prompt; "
            "then the same prompts streamed one at a time through both servers (`--server`); then replies "
            "constrained to JSON of a schema whose values copy the prompt (`--workloads extract`), a grammar's "
            "rows masked after the drafts before them. `benchmarks/predicted_outputs.py`: OpenAI's `prediction` "
            "as the drafts' source, beside the n-gram lookup alone and no drafts, in-process and through the "
            "server (`--server`).", "",
            *embedded(SPECULATIVE)], []


SPECULATIVE = ["speculative", "speculative-adaptive", "speculative-async", "speculative-async-edit",
               "speculative-server", "speculative-server-adaptive", "speculative-extract",
               "speculative-server-extract", "speculative-extract-shaped", "speculative-server-extract-shaped",
               "predicted_outputs", "predicted_outputs-server"]


# -- the page ------------------------------------------------------------------------------

Renderer = Callable[[str], tuple[list[str], list[str]]]

# (title, the result stems the section reads, renderer); order is the page's.
ONLINE_STEMS = ["vs_vllm-online-cpu", "vs_vllm-online-cpu-transformers", "vs_vllm-online-cpu-smollm2",
                "vs_vllm-online-cpu-smollm2-one-openmp-team", "vs_vllm-online-cpu-smollm2-yield-busy-cores",
                "vs_vllm-online-cpu-smollm2-core-waits", "vs_vllm-online-cpu-switch-beside-client",
                "vs_vllm-online-cpu-smollm2-final-check", "vs_vllm-online-cpu-switch-beside-client-trials",
                "vs_vllm-online-cpu-smollm2-trials-check", "vs_vllm-online-cpu-switch-same-flags",
                "vs_vllm-online-cpu-smollm2-fp8-kv", "vs_vllm-online-cpu-smollm2-auto-kv",
                "vs_vllm-online-cpu-smollm2-after-speculative"]
SECTIONS: list[tuple[str, list[str], Renderer]] = [
    ("Scheduling policies (simulator)", ["scheduling"], scheduling),
    ("Two KV tiers (simulator)", ["swapping"], swapping),
    ("The step token budget (simulator)", ["token_budget"], token_budget),
    ("The TTFT tail where memory does not bind (simulator)", ["ttft_tail"], ttft_tail),
    ("Prefix caching across both tiers (simulator)", ["prefix_cache_sim"], prefix_cache_sim),
    ("Co-serving (simulator)", ["coserving", "coserving-seed1", "coserving-seed2", "coserving-seed3"], coserving),
    ("Co-serving on the real engine",
     ["coserving_real", "coserving_real-safepoints", "coserving_real-designs", "coserving_real-loans"],
     coserving_real),
    ("A real model end to end", ["smollm2_greedy"], real_model),
    ("Online serving against vLLM and transformers", ONLINE_STEMS,
     vs_online),
    ("Offline throughput against vLLM and transformers",
     [*OFFLINE_STEMS, "throughput-cpu-cpu-small"], vs_offline),
    ("A long prompt's time to first token", LONG_PROMPT_STEMS, long_prompt),
    ("OpenMP teams and waiting on the CPU", ["omp_teams"], omp_teams),
    ("Waiting for cores beside another process", ["core_waits"], core_waits),
    ("Waiting for cores beside another process, decode at batch 32", ["core_waits-batch32"], core_waits),
    ("Waiting for cores beside another process, decode at batch 32, thread counts decided by trial",
     ["core_waits-batch32-trials"], core_waits),
    ("A data-parallel replica's CPU step", ["replica_team"], replica_team),
    ("Serving beside busy processes", ["busy_neighbour"], busy_neighbour),
    ("Serving beside a process busy 2 ms in every 5", ["busy_neighbour-duty"], busy_neighbour),
    ("Serving with no busy process beside", ["busy_neighbour-alone"], busy_neighbour),
    ("Serving beside busy processes, thread counts decided by trial", ["busy_neighbour-trials"], busy_neighbour),
    ("Serving beside a process busy 2 ms in every 5, thread counts decided by trial", ["busy_neighbour-duty-trials"],
     busy_neighbour),
    ("Engine bookkeeping per step", ["step_overhead-cpu"], step_overhead),
    ("Scheduler CPU time per step", ["sched_step_cost", "sched_step_cost-1024", "sched_step_cost-64-queued-2000"],
     sched_step_cost),
    ("Garbage collection during steps", ["gc_pauses"], gc_pauses),
    ("CPU kernels",
     ["cpu_decode_groups", "cpu_chunked_prefill", "cpu_short_rows", "shared_prefix_decode", "cpu_linear"],
     cpu_kernels),
    ("Structured output and prompt logprobs",
     ["grammar_mask", "structured_overhead-cpu", "structured_overhead-cpu-small", "grammar_mask_apply-cpu",
      "prompt_logprobs-cpu"], grammar),
    ("KV cache and preemption on the real engine",
     ["prefix_cache", "swap_serving", "swap_serving_chat", "swap_serving-default-seeds-0-6",
      "swap_serving-load-0.9-seeds-0-6", "swap_serving-load-0.9-baseline-again", "swap_serving_chat-default-seeds-0-6",
      "preemption"], kv_real),
    ("The KV cache's dtype: fp8", ["kv_cache_dtype"], kv_cache_dtype),
    ("Quantized checkpoints", QUANTIZED_STEMS, quantized_checkpoints),
    ("Speculative decoding: n-gram drafts",
     SPECULATIVE, speculative),
    ("Frontend, load generator and Ray executor", ["serve_overhead", "serve_bench-*", "ray_overhead-*"], frontend),
    ("Triton kernels compiled for sm_90", ["kernels_compile_sm90"], kernels_compile),
    ("Host time of a Triton launch", ["launch_overhead", "launch_overhead-triton3.6"], launch_overhead),
    ("Host time of the attention planner and the step's inputs", ["plan_host_time"], plan_host_time),
    ("Ops, kernels and syncs of an eager decode step", OP_COUNT_STEMS, op_counts),
    ("Attention plans: a model fitted to the GPU timings", ["plan_model_*"], plan_model),
    ("On a GPU", GPU_STEMS, gpu),
]


def claimed(stem: str) -> bool:
    return any(re.fullmatch(p.replace("*", ".*"), stem) for _, stems, _ in SECTIONS for p in stems)


def generic(stem: str) -> tuple[list[str], list[str]]:
    """A results file no section knows: its scalar fields, and its rows if it has any."""
    d = load(stem)
    if not isinstance(d, dict):
        return [f"- `benchmarks/results/{stem}.json`", ""], []
    out = provenance(stem, d)
    scalars = [[k, v] for k, v in d.items() if isinstance(v, (int, float, str)) and k not in ("command",)]
    if scalars:
        out += table(["field", "value"], scalars, "lr")
    rows = d.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float, str))]
        out += table(keys, [[r.get(k, "") for k in keys] for r in rows])
    return out, []


def anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def build() -> str:
    stems = sorted(p.stem for p in RESULTS.glob("*.json"))
    sections = [(t, r, stems_[0]) for t, stems_, r in SECTIONS
                # a benchmark not run yet has no section (a stem may be a glob pattern)
                if any(next(RESULTS.glob(f"{s}.json"), None) is not None for s in stems_)]
    sections += [(f"Other results: {s}", generic, s) for s in stems if not claimed(s)]
    head = ["# Benchmarks", "",
            "Generated by `python benchmarks/report.py` from the JSON in `benchmarks/results/` (one file per "
            "benchmark and configuration, each the latest run; earlier runs are in git history). Do not edit "
            "by hand: rerun a benchmark, then the report.", "",
            "Each section gives the figures, the hardware they were taken on and the command that took them. "
            "The simulator sections model a GPU with a roofline cost model (see [design.md](design.md#testing)); "
            "the others ran on the CPU they name.", ""]
    body, toc = [], []
    for title, render, stem in sections:
        text, plots = render(stem)
        toc.append(f"- [{title}](#{anchor(title)})")
        body += [f"## {title}", ""] + text + [p + "\n" for p in plots]
    lines = head + toc + [""] + body
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).rstrip("\n") + "\n"


def main() -> int:
    plt.rcParams.update({"font.size": 9})
    DOCS.mkdir(exist_ok=True)
    text = build()
    (DOCS / "benchmarks.md").write_text(text)
    for stale in DOCS.glob("*.png"):
        if stale.name not in WRITTEN:
            stale.unlink()
    print(f"wrote {DOCS / 'benchmarks.md'} and {len(WRITTEN)} plots: {', '.join(sorted(WRITTEN))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
