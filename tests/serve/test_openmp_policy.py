"""OpenMP's wait policy: the library leaves torch's (idle threads spin a
while: a batch job owns its cores), ``fluidserve serve`` makes idle threads
sleep before torch loads (its event loop shares the cores), and a policy the
user set wins either way."""

from __future__ import annotations

import os
import subprocess
import sys

ENGINE = "import fluidserve.engine, os; print(os.environ.get('OMP_WAIT_POLICY'))"
# The CLI's main, as `fluidserve serve --help` runs it: the policy is set
# before anything loads torch; --help then exits.
SERVER = """import os, sys
from fluidserve.serve import cli
assert 'torch' not in sys.modules
try:
    cli.main(['serve', '--help'])
except SystemExit:
    pass
print(os.environ.get('OMP_WAIT_POLICY'))"""


def _policy(code: str, env_value: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_the_library_leaves_the_policy_to_torch():
    assert _policy(ENGINE) == "None"


def test_the_server_makes_idle_threads_sleep():
    assert _policy(SERVER) == "PASSIVE"


def test_a_policy_the_user_set_wins():
    assert _policy(SERVER, env_value="ACTIVE") == "ACTIVE"
