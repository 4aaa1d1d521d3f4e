"""A request's outputs across a process boundary: what a data-parallel
replica has sent the front of each request's output, and the front's
rebuilding of the whole output from what it holds.

A RequestOutput carries the request's prompt tokens and, for each
completion, its whole text, token ids and logprobs so far, beside the delta
of the step (engine/outputs.py). In the engine's process these are shared
lists, free to hand over. Pickled every step, as a replica's poll sent them
(engine/data_parallel.py), 256 streamed requests of 2,000-token prompts
with 500 tokens out cost 31 ms to pickle and unpickle, 2.5 MB, every step,
and with 5 top logprobs a token 2.8 s, 28 MB (benchmarks/poll_outputs.py),
growing with the context: on the replica, under the GIL its engine steps
with, and in the server's process. Yet the prompt never changes and the
rest only grows. So a request's first output from a replica crosses whole,
and every later one (``OutputTail``) without the prompt fields and with each
completion's text, token ids and logprobs cut to what came since the last::

    replica                                wire                      front (the flight's copy)
    out 1: prompt P, text "He",  ids [a]   whole                     P, "He",    [a]
    out 2: prompt P, text "Hell", ids [a b] tail: "ll", [b]           P, "Hell",  [a b]

An output whose completions are not the ones sent before (another
request under the same id, a list that did not only grow) crosses whole
again. The sender forgets a request with its finished output, or when the
front aborts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fluidserve.engine.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class OutputTail:
    """One RequestOutput as a replica sends it. ``whole``: it is the output
    itself. Else its prompt fields are empty and each completion's
    ``text``, ``token_ids`` and ``logprobs`` hold what came after the
    output before (the deltas and the rest as they are)."""

    output: RequestOutput
    whole: bool


@dataclass(slots=True)
class _Sent:
    token_lists: list[list[int]]  # each completion's live token list: the same request's completions
    lengths: list[tuple[int, int, int]]  # each completion's text, token ids and logprobs sent (-1: no logprobs)
    prompt_logprobs: int  # prompt positions sent (-1: none)


def _lengths(c: CompletionOutput) -> tuple[int, int, int]:
    return len(c.text), len(c.token_ids), -1 if c.logprobs is None else len(c.logprobs)


class OutputSender:
    """The replica's side: what the front holds of each request's output."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def forget(self, request_id: str) -> None:
        """The front dropped the request (aborted): no more of it is sent."""
        self._sent.pop(request_id, None)

    def wire(self, outputs: list[RequestOutput]) -> list[OutputTail]:
        return [self._one(out) for out in outputs]

    def _one(self, out: RequestOutput) -> OutputTail:
        rid, comps = out.request_id, out.outputs
        sent = self._sent.get(rid)
        lengths = [_lengths(c) for c in comps]
        prompt_logprobs = -1 if out.prompt_logprobs is None else len(out.prompt_logprobs)
        whole = not (sent is not None and sent.prompt_logprobs == prompt_logprobs
                     and len(sent.lengths) == len(comps)
                     and all(c.token_ids is held for c, held in zip(comps, sent.token_lists))
                     and all(t >= st and k >= sk and (j >= sj >= 0 or j == sj == -1)
                             for (t, k, j), (st, sk, sj) in zip(lengths, sent.lengths)))
        starts = [(0, 0, 0)] * len(comps) if whole else sent.lengths
        # Cut at the lengths read above, not at the lists' ends: the engine's
        # thread appends to them while this runs and until Ray has pickled
        # them, and what is sent must be what is recorded as sent.
        cut = [CompletionOutput(c.index, c.text[st:t], c.token_ids[sk:k],
                                None if c.logprobs is None else c.logprobs[sj:j],
                                c.finish_reason, c.stop_reason, c.text_delta, c.new_token_ids, c.new_logprobs,
                                c.accepted_prediction_tokens, c.rejected_prediction_tokens)
               for c, (t, k, j), (st, sk, sj) in zip(comps, lengths, starts)]
        if whole:
            sent_out = RequestOutput(rid, out.prompt, out.prompt_token_ids, cut, out.finished, out.error,
                                     out.first_scheduled_time, out.prompt_logprobs, out.num_cached_tokens,
                                     out.embedding)
        else:
            sent_out = RequestOutput(rid, None, [], cut, out.finished, out.error, out.first_scheduled_time, None,
                                     out.num_cached_tokens, out.embedding)
        if out.finished or out.error is not None:
            self._sent.pop(rid, None)
        else:
            self._sent[rid] = _Sent([c.token_ids for c in comps], lengths, prompt_logprobs)
        return OutputTail(sent_out, whole)


def rebuild(held: RequestOutput | None, tail: OutputTail) -> RequestOutput:
    """The whole output ``tail`` stands for, given the request's output the
    front took before (``held``). Token and logprob lists grow in place, as
    the engine's own do (CompletionOutput)."""
    if tail.whole:
        return tail.output
    out = tail.output
    if held is None or len(held.outputs) != len(out.outputs):
        raise ValueError(f"request {out.request_id!r}: an output sent as what came since the one before, "
                         "but none was taken before")
    comps = []
    for c, h in zip(out.outputs, held.outputs):
        h.token_ids += c.token_ids
        if c.logprobs:
            h.logprobs += c.logprobs
        comps.append(CompletionOutput(c.index, h.text + c.text, h.token_ids, h.logprobs, c.finish_reason,
                                      c.stop_reason, c.text_delta, c.new_token_ids, c.new_logprobs,
                                      c.accepted_prediction_tokens, c.rejected_prediction_tokens))
    return RequestOutput(out.request_id, held.prompt, held.prompt_token_ids, comps, out.finished, out.error,
                         out.first_scheduled_time, held.prompt_logprobs, out.num_cached_tokens, out.embedding)
