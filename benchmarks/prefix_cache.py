"""Prefix caching on the real engine (CPU): time to first token with the
cache on and off, same engine, same requests, one process.

Two workloads, requests sent one after another (each waits for the one
before, so TTFT is the engine's work on that prompt, not queueing):

* ``shared-system-prompt``: every request is the same long system prompt
  (``--prefix-tokens``, default 2000) plus a short question of its own.
* ``multi-turn``: conversations whose every turn resends the whole history
  (previous prompts and answers) plus a new user message.
* ``tenants``: more system prompts (``--tenants`` of ``--tenant-tokens``)
  than a small device pool keeps cached, requests cycling through them: the
  host tier off (no host pool) vs on, where a prompt the device reused comes
  back from the host by copy.

Also the scheduler's CPU time per step (schedule + update_from_output) at
256 active decoding requests that share a prefix, cache on vs off.

    python benchmarks/prefix_cache.py            # ~3 min on 2 cores
Writes benchmarks/results/prefix_cache.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dummy_models import build_model_dir
from sched_step_cost import shared_prefix_scheduler
from scheduling import time_steps



def _ttfts(engine, prompts: list[list[int]], max_tokens: int) -> list[float]:
    from fluidserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"p{id(prompts)}-{i}", prompt, params)
        first = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if first is None and o.outputs[0].token_ids:
                    first = time.perf_counter() - t0
        out.append(first)
    return out


def shared_system_prompt(rng: random.Random, vocab: int, prefix: int, n: int) -> list[list[int]]:
    system = [rng.randrange(3, vocab) for _ in range(prefix)]
    return [system + [rng.randrange(3, vocab) for _ in range(rng.randrange(10, 40))] for _ in range(n)]


def multi_turn(engine, rng: random.Random, vocab: int, turns: int, conversations: int,
               cache: bool) -> list[float]:
    """TTFT of every turn after the first (the first has nothing to reuse)."""
    from fluidserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ttfts = []
    for c in range(conversations):
        history = [rng.randrange(3, vocab) for _ in range(200)]
        for t in range(turns):
            t0 = time.perf_counter()
            engine.add_request(f"mt{cache}-{c}-{t}", history, params)
            first, answer = None, []
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if first is None and o.outputs[0].token_ids:
                        first = time.perf_counter() - t0
                    answer = list(o.outputs[0].token_ids)
            if t:
                ttfts.append(first)
            history = history + answer + [rng.randrange(3, vocab) for _ in range(rng.randrange(20, 80))]
    return ttfts


def tenants(args, model_dir: Path, host_blocks: int) -> tuple[list[float], dict]:
    """TTFT of every request after each tenant's first, with a device pool
    that holds about two system prompts, and the prefix-cache figures."""
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.create(model=str(model_dir), load_format="dummy", device="cpu", max_model_len=1024,
                                    num_kv_blocks=args.tenant_tokens // 16 * 2 + 16, num_host_blocks=host_blocks))
    rng = random.Random(2)
    systems = [[rng.randrange(3, engine.vocab_size) for _ in range(args.tenant_tokens)] for _ in range(args.tenants)]
    prompts = [systems[i % args.tenants] + [rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(10, 40))]
               for i in range(args.tenants * args.tenant_rounds)]
    ttfts = _ttfts(engine, prompts, 8)[args.tenants:]  # each tenant's first request fills the cache
    st = engine.kv.prefix_stats
    figures = {"device_hit_rate": st.hit_tokens / st.query_tokens,
               "host_hit_rate": st.host_hit_tokens / st.query_tokens,
               "demoted_blocks": st.demoted_blocks, "num_kv_blocks": engine.kv.num_blocks}
    engine.shutdown()
    return ttfts, figures


def scheduler_cost(cache: bool, active: int = 256, steps: int = 200) -> float:
    """CPU seconds per schedule() + update_from_output() with ``active``
    decoding requests that share a 512-token prefix."""
    return time_steps(shared_prefix_scheduler(cache, active), warm_steps=40, steps=steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--tenant-tokens", type=int, default=600)
    ap.add_argument("--tenant-rounds", type=int, default=3)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.engine import LLMEngine

    model_dir = build_model_dir(args.preset, Path(tempfile.mkdtemp(prefix="fluidserve-prefix-")))
    rows = {}
    for cache in (False, True):
        engine = LLMEngine(EngineConfig.create(model=str(model_dir), load_format="dummy", device="cpu",
                                        max_model_len=4096, num_kv_blocks=1024, enable_prefix_caching=cache))
        vocab = engine.vocab_size
        shared = _ttfts(engine, shared_system_prompt(random.Random(0), vocab, args.prefix_tokens, args.requests), 8)
        turns = multi_turn(engine, random.Random(1), vocab, args.turns, args.conversations, cache)
        stats = engine.kv.prefix_stats
        rows["on" if cache else "off"] = {
            "shared_ttft_s": shared, "multi_turn_ttft_s": turns,
            "hit_rate": stats.hit_tokens / stats.query_tokens if stats.query_tokens else 0.0,
            "scheduler_s_per_step_256": scheduler_cost(cache),
        }
        engine.shutdown()
    off, on = rows["off"], rows["on"]
    tenant_rows = {}
    for label, host_blocks in (("device only", 0), ("device + host", 1024)):
        ttfts, figures = tenants(args, model_dir, host_blocks)
        tenant_rows[label] = {"ttft_s": ttfts, "mean_ttft_s": statistics.fmean(ttfts), **figures}
    rows["tenants"] = tenant_rows

    def mean_after_first(xs: list[float]) -> float:
        return statistics.fmean(xs[1:])  # the first request fills the cache

    summary = {
        "shared_mean_ttft_off_s": mean_after_first(off["shared_ttft_s"]),
        "shared_mean_ttft_on_s": mean_after_first(on["shared_ttft_s"]),
        "multi_turn_mean_ttft_off_s": statistics.fmean(off["multi_turn_ttft_s"]),
        "multi_turn_mean_ttft_on_s": statistics.fmean(on["multi_turn_ttft_s"]),
    }
    meta = {"command": "python benchmarks/prefix_cache.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "preset": args.preset, "prefix_tokens": args.prefix_tokens, "python": platform.python_version(),
            "machine": platform.processor() or platform.machine()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_cache.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    md = "\n".join([
        "# Prefix caching on the real engine (CPU)", "",
        f"Command: `{meta['command']}`; model preset {args.preset} (dummy weights, fp32), one process, cache off "
        "then on, requests one after another.", "",
        "| workload | mean TTFT off (ms) | mean TTFT on (ms) | speed-up | hit rate (on) |", "|---|---|---|---|---|",
        f"| shared system prompt ({args.prefix_tokens} tokens), requests 2..{args.requests} | "
        f"{summary['shared_mean_ttft_off_s'] * 1e3:.0f} | {summary['shared_mean_ttft_on_s'] * 1e3:.0f} | "
        f"{summary['shared_mean_ttft_off_s'] / summary['shared_mean_ttft_on_s']:.1f}x | {on['hit_rate']:.0%} |",
        f"| multi-turn ({args.conversations} conversations x {args.turns} turns), turns 2.. | "
        f"{summary['multi_turn_mean_ttft_off_s'] * 1e3:.0f} | {summary['multi_turn_mean_ttft_on_s'] * 1e3:.0f} | "
        f"{summary['multi_turn_mean_ttft_off_s'] / summary['multi_turn_mean_ttft_on_s']:.1f}x | |",
        "",
        f"Tenants: {args.tenants} system prompts of {args.tenant_tokens} tokens, requests cycling through them "
        f"({args.tenant_rounds} rounds; each tenant's first request not counted), device pool of "
        f"{tenant_rows['device only']['num_kv_blocks']} blocks of 16 tokens (about two system prompts):", "",
        "| prefix cache | mean TTFT (ms) | device hit | host hit | demoted blocks |", "|---|---|---|---|---|",
        *(f"| {label} | {r['mean_ttft_s'] * 1e3:.0f} | {r['device_hit_rate']:.0%} | {r['host_hit_rate']:.0%} | "
          f"{r['demoted_blocks']} |" for label, r in tenant_rows.items()),
        f"| host tier speed-up | "
        f"{tenant_rows['device only']['mean_ttft_s'] / tenant_rows['device + host']['mean_ttft_s']:.1f}x "
        "| | | |", "",
        f"Scheduler CPU time per step at 256 decoding requests sharing a 512-token prefix: "
        f"{off['scheduler_s_per_step_256'] * 1e3:.2f} ms with the cache off, "
        f"{on['scheduler_s_per_step_256'] * 1e3:.2f} ms on.", ""])
    (out / "prefix_cache.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
