"""OutputProcessor: what a step's sampled tokens do to their requests.

Owns, for each token the executor sampled: appending it to its sequence,
detokenization (through the sequence's ``TextStream``), the stop checks
(stop token ids and EOS, stop strings, the length limit that max_tokens and
max_model_len set), the logprobs' display text (sampled and prompt), and
the ``RequestOutput`` of each request that moved. A request leaves the
engine's request map here, with its finished output.

Not its own: each sequence's stop ids, length limit and text stream are
worked out when the engine admits the request; the KV cache and the
scheduler are told of the sequences that stopped by the engine, from the
list ``process`` returns. Two engine duties that the token loop reaches
come in as callbacks: keying a block that just filled for the prefix cache,
and telling the worker to drop a finished constrained sequence's grammar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from fluidserve.scheduler.request_state import RequestClass
from fluidserve.engine.batch import StepResult
from fluidserve.engine.outputs import RequestOutput, TokenLogprobs
from fluidserve.engine.pooling import Classifier, add_pooled, finish
from fluidserve.engine.request import Request, Sequence

if TYPE_CHECKING:
    from fluidserve.engine.engine import EngineStats


class OutputProcessor:
    """``requests`` and ``seqs`` are the engine's live maps (request id ->
    Request, sequence id -> Sequence), shared, not copied: a sequence that
    stops leaves ``seqs``, a request whose sequences all stopped leaves
    ``requests``. ``eos_token_ids``: the model's EOS ids, which end a
    sequence without being its stop_reason. ``stats``: the generated-token
    counters are added to. ``block_filled(seq)``: called when prompt +
    outputs just filled a KV block of ``block_size`` tokens.
    ``grammar_finished(seq_id)``: a constrained sequence stopped."""

    def __init__(self, requests: dict[str, Request], seqs: dict[str, Sequence], eos_token_ids: set[int],
                 stats: EngineStats, block_size: int, block_filled: Callable[[Sequence], None],
                 grammar_finished: Callable[[str], None], classifier: Classifier | None = None) -> None:
        self.requests = requests
        self.seqs = seqs
        self.eos_token_ids = eos_token_ids
        self.stats = stats
        self.block_size = block_size
        self._block_filled = block_filled
        self._grammar_finished = grammar_finished
        self.classifier = classifier  # a sequence classifier's head (engine/pooling.py)

    def process(self, result: StepResult, step_start: float) -> tuple[list[RequestOutput], list[str]]:
        """Append each sampled token to its sequence; the outputs of the
        requests that moved, and the sequences that stopped. ``step_start``
        is the first_scheduled_time of requests this step ran first."""
        finished: list[str] = []
        for rid, entries in result.prompt_logprobs.items():
            req = self.requests.get(rid)
            if req is None:  # aborted while the step ran
                continue
            decode = req.seqs[0].stream.decode_token
            for entry in entries:
                for t, lp in entry.items():
                    lp.decoded = decode(t)
            req.prompt_logprobs.extend(entries)
        pooled = self._take_pooled(result.pooled, step_start, finished) if result.pooled else []
        get = self.seqs.get
        offline = RequestClass.OFFLINE
        bs = self.block_size
        touched: list[Request] = []  # in the order of their first token this step
        seen: set[str] = set()  # requests of n > 1 already in touched
        num_appended = num_offline = 0
        # Once per sampled row per step: appending a token is written out
        # here, the rarer work (a filled block, logprobs, stops) is called.
        for rid, token in (result.sampled.items() if not result.drafted else _with_drafts(result)):
            seq = get(rid)
            if seq is None:
                continue
            num_appended += 1
            tid = token.token_id
            out = seq.output_token_ids
            out.append(tid)
            req = seq.request
            lazy = seq.lazy_text
            if not lazy:  # a lazy sequence's new tokens are set when it finishes (catch_up_text)
                seq.new_token_ids.append(tid)
            if (len(req.prompt_token_ids) + len(out)) % bs == 0:
                self._block_filled(seq)
            if token.logprobs is not None and seq.logprobs is not None:
                self._add_logprobs(seq, token.logprobs)
            # _stop's three ways to end, tested here first so a lazy row
            # that cannot end this step makes no call.
            stopped = ((not lazy or tid in seq.stop_ids or len(out) >= seq.max_output_len)
                       and self._stop(seq, tid))
            if stopped:
                finished.append(rid)
            if req.klass is offline:
                num_offline += 1
            if len(req.seqs) == 1:
                # A lazy one has no output before its last; one that kept drafts has a token after another.
                if (stopped or not seq.lazy_text) and (not touched or touched[-1] is not req):
                    touched.append(req)
            elif req.request_id not in seen:
                seen.add(req.request_id)
                touched.append(req)
        self.stats.generation_tokens_total += num_appended
        self.stats.offline_generation_tokens_total += num_offline
        outputs = pooled
        for req in touched:
            out = self._output(req, step_start)
            if out.finished or not req.final_only:
                outputs.append(out)
        return outputs, finished

    def _take_pooled(self, pooled: dict, step_start: float, finished: list[str]) -> list[RequestOutput]:
        """Embedding requests' pooled rows of the step into their sums; the
        outputs of those it completed (engine/pooling.py), which finish
        with the reason "stop" and no tokens."""
        outputs = []
        for rid, (part, count, final) in pooled.items():
            req = self.requests.get(rid)
            if req is None:  # aborted while the step ran
                continue
            req.pool_sum = add_pooled(req.pool_sum, part)
            req.pool_count += count
            if not final:
                continue
            seq = req.seqs[0]
            try:
                embedding = finish(req.params.pooling, req.pool_sum, req.pool_count, self.classifier)
            except ValueError as exc:
                outputs.append(self.fail(req, str(exc), step_start))
            else:
                seq.finish_reason = "stop"
                self.seqs.pop(seq.seq_id, None)
                out = self._output(req, step_start)
                out.embedding = embedding
                outputs.append(out)
            finished.append(seq.seq_id)
        return outputs

    def _output(self, req: Request, step_start: float) -> RequestOutput:
        """The request's output after this step; a finished request leaves the engine."""
        if len(req.seqs) == 1:  # the common case, without the loops
            seq = req.seqs[0]
            first = seq.state.first_scheduled_time
            finished = seq.finish_reason is not None
            if seq.lazy_text:
                seq.catch_up_text()
            completions = [seq.take_output()]
            cached = seq.state.num_cached_tokens  # what admission found in the prefix cache
        else:
            first = None  # when any of its sequences first ran; this step if none has
            for s in req.seqs:
                t = s.state.first_scheduled_time
                if t is not None and (first is None or t < first):
                    first = t
            finished = req.finished
            completions = [s.take_output() for s in req.seqs]
            cached = max(s.state.num_cached_tokens for s in req.seqs)
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, finished, None,
                            step_start if first is None else first, req.prompt_logprobs, num_cached_tokens=cached)
        if finished:
            self.requests.pop(req.request_id, None)
        return out

    def fail(self, req: Request, error: str, step_start: float) -> RequestOutput:
        """End each unfinished sequence of ``req`` with finish reason
        "error", its tokens so far kept: the request's finished output,
        carrying ``error``. The request leaves the engine."""
        for seq in req.seqs:
            if seq.finish_reason is not None:
                continue
            if seq.lazy_text:  # its stream has no token yet: all of them, as a streamed one's would
                for t in seq.output_token_ids:
                    seq.stream.append(t)
                seq.lazy_text = False
            seq.finish_reason = "error"
            self.seqs.pop(seq.seq_id, None)
            if req.params.structured_outputs is not None:
                self._grammar_finished(seq.seq_id)
        out = self._output(req, step_start)
        out.error = error
        return out

    @staticmethod
    def _add_logprobs(seq: Sequence, logprobs: TokenLogprobs) -> None:
        for t, lp in logprobs.items():
            lp.decoded = seq.stream.decode_token(t)
        seq.logprobs.append(logprobs)
        seq.new_logprobs.append(logprobs)

    def _stop(self, seq: Sequence, tid: int) -> bool:
        """After ``tid`` was appended: True when the sequence stops on it
        (a stop token, a stop string its text now ends in, its length)."""
        if tid in seq.stop_ids:  # EOS (unless ignore_eos) or one of stop_token_ids
            if tid not in self.eos_token_ids or seq.request.params.ignore_eos:
                seq.stop_reason = tid
            reason = "stop"
        else:
            reason = None
            if not seq.lazy_text:  # a lazy stream has no stop strings: it takes its tokens at the end
                matched = seq.stream.append(tid)
                if matched is not None:
                    seq.stop_reason = matched
                    reason = "stop"
            if reason is None:
                if len(seq.output_token_ids) < seq.max_output_len:
                    return False
                reason = "length"
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
        if seq.request.params.structured_outputs is not None:
            self._grammar_finished(seq.seq_id)
        return True


def _with_drafts(result: StepResult):
    """(sequence id, token) for every token the step appends: a sequence that
    verified drafts has each of those that stand, in order (engine/speculative.py)."""
    drafted = result.drafted
    for rid, token in result.sampled.items():
        kept = drafted.get(rid)
        if kept is None:
            yield rid, token
        else:
            for t in kept:
                yield rid, t
