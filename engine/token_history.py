"""TokenHistories: the tokens each penalised row of a step counts, as numpy,
converted only as they grow.

The repetition penalty counts a sequence's prompt and output tokens, the
presence and frequency penalties its output tokens, every step. Handed over
as Python lists and walked in Python every step, they cost a step of 64 rows
of 2,000-token prompts 52 ms of host time to sample with a repetition
penalty, against 1.8 ms without one (``benchmarks/penalty_cost.py``). A
sequence's prompt never changes and its outputs only grow, so the worker
keeps each penalised sequence's prompt + outputs under its sequence id
(engine/growing_lists.py) and converts only the tokens it gained since the
last step: one a decode step. The sampler then finds the cells to penalise
with numpy and touches only those (``sampler._seen_cells``).

A history is dropped once more histories are held than the step has rows,
those of sequences missing from the step first (finished, aborted,
preempted, or not scheduled this time); one that comes back is converted
afresh. Sequence ids are never reused, so a history kept a while is still
the sequence's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fluidserve.engine.growing_lists import GrowingLists


class TokenHistories:
    """Prompt + output tokens of the step's penalised rows, by sequence id."""

    def __init__(self) -> None:
        self._lists = GrowingLists("token history")

    def __len__(self) -> int:
        return len(self._lists)

    @property
    def converted_tokens(self) -> int:
        """Tokens turned from Python ints into numpy, over the object's life."""
        return self._lists.converted

    def rows(self, seq_ids: Sequence[str], samples: Sequence[Any]) -> list[np.ndarray | None]:
        """Each row's prompt + output tokens (the prompt where its
        SampleSpec carries one), None for a row no penalty reads."""
        out: list[np.ndarray | None] = [None] * len(samples)
        # One pass with the test inline: most steps have no penalised row, and
        # this runs for every step that samples.
        penalised_rows = [i for i, s in enumerate(samples) if s.params.repetition_penalty != 1.0
                          or s.params.presence_penalty or s.params.frequency_penalty]
        held = self._lists.held
        for i in penalised_rows:
            sid, spec = seq_ids[i], samples[i]
            prompt, outputs = spec.prompt_token_ids, spec.output_token_ids
            view = held.get(sid)
            if view is None or len(view) != len(prompt) + len(outputs):
                if view is None:
                    self._lists.take(sid, prompt)
                view = self._lists.take(sid, outputs, len(prompt))
            out[i] = view
        if len(held) > len(seq_ids):
            keep = set(seq_ids)
            for sid in [s for s in held if s not in keep]:
                self._lists.drop(sid)
        return out
