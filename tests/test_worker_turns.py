"""The turns the suite's pytest-xdist workers take (tests/worker_turns.py):
tests share the room, an ``alone`` test has it to itself. Threads stand in
for the workers: each opens the lock files afresh, and flock's locks belong
to an open file, so two threads contend as two processes do."""

from __future__ import annotations

import threading
import time

from worker_turns import worker_turn

HOLD_S = 0.3


def _hold(room, alone: bool, events: list[str], name: str, inside: threading.Event | None = None) -> None:
    with worker_turn(room, alone=alone):
        events.append(f"{name} in")
        if inside is not None:
            inside.set()
        time.sleep(HOLD_S)
        events.append(f"{name} out")


def test_shared_turns_run_together(tmp_path):
    events: list[str] = []
    first = threading.Event()
    a = threading.Thread(target=_hold, args=(tmp_path, False, events, "a", first))
    a.start()
    assert first.wait(5)
    _hold(tmp_path, False, events, "b")
    a.join()
    assert events.index("b in") < events.index("a out")


def test_an_alone_turn_waits_for_the_shared_one_inside_and_keeps_new_ones_out(tmp_path):
    events: list[str] = []
    a_inside, alone_waiting = threading.Event(), threading.Event()
    a = threading.Thread(target=_hold, args=(tmp_path, False, events, "a", a_inside))
    a.start()
    assert a_inside.wait(5)
    alone = threading.Thread(target=lambda: (alone_waiting.set(), _hold(tmp_path, True, events, "alone")))
    alone.start()
    assert alone_waiting.wait(5)
    time.sleep(HOLD_S / 3)  # the alone turn is at the turnstile, waiting for a
    b = threading.Thread(target=_hold, args=(tmp_path, False, events, "b"))  # comes after it
    b.start()
    for t in (a, alone, b):
        t.join(10)
    assert events == ["a in", "a out", "alone in", "alone out", "b in", "b out"]
