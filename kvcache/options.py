"""Command-line flags of the two KV tiers (names and meanings as vLLM's where
vLLM has the flag), kept beside the accounting they size."""

from __future__ import annotations

import argparse


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV cache tiers")
    g.add_argument(
        "--swap-space", type=float, default=None, metavar="GIB",
        help="host memory per worker for KV swapped out of the device, in GiB (pinned on CUDA); "
             "0 turns the host tier off (default: 4, or a quarter of the free RAM if less)",
    )
    g.add_argument(
        "--num-host-blocks", type=int, default=None, metavar="N",
        help="host KV blocks, overriding --swap-space (tests, benchmarks)",
    )
    g.add_argument(
        "--preemption-mode", default="swap", choices=["swap", "recompute"],
        help="swap: a preempted request's KV moves to host memory and a request the scheduler ranks "
             "higher may evict lower-ranked ones (FastServe); recompute: KV is discarded and "
             "prefilled again, and a waiting request takes only free blocks (vLLM's behaviour)",
    )
    g.add_argument(
        "--proactive-swap", action=argparse.BooleanOptionalAction, default=True,
        help="swap in a step ahead of a request's turn and keep free device blocks for arrivals "
             "(--no-proactive-swap: swap only when a step needs it)",
    )

    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="share the KV of prompt prefixes already in the cache (full blocks), as vLLM does; "
             "--no-enable-prefix-caching recomputes every prompt",
    )


def options_from_args(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments of these flags."""
    if args.swap_space is not None and args.swap_space < 0:
        raise ValueError(f"--swap-space must be >= 0, got {args.swap_space}")
    if args.num_host_blocks is not None and args.num_host_blocks < 0:
        raise ValueError(f"--num-host-blocks must be >= 0, got {args.num_host_blocks}")
    return {"swap_space": args.swap_space, "num_host_blocks": args.num_host_blocks,
            "preemption_mode": args.preemption_mode, "proactive_swap": args.proactive_swap,
            "enable_prefix_caching": args.enable_prefix_caching}
