"""The config tree (engine/config.py, scheduler/config.py, kvcache/config.py):
every setting declared once, the flags made from the declarations, flat
names routed to the config that owns them."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from fluidserve.engine.args import CONFIGS
from fluidserve.engine.config import EngineConfig, ParallelConfig
from fluidserve.kvcache.config import CacheConfig, cli_fields, flag_name
from fluidserve.scheduler.config import SchedulerConfig
from fluidserve.scheduler.simulator import SimConfig
from fluidserve.serve import cli


def leaf_names(cls: type) -> list[str]:
    names = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        names += leaf_names(sub) if dataclasses.is_dataclass(sub) else [f.name]
    return names


@pytest.mark.parametrize("tree", [EngineConfig, SimConfig])
def test_every_setting_has_one_name_in_its_tree(tree):
    names = leaf_names(tree)
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_the_simulator_embeds_the_engines_scheduler_and_cache_configs():
    kinds = {f.name: f.default_factory for f in dataclasses.fields(SimConfig)
             if f.default_factory is not dataclasses.MISSING}
    assert kinds == {"scheduler": SchedulerConfig, "cache": CacheConfig}


def test_serve_help_lists_every_setting_once_with_its_default():
    parser = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    options = [o for a in parser._actions for o in a.option_strings]
    assert len(options) == len(set(options))  # no flag twice
    flags = [flag_name(f) for cls in CONFIGS for f in cli_fields(cls)]
    assert len(flags) > 25 and set(flags) <= set(options)
    text = parser.format_help()
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] != "-h":
            assert action.help and "default" in action.help, action.option_strings
            assert action.option_strings[0] in text


def test_flags_give_the_configs_defaults():
    config = cli.engine_config_from_args(cli.build_parser().parse_args(["serve"]))
    # The server alone protects online requests beside offline work without an SLO flag.
    cap = cli.COSERVING_SLOWDOWN_CAP
    assert config.scheduler == SchedulerConfig(online_slowdown_cap=cap) and config.cache == CacheConfig()
    assert config.parallel == ParallelConfig()
    # The server alone yields cores other processes keep busy (its idle OpenMP threads spin).
    assert config == EngineConfig(yield_busy_cores=True).replace(online_slowdown_cap=cap)
    assert EngineConfig().yield_busy_cores is None


def test_flat_names_reach_the_config_that_owns_them():
    c = EngineConfig.create(model="m", block_size=8, max_num_seqs=4, tensor_parallel_size=2, online_tpot_slo_ms=40.0)
    assert (c.cache.block_size, c.scheduler.max_num_seqs, c.parallel.tensor_parallel_size) == (8, 4, 2)
    assert (c.block_size, c.max_num_seqs, c.online_tpot_slo_ms) == (8, 4, 40.0)  # read through
    d = c.replace(block_size=32, device="cpu", max_num_seqs=8)
    assert (d.cache.block_size, d.device, d.max_num_seqs, d.tensor_parallel_size) == (32, "cpu", 8, 2)
    assert pickle.loads(pickle.dumps(c)) == c  # it crosses to Ray actors
    with pytest.raises(TypeError, match="unknown setting.*bogus"):
        EngineConfig.create(bogus=1)
    with pytest.raises(AttributeError, match="no setting 'bogus'"):
        _ = c.bogus


def test_each_setting_is_checked_where_it_is_declared():
    with pytest.raises(ValueError, match="^max_num_seqs must be positive"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="^gpu_memory_utilization must be in"):
        CacheConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="^block_size must be one of"):  # the kernels' sizes: an engine check
        EngineConfig.create(block_size=4)
    assert CacheConfig(block_size=4).block_size == 4  # the accounting and the simulator take any
    assert SchedulerConfig(kv_checkpoint_threshold=1.0).kv_checkpoint_threshold is None  # 1: off


def test_a_bad_flag_value_names_the_flag():
    parse = cli.build_parser().parse_args
    with pytest.raises(ValueError, match="^--max-num-seqs must be positive"):
        cli.engine_config_from_args(parse(["serve", "--max-num-seqs", "0"]))
    with pytest.raises(ValueError, match="^--gpu-memory-utilization must be in"):
        cli.engine_config_from_args(parse(["serve", "--gpu-memory-utilization", "2"]))
    with pytest.raises(ValueError, match="^--tensor-parallel-size must be positive"):
        cli.engine_config_from_args(parse(["serve", "-tp", "0"]))


def test_the_server_protects_online_requests_beside_offline_work_unless_told():
    parse = cli.build_parser().parse_args

    def cap(*argv: str):
        return cli.engine_config_from_args(parse(["serve", *argv])).scheduler.online_slowdown_cap

    assert cap() == cli.COSERVING_SLOWDOWN_CAP  # requests of priority > 0 are offline work too
    assert cap("--data-dir", "/d") == cli.COSERVING_SLOWDOWN_CAP
    assert cap("--data-dir", "/d", "--online-slowdown-cap", "0") is None  # off, as asked
    assert cap("--data-dir", "/d", "--online-slowdown-cap", "1.5") == 1.5
    assert cap("--data-dir", "/d", "--online-tpot-slo-ms", "30") is None  # an SLO replaces it


def test_kv_loans_are_on_by_default_with_or_without_a_batch_api():
    parse = cli.build_parser().parse_args

    def loans(*argv: str):
        return cli.engine_config_from_args(parse(["serve", *argv])).scheduler.swap_loan_tokens

    assert loans() == SchedulerConfig().swap_loan_tokens == 32
    assert loans("--swap-loan-tokens", "8") == 8
    assert loans("--swap-loan-tokens", "-1") is None  # off
    assert loans("--data-dir", "/d") == 32  # beside a Batch API too (coserving_server-kv-loans.md)
    assert loans("--data-dir", "/d", "--swap-loan-tokens", "-1") is None


def test_a_cpu_server_with_the_batch_api_checks_for_online_arrivals_twice_a_layer():
    parse = cli.build_parser().parse_args

    def layers(*argv: str) -> float:
        return cli.engine_config_from_args(parse(["serve", "--device", "cpu", *argv])).scheduler \
            .preemption_safepoint_layers

    default = SchedulerConfig().preemption_safepoint_layers
    assert layers() == default  # nothing offline to interrupt
    assert layers("--data-dir", "/d") == cli.COSERVING_CPU_SAFEPOINT_LAYERS
    assert layers("--data-dir", "/d", "--preemption-safepoint-layers", "2") == 2  # as asked
    assert layers("--data-dir", "/d", "--preemption-safepoint-layers", "0") == 0
    on_gpu = cli.engine_config_from_args(parse(["serve", "--device", "cuda", "--data-dir", "/d"]))
    assert on_gpu.scheduler.preemption_safepoint_layers == default


def test_data_parallel_flags_and_the_routing_policies_the_router_knows():
    from fluidserve.engine.config import ROUTING_POLICIES
    from fluidserve.scheduler import router

    assert ROUTING_POLICIES == router.ROUTING_POLICIES
    assert EngineConfig().parallel.routing_balance_threshold_ms == router.DEFAULT_BALANCE_THRESHOLD_S * 1e3
    parse = cli.build_parser().parse_args
    config = cli.engine_config_from_args(parse(["serve", "-dp", "3", "--routing-policy", "least-loaded"]))
    assert (config.data_parallel_size, config.routing_policy) == (3, "least-loaded")
    assert config.replace(data_parallel_size=1).routing_policy == "least-loaded"
    with pytest.raises(ValueError, match="^--data-parallel-size must be positive"):
        cli.engine_config_from_args(parse(["serve", "--data-parallel-size", "0"]))
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse(["serve", "--routing-policy", "random"])
