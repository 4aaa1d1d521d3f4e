"""From a validated OpenAI request to what the engine takes: prompt token ids,
``SamplingParams`` and a request class.

Owns tokenization on the frontend (so it never runs on the engine loop), chat
template rendering, and the checks that need the model: token ids inside the
vocabulary, prompt plus ``max_tokens`` within ``max_model_len``. Every failure
is an ``APIError`` 400 naming its parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.sampling_params import SamplingParams
from .errors import APIError, bad_request, from_value_error
from .protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str  # the prompt as text (echo)


@dataclass(frozen=True)
class EngineInputs:
    prompts: list[Prompt]
    params: SamplingParams
    klass: str


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend needs to know of the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    is_tiny_default: bool = False
    aliases: tuple[str, ...] = ()  # further --served-model-name values clients may use
    # generation_config.json's sampling fields, for requests that leave them unset
    sampling_defaults: dict = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


class InputProcessor:
    def __init__(self, tokenizer: Any, model: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.model = model

    # -- endpoints ----------------------------------------------------------
    def completion(self, req: CompletionRequest) -> EngineInputs:
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported (no prompt logprobs)", "echo")
        prompts = [self._prompt(p) for p in req.prompts()]
        max_tokens = self._max_tokens(prompts, req.max_tokens, "prompt")
        return EngineInputs(prompts, self._params(req, max_tokens, req.logprobs), req.klass)

    def chat(self, req: ChatCompletionRequest) -> EngineInputs:
        text = self._render_chat(req)
        prompt = Prompt(self._encode(text, add_special_tokens=False), text)
        if not prompt.token_ids:
            raise bad_request("messages render to an empty prompt", "messages")
        max_tokens = self._max_tokens([prompt], req.max_new_tokens, "messages")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        return EngineInputs([prompt], self._params(req, max_tokens, top_n), req.klass)

    # -- pieces -------------------------------------------------------------
    def _prompt(self, p: str | list[int]) -> Prompt:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be empty", "prompt")
            return Prompt(self._encode(p, add_special_tokens=True), p)
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        vocab = self.model.vocab_size
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"prompt contains token id {bad} outside the vocabulary [0, {vocab})", "prompt")
        return Prompt(list(p), self.tokenizer.decode(p))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _render_chat(self, req: ChatCompletionRequest) -> str:
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 - a template's own raise_exception is a client error
            raise bad_request(f"messages could not be rendered with the chat template: {exc}", "messages") from None

    def _max_tokens(self, prompts: list[Prompt], asked: int | None, prompt_param: str) -> int:
        """``asked``, or all the room the longest prompt leaves; 400 when the
        prompt and the completion do not fit in the context."""
        limit = self.model.max_model_len
        longest = max(len(p.token_ids) for p in prompts)
        if longest >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the {prompt_param} has {longest} "
                f"tokens, leaving no room for a completion", prompt_param,
            )
        if asked is None:
            return limit - longest
        if longest + asked > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{longest + asked} tokens ({longest} in the {prompt_param}, {asked} in the completion)",
                "max_tokens",
            )
        return asked

    def _params(self, req: _SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=req.n,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                seed=req.seed,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                logprobs=logprobs,
                stop=req.stop_list,
                ignore_eos=req.ignore_eos,
            )
        except ValueError as exc:
            raise from_value_error(exc) from None


def check_model(requested: str | None, served: ModelInfo) -> None:
    """404 for a model this server does not serve (None means the default)."""
    if requested is not None and requested not in served.names:
        raise APIError(404, f"The model `{requested}` does not exist", param="model", code="model_not_found")
