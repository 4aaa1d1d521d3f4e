"""Speculative decoding by n-gram lookup (vLLM's ``method: ngram``, "prompt
lookup decoding"): what it is configured with, where a sequence's drafts
come from, and which of them a verifying step keeps.

A decode step computes one token of a sequence; the weights it reads cost
as much for a few more. So the engine guesses the next ``k`` tokens where
the text repeats itself: it finds the longest recent n-gram (``n`` between
``prompt_lookup_min`` and ``prompt_lookup_max``) that also occurs earlier in
the prompt and outputs, and proposes the tokens that followed that earlier
occurrence (the earliest one, as vLLM does). The step then runs the last
sampled token and the ``k`` drafts as one chunk, and samples a token at
each of its ``k + 1`` positions with the sequence's own sampling rows.

Which tokens stand (``accepted``): row ``j``'s sample is kept while every
draft before it was what row ``j - 1`` sampled. Each row is conditioned on
the drafts before it, which are, where it is kept, the sequence's real
tokens; and each row draws from the request's full distribution (greedy,
temperature, top-k/p, its seed per output position). So a draft that
matches is the token the sequence would have sampled anyway, and the first
row that does not match draws that position's token from the same
distribution: the outputs are distributed exactly as without speculation
(for greedy and seeded rows, they are the same tokens, up to the
arithmetic of a chunk against a one-token step). This is rejection
sampling with a one-token draft distribution, written as "sample, then
compare".

A row that reads the outputs so far (penalties, multi-token bad words,
min_tokens, a thinking budget) reads the drafts before its position as outputs (the worker's
``_after_drafts``), so it samples as the real position would. A grammar's
row is masked by the grammar after the drafts before its position (the
matcher takes them, fills the row's mask, and rolls back:
``StructuredDecoder.fill``); past a draft the grammar refuses, no row is
kept; a grammar that waits for a reasoning's end starts at that end where
it is among the drafts. A thinking budget counts the outputs, so it reads
the drafts too: every kind of sequence drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fluidserve.kvcache.config import json_object

# vLLM's keys of --speculative-config that n-gram drafting reads; the rest
# configure draft models, which are not built.
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "num_speculative_tokens_per_batch_size", "adaptive")
# vLLM's default where neither bound is given.
DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class NgramConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    # vLLM's num_speculative_tokens_per_batch_size: (first, last, k) ranges
    # of the step's batch size, sorted, the first from 1; a batch size
    # between or after ranges takes the k of the range before it. Where the
    # verified tokens cost the step more than the drafts that stand save
    # (more sequences a step: a CPU's matmuls, a GPU's compute bound), it
    # drafts fewer or none. Empty: num_speculative_tokens at every size.
    per_batch_size: tuple[tuple[int, int, int], ...] = ()
    # fluidserve's key: num_speculative_tokens is the most a sequence drafts,
    # and each step verifies the drafts that buy tokens a second on this
    # device (engine/draft_policy.py). The default, unless per_batch_size
    # fixes the counts; false: every step verifies every draft, as vLLM.
    adaptive: bool = True

    def drafts_at(self, batch_size: int) -> int:
        """Drafts a sequence may verify in a step of ``batch_size`` sequences."""
        k = self.num_speculative_tokens
        for first, _, at in self.per_batch_size:
            if first > batch_size:
                break
            k = min(self.num_speculative_tokens, at)
        return k


def parse_speculative_config(text: str | None) -> NgramConfig | None:
    """``--speculative-config``'s JSON object as vLLM spells it; a ValueError
    names what is wrong or not implemented."""
    if text is None:
        return None
    given = json_object(text, "speculative_config")
    method = given.get("method")
    if method != "ngram":
        raise ValueError(f"speculative_config: method {method!r} is not implemented (only \"ngram\": drafts "
                         "looked up in the prompt and outputs; draft models, EAGLE and MTP are not built)")
    unknown = [k for k in given if k not in _KEYS]
    if unknown:
        raise ValueError(f"speculative_config: {unknown[0]} is not supported with ngram "
                         f"(supported: {', '.join(_KEYS)})")
    k = given.get("num_speculative_tokens")
    lo, hi = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
    for name, value in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
    if k is None:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    if lo is None and hi is None:
        lo = hi = DEFAULT_LOOKUP
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    per_batch_size = _per_batch_size(given.get("num_speculative_tokens_per_batch_size"))
    adaptive = given.get("adaptive", not per_batch_size)
    if type(adaptive) is not bool:
        raise ValueError(f"speculative_config: adaptive must be true or false, got {adaptive!r}")
    if adaptive and per_batch_size:
        raise ValueError("speculative_config: adaptive chooses drafts per step; it cannot be true with "
                         "num_speculative_tokens_per_batch_size, which fixes them")
    return NgramConfig(k, lo, hi, per_batch_size, adaptive)


def _per_batch_size(given) -> tuple[tuple[int, int, int], ...]:
    """num_speculative_tokens_per_batch_size, checked as vLLM checks it."""
    if given is None:
        return ()
    name = "speculative_config: num_speculative_tokens_per_batch_size"
    if not isinstance(given, list) or not given:
        raise ValueError(f"{name} must be a non-empty list of [first, last, num_speculative_tokens] ranges")
    ranges = []
    for entry in given:
        if (not isinstance(entry, list) or len(entry) != 3 or any(type(v) is not int for v in entry)
                or entry[0] < 1 or entry[1] < entry[0] or entry[2] < 0):
            raise ValueError(f"{name}: {entry!r} is not a range [first, last, k] with 1 <= first <= last, k >= 0")
        ranges.append(tuple(entry))
    ranges.sort()
    if ranges[0][0] != 1:
        raise ValueError(f"{name}: the first range must start at batch size 1")
    if any(b[0] <= a[1] for a, b in zip(ranges, ranges[1:])):
        raise ValueError(f"{name}: ranges overlap")
    return tuple(ranges)


def draft_limit(k: int, num_outputs: int, max_outputs: int, min_tokens: int) -> int:
    """Drafts a sequence with ``num_outputs`` tokens may verify: none past
    its length limit (the row after the last draft samples one more), and
    while min_tokens holds its stop tokens back, none at a position where
    it no longer would (every row is masked by the output's length before
    the step)."""
    k = min(k, max_outputs - num_outputs - 1)
    if num_outputs < min_tokens:
        k = min(k, min_tokens - num_outputs - 1)
    return k


class NgramDrafter:
    """One sequence's n-gram index over its prompt and outputs, kept as the
    sequence grows: for each ``n``, the earliest position at which each
    n-gram ends, over every position but the newest (the suffix looked up
    must match somewhere before itself). A lookup is then a handful of dict
    reads, not a scan of the context every step. The index is keyed by the
    n-gram's hash (an int, not the tuple: a third of the memory, which a
    long context held by many sequences feels); a lookup compares the
    tokens, so a collision costs a draft, never a wrong one.

    ``outputs`` is the sequence's live output list: each ``propose`` takes
    in the tokens it gained since the last."""

    __slots__ = ("lo", "hi", "tokens", "_outputs", "_prompt_len", "_ends", "_indexed")

    def __init__(self, prompt: list[int], outputs: list[int], lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.tokens = list(prompt)  # prompt + outputs, contiguous for the slices a lookup compares
        self._outputs, self._prompt_len = outputs, len(prompt)
        self._ends: list[dict[int, int]] = [{} for _ in range(hi + 1)]
        self._indexed = 0  # positions 0 .. _indexed-1 are indexed as n-gram ends

    def index(self, upto: int) -> None:
        """Index the n-grams ending before position ``upto`` (at most the
        prompt): a prompt's chunks as they are computed, so its first
        lookup does not index it all at once."""
        self._index_to(min(upto, self._prompt_len))

    def _index_to(self, end: int) -> None:
        toks, lo, hi, ends = self.tokens, self.lo, self.hi, self._ends
        for e in range(self._indexed, end):
            for n in range(lo, min(hi, e + 1) + 1):
                ends[n].setdefault(hash(tuple(toks[e - n + 1:e + 1])), e)
        self._indexed = max(self._indexed, end)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the earliest earlier occurrence
        of the longest suffix of ``lo`` .. ``hi`` tokens; [] where none recurs."""
        toks = self.tokens
        toks += self._outputs[len(toks) - self._prompt_len:]
        last = len(toks) - 1
        self._index_to(last)  # every end but the newest
        if k <= 0:
            return []
        lo, hi, ends = self.lo, self.hi, self._ends
        for n in range(min(hi, last), lo - 1, -1):
            suffix = toks[last - n + 1:]
            e = ends[n].get(hash(tuple(suffix)))
            if e is not None and toks[e - n + 1:e + 1] == suffix:
                return toks[e + 1:min(e + 1 + k, last + 1)]
        return []


# An n-gram's key in a PredictionIndex: the polynomial hash of its tokens
# mod 2**64, which numpy computes for every n-gram of a prediction at once
# and Python for one suffix (``_gram_key``); an odd multiplier.
_GRAM_BASE = 0x9E3779B97F4A7C15
_MASK_64 = (1 << 64) - 1


def _gram_key(tokens: list[int]) -> int:
    key = 0
    for t in tokens:
        key = (key * _GRAM_BASE + t) & _MASK_64
    return key


class PredictionIndex:
    """Where each n-gram of a prediction ends, for ``n`` in ``lo`` .. ``hi``:
    per ``n``, the n-grams' keys sorted (stably, so the ends of one key stay
    in order) beside their ends. Built in numpy, once per request (its
    ``n`` sequences share it), on the engine's thread as the request is
    added: a dict of lists built in Python for each of the ``n`` took 39 ms
    there for a 30k-token prediction at 2-3-grams (189 ms at n=4), a stall
    of every running sequence, where this takes 5 ms
    (benchmarks/prediction_index.py). Keys can collide: a lookup's caller
    compares the tokens."""

    __slots__ = ("_keys", "_ends")

    def __init__(self, prediction: list[int], lo: int, hi: int) -> None:
        tokens = np.asarray(prediction, dtype=np.uint64)
        self._keys: list[np.ndarray | None] = [None] * (hi + 1)
        self._ends: list[np.ndarray | None] = [None] * (hi + 1)
        keys = np.zeros(len(tokens), dtype=np.uint64)
        for n in range(1, min(hi, len(tokens)) + 1):
            # The n-gram starting at i from the (n-1)-gram there; uint64 wraps, as _gram_key masks.
            keys = keys[:len(tokens) - n + 1] * np.uint64(_GRAM_BASE) + tokens[n - 1:]
            if n >= lo:
                order = np.argsort(keys, kind="stable")
                self._keys[n], self._ends[n] = keys[order], order + (n - 1)

    def ends(self, gram: list[int]) -> np.ndarray:
        """The ends, in order, of the prediction's n-grams whose key is
        ``gram``'s (each ``gram`` itself, barring a collision)."""
        keys = self._keys[len(gram)] if len(gram) < len(self._keys) else None
        if keys is None:
            return np.empty(0, dtype=np.int64)
        key = np.uint64(_gram_key(gram))
        return self._ends[len(gram)][keys.searchsorted(key, "left"):keys.searchsorted(key, "right")]


class PredictionDrafter:
    """Drafts from a request's predicted output (OpenAI's ``prediction``: a
    file the reply is expected to repeat with edits). While the outputs
    follow the prediction, the draft is what comes next in it. Where they
    leave it, the longest suffix of ``lo`` .. ``hi`` output tokens is looked
    up in it, at the first occurrence from where they left it (else the
    first of all), and drafting resumes after that; while nothing matches,
    the sequence's own n-gram lookup (``ngram``) drafts. The engine counts
    the prediction's drafted tokens the verifying steps keep
    (``accepted``) and throw away (``rejected``)."""

    __slots__ = ("prediction", "ngram", "lo", "hi", "_outputs", "_seen", "_pos", "_left", "_index",
                 "from_prediction", "accepted", "rejected")

    def __init__(self, prediction: list[int], outputs: list[int], ngram: NgramDrafter,
                 index: PredictionIndex | None = None) -> None:
        """``index``: the request's ``PredictionIndex`` of ``prediction`` over
        ``ngram``'s n-gram lengths, shared by its sequences (else built here)."""
        self.prediction, self.ngram = list(prediction), ngram
        self.lo, self.hi = ngram.lo, ngram.hi
        self._outputs = outputs
        self._seen = 0  # outputs read so far
        self._pos: int | None = 0  # where in the prediction the next output is expected; None: off it
        self._left = 0  # where the outputs last left the prediction
        self._index = index if index is not None else PredictionIndex(self.prediction, self.lo, self.hi)
        self.from_prediction = False  # the last proposal's origin
        self.accepted = self.rejected = 0

    def index(self, upto: int) -> None:
        self.ngram.index(upto)

    def _follow(self) -> None:
        """Move along the prediction with the outputs read since the last call."""
        pred, pos = self.prediction, self._pos
        for t in self._outputs[self._seen:]:
            if pos is not None and pos < len(pred) and pred[pos] == t:
                pos += 1
            elif pos is not None:
                self._left, pos = pos, None
        self._seen = len(self._outputs)
        self._pos = pos if pos is not None else self._realign()

    def _realign(self) -> int | None:
        out, pred = self._outputs, self.prediction
        for n in range(min(self.hi, len(out)), self.lo - 1, -1):
            suffix = out[len(out) - n:]
            ends = self._index.ends(suffix)
            at = int(ends.searchsorted(self._left))
            for i in range(len(ends)):  # from where the outputs left it, then from the start
                e = int(ends[(at + i) % len(ends)])
                if pred[e - n + 1:e + 1] == suffix:
                    return e + 1
        return None

    def propose(self, k: int) -> list[int]:
        self._follow()
        fallback = self.ngram.propose(k)  # its index keeps up with the outputs either way
        pos = self._pos
        self.from_prediction = k > 0 and pos is not None and pos < len(self.prediction)
        return self.prediction[pos:pos + k] if self.from_prediction else fallback


def accepted(sampled: list, draft: list[int]) -> int:
    """How many of ``draft`` stand: the rows' samples (``sampled[j]`` at the
    position after draft ``j - 1``; ``token_id`` each) are kept up to and
    including the first that is not the next draft."""
    m = 0
    while m < len(draft) and sampled[m].token_id == draft[m]:
        m += 1
    return m
