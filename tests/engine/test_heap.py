"""The garbage collector around the engine (``engine/heap.py``): steps run
with the heap of before frozen, and everything is collectable again after.

A process that forgot to unfreeze would keep every engine it ever built (they
sit in reference cycles with their 4 GiB host pools): these tests guard that
as much as the speed."""

from __future__ import annotations

import gc
import weakref

import pytest

from fluidserve.engine import SamplingParams
from fluidserve.engine.heap import frozen_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def nothing_frozen():
    assert gc.get_freeze_count() == 0, "an earlier test left the heap frozen"
    yield
    if gc.get_freeze_count():  # a test froze the heap itself, or failed frozen
        gc.unfreeze()
        gc.collect()  # its engines, out of reach of make_llm's collection while frozen


def test_generate_runs_its_steps_on_a_frozen_heap_and_unfreezes(tiny_model, make_llm):
    llm = make_llm(tiny_model())
    frozen_during_steps = []
    step = llm.engine.step

    def recording_step():
        frozen_during_steps.append(gc.get_freeze_count())
        return step()

    llm.engine.step = recording_step
    out = llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4, 4]
    assert frozen_during_steps and min(frozen_during_steps) > 0
    assert gc.get_freeze_count() == 0


def test_garbage_from_before_is_collected_after():
    """Without collect_first, a cycle made before the freeze is out of reach
    of collections inside it and collected once it ends."""
    garbage = _Cycle()
    ref = weakref.ref(garbage)
    del garbage
    with frozen_heap():
        gc.collect()
        assert ref() is not None
    gc.collect()
    assert ref() is None


def test_collect_first_collects_before_freezing():
    garbage = _Cycle()
    ref = weakref.ref(garbage)
    del garbage
    with frozen_heap(collect_first=True):
        assert ref() is None
        assert gc.get_freeze_count() > 0


def test_a_callers_freeze_is_left_alone(tiny_model, make_llm):
    """A caller that froze its own heap keeps it frozen through generate."""
    llm = make_llm(tiny_model())
    gc.freeze()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert gc.get_freeze_count() > 0  # generate's own unfreeze would have emptied it


def test_young_threshold_raised_inside_and_restored_after_an_error():
    """Inside, young collections wait for YOUNG_THRESHOLD allocations; the
    caller's thresholds come back at exit, also when the body raises."""
    from fluidserve.engine.heap import YOUNG_THRESHOLD

    before = gc.get_threshold()
    with pytest.raises(RuntimeError):
        with frozen_heap():
            inside = gc.get_threshold()
            raise RuntimeError("step failed")
    assert inside[0] == max(before[0], YOUNG_THRESHOLD) and inside[1:] == before[1:]
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
