"""What the engine hands back to its callers (LLM, AsyncEngine, the server).

Plain dataclasses, no torch. Each ``RequestOutput`` carries both the cumulative
state of a completion (for offline ``LLM.generate``) and the delta since the
previous output of the same request (for streaming).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded: str = ""


# One generated position: the sampled token plus the top-N alternatives.
TokenLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """``token_ids`` and ``logprobs`` are the completion's own lists, not
    copies: copying them every step would cost O(length) per request per
    step. They grow in place until the completion finishes and are never
    touched after; for streaming, read the ``new_*`` deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or string that matched
    # Delta since the previous RequestOutput of this request.
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    # A request with a predicted output (``SamplingParams.prediction_token_ids``):
    # the prediction's tokens verifying steps drafted and kept, and drafted
    # and threw away. None without a prediction.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None  # set with finish_reason "error" when generation failed
    # time.monotonic() when the scheduler first ran any of it (queue-time metrics)
    first_scheduled_time: float | None = None
    # Asked-for prompt logprobs: None for the first position (nothing predicts
    # it), then the prompt token plus the top-N at each later position.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Prompt tokens whose KV came from the prefix cache (usage's
    # prompt_tokens_details.cached_tokens); None where the engine does not say.
    num_cached_tokens: int | None = None
    # An embedding request's vector (SamplingParams.pooling), on its finished
    # output; a sequence classifier's label probabilities.
    embedding: list[float] | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass
class ScoringOutput:
    score: float  # the cosine of the pair's two vectors


@dataclass
class ScoringRequestOutput:
    """One pair of ``LLM.score`` (vLLM's shape: ``out.outputs.score``)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the two texts' tokens, one after the other


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (logits with use_activation false)


@dataclass
class ClassificationRequestOutput:
    """One prompt of ``LLM.classify`` (vLLM's shape: ``out.outputs.probs``)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
