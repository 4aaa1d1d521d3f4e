"""The engine's mutable state of a request: its prompt, parameters, and one
``Sequence`` per completion (``n`` of them). Each Sequence owns a SeqState,
the only part the scheduler sees."""

from __future__ import annotations

from dataclasses import dataclass, field

from fluidserve.scheduler.request_state import RequestClass, SeqState
from fluidserve.engine.outputs import CompletionOutput, TokenLogprobs
from fluidserve.engine.sampling_params import SamplingParams


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
    # The engine's copy of the device block table, kept from the block ids
    # each StepPlan carries (the scheduler resends it whole after a move).
    block_table: list[int] = field(default_factory=list)

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

    def take_output(self) -> CompletionOutput:
        """The completion so far plus what is new since the last call."""
        delta = self.stream.flush(self.finished)
        self.emitted_text += delta
        out = CompletionOutput(
            index=self.index,
            text=self.emitted_text,
            token_ids=self.output_token_ids,  # live, not copied: see CompletionOutput
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            text_delta=delta,
            new_token_ids=self.new_token_ids,
            new_logprobs=self.new_logprobs,
        )
        self.new_token_ids = []
        self.new_logprobs = [] if self.logprobs is not None else None
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

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
