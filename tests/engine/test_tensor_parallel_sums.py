"""``TensorParallel.all_reduce`` between real gloo ranks (two processes):
small tensors go as an all-gather and a sum in rank order, larger ones as
gloo's all-reduce; either way every rank ends with the same bits, and the
sum of every rank's part."""

from __future__ import annotations

import multiprocessing
import os
import tempfile

import pytest
import torch

from fluidserve.engine.parallel import GATHER_SUM_MAX_NUMEL, destroy_tensor_parallel, init_tensor_parallel

pytestmark = pytest.mark.timeout(120)

SHAPES = [(1, 64), (16, 4096), (GATHER_SUM_MAX_NUMEL // 512 + 1, 512)]  # the last past the gather's bound


def _rank(rank: int, rendezvous: str, results, received) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, rendezvous, "gloo")
    try:
        out = []
        for i, shape in enumerate(SHAPES):
            for dtype in (torch.float32, torch.bfloat16):
                gen = torch.Generator().manual_seed(100 * i + rank)
                x = torch.randn(shape, generator=gen).to(dtype)
                mine = x.clone()
                assert tp.all_reduce(x) is x  # in place
                out.append((mine, x))
        results.put((rank, tp.gather_small_sums, out))
        # The tensors cross as file descriptors this process serves: it
        # stays up until the test has them (exiting first fails the get).
        received.wait(120)
    finally:
        destroy_tensor_parallel()


def test_sums_over_two_gloo_ranks_are_the_same_bits_on_both():
    ctx = multiprocessing.get_context("spawn")
    results, received = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = f"file://{os.path.join(tmp, 'rdv')}"
        procs = [ctx.Process(target=_rank, args=(r, rendezvous, results, received)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict((rank, (gathers, out)) for rank, gathers, out in (results.get(timeout=60) for _ in procs))
        received.set()
        for p in procs:
            p.join(30)
    assert got[0][0] and got[1][0]  # gloo: small sums by gather
    for (part0, sum0), (part1, sum1) in zip(got[0][1], got[1][1]):
        assert torch.equal(sum0, sum1)  # the same bits on every rank
        expected = (part0.float() + part1.float()).to(part0.dtype)
        tol = 0 if part0.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(sum0, expected, rtol=tol, atol=tol)
