"""Command-line flags of the two KV tiers (names and meanings as vLLM's where
vLLM has the flag), made from CacheConfig's declarations."""

from __future__ import annotations

import argparse

from fluidserve.kvcache.config import CacheConfig, add_flags


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("KV cache tiers"), CacheConfig)
