"""SamplingParams: what a request asks of generation, validated at the door.

Pure Python (no torch) so the scheduler, the server and tests can build one
cheaply. Every check raises ``ValueError`` naming the offending parameter; the
HTTP layer turns that into a 400 in OpenAI's error shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16


# The structured output backends a request or a flag may name: xgrammar is
# the one built in, and "auto" picks it.
STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """A grammar the generated text must follow; exactly one kind is set.
    Compiled against the tokenizer and enforced token by token on the worker
    (engine/structured.py). Frozen and hashable: it keys the compile cache."""

    json: str | None = None  # a JSON schema, serialized
    json_object: bool = False  # any JSON object (OpenAI's JSON mode)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF syntax)
    # JSON kinds only: no whitespace outside strings, "," and ":" as the
    # separators (vLLM's option of the same name). Fewer tokens, but not a
    # cure for a model that loops: one that learned pretty-printed JSON is
    # pushed off it (benchmarks/structured_whitespace.py).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs: exactly one of json, json_object, regex, choice, grammar must be "
                             f"set, got {kinds or 'none'}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs: choice must be a non-empty list of strings")
        if self.disable_any_whitespace and self.json is None and not self.json_object:
            raise ValueError(f"structured_outputs: disable_any_whitespace applies to json and json_object, "
                             f"not {kinds[0]}, which says itself where whitespace may go")


# How an embedding request pools its prompt's final hidden states: the
# last token's (a decoder model's default), the mean over every token, or
# the first token's (an encoder's CLS).
POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: its prompt runs through the model and the final
    hidden states are pooled into one vector (engine/pooling.py) where a
    generation request would sample. ``dimensions`` keeps the first N
    (Matryoshka), before ``normalize`` scales it to unit length."""

    # None: the served model's (engine/pooling.py model_pooling), which the
    # engine fills in as it admits the request.
    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")

    def over(self, default: "PoolingParams") -> "PoolingParams":
        """These params, each field left None taken from ``default``."""
        return PoolingParams(self.pooling_type or default.pooling_type,
                             default.normalize if self.normalize is None else self.normalize,
                             default.dimensions if self.dimensions is None else self.dimensions)

    @property
    def reads_cache(self) -> bool:
        """Whether a prefix-cache hit may stand in for computed positions:
        only the last position's state is pooled, and it is always computed."""
        return self.pooling_type == "last"


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N alternatives per generated token
    # Per prompt position: the prompt token's logprob plus the top-N (vLLM's
    # field). A request asking for it never reads the prefix cache: every
    # prompt position must be computed to be scored.
    prompt_logprobs: int | None = None
    # vLLM's: these token ids' logprobs at every generated position, beside
    # the sampled token and the top-N (which ``logprobs`` still sets).
    logprob_token_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # With special tokens kept: a space between each special token and its
    # neighbours. Off by default, which is how fast tokenizers decode.
    spaces_between_special_tokens: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Token sequences that may not be generated: the last token of each is
    # banned wherever the output already ends with the ones before it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Constrained decoding: only tokens the grammar allows are sampled, and
    # EOS only where the grammar may end.
    structured_outputs: StructuredOutputs | None = None
    # The grammar reads only the output after this token's first appearance
    # (a reasoning model's end of thinking: vLLM's structured output after
    # reasoning); until it comes, decoding is free.
    structured_after_token_id: int | None = None
    # A thinking reply's budget: once its output holds this many tokens of
    # thinking (``thinking_start_token_id`` s not counted) and no
    # ``thinking_end_token_id``, that token is the only one it may take.
    thinking_token_budget: int | None = None
    thinking_start_token_id: int | None = None
    thinking_end_token_id: int | None = None
    # vLLM's: cached prompt blocks are shared only among requests of the same
    # salt (kvcache/prefix_cache.py), so one tenant cannot time another's
    # prompts through the prefix cache.
    cache_salt: str | None = None
    # The LoRA adapter to generate with, by its served name (engine/lora.py);
    # None: the base model.
    lora: str | None = None
    # OpenAI's predicted output: tokens the reply is expected to repeat (a
    # file it edits). With speculative decoding on, drafts come from them
    # first (engine/speculative.py, PredictionDrafter); the tokens sampled
    # are the same either way.
    prediction_token_ids: list[int] | None = None
    # Set: an embedding request, which samples nothing (its other sampling
    # fields are unread).
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids or [] if w]
        if self.top_k == 0:
            self.top_k = -1
        if self.logprob_token_ids and self.logprobs is None:
            self.logprobs = 0  # the sampled token's entry carries the asked-for ids beside it
        self.validate()

    def with_extra_eos(self, eos_ids: set[int] | list[int]) -> "SamplingParams":
        """These params with a model's further EOS ids as stop tokens (unless
        ``ignore_eos``), so ``min_tokens`` holds against them too; ``self``
        when there is nothing to add."""
        extra = [t for t in sorted(eos_ids) if t not in self.stop_token_ids]
        if self.ignore_eos or not extra:
            return self
        return dataclasses.replace(self, stop_token_ids=[*self.stop_token_ids, *extra])

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def bad(param: str, why: str) -> ValueError:
            return ValueError(f"{param} {why}")

        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            raise bad("n", f"must be an integer in [1, 128], got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", f"must be in [0, 2], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", f"must be a non-empty string, got {self.cache_salt!r}")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise bad("lora", f"must be a non-empty adapter name, got {self.lora!r}")
        if self.pooling is not None:
            wanted = [name for name, on in (("n", self.n != 1), ("logprobs", self.logprobs is not None),
                                            ("prompt_logprobs", self.prompt_logprobs is not None),
                                            ("structured_outputs", self.structured_outputs is not None),
                                            ("prediction", bool(self.prediction_token_ids))) if on]
            if wanted:
                raise bad(wanted[0], "does not apply to an embedding request")
        if self.thinking_token_budget is not None and (self.thinking_token_budget < 0
                                                       or self.thinking_end_token_id is None):
            raise bad("thinking_token_budget", f"must be at least 0, with the token that ends the thinking, "
                      f"got {self.thinking_token_budget!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        # No upper bound here: the cap is the server's --max-logprobs (MAX_LOGPROBS by default).
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", f"must be non-negative, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs!r}")
        if self.logprob_token_ids is not None and (
                not self.logprob_token_ids or any(not isinstance(t, int) or t < 0 for t in self.logprob_token_ids)):
            raise bad("logprob_token_ids", "must be a non-empty list of non-negative token ids")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise bad("stop", f"accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "sequences must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            if any(t < 0 for t in self.logit_bias):
                raise bad("logit_bias", "keys must be non-negative token ids")
            if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
                raise bad("logit_bias", "values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty")
            if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be non-negative integers")
        if self.prediction_token_ids is not None and (
                any(not isinstance(t, int) or t < 0 for t in self.prediction_token_ids)):
            raise bad("prediction", "token ids must be non-negative integers")
        if any(not isinstance(t, int) or t < 0 for w in self.bad_words_token_ids for t in w):
            raise bad("bad_words", "token ids must be non-negative integers")
        if self.structured_outputs is not None:
            # Both would have to mask EOS where the grammar allows only EOS:
            # no token would be left to sample.
            if self.ignore_eos:
                raise bad("ignore_eos", "cannot be combined with structured output")
            if self.min_tokens:
                raise bad("min_tokens", "cannot be combined with structured output")
