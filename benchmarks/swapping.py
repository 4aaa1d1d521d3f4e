"""Two-tier KV in the simulator (FastServe §4.2, §6.3): what swapping to host
memory buys the scheduler when device KV is what binds.

Variants on the same jobs, same model, same device:

* ``fcfs + recompute``       vLLM's behaviour: arrival order, a preempted job
                             loses its KV and prefills again
* ``skip-join + recompute``  FastServe's MLFQ without a host tier
* ``skip-join + proactive``  also prefetches swapped KV ahead of its turn and
                             keeps a reserve of free blocks for arrivals, with
                             KV loans off (``--swap-loan-tokens -1``: a request
                             ranked higher may evict any stream, FastServe's
                             rule): alone, and with ``--swap-tpot-slack 1.25``
                             (scheduler/token_gap.py); ``--slack-sweep`` runs
                             other slacks
* ``skip-join + proactive, KV loans``  the default flags (``--swap-loan-tokens
                             32``, scheduler/loans.py): streams keep their place;
                             a request whose max_tokens is at most 32 may
                             borrow KV from streams whose streamed tokens
                             cover its stay; ``--loan-sweep`` runs other caps
* ``default flags but ...``  one threshold moved, on every seed:
                             ``--starving-sweep`` the multiple of the mean
                             admission wait after which a request without a
                             bound keeps the blocks it needs
                             (scheduler/loans.py ``STARVING_WAITS``, 2),
                             ``--growth-sweep`` the steps of resident growth
                             an admission leaves room for (scheduler.py
                             ``GROWTH_STEPS``, 8; 16 covers every resident),
                             ``--guard-sweep`` the first-token guard's slack
                             (``--mlfq-first-token-slack``, 0; ``off`` is
                             FastServe's skip-join alone), ``--backfill-sweep``
                             backfilling off (``--no-swap-backfill``),
                             ``--gap-sweep`` a token-gap bound
                             (``--max-token-gap-ms``) of a fraction of a
                             full-budget step: prompt chunks beside streams
                             are then cut to keep it
                             The simulator's jobs carry their true output
                             length as max_tokens: the figures are for
                             clients that state a tight cap on short requests
* ``clairvoyant reference``  not a policy of the engine: weighted shortest
                             remaining time first on the true output length
                             (``ClairvoyantPolicy``), with swap, loans off and
                             on; how far ranking alone could move the mean
* ``size-blind reference``   not a policy of the engine either: the Gittins
                             index for mean normalized latency
                             (``SizeBlindPolicy``), which knows the preset's
                             output-length distribution but not each job's
                             length (a server could learn it from the
                             requests it has finished); with swap and loans on;
                             how far a ranking that learns the lengths' shape
                             could move the mean

Presets are memory-bound on purpose: OPT-13B on a 40 GB A100 (FastServe's
setting), Llama-3-8B on an H100 with an eighth of its KV pool, Llama-3-8B with
arXiv-summarization (long prompt) lengths and a quarter of the pool, and the
Azure code trace on the small pool; Llama-3-8B with its whole pool on
ShareGPT is where memory does not bind; ``chat`` is a conversational
multi-turn mix (``chat_jobs``: long prompts of opening context and history,
short answers, bursty arrivals) on the small pool; ``cpu-small/cpu 64 blocks`` is the
real engine's regime in ``benchmarks/swap_serving.py`` (its model in fp32 on
the CPU device model, 64 device blocks, ShareGPT lengths x0.2 cut to 512 and
256 tokens), for setting the simulator's figures beside the engine's. The host link moves one block in
``block bytes / PCIe bandwidth`` (DeviceSpec), copies overlap compute, and a
step stalls only on swap-ins it reads (see scheduler/simulator.py). Per-step
swap traffic is bounded as the engine bounds it: the blocks that move in one
minimum iteration. Load = arrival rate / saturated throughput of fcfs +
recompute on the same lengths.

    python benchmarks/swapping.py --loads 0.9 --speeds 1   # a few minutes on 2 cores
    python benchmarks/swapping.py --quick    # smoke run

Writes benchmarks/results/swapping.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from dummy_models import PRESETS as MODEL_PRESETS
from swap_serving import LENGTH_SCALE, NUM_KV_BLOCKS, length_limits

from fluidserve.scheduler import loans
from fluidserve.scheduler import scheduler as scheduler_module
from fluidserve.scheduler.config import DEFAULT_LOAN_TOKENS
from fluidserve.scheduler.policy_base import Policy
from fluidserve.scheduler.cost_model import DeviceSpec, ModelShape, RooflineCostModel
from fluidserve.scheduler.simulator import SimConfig, estimate_capacity, saturated_rate, simulate
from fluidserve.serve.bench_client import scaled_lengths
from fluidserve.scheduler.workloads import (
    ARXIV, AZURE_CODE, DEFAULT_WORKLOAD_DIR, SHAREGPT, Job, clamp_lengths, empirical_lengths, load_lengths,
    LMSYS_CHAT, load_trace, poisson_arrivals, replay_trace, synthesize, conversations,
)

BLOCK = 16
HOST_GIB = 64  # FastServe's host memory for swapped KV
SKIP_JOIN = "skip-join-mlfq"
# The deadline variant's slack: a request's TPOT within 1.25x of its own pace
# (the P99 TPOT ratio asked of the scheduler, not a tuned value).
SLACK = 1.25
# The loan variant's cap, the default: requests of up to 32 output tokens
# borrow (not a tuned value: --loan-sweep shows the others).
LOAN_TOKENS = DEFAULT_LOAN_TOKENS
LOANS_OFF = "skip-join + proactive swap, loans off"
# The engine's thresholds: a sweep point sets the module's for its run alone.
STARVING_WAITS = loans.STARVING_WAITS
GROWTH_STEPS = scheduler_module.GROWTH_STEPS
SWEPT = "default flags but "


def sweep_label(knob: str, value) -> str:
    if knob == "starving":
        return f"{SWEPT}starving after {value:g} mean waits"
    if knob == "growth":
        return f"{SWEPT}growth reserve {value} steps"
    if knob == "cache":
        return f"{SWEPT}prefix cache {'on the device only' if value == 'device' else 'off'}"
    if knob == "backfill":
        return f"{SWEPT}backfilling {'on' if value else 'off'}"
    if knob == "gap":
        return f"{SWEPT}token-gap bound {value:g} full-budget steps"
    return f"{SWEPT}first-token guard {'off' if value is None else f'slack {value} tokens'}"


def loan_label(n: int) -> str:
    if not n:
        return "skip-join + proactive swap, streams keep their place (--swap-loan-tokens 0)"
    default = "; default flags" if n == DEFAULT_LOAN_TOKENS else ""
    return f"skip-join + proactive swap, KV loans (max_tokens <= {n}{default})"


class _ReferencePolicy(Policy):
    """A benchmark's reference order: lowest ``_key`` first, then arrival.
    A decode rides in a batched step: it costs a share of a minimum
    iteration (``_decode``), a sixteenth."""

    def __init__(self, cost_model) -> None:
        super().__init__(cost_model)
        self._decode = cost_model.min_iteration_time() / 16

    def _key(self, seq) -> float:
        raise NotImplementedError

    def order(self, seqs, now):
        return sorted(seqs, key=lambda s: (self._key(s), s.arrival_time, s.arrival_index))

    def priority(self, seq) -> float:
        return self._key(seq)


class ClairvoyantPolicy(_ReferencePolicy):
    """A reference no server can run: weighted shortest remaining time
    first, knowing each job's output length (the simulator's jobs carry it
    as max_tokens). Smith's rule with weight 1 / output tokens ranks by
    remaining time x output tokens: on one machine, the order that
    minimizes mean normalized latency, whatever it costs the tails."""

    name = "clairvoyant"

    def _key(self, seq) -> float:
        prefill = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
        decodes = max(0, seq.max_new_tokens - seq.num_output_tokens)
        left = (self.cost.prefill_time(prefill) if prefill else 0.0) + decodes * self._decode
        return left * seq.max_new_tokens


class SizeBlindPolicy(_ReferencePolicy):
    """A reference the engine does not offer: a ranking that knows each job's
    prompt and the distribution of output lengths, but not the job's own
    output length. It is the Gittins index with each completion worth 1 /
    its output tokens: queueing theory's index order for jobs of unknown
    length on one machine, the optimal such order for the mean response
    time (Scully and Harchol-Balter, "The Gittins policy in the M/G/1
    queue", 2021). A job that has emitted ``a`` tokens, with ``pre``
    seconds of prompt left, is worth serving for as far as the best stretch
    to ``b`` tokens pays:

        index = max over b of  E[1/X ; a < X <= b] / E[pre + d * (min(X, b) - a) ; X > a]

    X the output length, ``d`` a decode's share of a batched step
    (``_ReferencePolicy._decode``). Where the lengths' hazard rises (the
    longer a job has run, the less it has left) the index rises with ``a``
    and the order keeps serving who started; where it falls it is
    skip-join's least-attained-first."""

    name = "size-blind"

    def __init__(self, cost_model, output_lengths: Sequence[int]) -> None:
        super().__init__(cost_model)
        lengths, counts = np.unique(np.asarray(output_lengths), return_counts=True)
        self._x = lengths.astype(float)
        self._p = counts / counts.sum()
        self._memo: dict[tuple[int, int], float] = {}  # (a, prompt tokens left) -> index

    def index(self, emitted: int, prompt_left: float) -> float:
        """The Gittins index of a job with ``emitted`` tokens out and
        ``prompt_left`` seconds of prompt to compute."""
        alive = self._x > emitted
        if not alive.any():  # longer than every length seen: about to end
            return math.inf
        x, p = self._x[alive], self._p[alive]
        gain = np.cumsum(p / x)  # stopping at b = x[k]: the jobs done by then, each weighted 1/X
        served = np.cumsum((x - emitted) * p) + (x - emitted) * (p.sum() - np.cumsum(p))
        return float((gain / (prompt_left * p.sum() + self._decode * served)).max())

    def _key(self, seq) -> float:
        left = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
        memo = (seq.num_output_tokens, left)
        v = self._memo.get(memo)
        if v is None:
            v = self._memo[memo] = -self.index(seq.num_output_tokens, self.cost.prefill_time(left) if left else 0.0)
        return v


def mean_remaining(output_lengths: Sequence[int], after: Sequence[int]) -> list[tuple[int, float, float]]:
    """(a, share of jobs longer than a, their mean output tokens left after a)
    for each a in ``after``: what having emitted a tokens says of a job."""
    x = np.asarray(output_lengths, dtype=float)
    out = []
    for a in after:
        alive = x[x > a]
        out.append((a, len(alive) / len(x), float((alive - a).mean()) if len(alive) else 0.0))
    return out


ALONE = "each job alone (a floor, not a policy)"
CLAIRVOYANT = "clairvoyant reference + swap (knows output lengths; loans off)"
CLAIRVOYANT_LOANS = "clairvoyant reference + swap, KV loans (knows output lengths; default flags)"
SIZE_BLIND_LOANS = "size-blind reference + swap, KV loans (knows the lengths' distribution; default flags)"
REFERENCES = (CLAIRVOYANT, CLAIRVOYANT_LOANS, SIZE_BLIND_LOANS)


VARIANTS = [  # (label, policy, preemption mode, proactive, swap_tpot_slack (0: none), swap_loan_tokens (None: off))
    ("fcfs + recompute", "fcfs", "recompute", False, 0.0, None),
    ("skip-join + recompute", SKIP_JOIN, "recompute", False, 0.0, None),
    (LOANS_OFF, SKIP_JOIN, "swap", True, 0.0, None),
    (f"skip-join + proactive swap, slack {SLACK:g}", SKIP_JOIN, "swap", True, SLACK, None),
    (loan_label(LOAN_TOKENS), SKIP_JOIN, "swap", True, 0.0, LOAN_TOKENS),
    (CLAIRVOYANT, ClairvoyantPolicy.name, "swap", True, 0.0, None),
    (CLAIRVOYANT_LOANS, ClairvoyantPolicy.name, "swap", True, 0.0, LOAN_TOKENS),
    (SIZE_BLIND_LOANS, SizeBlindPolicy.name, "swap", True, 0.0, LOAN_TOKENS),
]


METRICS = [("mean_norm_latency_s", "mean norm (ms/tok)", 1e3), ("p95_norm_latency_s", "P95 norm (ms/tok)", 1e3),
           ("mean_ttft_s", "mean TTFT (s)", 1.0), ("p99_ttft_s", "P99 TTFT (s)", 1.0),
           ("p99_tpot_s", "P99 TPOT (ms)", 1e3), ("p99_latency_bound_s", "P99 max token gap (ms)", 1e3)]


def opt_13b() -> ModelShape:
    return ModelShape.from_hf_config({"num_hidden_layers": 40, "hidden_size": 5120, "ffn_dim": 20480,
                                      "num_attention_heads": 40, "vocab_size": 50272, "_name_or_path": "opt-13b"})


def cpu_small() -> ModelShape:
    """benchmarks/dummy_models.py's ``cpu-small``, in fp32 as the CPU engine runs it."""
    return ModelShape.from_hf_config({**MODEL_PRESETS["cpu-small"], "_name_or_path": "cpu-small"}, dtype_bytes=4)


def real_engine_pairs(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The lengths benchmarks/swap_serving.py's load sends for ``pairs``."""
    limits = length_limits(NUM_KV_BLOCKS)
    return [scaled_lengths(p, o, LENGTH_SCALE, *limits) for p, o in pairs]


CHAT = LMSYS_CHAT
CHAT_PAIRS_CONVERSATIONS = 4000


def chat_pairs(num: int = CHAT_PAIRS_CONVERSATIONS, seed: int = 1) -> list[tuple[int, int]]:
    """(prompt, output) of the turns of ``num`` conversations, for capacity:
    each turn's prompt is the opening context, the history and the new message."""
    return [(j.prompt_tokens, j.output_tokens) for j in chat_jobs(num, 1.0, seed)]


def chat_jobs(num_conversations: int, rate: float, seed: int = 0) -> list[Job]:
    """Turns of ``workloads.conversations`` as jobs: each turn's prompt is
    all that came before it, so it extends the previous turn's prompt and
    finds that prefix wherever the prefix cache still holds it (the device,
    or the host tier where there is one); a follow-up arrives its think time
    after the reply before it has finished."""
    jobs = []
    for c, conv in enumerate(conversations(num_conversations, rate, seed, CHAT)):
        history = CHAT.context
        for k, turn in enumerate(conv.turns):
            prompt = min(history + turn.user, 8192 - turn.reply)
            jobs.append(Job(f"c{c}t{k}", conv.start, prompt, turn.reply, conversation=c,
                            follows=f"c{c}t{k - 1}" if k else None, think_time=turn.think_s))
            history += turn.user + turn.reply
    jobs.sort(key=lambda j: j.arrival_time)
    return jobs


def presets(wdir: Path) -> dict[str, dict]:
    """name -> model, device, pool fraction, lengths or trace, max length."""
    sharegpt = load_lengths(wdir / SHAREGPT)
    return {
        "opt-13b/a100-40g sharegpt": dict(model=opt_13b(), device=DeviceSpec.a100_40g(), pool=1.0,
                                          pairs=clamp_lengths(sharegpt, 2048)),
        "llama-3-8b/h100 pool/8 sharegpt": dict(model=ModelShape.llama3_8b(), device=DeviceSpec.h100(), pool=1 / 8,
                                                pairs=clamp_lengths(sharegpt, 8192)),
        "llama-3-8b/h100 pool/4 arxiv": dict(model=ModelShape.llama3_8b(), device=DeviceSpec.h100(), pool=1 / 4,
                                             pairs=clamp_lengths(load_lengths(wdir / ARXIV), 8192)),
        "llama-3-8b/h100 pool/8 azure-code": dict(model=ModelShape.llama3_8b(), device=DeviceSpec.h100(),
                                                  pool=1 / 8, trace=load_trace(wdir / AZURE_CODE)),
        "llama-3-8b/h100 sharegpt (memory does not bind)": dict(
            model=ModelShape.llama3_8b(), device=DeviceSpec.h100(), pool=1.0, pairs=clamp_lengths(sharegpt, 8192)),
        "llama-3-8b/h100 pool/8 chat": dict(model=ModelShape.llama3_8b(), device=DeviceSpec.h100(), pool=1 / 8,
                                            pairs=chat_pairs(), chat=True),
        # The real engine's regime (benchmarks/swap_serving.py): the pool holds
        # one and a third of the largest requests.
        "cpu-small/cpu 64 blocks sharegpt x0.2 (swap_serving)": dict(
            model=cpu_small(), device=DeviceSpec.cpu(), pairs=real_engine_pairs(sharegpt),
            pool=(NUM_KV_BLOCKS + 0.5) / RooflineCostModel(cpu_small(), DeviceSpec.cpu()).num_kv_blocks(BLOCK)),
    }


def sim_config(cm: RooflineCostModel, pool: float, mode: str, proactive: bool, slack: float = 0.0,
               gap_ms: float | None = None, loan_tokens: int | None = DEFAULT_LOAN_TOKENS) -> SimConfig:
    """The engine's flags for a preset; ``loan_tokens=None``: KV loans off."""
    block_bytes = BLOCK * cm.model.kv_bytes_per_token
    per_block = cm.transfer_time(block_bytes)
    swap = mode == "swap"
    return SimConfig.create(
        num_kv_blocks=max(1, int(cm.num_kv_blocks(BLOCK) * pool)), block_size=BLOCK,
        max_num_batched_tokens=2048, max_num_seqs=256,
        num_host_blocks=HOST_GIB * 2**30 // block_bytes if swap else 0,
        preemption_mode=mode, proactive_swap=proactive, block_transfer_time=per_block,
        max_swap_blocks_per_step=max(1, int(cm.min_iteration_time() / per_block)), swap_tpot_slack=slack,
        max_token_gap_ms=gap_ms, swap_loan_tokens=loan_tokens,
    )


def gap_bound_ms(cm: RooflineCostModel, steps: float) -> float:
    """A gap bound of ``steps`` full-budget steps (the longest step the
    scheduler makes with no bound: below one, prompt chunks beside streams
    are cut to keep it)."""
    return steps * cm.prefill_time(2048) * 1e3


def _run(task: dict) -> dict:
    cm = RooflineCostModel(task["model"], task["device"])
    sweep = task.get("sweep", {})  # read where each rule is applied
    loans.STARVING_WAITS = sweep.get("starving", STARVING_WAITS)
    scheduler_module.GROWTH_STEPS = sweep.get("growth", GROWTH_STEPS)
    options = {"first_token_slack": sweep["guard"]} if "guard" in sweep else {}
    cfg = sim_config(cm, task["pool"], task["mode"], task["proactive"], task["slack"], None, task.get("loan"))
    if "backfill" in sweep:
        cfg = cfg.replace(swap_backfill=sweep["backfill"])
    if "gap" in sweep:
        cfg = cfg.replace(max_token_gap_ms=gap_bound_ms(cm, sweep["gap"]))
    if "cache" in sweep:  # the host tier's share of a conversation's reuse, then the cache's
        cfg = cfg.replace(cache_on_host=False) if sweep["cache"] == "device" else cfg.replace(
            enable_prefix_caching=False)
    t0 = time.perf_counter()
    policy = task["policy"]
    if policy == ClairvoyantPolicy.name:
        policy = ClairvoyantPolicy(cm)
    elif policy == SizeBlindPolicy.name:
        policy = SizeBlindPolicy(cm, task["output_lengths"])
    res = simulate(task["jobs"], policy, cm, cfg, policy_options=options)
    s = res.summary()
    row = {"preset": task["preset"], "x": task["x"], "seed": task["seed"], "variant": task["label"],
           "num_kv_blocks": cfg.num_kv_blocks,
           "num_host_blocks": cfg.num_host_blocks, "max_swap_blocks_per_step": cfg.max_swap_blocks_per_step,
           "swap_tpot_slack": task["slack"], "max_token_gap_ms": cfg.max_token_gap_ms,
           "swap_loan_tokens": task.get("loan"), **s}
    if cfg.max_token_gap_ms is not None:  # requests whose longest gap broke the bound
        row["num_over_gap_bound"] = sum(r.max_token_gap * 1e3 > cfg.max_token_gap_ms for r in res.records)
    row["swap_gib"], row["demoted_gib"] = (n * BLOCK * cm.model.kv_bytes_per_token / 2**30
                                           for n in (s["swap_blocks"], s["demoted_blocks"]))
    row["stall_share"] = s["swap_stall_s"] / res.makespan if res.makespan else 0.0
    row.update(mean_shares(res.records))
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def mean_shares(records) -> dict:
    """Mean normalized latency split in two: the wait for the first token
    (TTFT / output tokens: the part a ranking decides) and the time from it
    to the last (the steps every resident pays, prefill chunks riding in
    them included)."""
    done = [r for r in records if r.finish_time is not None]
    return {"mean_ttft_share_s": sum(r.ttft / r.output_tokens for r in done) / len(done),
            "mean_decode_share_s": sum((r.e2e - r.ttft) / r.output_tokens for r in done) / len(done)}


def _run_alone(task: dict) -> dict:
    """Each job on its own, arriving at an idle device: no wait, no batch
    to share. No policy does better for any job, so the mean is a floor
    under every variant's (not for the chat mix, whose turns find earlier
    turns' prefixes in the cache)."""
    cm = RooflineCostModel(task["model"], task["device"])
    cfg = sim_config(cm, task["pool"], "recompute", False)
    records = [simulate([dataclasses.replace(j, arrival_time=0.0)], "fcfs", cm, cfg).records[0]
               for j in task["jobs"]]
    shares = mean_shares(records)
    return {"preset": task["preset"], "x": task["x"], "seed": task["seed"], "variant": ALONE,
            "mean_norm_latency_s": shares["mean_ttft_share_s"] + shares["mean_decode_share_s"], **shares}


def run_task(task: dict) -> dict:
    return _run_alone(task) if task["label"] == ALONE else _run(task)


def _turns_per_conversation(p: dict) -> float:
    """The chat mix's mean (its pairs are the turns of ``CHAT_PAIRS_CONVERSATIONS``)."""
    return len(p["pairs"]) / CHAT_PAIRS_CONVERSATIONS


def preset_capacity(p: dict, cm: RooflineCostModel, num_jobs: int) -> float:
    """Saturated fcfs + recompute throughput (req/s) on a synthetic preset's lengths: what load 1 means.
    The chat mix's turns share prompt tokens, so its capacity is timed on
    conversations rather than on a length mix."""
    cfg = sim_config(cm, p["pool"], "recompute", False)
    if p.get("chat"):  # every first turn, then every second turn, ...: each queued behind the one it follows
        jobs, depth = chat_jobs(max(1, round(num_jobs / _turns_per_conversation(p))), 1.0, seed=1), {}
        for j in jobs:
            depth[j.request_id] = 0 if j.follows is None else depth[j.follows] + 1
        return saturated_rate(sorted(jobs, key=lambda j: depth[j.request_id]), cm, cfg)
    return estimate_capacity(p["pairs"], cm, cfg, num_jobs=num_jobs)


def preset_jobs(p: dict, num_jobs: int, rate: float, seed: int) -> list[Job]:
    """About ``num_jobs`` jobs of a synthetic preset arriving at ``rate``
    per second: Poisson, or for the chat mix conversations starting at the
    rate that makes ``rate`` turns per second."""
    if p.get("chat"):
        per_conv = _turns_per_conversation(p)
        return chat_jobs(max(1, round(num_jobs / per_conv)), rate / per_conv, seed=seed)
    return synthesize(num_jobs, empirical_lengths(p["pairs"]), poisson_arrivals(rate), seed=seed)


def build_tasks(args) -> tuple[list[dict], dict, dict]:
    """Every variant at every load (or speed) and the sweeps, on the first
    seed; the main variants at the highest load on the other seeds (a trace
    replays the same jobs whatever the seed: it runs once). Also each
    preset's output lengths: the distribution the size-blind reference knows."""
    tasks, capacity, lengths = [], {}, {}
    for name, p in presets(Path(args.workload_dir)).items():
        cm = RooflineCostModel(p["model"], p["device"])
        if "trace" in p:
            points = [(speed, args.seeds[0], replay_trace(p["trace"], speed=speed, limit=args.trace_jobs,
                                                          max_model_len=8192)) for speed in args.speeds]
            lengths[name] = [j.output_tokens for j in points[0][2]]
        else:
            lengths[name] = [o for _, o in p["pairs"]]
            cap = capacity[name] = preset_capacity(p, cm, args.capacity_jobs)
            points = [(load, seed, preset_jobs(p, args.num_jobs, load * cap, seed))
                      for seed in args.seeds for load in args.loads
                      if seed == args.seeds[0] or load == max(args.loads)]
        top = max(x for x, _, _ in points)
        for x, seed, jobs in points:
            if x == top and not p.get("chat"):
                tasks.append({"preset": name, "x": x, "seed": seed, "label": ALONE, "jobs": jobs,
                              "model": p["model"], "device": p["device"], "pool": p["pool"]})
            variants = list(VARIANTS)
            if x == top and seed == args.seeds[0]:
                variants += [(f"skip-join + proactive swap, slack {k:g}", SKIP_JOIN, "swap", True, k, None)
                             for k in args.slack_sweep if k != SLACK]
                variants += [(loan_label(n), SKIP_JOIN, "swap", True, 0.0, n)
                             for n in args.loan_sweep if n != LOAN_TOKENS]
            for label, policy, mode, proactive, slack, loan in variants:
                tasks.append({"preset": name, "x": x, "seed": seed, "label": label, "policy": policy, "mode": mode,
                              "proactive": proactive, "slack": slack, "loan": loan, "jobs": jobs, "model": p["model"],
                              "device": p["device"], "pool": p["pool"]})
                if policy == SizeBlindPolicy.name:
                    tasks[-1]["output_lengths"] = lengths[name]
            sweeps = [("starving", n) for n in args.starving_sweep] + [("growth", n) for n in args.growth_sweep]
            sweeps += [("guard", n) for n in args.guard_sweep] + [("backfill", b) for b in args.backfill_sweep]
            sweeps += [("cache", n) for n in args.cache_sweep if p.get("chat")]  # only its turns share prompts
            sweeps += [("gap", k) for k in args.gap_sweep]
            for knob, value in sweeps if x == top else ():
                tasks.append({"preset": name, "x": x, "seed": seed, "label": sweep_label(knob, value),
                              "policy": SKIP_JOIN, "mode": "swap", "proactive": True, "slack": 0.0,
                              "loan": LOAN_TOKENS, "sweep": {knob: value}, "jobs": jobs, "model": p["model"],
                              "device": p["device"], "pool": p["pool"]})
    return tasks, capacity, lengths


# Presets where memory does not bind, or prompts do (the targets there: no
# figure worse than fcfs + recompute); on the rest it binds.
NOT_MEMORY_BOUND = ("memory does not bind", "arxiv")
DEPENDS = """What the figures depend on: the pool fraction (how often memory binds at
all: with the whole pool only bursts make the scheduler evict), the host
link's speed (a round trip costs ``2 * blocks * block bytes / PCIe
bandwidth``, and the per-step swap allowance is what the link moves in one
minimum iteration: a slower link means fewer, costlier evictions and more
stall), the load (the queue that skip-join lets short jobs pass) and, for
the deadline variants, the slack: a streaming request may be away for
``(slack - 1)`` steps per token it has streamed, so a larger slack buys the
scheduler more evictions and costs the tail more. For the KV-loan variants,
the cap (``--swap-loan-tokens``) and the share of requests whose
``max_tokens`` is at most the cap: the simulator's jobs carry their true
output length as ``max_tokens``, so every short request borrows; a client
that sends a loose cap gets the keep-your-place rule alone (the sweep's
``--swap-loan-tokens 0`` row).
A stream lends a quarter of a step per token it has streamed
(scheduler/loans.py ``LEND_SHARE``), and a request without a bound that has
waited twice the mean admission wait (``STARVING_WAITS``, at least the MLFQ
starve limit) keeps the blocks it needs from those ranked below it. Such a
request is admitted with a block to spare for each resident that needs one
within 8 decodes (``GROWTH_STEPS``): fewer admit more in a burst and leave
the residents' growth to the eviction rules (more swap traffic). It also
takes blocks owed to streams on the host (or to a starving request) when its
max_tokens ends its stay before the residents, by theirs, free enough for
any of them (backfilling): the tighter the clients' caps, the more it acts. The
first-token guard (slack 0 tokens) decides where memory does not bind: there
P99 TTFT no worse than fcfs means fcfs's prefill order, and the guard gives
each prompt that order unless an older prompt has slack to give; it stands
aside while an online request is held off the device.
Both sides run the same step token budget (2048): it moves fcfs +
recompute's own figures as much as the ranking does
(``benchmarks/token_budget.py``). A token-gap bound below a full-budget
step (the ``token-gap bound`` rows) cuts prompt chunks beside streams so
each step keeps it, never below the chunk whose fixed cost is half its
time (scheduler.py ``GAP_FLOOR_OVERHEAD``): streams and the blocks they
hold turn over faster, and prompts take more, shorter steps to their first
token, which costs where prompts dominate (the Azure code trace). Memory
still breaks the bound: a stream that needs a block while none is free
waits for one.
``P99 max token gap`` is each request's longest wait between two tokens (its
latency bound). ``swapped GiB`` counts the copies of evictions both ways
and of prefixes brought back from the host; ``demoted GiB`` the freed
cached blocks the prefix cache copies to the host with the link's spare
credit (every run's requests key their prompts, so every preset demotes).
"""


def figure_ratios(base: dict, r: dict) -> tuple[float, float, float]:
    """mean normalized latency and P99 TTFT as fcfs + recompute's over
    this variant's (higher is better), P99 TPOT as this over fcfs'."""
    return (base["mean_norm_latency_s"] / r["mean_norm_latency_s"], base["p99_ttft_s"] / r["p99_ttft_s"],
            r["p99_tpot_s"] / base["p99_tpot_s"])


CLAIRVOYANT_NOTE = """The clairvoyant reference ranks by what no server knows, each job's true
output length (weighted shortest remaining time first, the order that
minimizes mean normalized latency on one machine): it shows how far ranking
alone can move the mean on a preset, and what that order does to the
tails; with KV loans (the default flags) it shows the same beside the
engine's memory rules. The size-blind reference ranks by what a server
could learn from the requests it has finished: the distribution of output
lengths, not each job's (the Gittins index for mean normalized latency,
``SizeBlindPolicy``: queueing theory's index order for jobs of unknown
length on one machine). Beside the engine's memory rules it shows how far
a ranking that learned the lengths' shape could go, and its gap to the
clairvoyant reference is what only knowing each length buys."""

REMAINING_AFTER = (0, 32, 128, 256, 512)
REMAINING_NOTE = """Skip-join demotes a job as it is served: it bets that a job which has
run long has long to go. Where the mean left grows as a job runs (OPT-13B's
ShareGPT lengths cut at 2048: half the jobs end within 32 tokens, the rest
have 374 left; arXiv past 128 tokens) the bet pays. Where it falls (the
ShareGPT lengths as the Llama and CPU presets cut them) the job served
longest is the nearest to its end, and no ranking that sees only how long
each job has run picks the short ones out; where it stays flat (the chat
mix's exponential replies) having run says nothing. A ranking that learns
the distribution (the size-blind reference) takes whichever of these the
lengths show, and weighs the prompt it knows against them."""


def output_left(meta: dict) -> list[str]:
    """Each preset's output lengths: of the jobs that have emitted ``a``
    tokens, how many are left and how much they have left."""
    left = meta.get("output_left")
    if not left:
        return []
    out = ["## What having run says of a job", "",
           "Of each preset's output lengths (the distribution the size-blind reference knows): the share of jobs "
           "longer than a tokens, and their mean tokens left after a.", "",
           "| preset | " + " | ".join(f"a = {a}" for a in REMAINING_AFTER) + " |",
           "|---|" + "---|" * len(REMAINING_AFTER)]
    for preset, points in left.items():
        out.append(f"| {preset} | " + " | ".join(f"{share:.0%}: {mean:.0f}" for _, share, mean in points) + " |")
    return out + ["", REMAINING_NOTE]


def targets(rows: list[dict]) -> list[str]:
    """At the highest load or speed of each preset, the two swap variants
    against fcfs + recompute, each seed against its own baseline, and
    whether the median over seeds meets each target: where memory binds,
    mean normalized latency >= 2x, P99 TTFT no worse, P99 TPOT <= 1.25x;
    where it does not (and on arXiv), no figure worse; swap stall under 3%
    of the makespan everywhere."""
    seeds = list(dict.fromkeys(r["seed"] for r in rows))
    out = ["## Targets at the highest load (or speed)", "",
           f"Medians over seeds {', '.join(map(str, seeds))} (a trace replays its jobs: one run), "
           "each seed's run against fcfs + recompute on the same jobs; the seeds' own ratios in brackets.", "",
           "| preset | variant | mean norm (fcfs / this) | P99 TTFT (fcfs / this) | P99 TPOT (this / fcfs) "
           "| swapped GiB | demoted GiB | stall / makespan | met |", "|---|---|---|---|---|---|---|---|---|"]
    swap_variants = [v[0] for v in VARIANTS if v[2] == "swap"]
    swap_variants += [v for v in dict.fromkeys(r["variant"] for r in rows) if v.startswith(SWEPT)]

    def cell(values: list[float], fmt: str, unit: str = "x") -> str:
        med = f"{statistics.median(values):{fmt}}{unit}"
        return med if len(values) == 1 else f"{med} [{' / '.join(f'{v:{fmt}}' for v in values)}]"

    for preset in dict.fromkeys(r["preset"] for r in rows):
        sub = [r for r in rows if r["preset"] == preset]
        top = max(r["x"] for r in sub)
        base = {r["seed"]: r for r in sub if r["x"] == top and r["variant"] == VARIANTS[0][0]}
        bound = not any(k in preset for k in NOT_MEMORY_BOUND)
        for variant in swap_variants:
            runs = [r for r in sub if r["x"] == top and r["variant"] == variant]
            if not runs:  # a sweep of one preset's alone
                continue
            ratios = list(zip(*(figure_ratios(base[r["seed"]], r) for r in runs)))
            norm, ttft, tpot = (statistics.median(v) for v in ratios)
            stall = statistics.median(r["stall_share"] for r in runs)
            checks = {"mean": norm >= (2.0 if bound else 1.0), "TTFT": ttft >= 1.0,
                      "TPOT": tpot <= (1.25 if bound else 1.0), "stall": stall < 0.03}
            missed = [k for k, ok in checks.items() if not ok]
            met = ("reference" if variant in REFERENCES
                   else "all" if not missed else "not " + ", ".join(missed))
            out.append(f"| {preset} | {variant} | {cell(ratios[0], '.2f')} | {cell(ratios[1], '.2f')} | "
                       f"{cell(ratios[2], '.2f')} | {cell([r['swap_gib'] for r in runs], '.0f', '')} | "
                       f"{cell([r['demoted_gib'] for r in runs], '.0f', '')} | "
                       f"{cell([100 * r['stall_share'] for r in runs], '.2f', '%')} | {met} |")
    return out + ["", CLAIRVOYANT_NOTE, "", DEPENDS]


SHARES_NOTE = """A ranking decides the first part: who waits for a first token. The second
is the time between a request's tokens, which every resident pays for the
batch it rides in and the prefill chunks that share its steps; a ranking
moves it only as far as it changes those batches. The ceiling of a
variant is fcfs + recompute's mean over its decode share: what its
ranking would gain with no wait for first tokens at all, its batches
unchanged. The jobs alone, each on an idle device, are a floor no
scheduler passes, and their ceiling (fcfs + recompute's mean over theirs)
bounds every scheduler's gain (no floor for the chat mix, whose turns find
earlier turns in the prefix cache)."""

SHARE_VARIANTS = (VARIANTS[0][0], LOANS_OFF, loan_label(LOAN_TOKENS), CLAIRVOYANT_LOANS, SIZE_BLIND_LOANS, ALONE)


def where_the_mean_goes(rows: list[dict]) -> list[str]:
    """Each memory-bound preset's mean normalized latency at the highest
    load as its wait for the first token and its decode time (medians over
    seeds, ms per output token)."""
    out = ["## Where the mean goes", "",
           "Mean normalized latency = mean of TTFT / output tokens + mean of (last token - first token) / "
           "output tokens, at the highest load or speed; medians over the seeds (ms per output token).", "",
           "| preset | variant | mean norm | first-token share | decode share | ceiling over fcfs + recompute |",
           "|---|---|---|---|---|---|"]
    for preset in dict.fromkeys(r["preset"] for r in rows):
        if any(k in preset for k in NOT_MEMORY_BOUND):
            continue
        sub = [r for r in rows if r["preset"] == preset]
        top = max(r["x"] for r in sub)
        base = {r["seed"]: r for r in sub if r["x"] == top and r["variant"] == VARIANTS[0][0]}
        for variant in SHARE_VARIANTS:
            runs = [r for r in sub if r["x"] == top and r["variant"] == variant and "mean_ttft_share_s" in r]
            if not runs:
                continue
            med = {k: 1e3 * statistics.median(r[k] for r in runs)
                   for k in ("mean_norm_latency_s", "mean_ttft_share_s", "mean_decode_share_s")}
            part = "mean_norm_latency_s" if variant == ALONE else "mean_decode_share_s"
            reach = statistics.median(base[r["seed"]]["mean_norm_latency_s"] / r[part] for r in runs)
            out.append(f"| {preset} | {variant} | {med['mean_norm_latency_s']:.2f} | "
                       f"{med['mean_ttft_share_s']:.2f} | {med['mean_decode_share_s']:.2f} | {reach:.2f}x |")
    return out + ["", SHARES_NOTE]


def to_markdown(rows: list[dict], capacity: dict, meta: dict) -> str:
    out = ["# Two-tier KV in the simulator: recompute vs proactive swapping, with and without token deadlines", "",
           f"Roofline cost model; block {BLOCK} tokens; host pool {HOST_GIB} GiB; token budget 2048, request cap 256; "
           f"{meta['num_jobs']} jobs per synthetic run (trace: first {meta['trace_jobs']}); the tables after the "
           f"targets are seed {meta['seeds'][0]}'s. "
           "Load = arrival rate / saturated fcfs + recompute throughput: "
           + ", ".join(f"{k} {v:.2f} req/s" for k, v in capacity.items()) + ".",
           f"Command: `{meta['command']}` ({meta['wall_s']:.0f} s wall).",
           f"Chat mix (`chat_jobs`): conversations start as a gamma process (CV {CHAT.cv:g}); turns per "
           f"conversation geometric with mean {CHAT.turns:g}, user messages and replies exponential with means "
           f"{CHAT.user:g} and {CHAT.reply:g} tokens (LMSYS-Chat-1M, Zheng et al. 2023); each turn's prompt is "
           f"the conversation's own {CHAT.context}-token opening context plus the whole history, so it extends "
           "the previous turn's prompt and the prefix cache (on, as in the engine, for fcfs + recompute too: "
           "device only there, no host pool) serves what it still holds; a turn comes "
           f"{CHAT.think_s:g} s on average after the reply before it has finished (the context, think time "
           "and CV are assumptions).", ""]
    out += targets(rows) + [""] + where_the_mean_goes(rows) + [""] + output_left(meta)
    rows = [r for r in rows if r["seed"] == meta["seeds"][0] and r["variant"] != ALONE]
    for preset in dict.fromkeys(r["preset"] for r in rows):
        sub = [r for r in rows if r["preset"] == preset]
        xname = "speed" if "azure" in preset else "load"
        out += [f"## {preset} ({sub[0]['num_kv_blocks']} device blocks)", "",
                f"| {xname} | variant | " + " | ".join(m[1] for m in METRICS)
                + " | recomputes | swap-outs | swapped GiB | demoted GiB | stall / makespan "
                  "| requests over the gap bound | fcfs+recompute / this: mean norm | P99 TTFT "
                  "| this / fcfs+recompute: P99 TPOT |",
                "|" + "---|" * (len(METRICS) + 11)]
        base = {r["x"]: r for r in sub if r["variant"] == VARIANTS[0][0]}
        for r in sub:
            b = base[r["x"]]
            vals = " | ".join(f"{r[k] * s:.3g}" for k, _, s in METRICS)
            ratios = " | ".join(f"{x:.2f}x" for x in figure_ratios(b, r))
            out.append(f"| {r['x']:g} | {r['variant']} | {vals} | {r['num_recomputes']} | {r['num_swap_outs']} | "
                       f"{r['swap_gib']:.1f} | {r['demoted_gib']:.1f} | {100 * r['stall_share']:.2f}% | "
                       f"{r.get('num_over_gap_bound', '-')} | "
                       f"{ratios} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload-dir", default=str(DEFAULT_WORKLOAD_DIR))
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--num-jobs", type=int, default=600)
    ap.add_argument("--trace-jobs", type=int, default=1500)
    ap.add_argument("--capacity-jobs", type=int, default=300)
    ap.add_argument("--loads", default="0.7,0.9")
    ap.add_argument("--speeds", default="1,2")
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6",
                    help="synthetic jobs' seeds: the first runs everything, the others the main variants at the "
                         "highest load; the targets take the median")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--slack-sweep", default="1.1,1.5,2,4",
                    help="also run proactive swap at these --swap-tpot-slack values at the highest load or speed")
    ap.add_argument("--loan-sweep", default="0,1,8,128",
                    help="also run KV loans with these --swap-loan-tokens caps at the highest load or speed")
    ap.add_argument("--starving-sweep", default="3,6,12",
                    help="also run the default flags with scheduler/loans.py's STARVING_WAITS at these values "
                         f"(default {STARVING_WAITS:g}), at the highest load on every seed")
    ap.add_argument("--growth-sweep", default="0,4,16",
                    help="also run the default flags with scheduler.py's GROWTH_STEPS at these values "
                         f"(default {GROWTH_STEPS}; 16: every resident), at the highest load on every seed")
    ap.add_argument("--guard-sweep", default="off,2048",
                    help="also run the default flags with the first-token guard at these slacks in tokens "
                         "('off': FastServe's skip-join alone; default 0), at the highest load on every seed")
    ap.add_argument("--backfill-sweep", default="off",
                    help="also run the default flags with backfilling 'off' (--no-swap-backfill), at the highest "
                         "load on every seed ('' : not)")
    ap.add_argument("--cache-sweep", default="device,off",
                    help="also run the default flags on the chat mix with the prefix cache on the device only "
                         "('device') or off ('off'), at the highest load on every seed")
    ap.add_argument("--gap-sweep", default="0.2,0.5",
                    help="also run the default flags with --max-token-gap-ms of these fractions of a full-budget "
                         "step, at the highest load on every seed")
    args = ap.parse_args(argv)
    args.slack_sweep = [float(x) for x in args.slack_sweep.split(",") if x]
    args.gap_sweep = [float(x) for x in args.gap_sweep.split(",") if x]
    args.starving_sweep = [float(x) for x in args.starving_sweep.split(",") if x]
    args.growth_sweep = [int(x) for x in args.growth_sweep.split(",") if x]
    args.guard_sweep = [None if x == "off" else int(x) for x in args.guard_sweep.split(",") if x]
    args.loan_sweep = [int(x) for x in args.loan_sweep.split(",") if x]
    args.cache_sweep = [x for x in args.cache_sweep.split(",") if x]
    args.backfill_sweep = [x == "on" for x in args.backfill_sweep.split(",") if x]
    if args.quick:
        args.num_jobs, args.trace_jobs, args.capacity_jobs, args.loads, args.speeds = 150, 300, 120, "0.9", "1"
    args.loads = [float(x) for x in args.loads.split(",")]
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    args.speeds = [float(x) for x in args.speeds.split(",")]
    t0 = time.perf_counter()
    tasks, capacity, lengths = build_tasks(args)
    print(f"{len(tasks)} simulations on {args.workers} workers ...", file=sys.stderr)
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(run_task, tasks, chunksize=1))
    meta = {"num_jobs": args.num_jobs, "trace_jobs": args.trace_jobs, "seeds": args.seeds,
            "command": "python benchmarks/swapping.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "wall_s": time.perf_counter() - t0, "python": platform.python_version(),
            "output_left": {name: mean_remaining(x, REMAINING_AFTER) for name, x in lengths.items()}}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "swapping_quick" if args.quick else "swapping"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "capacity_rps": capacity, "rows": rows}, indent=1))
    md = to_markdown(rows, capacity, meta)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
