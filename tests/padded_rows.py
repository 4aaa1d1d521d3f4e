"""How exactly a padded step can match the eager one on this machine's CPU.

Decode buckets and piecewise graphs pad a step's rows up to a bucket, and a
padding row must change nothing the real rows compute. The CPU tests check
that bit for bit where the engine's CPU linear computes a row the same way
whatever the batch around it, as oneDNN's prepacked linear does in torch
2.13.0's CPU build. In torch 2.11.0's wheel (the GPU machines' torch) oneDNN
blocks the same product differently for 3 rows than for 4, and a real row's
last bits move with the padding. There the tests compare as the GPU tests
do, to 1e-5, which a padding row leaking into a real one still breaks by far.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F


@functools.cache
def rows_exact_when_padded() -> bool:
    """Whether a row's output from the engine's CPU linear has the same bits
    in a batch of 3 as in that batch padded to 4."""
    from fluidserve.engine.parallel import can_prepack

    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 64, generator=gen), torch.randn(4, 64, generator=gen)
    if can_prepack(weight):  # as _PrepackedLinear runs it on the CPU lane
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)

        def linear(rows: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
    else:

        def linear(rows: torch.Tensor) -> torch.Tensor:
            return F.linear(rows, weight)

    return torch.equal(linear(x[:3]), linear(x)[:3])


def assert_as_eager(padded: torch.Tensor, eager: torch.Tensor) -> None:
    """A tensor a padded step computed equals what the eager step did: bit
    for bit on a GPU (a replayed bucket has written eager's bits on every GPU
    run so far) and on a CPU where padding cannot move a row's bits, else to
    1e-5."""
    if padded.device.type != "cpu" or rows_exact_when_padded():
        assert torch.equal(padded, eager)
    else:
        torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)


def max_padded_diff() -> float:
    """The largest difference a padded step's hidden state may show against
    the eager step's (tiny models' hidden states are of order 1)."""
    return 0.0 if rows_exact_when_padded() else 1e-4
