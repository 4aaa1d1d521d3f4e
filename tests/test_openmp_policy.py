"""Importing the engine before torch makes idle OpenMP threads sleep (as the
server does), unless the user chose a policy; after torch has loaded OpenMP
the setting would be a lie, so the engine leaves it alone."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "import sys; {pre}import fluidserve.engine, os; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy(pre: str = "", env_value: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], capture_output=True, text=True,
                         env=env, check=True)
    return out.stdout.strip()


def test_engine_import_sets_passive_wait_policy():
    assert _policy() == "PASSIVE"


def test_a_policy_the_user_set_wins():
    assert _policy(env_value="ACTIVE") == "ACTIVE"


def test_left_alone_once_torch_has_loaded_openmp():
    assert _policy(pre="import torch; ") == "None"
