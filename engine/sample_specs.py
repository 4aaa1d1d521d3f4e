"""A step's sampler rows across a process boundary: what the engine's side
has sent of each sequence's SampleSpec, and the sampling rank's copy of
them.

A SampleSpec holds a sequence's SamplingParams and, where a penalty,
min_tokens, bad words or a grammar read them, its prompt and its outputs so
far. Pickled whole every step, as the Ray executor sent them, 256 rows cost
1.3 ms to pickle and unpickle with no penalty in play (the parameters
alone, 47 KB), and with a repetition penalty 29 ms for 256 rows of
2,000-token prompts, 47 ms for 64 rows of 16k: host time that grows with the
context, every step. Yet a sequence's parameters and prompt never change
and its outputs only grow, by one token a decode step. So the rank that
samples keeps each sequence's spec by sequence id, and a step sends
(``SampleWire``) each row's seed, the parameters and
prompt of sequences the rank does not hold, and outputs from the first
token it lacks::

    engine                          wire (step k)              rank 0
    s1 params p, outputs [a b c d]  s1: tail (3, [d])          s1 -> p, [a b c] + [d]
    s9 params q, outputs []         s9: new (q, prompt)        s9 -> q, []

The sender decides what the rank forgets (``SampleWire.dropped``): once it
holds more than twice the step's rows, the sequences missing from the step
(finished, aborted, or not scheduled this time). One that comes back is
sent whole again. Sequence ids are never reused, so a spec kept a while is
still its sequence's own. Only rank 0 samples; the other ranks get no rows
at all (engine/executor/ray.py).
"""

from __future__ import annotations

import dataclasses

from fluidserve.engine.batch import ModelInput, SampleSpec, SampleWire
from fluidserve.engine.sampling_params import SamplingParams

# How many sequences beyond a step's rows the rank may hold, as a multiple
# of the rows: a sequence skipped for a step or two (a preemption, a prompt
# between its decodes) keeps its spec; past it the missing ones go.
HELD_PER_ROW = 2


class SampleSpecSender:
    """The engine's side: what the sampling rank holds of each sequence's
    spec. The rank must take every input ``wire`` makes, in order."""

    def __init__(self) -> None:
        # sequence id -> (the params object sent, outputs the rank holds)
        self._sent: dict[str, tuple[SamplingParams, int]] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def wire(self, inp: ModelInput) -> ModelInput:
        """``inp`` with its SampleSpecs cut to what the rank lacks (the same
        input when it samples no row)."""
        if not inp.samples:
            return inp
        sent = self._sent
        new: dict[int, tuple[SamplingParams, list[int]]] = {}
        tails: dict[int, tuple[int, list[int]]] = {}
        for i, (sid, spec) in enumerate(zip(inp.sample_ids, inp.samples)):
            outputs, params = spec.output_token_ids, spec.params
            params_held, held = sent.get(sid, (None, 0))
            n = len(outputs)
            # A sequence new to the rank, or one whose spec is not the one
            # sent (a list that did not only grow): sent whole.
            if params_held is not params or n < held:
                new[i] = (params, spec.prompt_token_ids)
                held = 0
            if n != held:
                tails[i] = (held, outputs[held:n])
            sent[sid] = (params, n)
        dropped: list[str] = []
        if len(sent) > HELD_PER_ROW * len(inp.sample_ids):
            step = set(inp.sample_ids)
            dropped = [sid for sid in sent if sid not in step]
            for sid in dropped:
                del sent[sid]
        sample_wire = SampleWire(seeds=[s.seed for s in inp.samples], new=new, tails=tails, dropped=dropped)
        return dataclasses.replace(inp, samples=[], sample_wire=sample_wire)


class SampleSpecMirror:
    """The sampling rank's side: every sequence's spec it has been sent, by
    sequence id, each updated in place as its step comes in."""

    def __init__(self) -> None:
        self._specs: dict[str, SampleSpec] = {}

    def __len__(self) -> int:
        return len(self._specs)

    def sync(self, inp: ModelInput) -> None:
        """Turn ``inp.sample_wire`` back into ``inp.samples`` (nothing for
        an input that came with its specs)."""
        wire = inp.sample_wire
        if wire is None:
            return
        specs = self._specs
        for sid in wire.dropped:
            specs.pop(sid, None)
        new, tails = wire.new, wire.tails
        rows: list[SampleSpec] = []
        for i, (sid, seed) in enumerate(zip(inp.sample_ids, wire.seeds)):
            fresh = new.get(i)
            if fresh is not None:
                spec = specs[sid] = SampleSpec(params=fresh[0], seed=None, prompt_token_ids=fresh[1])
            else:
                spec = specs.get(sid)
                if spec is None:
                    raise ValueError(f"sampling row {sid!r} sent without its parameters, which are not held")
            tail = tails.get(i)
            if tail is not None:
                start, tokens = tail
                held = spec.output_token_ids
                if start != len(held):
                    raise ValueError(f"sampling row {sid!r} sent outputs from token {start}, "
                                     f"but {len(held)} of them are held")
                held += tokens
            if sid in inp.drafts:  # a sequence verifying drafts: a row each position, each its own seed
                spec = dataclasses.replace(spec, seed=seed)
            else:
                spec.seed = seed
            rows.append(spec)
        inp.samples, inp.sample_wire = rows, None
