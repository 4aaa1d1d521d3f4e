"""benchmarks/gpu_check.sh, the one GPU command, on a machine without CUDA:
it must stop at once with a non-zero status and say why, before installing
or running anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the script's real job")
def test_gpu_check_fails_clearly_without_cuda(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "--results", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 1
    assert "no CUDA device" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing installed, run or written


def test_gpu_check_refuses_unknown_arguments():
    done = subprocess.run(["bash", str(SCRIPT), "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown argument --no-such-flag" in done.stderr
