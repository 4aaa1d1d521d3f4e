"""What the engine does about Python's cyclic garbage collector.

A process that has imported torch, transformers (and, for the server,
FastAPI and pydantic) holds some 400k tracked objects that live as long as it
does. A full (generation 2) collection walks every one of them: 240 ms on
two x86 cores, paid inside whichever step allocated the object that
set it off. Streaming 1024 requests sets one off every 25 steps or so, since
each step makes a few thousand short-lived objects (outputs, token lists).

``gc.freeze`` moves every tracked object into a generation no collection
walks, in O(1), and ``gc.unfreeze`` moves them back. ``serve`` and
``run-batch`` freeze once everything they keep for their lifetime exists
(after a collection), ``LLM.generate`` for the length of the call (none: a
full collection per call would cost what it saves); all unfreeze when done,
so garbage made before is still collected afterwards, in a process that goes
on (a test, a notebook).

Young collections still run on what is made after the freeze, and a
streamed step makes thousands of objects that live until its outputs are
read (a RequestOutput, a CompletionOutput and their lists per request):
with the default threshold (700 allocations) a 1024-request step set off
several young collections, each walking the step's survivors so far. The
young threshold is raised while the heap is frozen (``YOUNG_THRESHOLD``): a
60-step run of 1024 streamed requests then makes 2 young collections instead
of some 450 (benchmarks/gc_pauses.py). It is restored at exit.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

# Allocations (net of frees) between young collections while frozen: above
# what one 1024-request streamed step keeps alive until it is read.
YOUNG_THRESHOLD = 20_000


@contextlib.contextmanager
def frozen_heap(collect_first: bool = False) -> Iterator[None]:
    """Keep collections off the objects that exist at entry, until exit.

    ``collect_first`` collects the garbage of what came before, for a call
    that lasts the process's life (frozen garbage waits for the exit). Does
    nothing where something is already frozen (a server, or a caller managing
    its own heap): unfreezing at exit would undo that freeze too."""
    if gc.get_freeze_count():
        yield
        return
    if collect_first:
        gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], YOUNG_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
