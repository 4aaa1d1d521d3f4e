"""What the engine does about Python's cyclic garbage collector.

A process that has imported torch, transformers (and, for the server,
FastAPI and pydantic) holds some 400k tracked objects that live as long as it
does. A full (generation 2) collection walks every one of them: 240 ms on
the 2-core CPU machine, paid inside whichever step allocated the object that
set it off. Streaming 1024 requests sets one off every 25 steps or so, since
each step makes a few thousand short-lived objects (outputs, token lists).

``gc.freeze`` moves every tracked object into a generation no collection
walks, in O(1), and ``gc.unfreeze`` moves them back. ``serve`` and
``run-batch`` freeze once everything they keep for their lifetime exists
(after a collection), ``LLM.generate`` for the length of the call (none: a
full collection per call would cost what it saves); all unfreeze when done,
so garbage made before is still collected afterwards, in a process that goes
on (a test, a notebook). Collections of the objects made after the freeze run
as before.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


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
    try:
        yield
    finally:
        gc.unfreeze()
