"""OpenAI wire types: the request and response bodies of /v1/completions,
/v1/chat/completions and /v1/models, and OpenAI's error object.

Pydantic lives here and in ``api.py`` only. These models describe JSON on the
wire; turning a request into engine inputs is ``inputs.py``'s job, turning
engine outputs into responses is ``render.py``'s. Field bounds are checked
here so a bad value is a 400 naming its parameter before the engine sees it.

No request field is silently dropped. Every field OpenAI or vLLM defines for
the two generation endpoints is either a model field here (implemented) or in
a ``_REFUSED`` table: sent with anything but its "off" value it is a 400 whose
``param`` names it. A key neither knows is a 400 naming it too, as OpenAI's
own API answers ("Unrecognized request argument"): a misspelt ``max_token``
or ``temprature`` must not run with the default it meant to change. A server
started with ``--ignore-unknown-fields`` (validation context
``IGNORE_UNKNOWN_FIELDS``) logs such keys and drops them instead, as vLLM
does, for clients that send fields of their own.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from fluidserve.engine.sampling_params import MAX_STOP_SEQUENCES, STRUCTURED_OUTPUT_BACKENDS

MAX_N = 16  # completions per prompt
MAX_LOGIT_BIAS = 300  # entries of logit_bias
MAX_BAD_WORDS = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's seed range
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids

logger = logging.getLogger("fluidserve.serve")

# Validation-context key: true drops unknown request keys with a warning
# instead of refusing them (``--ignore-unknown-fields``).
IGNORE_UNKNOWN_FIELDS = "ignore_unknown_fields"


class _Wire(BaseModel):
    # Response bodies, and request parts echoed from one (a tool call's
    # history): keys of a newer API are dropped there, nothing acts on them.
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


def _off(*values: Any) -> Callable[[Any], bool]:
    """A refused field's harmless values: None, empty, or one of ``values``."""
    return lambda v: v is None or v in values or (isinstance(v, (list, dict, str)) and not v)


# Fields both endpoints know but do not implement -> which values mean "off".
_REFUSED_COMMON: dict[str, Callable[[Any], bool]] = {
    "logits_processors": _off(),
    "kv_transfer_params": _off(),
    "vllm_xargs": _off(),
    "prompt_embeds": _off(),
    "mm_processor_kwargs": _off(),
    "guided_decoding_backend": _off(*STRUCTURED_OUTPUT_BACKENDS),
    "guided_whitespace_pattern": _off(),
    "structural_tag": _off(),
    "store": _off(False),  # nothing is stored, so metadata has no use either
    "metadata": _off(),
    "service_tier": _off("auto", "default"),
    "suffix": _off(),
    "session_id": _off(),
    "stream_interval": _off(1),
    "thinking_token_budget": _off(),
    "watermarking": _off(False),
    "media_io_kwargs": _off(),
    "routed_experts_prompt_start": _off(),
    "return_token_offsets": _off(False),
    "return_prompt_text": _off(False),
    "mm_payload": _off(),
    "return_mm_kwargs": _off(False),
    "ec_transfer_params": _off(),
    "repetition_detection": _off(),
}
_REFUSED_CHAT: dict[str, Callable[[Any], bool]] = {
    # A thinking budget needs to know where the thinking ends: chat replies only.
    **{k: v for k, v in _REFUSED_COMMON.items() if k != "thinking_token_budget"},
    "functions": _off(),
    "function_call": _off("none"),
    "audio": _off(),
    "modalities": lambda v: v is None or v == ["text"],
    # Even {} asks for a search (with the default context size): only null is off.
    "web_search_options": lambda v: v is None,
    "verbosity": _off(),
    "moderation": _off(),
    "prompt_cache_options": _off(),
    "prompt_cache_retention": _off("in_memory"),  # what the prefix cache is; 24h is not kept
}
_REFUSED_MESSAGE: dict[str, Callable[[Any], bool]] = {
    "function_call": _off(),
    "audio": _off(),
    "refusal": _off(),
    "annotations": _off(),  # on a reply echoed back as history
}
_REFUSED_STREAM_OPTIONS: dict[str, Callable[[Any], bool]] = {"include_obfuscation": _off(False)}
_REFUSED_STRUCTURED: dict[str, Callable[[Any], bool]] = {
    "structural_tag": _off(),
    "backend": _off(*STRUCTURED_OUTPUT_BACKENDS),
    "disable_fallback": _off(False),
    "disable_additional_properties": _off(False),
    "whitespace_pattern": _off(),
}


class _Request(BaseModel):
    """A request body: known-but-unimplemented fields are refused by name,
    and so are unknown ones unless the context says to drop them (see the
    module docstring)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _screen_fields(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        unknown = []
        for key, value in data.items():
            if key in known:
                continue
            harmless = cls._REFUSED.get(key)
            if harmless is None:
                unknown.append(str(key))
            elif not harmless(value):
                raise ValueError(f"{key}: is not supported by this server")
        if unknown:
            named = ", ".join(repr(k[:64]) for k in unknown[:16]) + (", ..." if len(unknown) > 16 else "")
            if not (info.context or {}).get(IGNORE_UNKNOWN_FIELDS):
                raise ValueError(f"{unknown[0][:64]}: unrecognized request argument(s) supplied: {named}")
            logger.warning("%s: ignoring unknown field(s) %s", cls.__name__, named)
        return data


class StreamOptions(_Request):
    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = _REFUSED_STREAM_OPTIONS
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk, not only the last


# -- structured output and tools (request side) -----------------------------------

FunctionName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted: decoding always follows the schema strictly


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        return self


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = _REFUSED_STRUCTURED
    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = None
    json_object: bool | None = None
    # None: the server's --structured-outputs-config default.
    disable_any_whitespace: bool | None = None


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: a forced call always follows the schema strictly


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionRef


class FunctionCallWire(_Wire):
    name: str
    arguments: str  # JSON text


class ToolCallWire(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallWire

Prob = Annotated[float, Field(ge=0.0, le=2.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
RequestClassName = Literal["online", "offline"]


class _SamplingFields(_Request):
    """Parameters both endpoints share, with OpenAI's bounds."""

    model: str | None = None
    temperature: Prob | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    # OpenAI's: best_of candidates made, the n with the highest logprob per token returned.
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # Identify the end user for the client's own records; no effect on generation.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a cache-routing hint; prefix reuse never depends on it
    # False: at most one call under tool_choice "required"; no effect on completions.
    parallel_tool_calls: bool | None = None
    # Structured output: at most one of these (OpenAI's, then vLLM's names).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    guided_grammar: StrictStr | None = None
    # Extensions beyond OpenAI's API (vLLM's names and meanings).
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False
    allowed_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)] | None = None
    bad_words: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=MAX_BAD_WORDS)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None  # keep k tokens; -1: max_model_len
    truncation_side: Literal["left", "right"] = "left"  # left: keep the last k, right: the first k
    add_special_tokens: bool | None = None
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")] | None = None
    # vLLM's int (lower runs first, default 0), or our class name.
    priority: StrictInt | RequestClassName | None = None
    # vLLM's: cached prompt blocks are shared only among requests of the same salt.
    cache_salt: Annotated[StrictStr, Field(min_length=1)] | None = None
    request_class: RequestClassName | None = Field(default=None, alias="class")
    # vLLM's: each prompt position's token logprob plus the top N (not streamed);
    # -1: the whole vocabulary. The cap is the server's --max-logprobs (inputs.py).
    prompt_logprobs: Annotated[int, Field(ge=-1)] | None = None
    # vLLM's: these ids' logprobs at every generated position, beside the
    # sampled token, in place of the top N; needs logprobs.
    logprob_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]],
                                 Field(max_length=MAX_LOGPROB_TOKEN_IDS)] | None = None
    # vLLM's beam search: n beams, scored cumulative logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: the prompt's and each choice's token ids in the response.
    return_token_ids: bool | None = None
    # vLLM's: logprob tokens written "token_id:N" (None: the server's --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None

    @property
    def candidates(self) -> int:
        """Completions made per prompt: ``best_of``, else ``n``."""
        return self.best_of or self.n

    @property
    def ranked(self) -> bool:
        """More candidates are made than returned (``best_of > n``)."""
        return self.candidates > self.n

    @model_validator(mode="after")
    def _check_shared(self) -> "_SamplingFields":
        if self.stop is not None and any(not s for s in ([self.stop] if isinstance(self.stop, str) else self.stop)):
            raise ValueError("stop: sequences must be non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of: must be at least n")
        if self.ranked and self.stream:
            raise ValueError("best_of: a reply ranked among best_of candidates cannot be streamed")
        if self.ranked and self.use_beam_search:
            raise ValueError("best_of: beam search keeps its own n beams; it takes no best_of above n")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: is not available when stream is true")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens: must be -1 or at least 1")
        if self.logprob_token_ids is not None and not self.logprob_token_ids:
            raise ValueError("logprob_token_ids: must not be an empty list")
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise ValueError("length_penalty: only applies with use_beam_search")
        if self.use_beam_search:
            self._check_beam_search()
        if self.priority is not None and self.request_class and self._priority_class != self.request_class:
            raise ValueError("priority: conflicts with class")
        given = [f for f in STRUCTURED_FIELDS if getattr(self, f) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise ValueError(f"{given[1]}: cannot be combined with {given[0]} (one output constraint per request)")
        return self

    def _check_beam_search(self) -> None:
        """Beam search expands the model's likeliest tokens, as vLLM's does:
        a field that would reshape the distribution or end a beam elsewhere
        is refused rather than silently ignored (vLLM ignores them).
        Sampling knobs (top_p, top_k, min_p, seed) have nothing to act on."""
        if self.logprob_token_ids:
            raise ValueError("logprob_token_ids: is not supported with beam search")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: is not supported with beam search")
        unsupported = {
            "stop": bool(self.stop_list), "stop_token_ids": bool(self.stop_token_ids),
            "logit_bias": bool(self.logit_bias), "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words), "min_tokens": self.min_tokens > 0,
            "presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            **{f: getattr(self, f) is not None and not (f == "response_format" and self.response_format.type == "text")
               for f in STRUCTURED_FIELDS},
        }
        field = next((f for f, given in unsupported.items() if given), None)
        if field is not None:
            raise ValueError(f"{field}: is not supported with beam search")

    @property
    def _priority_class(self) -> str | None:
        # vLLM's int priority onto our two classes: the default 0 and anything
        # more urgent stay online; a positive (later) priority runs offline,
        # behind every online request.
        if isinstance(self.priority, int):
            return "online" if self.priority <= 0 else "offline"
        return self.priority

    @property
    def klass(self) -> str:
        return self._priority_class or self.request_class or "online"

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
TokenIds = list[StrictInt]


class CompletionRequest(_SamplingFields):
    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = _REFUSED_COMMON
    # A string, a list of strings, a list of token ids, or a list of those.
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=-1)] | None = None  # -1: the whole vocabulary
    echo: bool = False

    @model_validator(mode="after")
    def _check_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be empty")
        if self.logprob_token_ids and self.logprobs is None:
            raise ValueError("logprob_token_ids: needs logprobs to be set")
        if self.use_beam_search and self.stream:
            raise ValueError("stream: streaming is not supported with beam search")
        return self

    @property
    def top_n(self) -> int | None:
        """Alternatives each logprobs position lists: -1 for every entry the
        engine returned (the whole vocabulary, or the logprob_token_ids)."""
        return -1 if self.logprob_token_ids else self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or token ids."""
        return prompt_list(self.prompt)


def prompt_list(given: str | list) -> list[str | list[int]]:
    """A string, a list of strings, token ids or a list of those (OpenAI's
    ``prompt`` and ``input``) as a list of prompts, each a string or ids."""
    if isinstance(given, str):
        return [given]
    if all(isinstance(x, int) for x in given):
        return [list(given)]
    return list(given)


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = _REFUSED_MESSAGE
    # Any role, as vLLM takes it: the chat template decides what a custom one means.
    role: Annotated[StrictStr, Field(min_length=1)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallWire] | None = None  # an assistant turn's calls (tool history)
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant turn's reasoning, as a reasoning parser returned it (vLLM
    # takes both names); the chat template decides whether the model sees it.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Name the part this server cannot take, instead of pydantic's
        # account of every way the union failed.
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content part {i} is of type {kind!r}: this server takes text parts only")
        return content

    @model_validator(mode="after")
    def _check_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"messages: a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only a tool message answers a tool call")
        if (self.reasoning is not None or self.reasoning_content is not None) and self.role != "assistant":
            raise ValueError("reasoning: only an assistant message carries reasoning")
        return self

    @property
    def reasoning_text(self) -> str | None:
        return self.reasoning if self.reasoning is not None else self.reasoning_content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class Prediction(_Request):
    """OpenAI's ``prediction``: ``{"type": "content", "content": ...}``, the
    content a string or a list of text parts."""

    type: Literal["content"]
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1)]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = _REFUSED_CHAT
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=-1)] | None = None  # -1: the whole vocabulary
    add_generation_prompt: bool = True
    # Render the last (assistant) message open, so the reply continues it.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    # vLLM's: the request's own Jinja chat template (a server started with
    # --trust-request-chat-template), and documents for a template that reads them (RAG).
    chat_template: StrictStr | None = None
    documents: list[dict[str, Any]] | None = None
    # vLLM's: the reply is prefixed with the last message's content when the
    # reply's role (assistant, or the last message's without a generation prompt) is its role.
    echo: bool = False
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # With --reasoning-parser: false leaves the reasoning out of the reply
    # (it is still made, and its tokens counted).
    include_reasoning: bool = True
    # Given to the chat template, as vLLM does, with enable_thinking set to
    # whether it is "none" unless chat_template_kwargs sets it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's: at most this many tokens of thinking, then the end marker is
    # forced; -1 is no limit.
    thinking_token_budget: Annotated[StrictInt, Field(ge=-1)] | None = None
    # OpenAI's predicted output: text the reply is expected to repeat (a file
    # it edits), the source of speculative decoding's drafts.
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.logprob_token_ids and not self.logprobs:
            raise ValueError("logprob_token_ids: requires logprobs to be true")
        if self.use_beam_search and self.tool_choice_mode in ("required", "named"):
            raise ValueError("tool_choice: a forced tool call is not supported with beam search")
        _check_template_flags(self)
        return self

    @property
    def top_n(self) -> int | None:
        """Alternatives each logprobs position lists (None: no logprobs; -1:
        every entry the engine returned, the whole vocabulary or the
        logprob_token_ids)."""
        if not self.logprobs:
            return None
        return -1 if self.logprob_token_ids else (self.top_logprobs or 0)

    @property
    def reply_role(self) -> str:
        """vLLM's response role: assistant after a generation prompt, else the
        role of the message being continued."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not among the tools")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        constrained = [f for f in STRUCTURED_FIELDS if getattr(self, f) is not None
                       and not (f == "response_format" and self.response_format.type == "text")]
        if forced and constrained:
            raise ValueError(f"{constrained[0]}: cannot be combined with a forced tool_choice "
                             "(the call's schema already constrains the reply)")
        return self

    @property
    def tool_choice_mode(self) -> str:
        """"none", "auto", "required" or "named": OpenAI's default is auto
        when tools are given, none otherwise."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class BatchChatCompletionRequest(BaseModel):
    """vLLM's /v1/chat/completions/batch: a chat body whose ``messages`` is a
    list of conversations, one choice each (indexed in order). Only the
    batch's own shape is checked here; each conversation is then validated
    as a whole ``ChatCompletionRequest``, so every other field means what it
    means there. Streaming, tools, beam search and n > 1 are refused, as vLLM
    refuses them (vLLM ignores ``stream`` and ``tools``; a 400 says it)."""

    model_config = ConfigDict(extra="allow")  # the other fields, for each conversation's own validation
    messages: Annotated[list[Annotated[list[ChatMessage], Field(min_length=1)]], Field(min_length=1)]
    n: int | None = 1
    stream: bool | None = False
    use_beam_search: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _check_batch(self) -> "BatchChatCompletionRequest":
        if self.use_beam_search:
            raise ValueError("use_beam_search: batch chat completions do not support beam search")
        if self.n not in (None, 1):
            raise ValueError("n: batch chat completions do not support n > 1")
        if self.stream:
            raise ValueError("stream: batch chat completions are not streamed")
        if self.tools:
            raise ValueError("tools: batch chat completions do not support tools")
        if self.tool_choice not in (None, "none"):
            raise ValueError('tool_choice: batch chat completions only take "none"')
        return self


def _check_template_flags(req: Any) -> None:
    # vLLM refuses the pair: a generation prompt would close the message that is to be continued.
    if req.continue_final_message and req.add_generation_prompt:
        raise ValueError("continue_final_message: cannot be true together with add_generation_prompt "
                         "(set add_generation_prompt to false)")


_REFUSED_TOKENIZE_CHAT: dict[str, Callable[[Any], bool]] = {"mm_processor_kwargs": _REFUSED_CHAT["mm_processor_kwargs"]}


class TokenizeCompletionRequest(_Request):
    """/tokenize of a prompt (vLLM's form)."""

    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """/tokenize of chat messages rendered through the chat template."""

    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = _REFUSED_TOKENIZE_CHAT
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: StrictStr | None = None
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None  # rendered by the template

    @model_validator(mode="after")
    def _check_flags(self) -> "TokenizeChatRequest":
        _check_template_flags(self)
        return self


class TokenizeRequest:
    """Either form of /tokenize, told apart by ``messages`` (as vLLM does)."""

    @staticmethod
    def model_validate(data: dict, context: dict[str, Any] | None = None,
                       ) -> TokenizeCompletionRequest | TokenizeChatRequest:
        cls = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
        return cls.model_validate(data, context=context)


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


# -- responses ----------------------------------------------------------------


class TokenizeResponse(_Wire):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Wire):
    prompt: str


class LoadResponse(_Wire):
    server_load: int


class PromptTokensDetails(_Wire):
    cached_tokens: int = 0


def _without_nulls(out: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``out`` without those of ``keys`` that are null: fields absent unless
    the server reports them, so a body compares equal whether or not a
    serializer drops nulls."""
    for key in keys:
        if out.get(key) is None:
            out.pop(key, None)
    return out


class CompletionTokensDetails(_Wire):
    reasoning_tokens: int = 0
    # A request with a prediction: its tokens drafted and kept, and drafted and thrown away.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @model_serializer(mode="wrap")
    def _omit_prediction(self, handler: Any) -> dict[str, Any]:
        return _without_nulls(handler(self), ("accepted_prediction_tokens", "rejected_prediction_tokens"))


class Usage(_Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # --enable-prompt-tokens-details: prompt tokens served from the prefix cache.
    prompt_tokens_details: PromptTokensDetails | None = None
    # --reasoning-parser, on chat replies: the tokens that were reasoning.
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _omit_details(self, handler: Any) -> dict[str, Any]:
        return _without_nulls(handler(self), ("prompt_tokens_details", "completion_tokens_details"))


class CompletionLogprobs(_Wire):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Wire):
    """vLLM's Logprob as its prompt_logprobs carry it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token, keyed by token id; None for the first.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(_Wire):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (None: EOS or length)
    prompt_token_ids: list[int] | None = None  # return_token_ids (a stream's first chunk of the choice)
    token_ids: list[int] | None = None  # return_token_ids: the choice's tokens (a chunk's new ones)


class CompletionResponseChoice(CompletionChoice):
    """A whole response's choice; stream chunks carry no prompt logprobs."""

    prompt_logprobs: PromptLogprobs | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(_Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
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
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # --reasoning-parser: the reply's thinking (vLLM's field)
    tool_calls: list[ToolCallWire] = Field(default_factory=list)


class FunctionCallDelta(_Wire):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Wire):
    """One streamed piece of a tool call: id, type and name on its first."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatChoice(_Wire):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(_Wire):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class ChatDelta(_Wire):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Wire):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new tokens


class ChatCompletionChunk(_Wire):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids, on each choice's role chunk


class CompletionChunk(_Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelPermission(_Wire):
    """vLLM's permission entry, fixed values: every served model allows sampling and logprobs."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=_now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(_Wire):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "fluidserve"
    root: str | None = None  # the model the name serves (its path or hub id)
    parent: str | None = None  # an adapter's base model; None for a base model
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(_Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


# -- OpenAPI ------------------------------------------------------------------

# Bodies are parsed by hand (size limit first, then OpenAI-shaped 400s, never
# FastAPI's 422), so the routes declare no body parameter; their schemas are
# added to /openapi.json here instead.
REQUEST_BODIES: dict[str, tuple[type[BaseModel], ...]] = {
    "/v1/completions": (CompletionRequest,),
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/detokenize": (DetokenizeRequest,),
    "/invocations": (CompletionRequest, ChatCompletionRequest),
    "/v1/chat/completions/batch": (BatchChatCompletionRequest,),
}


def add_request_schemas(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (FastAPI's OpenAPI document) with each hand-parsed route's
    request body and its 400 error described."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})

    def ref(model: type[BaseModel]) -> dict[str, str]:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = ref(ErrorResponse)
    for path, models in REQUEST_BODIES.items():
        op = schema.get("paths", {}).get(path, {}).get("post")
        if op is None:
            continue
        refs = [ref(m) for m in models]
        body = refs[0] if len(refs) == 1 else {"oneOf": refs}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        op.setdefault("responses", {})["400"] = {
            "description": "Invalid request; ``param`` names the field",
            "content": {"application/json": {"schema": error}},
        }
    return schema


# -- Batch API ----------------------------------------------------------------

# An embedding model's endpoints; the others are a generating model's.
POOLING_ENDPOINTS = ("/v1/embeddings", "/v1/score", "/v1/rerank")
BATCH_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", *POOLING_ENDPOINTS)
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[StrictStr, Field(max_length=512)]


class BatchCreateRequest(BaseModel):
    # Unlike the generation bodies, a batch field we do not implement (say
    # output_expires_after) is refused by name rather than ignored.
    model_config = ConfigDict(extra="forbid")

    input_file_id: StrictStr
    endpoint: StrictStr
    completion_window: Literal["24h"]
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None

    @model_validator(mode="after")
    def _check_endpoint(self) -> "BatchCreateRequest":
        if self.endpoint not in BATCH_ENDPOINTS:
            raise ValueError(f"endpoint: must be one of {', '.join(BATCH_ENDPOINTS)}")
        return self
