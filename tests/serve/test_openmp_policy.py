"""OpenMP on CPU: the library leaves torch's waiting as it is (a batch job
owns its cores); ``fluidserve serve`` bounds idle threads' spin before torch
loads (its event loop shares the cores) and builds its engine on the thread
that steps it (one OpenMP team, whose spin OpenMP does not cut short); a
policy the user set wins either way."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from fluidserve.engine.async_engine import AsyncEngine, EngineThread

ENGINE = ("import fluidserve.engine, os; "
          "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
# The CLI's main, as `fluidserve serve --help` runs it: the policy is set
# before anything loads torch; --help then exits.
SERVER = """import os, sys
from fluidserve.serve import cli
assert 'torch' not in sys.modules
try:
    cli.main(['serve', '--help'])
except SystemExit:
    pass
print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"""


def _policy(code: str, **env_values: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_values)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_the_library_leaves_the_policy_to_torch():
    assert _policy(ENGINE) == "None None"


def test_the_server_bounds_the_spin_of_idle_threads():
    assert _policy(SERVER) == "None 10000"


@pytest.mark.parametrize("env, expected", [({"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE None"),
                                           ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None"),
                                           ({"GOMP_SPINCOUNT": "500"}, "None 500")])
def test_a_policy_the_user_set_wins(env, expected):
    assert _policy(SERVER, **env) == expected


def test_the_engine_is_built_and_stepped_on_one_thread(tiny_model):
    """What ``fluidserve serve`` does: the engine built on an EngineThread,
    whose loop then steps it; a build that raises raises to its caller."""
    from fluidserve.engine import SamplingParams
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.engine import LLMEngine

    host = EngineThread()
    with pytest.raises(ValueError, match="num_kv_blocks"):
        host.build(LLMEngine, EngineConfig.create(model=tiny_model("llama"), device="cpu", num_kv_blocks=1))
    built_on = host.build(threading.get_ident)
    engine = host.build(LLMEngine, EngineConfig.create(model=tiny_model("llama"), device="cpu", num_kv_blocks=64))
    stepped_on: set[int] = set()
    step = engine.step

    def recording_step():
        stepped_on.add(threading.get_ident())
        return step()

    engine.step = recording_step

    async def serve() -> list[int]:
        front = AsyncEngine(engine, thread=host)
        front.start()
        stream = await front.add_request("r", "Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        tokens = [out.outputs[0].token_ids for out in [o async for o in stream]][-1]
        await front.shutdown()
        return tokens

    assert len(asyncio.run(serve())) == 5
    assert stepped_on == {built_on} and built_on != threading.get_ident()
