"""Command-line flags of the scheduler, kept beside the policies they set so the
CLI never has to know a policy's knobs."""

from __future__ import annotations

import argparse

from fluidserve.scheduler.policies import DEFAULT_POLICY, POLICIES

# From benchmarks/preemption.py (results/preemption.md): on one rank a check
# is a host-side flag read (under 10 us inside a forward, below 0.01% of a
# layer at any k); under tensor parallelism it is one all-reduce of one int
# among the ranks (1.1-1.9 ms between two gloo processes on the loaded 2-core
# CPU: about 0.5% of a cpu-small layer at k = 2). Not 1: on CUDA a safepoint
# also keeps the host at most one interval ahead of the device, and one layer
# of queued kernels is too little to hide the host's launch time; an
# interrupt waits at most 2 layers.
DEFAULT_SAFEPOINT_LAYERS = 2


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scheduling")
    g.add_argument(
        "--scheduling-policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
        help="order in which requests are offered each step: fcfs (vLLM/Orca), fixed-priority "
             "(shortest prompt first), mlfq (naive, every job enters Q1), skip-join-mlfq "
             f"(FastServe; default {DEFAULT_POLICY})",
    )
    g.add_argument(
        "--online-tpot-slo-ms", type=float, default=None, metavar="MS",
        help="co-serving (ConServe): offline work in a step with online requests is cut so the "
             "step's predicted time stays within this time per output token (default: no cut)",
    )
    g.add_argument(
        "--online-ttft-slo-ms", type=float, default=None, metavar="MS",
        help="co-serving (ConServe): an online arrival interrupts a running offline-only step at its next "
             "layer safepoint when waiting for the step to end would miss this time to first token "
             "(default: any online arrival interrupts one)",
    )
    g.add_argument(
        "--preemption-safepoint-layers", type=float, default=DEFAULT_SAFEPOINT_LAYERS, metavar="K",
        help="co-serving (ConServe): an offline-only step checks for an interrupt every K decoder layers, "
             "a whole or half number: 0.5 also checks between a layer's attention and its MLP, for a "
             "shorter wait where layers are slow, as on a CPU "
             f"(default {DEFAULT_SAFEPOINT_LAYERS}; 0 turns layer-wise preemption off)",
    )
    g.add_argument(
        "--kv-checkpoint-threshold", type=float, default=0.5, metavar="FRACTION",
        help="co-serving (ConServe): past this device-KV usage, offline requests copy their newly "
             "full KV blocks to the host as they run, so evicting one for online work costs no copy "
             "(default 0.5; 1 turns it off)",
    )
    g.add_argument(
        "--mlfq-num-queues", type=int, default=None, metavar="N",
        help="MLFQ: number of priority queues (default 8)",
    )
    g.add_argument(
        "--mlfq-base-quantum-ms", type=float, default=None, metavar="MS",
        help="MLFQ: quantum of Q1; Q(k+1) doubles it (default: the minimum iteration "
             "time from the cost model)",
    )
    g.add_argument(
        "--mlfq-starve-limit-ms", type=float, default=None, metavar="MS",
        help="MLFQ: a job not scheduled for this long is promoted to Q1 (default: "
             "FastServe's 300 ms = 10 iterations, scaled to this model: 10 x the predicted time of a 2048-token step)",
    )


def options_from_args(args: argparse.Namespace) -> tuple[str, dict]:
    """(policy name, policy options) for EngineConfig.scheduling_policy and
    EngineConfig.policy_options; only flags actually given are included."""
    options = {
        "num_queues": args.mlfq_num_queues,
        "base_quantum_ms": args.mlfq_base_quantum_ms,
        "starve_limit_ms": args.mlfq_starve_limit_ms,
    }
    for name, value in options.items():
        if value is not None and not value > 0:
            raise ValueError(f"--mlfq-{name.replace('_', '-')} must be positive, got {value}")
    return args.scheduling_policy, {k: v for k, v in options.items() if v is not None}


def coserving_options_from_args(args: argparse.Namespace) -> dict:
    """The co-serving flags as EngineConfig keyword arguments."""
    for flag in ("online_tpot_slo_ms", "online_ttft_slo_ms"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    k = args.preemption_safepoint_layers
    if k < 0 or not float(2 * k).is_integer():
        raise ValueError(f"--preemption-safepoint-layers must be 0 (off) or a positive whole or half number "
                         f"of layers, got {k:g}")
    if not 0.0 <= args.kv_checkpoint_threshold <= 1.0:
        raise ValueError(f"--kv-checkpoint-threshold must be in [0, 1], got {args.kv_checkpoint_threshold}")
    return {"online_tpot_slo_ms": args.online_tpot_slo_ms, "online_ttft_slo_ms": args.online_ttft_slo_ms,
            "kv_checkpoint_threshold": None if args.kv_checkpoint_threshold >= 1.0 else args.kv_checkpoint_threshold,
            "preemption_safepoint_layers": args.preemption_safepoint_layers}
