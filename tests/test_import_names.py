"""The checkout's folders install as ``fluidserve.*`` and must hide no PyPI
package, however Python is started: transformers imports PyPI's
``kernels`` as soon as that is installed (transformers 5.25 requires it),
and a ``python -m``/``python -c`` run from the checkout's root puts the root,
and its ``kernels/`` folder, first on ``sys.path``; a benchmark run as a
script puts ``benchmarks/`` there."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pypi_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_kernels_from_the_checkouts_root_is_pypis_package():
    done = _run("import sys, kernels; assert sys.path[0] == ''; print(kernels.__file__)")
    if _pypi_kernels_installed():
        assert done.returncode == 0, done.stderr[-2000:]
        found = Path(done.stdout.strip()).resolve()
        assert not found.is_relative_to(ROOT), found
    else:
        assert done.returncode != 0 and "fluidserve's kernels are fluidserve.kernels" in done.stderr


def test_transformers_imports_beside_the_checkout_and_the_benchmarks():
    """A Llama config and its activations (which import the hub kernels)
    from the root, with the benchmarks' folder first on the path as when a
    benchmark runs; our own kernels stay ``fluidserve.kernels``."""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks')\n"
        "import transformers.activations\n"
        "from transformers import LlamaConfig\n"
        "LlamaConfig(hidden_size=64)\n"
        "import fluidserve.kernels.ops, kernel_bench\n"
        "assert fluidserve.kernels.ops.__name__ == 'fluidserve.kernels.ops'\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr[-2000:]
