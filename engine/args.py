"""The engine's command-line flags, made from the config tree's declarations
(``setting`` in kvcache/config.py), and the ``EngineConfig`` they give, as
vLLM's ``EngineArgs`` does: a setting added to a config is a flag, with its
default and help, without a line here."""

from __future__ import annotations

import argparse

from fluidserve.engine.config import EngineConfig, LoRAConfig, ParallelConfig
from fluidserve.kvcache.config import CacheConfig, add_flags, flag_error, flag_values
from fluidserve.kvcache.options import add_cli_args as add_cache_args
from fluidserve.scheduler.config import SchedulerConfig
from fluidserve.scheduler.options import add_cli_args as add_scheduler_args
from fluidserve.scheduler.options import options_from_args as policy_options_from_args

CONFIGS = (EngineConfig, SchedulerConfig, CacheConfig, ParallelConfig, LoRAConfig)


def add_engine_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Every engine flag, in groups; returns the first ("model and engine"),
    where the caller adds what is not a setting (the model's name, ...)."""
    engine = parser.add_argument_group("model and engine")
    add_flags(engine, EngineConfig)
    add_flags(parser.add_argument_group("parallelism"), ParallelConfig)
    add_flags(parser.add_argument_group("LoRA adapters"), LoRAConfig)
    add_scheduler_args(parser)
    add_cache_args(parser)
    return engine


def engine_config_from_args(args: argparse.Namespace, **settings) -> EngineConfig:
    """The config the flags give; ``settings`` (flat names) are the ones
    the caller resolves itself (the model, its served name). A bad value is
    a ValueError naming its flag."""
    try:
        policy, policy_options = policy_options_from_args(args)
        flat = {name: value for cls in CONFIGS for name, value in flag_values(args, cls).items()}
        return EngineConfig.create(**{**flat, "scheduling_policy": policy, "policy_options": policy_options,
                                      **settings})
    except ValueError as exc:
        raise flag_error(exc, CONFIGS) from None
