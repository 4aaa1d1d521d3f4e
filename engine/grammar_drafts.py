"""The drafts of constrained sequences, on the engine's side: speculative
decoding under a grammar (response_format, structured outputs).

The worker masks each row of a verifying step by the grammar after the
drafts before it (``StructuredDecoder.fill``), so any draft is safe; but a
draft the grammar refuses cannot stand, and costs its position in the step.
Here each constrained sequence has a matcher of its own, fed the tokens the
engine accepted, which shapes its drafts before the step:

* the n-gram drafts are cut at the first the grammar refuses (as vLLM's
  scheduler does);
* where none is left, the draft is what the grammar forces next (xgrammar's
  jump-forward string, a schema's keys and punctuation), tokenized as the
  tokenizer would: the model verifies them as any drafts, so the outputs
  are those without drafts, and where the model tokenizes the forced text
  as the tokenizer does, they stand.

A grammar that waits for a reasoning's end (``structured_after_token_id``)
starts here once that end is among the outputs; before, the n-gram drafts
go as they are. Pure bookkeeping around xgrammar; the worker's matchers
stay the ones that mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fluidserve.engine.sampling_params import SamplingParams, StructuredOutputs
from fluidserve.engine.structured import GrammarCompiler, xgrammar


@dataclass
class _Tracked:
    spec: StructuredOutputs
    matcher: Any  # xgrammar.GrammarMatcher
    start: int  # where in the outputs the grammar starts
    consumed: int = 0  # outputs from start on the matcher has taken
    broken: bool = False  # an output the grammar refused: no grammar drafts


class GrammarDrafts:
    """Matchers of the constrained sequences that draft, by sequence id."""

    def __init__(self, tokenizer: Any, compiler: Callable[[], GrammarCompiler]) -> None:
        self.tokenizer = tokenizer
        # The grammars compiled against the tokenizer: the worker's, where it
        # runs in this process, so each grammar compiles once.
        self._compiler = compiler
        self._seqs: dict[str, _Tracked] = {}
        self.forced = 0  # drafts the grammar forced (for the tests and figures)
        self.cut = 0  # n-gram drafts cut because the grammar refused them

    def release(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def propose(self, seq_id: str, params: SamplingParams, outputs: list[int], draft: list[int],
                limit: int) -> list[int]:
        """The drafts of a constrained sequence whose n-gram drafter offered
        ``draft`` (at most ``limit`` tokens a step)."""
        tracked = self._synced(seq_id, params, outputs)
        if tracked is None:
            return draft
        matcher = tracked.matcher
        keep = _take(matcher, draft)
        self.cut += len(draft) - keep
        if keep or not limit or matcher.is_terminated():
            return draft[:keep]
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        forced = self.tokenizer.encode(text, add_special_tokens=False)[:limit]
        keep = _take(matcher, forced)
        self.forced += keep
        return forced[:keep]

    def _synced(self, seq_id: str, params: SamplingParams, outputs: list[int]) -> _Tracked | None:
        """The sequence's matcher after its outputs (from the grammar's start
        on), made on its first call; None before its grammar starts or once
        an output was one the grammar refused."""
        gate = params.structured_after_token_id
        tracked = self._seqs.get(seq_id)
        if tracked is None:
            start = 0
            if gate is not None:
                if gate not in outputs:
                    return None
                start = outputs.index(gate) + 1
            spec = params.structured_outputs
            tracked = self._seqs[seq_id] = _Tracked(spec, xgrammar().GrammarMatcher(self._compiler().compile(spec)),
                                                    start)
        if tracked.broken:
            return None
        for tok in outputs[tracked.start + tracked.consumed:]:
            if tracked.matcher.is_terminated() or not tracked.matcher.accept_token(tok):
                tracked.broken = True
                return None
            tracked.consumed += 1
        return tracked


def _take(matcher: Any, tokens: list[int]) -> int:
    """How many of ``tokens``, in order, the grammar takes from where the
    matcher stands (through the one that ends it); the matcher is left
    where it stood."""
    taken = 0
    try:
        for tok in tokens:
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
            taken += 1
    finally:
        if taken:
            matcher.rollback(taken)
    return taken
