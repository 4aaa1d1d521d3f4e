"""Command-line flags of the scheduler: SchedulerConfig's (made from its
declarations) and the policies' own knobs, kept beside the policies they
set so the CLI never has to know a policy's knobs."""

from __future__ import annotations

import argparse

from fluidserve.kvcache.config import add_flags
from fluidserve.scheduler.config import DEFAULT_SAFEPOINT_LAYERS, SchedulerConfig

__all__ = ["DEFAULT_SAFEPOINT_LAYERS", "add_cli_args", "options_from_args"]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """SchedulerConfig's flags, and the policies' own knobs."""
    g = parser.add_argument_group("scheduling")
    add_flags(g, SchedulerConfig)
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
    g.add_argument(
        "--mlfq-first-token-slack", default=None, metavar="TOKENS|off",
        help="skip-join MLFQ: while memory does not bind, no prompt's first token comes later than "
             "first-come-first-served would give it, plus this many prefill tokens (default 0; 'off': "
             "FastServe's skip-join alone, which trades the P99 TTFT for the mean)",
    )


def options_from_args(args: argparse.Namespace) -> tuple[str, dict]:
    """(policy name, policy options) for SchedulerConfig.scheduling_policy
    and SchedulerConfig.policy_options; only flags actually given are included."""
    options = {
        "num_queues": args.mlfq_num_queues,
        "base_quantum_ms": args.mlfq_base_quantum_ms,
        "starve_limit_ms": args.mlfq_starve_limit_ms,
    }
    for name, value in options.items():
        if value is not None and not value > 0:
            raise ValueError(f"--mlfq-{name.replace('_', '-')} must be positive, got {value}")
    options = {k: v for k, v in options.items() if v is not None}
    slack = getattr(args, "mlfq_first_token_slack", None)
    if slack is not None:
        if slack == "off":
            options["first_token_slack"] = None
        elif not slack.isdigit():
            raise ValueError(f"--mlfq-first-token-slack must be a number of tokens >= 0 or 'off', got {slack!r}")
        else:
            options["first_token_slack"] = int(slack)
    return args.scheduling_policy, options
