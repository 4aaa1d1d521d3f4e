"""OpenAI wire types: the request and response bodies of /v1/completions,
/v1/chat/completions and /v1/models, and OpenAI's error object.

Pydantic lives here and in ``api.py`` only. These models describe JSON on the
wire; turning a request into engine inputs is ``inputs.py``'s job, turning
engine outputs into responses is ``render.py``'s. Field bounds are checked
here so a bad value is a 400 naming its parameter before the engine sees it.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from ..engine.sampling_params import MAX_LOGPROBS, MAX_STOP_SEQUENCES

MAX_N = 16  # completions per prompt


class _Wire(BaseModel):
    # Unknown fields are ignored, as the official API tolerates newer clients.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# -- errors -------------------------------------------------------------------


class ErrorInfo(_Wire):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Wire):
    error: ErrorInfo


# -- requests -----------------------------------------------------------------


class StreamOptions(_Wire):
    include_usage: bool = False


Prob = Annotated[float, Field(ge=0.0, le=2.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
RequestClassName = Literal["online", "offline"]


class _SamplingFields(_Wire):
    """Parameters both endpoints share, with OpenAI's bounds."""

    model: str | None = None
    temperature: Prob | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    user: str | None = None
    # Extensions beyond OpenAI's API.
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    priority: RequestClassName | None = None
    request_class: RequestClassName | None = Field(default=None, alias="class")

    @model_validator(mode="after")
    def _check_shared(self) -> "_SamplingFields":
        if self.stop is not None and any(not s for s in ([self.stop] if isinstance(self.stop, str) else self.stop)):
            raise ValueError("stop: sequences must be non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.priority and self.request_class and self.priority != self.request_class:
            raise ValueError("priority: conflicts with class")
        return self

    @property
    def klass(self) -> str:
        return self.priority or self.request_class or "online"

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


TokenIds = list[StrictInt]


class CompletionRequest(_SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of those.
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be empty")
        if self.suffix:
            raise ValueError("suffix: is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"messages: a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses ----------------------------------------------------------------


class Usage(_Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Wire):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Wire):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(_Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Wire):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(_Wire):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(_Wire):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Wire):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(_Wire):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Wire):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Wire):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(_Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Wire):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "fluidserve"
    max_model_len: int | None = None


class ModelList(_Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
