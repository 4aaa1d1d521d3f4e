"""The engine's mutable state of a request: its prompt, parameters, and one
``Sequence`` per completion (``n`` of them). Each Sequence owns a SeqState,
the only part the scheduler sees.

A Sequence also keeps what the engine's per-step work reads of it worked out
once (its stop ids, its length limit, its sampler row), so a decode row costs
a few appends and lookups, never work that grows with the output so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from fluidserve.scheduler.request_state import RequestClass, SeqState
from fluidserve.engine.batch import SampleSpec
from fluidserve.engine.outputs import CompletionOutput, TokenLogprobs
from fluidserve.engine.sampling_params import SamplingParams
from fluidserve.engine.draft_policy import Acceptance
from fluidserve.engine.speculative import NgramDrafter, PredictionDrafter


@dataclass(eq=False)
class Sequence:
    index: int
    state: SeqState
    request: Request
    stream: object  # detokenizer.TextStream
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    emitted_text: str = ""
    # Produced since the last RequestOutput of this request.
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    # Worked out once, read every step (engine/output_processor.py):
    # tokens that may end the sequence (EOS unless ignore_eos, stop_token_ids),
    # and the output length at which it ends ("length").
    stop_ids: frozenset[int] = frozenset()
    max_output_len: int = 0
    # The sampler row, made on the first sample and updated in place after:
    # its token history is the live output list (read by the worker within
    # the step, before this step's token is appended).
    sample_spec: SampleSpec | None = None
    # The text is due only once the sequence finishes (a final-only request
    # of one completion and no stop strings): the stream takes its tokens
    # then, in one go (catch_up_text), instead of one per step.
    lazy_text: bool = False
    # Speculative decoding (engine/speculative.py): the n-gram index of its
    # tokens (None: it does not draft), the drafts for its next decode, and
    # how its drafts have fared (the adaptive policy's estimate of its rate).
    drafter: NgramDrafter | PredictionDrafter | None = None
    draft: list[int] = field(default_factory=list)
    acceptance: Acceptance | None = None
    # Whether ``draft`` came from the request's predicted output.
    draft_from_prediction: bool = False

    @property
    def seq_id(self) -> str:
        return self.state.request_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + outputs."""
        prompt = self.request.prompt_token_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return prompt[start:] + self.output_token_ids[:end - n]

    def catch_up_text(self) -> None:
        """For a finished ``lazy_text`` sequence: feed the stream every token
        a streamed one would have fed, and set the state its last output
        before this step would have left, so ``take_output`` returns exactly
        the streamed final output (deltas included)."""
        out = self.output_token_ids
        for t in out[:-1]:
            self.stream.append(t)
        self.emitted_text = self.stream.flush(False)  # what the previous step's output released
        if self.finish_reason == "length":  # a stop token is never detokenized (no stop strings here)
            self.stream.append(out[-1])
        self.new_token_ids = out[-1:]
        if self.logprobs is not None:
            self.new_logprobs = self.logprobs[-1:]

    def take_output(self) -> CompletionOutput:
        """The completion so far plus what is new since the last call."""
        delta = self.stream.flush(self.finish_reason is not None)
        if delta:
            self.emitted_text += delta
        # token_ids and logprobs are live, not copied: see CompletionOutput.
        out = CompletionOutput(self.index, self.emitted_text, self.output_token_ids, self.logprobs,
                               self.finish_reason, self.stop_reason, delta, self.new_token_ids, self.new_logprobs)
        self.new_token_ids = []
        if self.logprobs is not None:
            self.new_logprobs = []
        if isinstance(self.drafter, PredictionDrafter):
            out.accepted_prediction_tokens = self.drafter.accepted
            out.rejected_prediction_tokens = self.drafter.rejected
        return out


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    klass: RequestClass
    arrival_time: float
    max_tokens: int  # params.max_tokens, or what max_model_len leaves
    seqs: list[Sequence] = field(default_factory=list)
    # Prompt positions scored so far (params.prompt_logprobs), shared by the
    # n completions: whichever computes a position first scores it.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Only the finished output is handed back (LLM.generate): no output of
    # the steps before is built.
    final_only: bool = False
    # Every token it samples depends on the logits alone (sampler.device_only)
    # and it scores no prompt: its decodes may be queued before the step
    # ahead of them is read (async scheduling).
    launchable: bool = False
    lora_slot: int = -1  # the adapter slot it generates with (engine/lora.py); -1: the base model
    # Neither scores its prompt nor pools it: a one-token row of it is a plain decode or chunk.
    plain: bool = True
    # An embedding request (params.pooling): the float32 sum of the rows
    # pooled so far and how many prompt positions they cover.
    pool_sum: list[float] | None = None
    pool_count: int = 0

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.finish_reason is None:
                return False
        return True
