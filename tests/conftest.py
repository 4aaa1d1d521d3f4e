"""Shared fixtures: tiny random-weight checkpoints built once per session, and
engines that are checked for leaked KV blocks when a test ends."""

from __future__ import annotations

import json
import os

import torch

# Triton takes the interpreter or the compiler when it is first imported: on
# a machine without CUDA every Triton kernel (the kernel tests, the engine's
# FLUIDSERVE_KERNELS=triton lane) runs interpreted on CPU tensors.
if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

import pytest  # noqa: E402

from fluidserve.engine.tiny_model import build_tiny_model  # noqa: E402
from worker_turns import worker_turn  # noqa: E402


# Why the suite's patch of Triton's interpreter is not in force (None: it is).
_INTERPRETER_PATCH = pytest.StashKey[str | None]()


def pytest_configure(config):
    """Stop at once, with the fix, where the interpreter cannot run the
    kernels beside this numpy (a hundred tests would otherwise fail with a
    TypeError inside Triton); else patch it to patch the language once a
    launch (tests/triton_interpreter.py)."""
    if os.environ["TRITON_INTERPRET"] == "1":
        from fluidserve.kernels.ops import interpreter_incompatibility

        problem = interpreter_incompatibility()
        if problem:
            raise pytest.UsageError(problem)
        from triton_interpreter import install

        config.stash[_INTERPRETER_PATCH] = install()


@pytest.hookimpl(hookwrapper=True)  # the old style: the GPU machine's pytest may predate wrapper=True
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist (the README's ``-n 2``), a test marked ``alone``
    runs while no other worker is inside a test; every other test runs
    beside whatever else runs. Tests that watch the machine's load (the CPU
    share's neighbours) would otherwise count the next worker as one."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    room = item.config._tmp_path_factory.getbasetemp().parent  # one per run, shared by its workers
    with worker_turn(room, alone=item.get_closest_marker("alone") is not None):
        yield


def pytest_report_header(config):
    if _INTERPRETER_PATCH in config.stash:
        why = config.stash[_INTERPRETER_PATCH]
        return "triton interpreter: " + ("patches the language once a launch" if why is None
                                         else f"as shipped, patching it at every device-function call ({why})")
    return None


# arch -> config overrides; llama is GQA (4 query heads over 2 KV heads), opt is MHA.
TINY_ARCHS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 24},  # short window so generation crosses it
    "opt": {},
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, **overrides) -> directory of a saved checkpoint."""
    cache: dict = {}

    def build(arch: str = "llama", **overrides) -> str:
        key = (arch, json.dumps(overrides, sort_keys=True))  # lists and dicts among the values
        if key not in cache:
            kw = {**TINY_ARCHS.get(arch, {}), **overrides}
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = str(build_tiny_model(path, arch, **kw))
        return cache[key]

    return build


@pytest.fixture
def make_llm():
    """Build LLMs on CPU; at teardown every KV block must be free again and
    the block accounting consistent."""
    from fluidserve.engine import LLM

    made = []

    def make(model: str, **kwargs):
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("num_kv_blocks", 128)
        if kwargs["device"] != "cpu" and "num_host_blocks" not in kwargs:
            # The default host tier is 4 GiB, pinned on CUDA: resident from the
            # start. Sixteen test workers holding two or three engines each
            # would pin more than the machine has.
            kwargs.setdefault("swap_space", 0.25)
        llm = LLM(model=model, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        engine = llm.engine
        assert not engine.has_unfinished_requests(), "a request was left in the engine"
        assert engine.kv.num_used_blocks == 0, f"{engine.kv.num_used_blocks} KV blocks leaked"
        engine.kv.check_integrity()
        # Each engine reserves a host KV pool (4 GiB by default) and sits in
        # reference cycles: held until a full collection, several would pile
        # up, and a later test that forks (Ray) would be refused by the
        # kernel's overcommit check. Shutting it down frees its caches now,
        # and Ray workers with them; a collection here instead would walk
        # the whole heap, half a second or more after every test.
        engine.shutdown()
    llm = engine = None
    made.clear()
