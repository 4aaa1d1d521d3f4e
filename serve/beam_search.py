"""Beam search above the engine, as vLLM serves ``use_beam_search``.

Owns the search: each step asks the ``AsyncEngine`` for one token of every
live beam (a request of ``prompt + beam`` with ``max_tokens=1`` and ``2 *
width`` logprobs), keeps the ``width`` likeliest continuations that are not
EOS, and sets aside every beam that reaches EOS. Nothing here touches KV:
a step's request shares all of its tokens but the last with the request of
the step before, and the prefix cache serves those full blocks, so a step
recomputes about one block per beam instead of the whole sequence.

Scores follow vLLM (``vllm/beam_search.py``): cumulative logprob divided by
``length ** length_penalty``, where the length counts the prompt and the
generated tokens, not EOS. The search runs ``max_tokens`` steps or until no
beam is live; the ``width`` best by score are the choices.

``BeamSearchStream`` lets a search stand where the server expects a
``RequestStream``: it yields one, final, output, and ``abort()`` cancels the
search and every engine request it has in flight.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fluidserve.engine.async_engine import RequestFailedError
from fluidserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from fluidserve.engine.sampling_params import SamplingParams

Decode = Callable[[list[int], bool], str]  # (token ids, skip special tokens) -> text


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    step: SamplingParams  # one step of one beam: max_tokens=1, logprobs >= 2 * beam_width
    eos_token_ids: frozenset[int]
    ignore_eos: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the EOS that ended a beam in its tokens
    skip_special_tokens: bool = True

    @property
    def num_candidates(self) -> int:
        """Continuations each beam offers a step: 2 * width, so that width
        remain when one of them is EOS (vLLM's choice)."""
        return 2 * self.beam_width


@dataclass
class Beam:
    tokens: list[int]  # the prompt, then the generated tokens
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one entry per generated token
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None

    def extended(self, token: int, entry: TokenLogprobs, cum_logprob: float) -> "Beam":
        return Beam(self.tokens + [token], self.logprobs + [entry], cum_logprob)

    def ended(self, eos: int, entry: TokenLogprobs, cum_logprob: float, keep_eos: bool) -> "Beam":
        if keep_eos:
            return Beam(self.tokens + [eos], self.logprobs + [entry], cum_logprob, "stop", eos)
        return Beam(self.tokens, self.logprobs, cum_logprob, "stop", eos)

    def score(self, length_penalty: float) -> float:
        length = len(self.tokens) - (1 if self.finish_reason and self.tokens[-1] == self.stop_reason else 0)
        return self.cum_logprob / (length ** length_penalty)


async def beam_search(engine: Any, request_id: str, prompt: list[int], params: BeamSearchParams,
                      decode: Decode, klass: str = "online") -> RequestOutput:
    """The ``beam_width`` best beams of ``prompt`` as one finished output,
    choice ``i`` the ``i``-th best. ``engine``: an ``AsyncEngine``."""
    width = params.beam_width
    live = [Beam(list(prompt))]
    done: list[Beam] = []
    for step in range(params.max_tokens):
        steps = await _step_all(engine, [f"{request_id}-s{step}-b{i}" for i in range(len(live))],
                                [beam.tokens for beam in live], params.step, klass)
        candidates: list[tuple[float, int, Beam, TokenLogprobs]] = []
        for beam, (sampled, entry) in zip(live, steps):
            for token, lp in entry.items():
                if lp.rank > params.num_candidates and token != sampled:
                    continue  # listed for the response only (a larger logprobs), not a candidate
                cum = beam.cum_logprob + lp.logprob
                if token in params.eos_token_ids and not params.ignore_eos:
                    done.append(beam.ended(token, entry, cum, params.include_stop_str_in_output))
                else:
                    candidates.append((cum, token, beam, entry))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then rank order
        live = [beam.extended(token, entry, cum) for cum, token, beam, entry in candidates[:width]]
        if not live:
            break
    done.extend(live)
    best = sorted(done, key=lambda b: b.score(params.length_penalty), reverse=True)[:width]
    outputs = [_completion(i, beam, len(prompt), params, decode) for i, beam in enumerate(best)]
    return RequestOutput(request_id, None, list(prompt), outputs, finished=True)


def _completion(index: int, beam: Beam, prompt_len: int, params: BeamSearchParams, decode: Decode) -> CompletionOutput:
    token_ids = beam.tokens[prompt_len:]
    shown = token_ids[:-1] if beam.finish_reason and token_ids and token_ids[-1] == beam.stop_reason else token_ids
    text = decode(shown, params.skip_special_tokens)
    # The whole choice at once, as its first and last delta (a stream sends it in one chunk).
    return CompletionOutput(index, text, token_ids, beam.logprobs, beam.finish_reason or "length",
                            beam.stop_reason, text, list(token_ids), list(beam.logprobs))


async def _step_all(engine: Any, request_ids: list[str], sequences: list[list[int]], params: SamplingParams,
                    klass: str) -> list[tuple[int, TokenLogprobs]]:
    """One token of every beam, concurrently; if one fails or the search is
    cancelled, the others are cancelled too (which aborts their requests)."""
    tasks = [asyncio.ensure_future(_one_token(engine, rid, seq, params, klass))
             for rid, seq in zip(request_ids, sequences)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def _one_token(engine: Any, request_id: str, tokens: list[int], params: SamplingParams,
                     klass: str) -> tuple[int, TokenLogprobs]:
    """(the sampled token, its logprobs entry: it and the top N)."""
    stream = await engine.add_request(request_id, tokens, params, klass, time.monotonic())
    last: RequestOutput | None = None
    try:
        async for out in stream:
            last = out
    finally:
        stream.abort()
    co = last.outputs[0] if last is not None and last.outputs else None
    if co is None or not co.token_ids or not co.logprobs:
        raise RequestFailedError(f"beam search step {request_id} returned no token")
    return co.token_ids[0], co.logprobs[0]


class BeamSearchStream:
    """A beam search read as a ``RequestStream`` is: one output, the final
    one, once the search ends; ``abort()`` cancels it."""

    def __init__(self, engine: Any, request_id: str, prompt: list[int], params: BeamSearchParams,
                 decode: Decode, klass: str = "online") -> None:
        self.request_id = request_id
        self.finished = False
        self._task = asyncio.ensure_future(beam_search(engine, request_id, prompt, params, decode, klass))

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self.finished:
            return
        try:
            out = await self._task
        except ValueError as exc:  # the engine refused a step: not the client's input, which was checked
            raise RequestFailedError(str(exc)) from None
        finally:
            self.finished = True
        yield out

    def abort(self) -> None:
        self.finished = True
        if not self._task.done():
            self._task.cancel()
        elif not self._task.cancelled():
            self._task.exception()  # retrieved: an abandoned failure is not logged as unhandled
