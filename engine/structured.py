"""Structured output on the worker: grammars compiled against the tokenizer,
one matcher per constrained sequence, and each step's next-token bitmask.

Owns everything grammar-shaped below the HTTP layer, through xgrammar (picked
over llguidance by benchmarks/grammar_mask.py):

* ``check_structured_outputs``: builds a request's grammar without a
  tokenizer, so a bad schema or regex is a 400 at the door, not a failed step;
* ``GrammarCompiler``: compiled grammars of one tokenizer, cached by spec;
* ``StructuredDecoder``: per-sequence matchers, kept by sequence id on the
  worker that samples (rank 0 under tensor parallelism). Each step, once the
  forward is queued, each matcher takes the token the engine accepted last
  step and the batch's bitmask is filled (``TokenMask``, one row per constrained
  row, applied by the sampler as one op). The engine's token history is the
  truth: a matcher that does not match it (a recomputed or restarted
  sequence, a reused id) is rebuilt by replaying the history, so preemption
  by recompute or swap cannot leave a matcher out of step. Sequences the
  engine finished or aborted are released (``ModelInput.finished_ids``).

EOS: the grammar's stop tokens are the model's EOS ids, so the mask allows
EOS exactly where the grammar may end, and nothing else there.

A thinking model's grammar waits for its end-of-thinking token
(``SamplingParams.structured_after_token_id``): the reasoning before it is
free, and the grammar reads the output from the token after it.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from fluidserve.engine.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

# A run of JSON whitespace longer than this is refused: a weak model can loop
# on newlines forever, and no pretty-printed document needs more.
MAX_JSON_WHITESPACE = 16
MAX_CACHED_GRAMMARS = 256


def xgrammar():
    """The xgrammar module, imported on the first constrained request: an
    engine that is never asked for a grammar (a GPU node without xgrammar)
    starts and serves without it. Raises ValueError naming the package
    where it is missing, which the server answers with a 400."""
    try:
        import xgrammar as module
    except ImportError:
        raise ValueError("structured_outputs: the 'xgrammar' package is not installed; structured output "
                         "(response_format, guided decoding, forced tool calls) needs it: "
                         "pip install xgrammar") from None
    return module


def _grammar(spec: StructuredOutputs) -> xgr.Grammar:
    """The spec as a tokenizer-independent grammar; raises ValueError naming
    what is wrong with it."""
    xgr = xgrammar()
    # xgrammar's any_whitespace=False alone still puts a space after "," and
    # ":"; compact JSON needs the separators named too.
    layout = (dict(any_whitespace=False, separators=(",", ":")) if spec.disable_any_whitespace
              else dict(any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE))
    try:
        if spec.json is not None:
            return xgr.Grammar.from_json_schema(spec.json, **layout)
        if spec.json_object:
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **layout)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            # One alternative per choice, each a JSON-escaped string literal of the EBNF.
            alts = " | ".join(json.dumps(c) for c in spec.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alts}")
        return xgr.Grammar.from_ebnf(spec.grammar or "")
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and friends for bad input
        raise ValueError(f"{_kind(spec)}: {_first_line(exc)}") from None


def check_structured_outputs(spec: StructuredOutputs) -> None:
    """Raise ValueError if ``spec`` does not build into a grammar."""
    _grammar(spec)


def _kind(spec: StructuredOutputs) -> str:
    for kind in ("json", "regex", "choice", "grammar"):
        if getattr(spec, kind) is not None:
            return f"structured_outputs.{kind}"
    return "structured_outputs.json_object"


# xgrammar's C++ errors open with a time and a source location, as in
# "[00:33:41] /project/cpp/regex_converter.cc:94: Regex parsing error ...":
# of no use to whoever sent the grammar.
_NATIVE_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _NATIVE_PREFIX.sub("", text.splitlines()[0])[:300]


class GrammarCompiler:
    """Grammars compiled against one tokenizer, kept by spec (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgr = xgrammar()
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(set(stop_token_ids)))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutputs, xgr.CompiledGrammar] = OrderedDict()

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        compiled = self._cache.get(spec)
        if compiled is None:
            compiled = self._compiler.compile_grammar(_grammar(spec))
            self._cache[spec] = compiled
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return compiled


@dataclass
class TokenMask:
    """The next-token bitmask of a step's constrained rows: bit ``t % 32`` of
    word ``t // 32`` in row ``i`` says whether token ``t`` may follow in
    sampling row ``rows[i]``."""

    bitmask: torch.Tensor  # [len(rows), ceil(V / 32)] int32, on the host
    rows: list[int]
    vocab_size: int

    def row(self, index: int) -> TokenMask | None:
        """The mask of sampling row ``index`` alone (as a batch of that row),
        None where it is not constrained."""
        if index not in self.rows:
            return None
        k = self.rows.index(index)
        return TokenMask(self.bitmask[k:k + 1], [0], self.vocab_size)

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens of the constrained rows to -inf, in place, in one
        kernel for all of them (``logits``: [R, V] fp32, every sampling row)."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        vocab = min(self.vocab_size, logits.shape[1])
        # xgrammar reads bitmask row r for logits row r (its ``indices`` pick
        # rows of both), while ours holds the constrained rows alone.
        rows, first = self.rows, self.rows[0]
        if rows[-1] - first + 1 == len(rows):  # consecutive (rows ascend): the mask fits a view of them
            xgrammar().apply_token_bitmask_inplace(logits[first:first + len(rows)], bitmask, vocab_size=vocab)
        else:
            # Each mask row moved to its logits row's place; xgrammar reads
            # no other, so the rows between are left unwritten.
            spread = bitmask.new_empty((rows[-1] + 1, bitmask.shape[1]))
            spread[rows] = bitmask
            xgrammar().apply_token_bitmask_inplace(logits, spread, vocab_size=vocab, indices=rows)
        if logits.shape[1] > self.vocab_size:  # ids past the tokenizer's: never grammatical
            logits[rows, self.vocab_size:] = float("-inf")


@dataclass
class _SeqGrammar:
    spec: StructuredOutputs
    matcher: xgr.GrammarMatcher
    accepted: int = 0  # output tokens the matcher has consumed
    last_token: int = -1  # the last of them
    broken: bool = False  # the history held a token the grammar refused
    start: int = 0  # where in the output the grammar starts (past a reasoning)


class StructuredDecoder:
    """Matchers of the constrained sequences a worker samples for.

    Each step the matchers first take the tokens the engine accepted last
    step (from the history each constrained SampleSpec carries), then fill
    the batch's bitmask, one library call each. The worker calls ``fill``
    once the forward is queued, so on a GPU it overlaps the forward.

    ``tokenizer_loader`` is called once, on the first constrained request,
    so a worker that never sees one never loads the tokenizer."""

    def __init__(self, tokenizer_loader: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._load_tokenizer = tokenizer_loader
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._seqs: dict[str, _SeqGrammar] = {}
        # Rows whose grammar waits for a token: (output scanned, its index or -1).
        self._gates: dict[str, tuple[int, int]] = {}
        self._batch: xgr.BatchGrammarMatcher | None = None  # made with the compiler, on first use

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._load_tokenizer(), self.vocab_size, self.stop_token_ids)
            self._batch = xgrammar().BatchGrammarMatcher(max_threads=1)
        return self._compiler

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    def release(self, seq_ids: Iterable[str]) -> None:
        for sid in seq_ids:
            self._seqs.pop(sid, None)
            self._gates.pop(sid, None)

    def fill(self, seq_ids: Sequence[str], samples: Sequence[Any],
             drafts: dict[str, list[int]] | None = None) -> TokenMask | None:
        """The bitmask of this step's constrained rows (``samples`` are the
        step's SampleSpecs, row by row), or None when no row is constrained.
        A row whose grammar waits for a token (``structured_after_token_id``:
        a reasoning model still thinking) is not constrained yet.

        A sequence verifying drafts (``drafts``: its id -> them) has a row at
        each position, in order: its ``j``-th row after its first is masked
        by the grammar after the first ``j`` drafts (``_fill_drafted``).
        Where a reasoning's end is among the drafts, the rows up to it are
        free and those after it masked by the grammar from its start."""
        rows: list[int] = []
        firsts: list[int] = []  # of rows, those at their sequence's position now
        later: dict[str, list[int]] = {}  # a verifying sequence's rows, as indices into rows
        starts: list[int] = []
        # A verifying sequence whose grammar starts inside its drafts (past a
        # reasoning's end among them): the draft index of that end, its rows
        # seen so far, and its rows the grammar masks (indices into rows).
        gated: dict[str, tuple[int, list[int], list[int]]] = {}
        for i, s in enumerate(samples):
            if s.params.structured_outputs is None:
                continue
            sid = seq_ids[i]
            if sid in later:
                later[sid].append(len(rows))
                rows.append(i)
                continue
            if sid in gated:
                end, seen, ks = gated[sid]
                seen.append(i)
                if len(seen) > end + 1:  # the row after the end, and those after it
                    ks.append(len(rows))
                    rows.append(i)
                continue
            start = self._grammar_start(sid, s)
            if start is not None:
                if drafts and sid in drafts:
                    later[sid] = [len(rows)]
                firsts.append(len(rows))
                rows.append(i)
                starts.append(start)
            elif drafts and s.params.structured_after_token_id in drafts.get(sid, ()):
                gated[sid] = drafts[sid].index(s.params.structured_after_token_id), [i], []
        if not rows:
            return None
        entries = self._synced([seq_ids[rows[k]] for k in firsts], [samples[rows[k]] for k in firsts], starts)
        xgr = xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)  # [C, W], all allowed
        live = [k for k, e in zip(firsts, entries) if not e.broken]
        # One call for the batch: per-row calls cost more in crossing into
        # the library than in filling small masks.
        if live:
            self._batch.batch_fill_next_token_bitmask([e.matcher for e in entries if not e.broken], bitmask,
                                                      indices=live)
        for k, entry in zip(firsts, entries):
            if entry.broken:
                self._only_stop_tokens(bitmask, k)
        for sid, ks in later.items():
            if len(ks) > 1:
                self._fill_drafted(self._seqs[sid], drafts[sid], bitmask, ks)
        for sid, (end, _, ks) in gated.items():
            if ks:
                # The grammar as it starts, after the end of the reasoning,
                # then the drafts after that end; the engine's outputs reach
                # it next step and make the sequence's own matcher.
                spec = samples[rows[ks[0]]].params.structured_outputs
                entry = _SeqGrammar(spec, xgr.GrammarMatcher(self.compiler.compile(spec)))
                entry.matcher.fill_next_token_bitmask(bitmask, ks[0])
                self._fill_drafted(entry, drafts[sid][end + 1:], bitmask, ks)
        return TokenMask(bitmask, rows, self.vocab_size)

    def _fill_drafted(self, entry: _SeqGrammar, draft: list[int], bitmask: torch.Tensor, ks: list[int]) -> None:
        """Mask rows ``ks`` of a verifying sequence, its position now and
        each after it, in order (the first is filled): the matcher takes the
        drafts one by one, each row masked after the ones before it, then
        rolls back to the engine's outputs, which stay the truth. Past a
        draft the grammar refuses, or one that ends it, no verification
        reaches: the row before cannot keep that draft (its mask refuses it)
        or stops there, so the rows after take a copy of its mask, which
        sampling reads but no token kept comes from."""
        if entry.broken:
            for k in ks[1:]:
                self._only_stop_tokens(bitmask, k)
            return
        matcher = entry.matcher
        walked = 0
        try:
            for j, k in enumerate(ks[1:]):
                if walked == j and not matcher.is_terminated() and matcher.accept_token(draft[j]):
                    walked += 1
                    if not matcher.is_terminated():
                        matcher.fill_next_token_bitmask(bitmask, k)
                        continue
                bitmask[k] = bitmask[ks[j]]
        finally:
            if walked:
                matcher.rollback(walked)

    def _grammar_start(self, sid: str, sample: Any) -> int | None:
        """Where the row's grammar starts in its output: 0, or just past the
        first ``structured_after_token_id``; None while that has not come.
        The search resumes where the last step's ended, so a long reasoning
        costs each step only its new tokens."""
        gate = sample.params.structured_after_token_id
        if gate is None:
            return 0
        history: list[int] = sample.output_token_ids
        scanned, found = self._gates.get(sid, (0, -1))
        if found >= 0 and (found >= len(history) or history[found] != gate):
            scanned, found = 0, -1  # a history that is not the one scanned (a reused id)
        if found < 0:
            scanned = min(scanned, len(history))
            try:
                found = history.index(gate, scanned)
            except ValueError:
                self._gates[sid] = (len(history), -1)
                return None
            self._gates[sid] = (found + 1, found)
        return found + 1

    # -- keeping matchers in step with the engine ------------------------------
    def _synced(self, seq_ids: list[str], samples: list[Any], starts: list[int]) -> list[_SeqGrammar]:
        """Each row's matcher after exactly the engine's outputs so far (from
        the row's grammar start on).

        ``output_token_ids`` is a constrained sequence's whole output (the
        engine sends it): usually the matcher is one token behind, last
        step's sample, and those tokens go in with one call for the batch.
        Any other matcher is caught up from the history or, if the history
        no longer extends what it consumed (a recompute, a reused id), built
        anew and replayed."""
        xgr = xgrammar()
        entries: list[_SeqGrammar] = []
        behind: list[tuple[str, _SeqGrammar, int]] = []  # one token to take
        for sid, sample, start in zip(seq_ids, samples, starts):
            spec = sample.params.structured_outputs
            history: list[int] = sample.output_token_ids
            length = len(history) - start  # the tokens the grammar reads
            entry = self._seqs.get(sid)
            n = entry.accepted if entry is not None else 0
            if entry is None or not (entry.spec is spec or entry.spec == spec) or entry.start != start or \
                    n > length or (n and history[start + n - 1] != entry.last_token):
                entry = _SeqGrammar(spec, xgr.GrammarMatcher(self.compiler.compile(spec)), start=start)
                self._seqs[sid] = entry
                n = 0
            if n + 1 == length and not entry.broken:
                behind.append((sid, entry, history[-1]))
            else:
                for tok in history[start + n:]:
                    if entry.broken:
                        break
                    self._take(sid, entry, tok, entry.matcher.accept_token(tok))
            entries.append(entry)
        if behind:
            taken = xgr.BatchGrammarMatcher.batch_accept_token([e.matcher for _, e, _ in behind],
                                                               [tok for _, _, tok in behind])
            for (sid, entry, tok), ok in zip(behind, taken):
                self._take(sid, entry, tok, ok)
        return entries

    def _take(self, sid: str, entry: _SeqGrammar, tok: int, ok: bool) -> None:
        if ok:
            entry.accepted += 1
            entry.last_token = tok
            return
        # Only a token the mask did not allow gets here (say allowed_token_ids
        # left nothing grammatical): end the sequence rather than mask nothing.
        log.warning("structured output: sequence %s produced token %d outside its grammar; it ends here", sid, tok)
        entry.broken = True

    def _only_stop_tokens(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        for tok in self.stop_token_ids:
            bit = 1 << (tok % 32)
            bitmask[row, tok // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
