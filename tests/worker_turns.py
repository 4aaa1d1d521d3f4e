"""The turns pytest-xdist's workers take at running tests (conftest.py): a
readers-writer lock over two files in a folder every worker of a run shares.
Tests share the room; a test marked ``alone`` takes it whole."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def worker_turn(room: Path, *, alone: bool) -> Iterator[None]:
    """Hold a turn in ``room`` while the block runs: shared, or the whole room
    where ``alone``. An ``alone`` turn keeps the turnstile while it waits, so
    no new shared turn starts meanwhile and back-to-back tests on the other
    workers cannot hold it off for ever."""
    with open(room / "turnstile.lock", "a") as turnstile, open(room / "room.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
