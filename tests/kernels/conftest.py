"""Shared fixtures of the kernel tests.

Triton decides at decoration time whether a kernel is interpreted, so the
interpreter switch must be set before any kernel module is imported: on a
machine without CUDA every Triton kernel runs in the interpreter on CPU
tensors (fp32); with CUDA they compile and the same tests run on the GPU.

Every test here is marked ``gpu`` as well: on a GPU machine ``pytest -m gpu``
runs the whole kernel suite, the strong fp32 comparisons included.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

import itertools  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
KERNEL_TESTS = os.path.dirname(os.path.abspath(__file__)) + os.sep

# (atol, rtol) against the fp32 reference. fp32: the kernel's own rounding
# (observed ~1e-6; a wrong page, mask or split is off by O(1)). fp16/bf16:
# rtol covers rounding the output (half an ulp: 2^-11 and 2^-8 relative),
# atol the probabilities rounded to the input dtype before the PV product, as
# every flash-style kernel does. Emulating exactly that arithmetic on the GPU
# test's batches (16 heads, up to 512 x 2048) used at most 0.61 (fp16) and
# 0.67 (bf16) of these bounds; bf16 at atol 3e-3 used 0.98, too close to call.
# A broken split or page is off by far more than either.
TOLERANCES = {
    torch.float32: (1e-4, 2e-4),
    torch.float16: (5e-4, 1e-3),
    torch.bfloat16: (4e-3, 6e-3),
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    atol, rtol = TOLERANCES[dtype]
    return dict(atol=atol, rtol=rtol)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    # tryfirst: the marker must be there before `-m` deselects.
    for item in items:
        if str(item.path).startswith(KERNEL_TESTS):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def gpu_launch_shapes(monkeypatch):
    """The kernels' launches at the GPU's shapes. Off CUDA the engine gives
    the interpreter bigger tiles of the same arithmetic (fewer programs);
    a kernel test checks what a GPU launches, and a test of the bigger
    tiles sets them itself."""
    from fluidserve.kernels import gemv, launch

    monkeypatch.setattr(gemv, "INTERPRETER_BLOCK_N", None)
    monkeypatch.setattr(launch, "INTERPRETER_ROWS", 1)


@dataclass
class PagedBatch:
    """A flat ragged batch over a paged cache whose block tables are shuffled
    and whose cache holds junk blocks no table references."""

    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks_per_seq] int32, rows padded with junk ids
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    q_lens: list[int]
    seq_len_list: list[int]
    scale: float

    @property
    def args(self) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def build_batch(
    specs: list[tuple[int, int]],  # (q_len, seq_len) per sequence
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    spare_blocks: int = 5,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in specs]
    seq_lens = [s for _, s in specs]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    max_blocks = max(needed) + 2
    # Physical blocks handed out in a random order, so logical block i of a
    # sequence is almost never physical block i.
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.randint(0, num_blocks, (len(specs), max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    query = torch.randn((sum(q_lens), num_kv_heads * group, head_dim), generator=gen)
    starts = [0, *itertools.accumulate(q_lens)]
    i32 = dict(dtype=torch.int32, device=device)
    return PagedBatch(
        query=query.to(device, dtype),
        key_cache=key_cache.to(device, dtype),
        value_cache=value_cache.to(device, dtype),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, **i32),
        query_start_loc=torch.tensor(starts, **i32),
        q_lens=q_lens,
        seq_len_list=seq_lens,
        scale=head_dim**-0.5,
    )


def reference_attention(batch: PagedBatch, sliding_window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """The oracle, always in fp32 on CPU: [num_tokens, num_q_heads, head_dim]."""
    from fluidserve.kernels import reference

    cpu = [t.float().cpu() if t.is_floating_point() else t.cpu() for t in batch.args[:-1]]
    return reference.paged_attention(*cpu, batch.scale, sliding_window, softcap)


@pytest.fixture
def device() -> str:
    """Where the kernels run: the GPU when there is one, else the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def cuda_only() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture
def make_batch():
    """``build_batch`` as a fixture, so test modules need not import conftest."""
    return build_batch


@pytest.fixture
def tol():
    """``tolerance`` as a fixture: ``assert_close(out, ref, **tol(dtype))``."""
    return tolerance


@pytest.fixture
def oracle():
    """``reference_attention`` as a fixture."""
    return reference_attention


@pytest.fixture
def offline_compile():
    """``run(call)``: ``kernel_bench.<call>`` (``"int_linear_compile_report()"``,
    ``"_compile_attention(8, 16, torch.bfloat16, ...)"``) in a process without
    the interpreter, which Triton picks at import: each launch compiled for
    sm_90 offline, with its registers and spills; its result read back as
    JSON (skips where this Triton ships no CUDA tools to compile with)."""
    return _offline_compile


def _offline_compile(call: str):
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "cuobjdump").exists() or not (tools / "ptxas").exists():
        pytest.skip("this Triton ships no CUDA tools to compile with")
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    script = (f"import json, sys, torch; sys.path.insert(0, {str(bench)!r}); import kernel_bench; "
              f"print(json.dumps(kernel_bench.{call}))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
