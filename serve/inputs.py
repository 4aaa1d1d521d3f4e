"""From a validated OpenAI request to what the engine takes: prompt token ids,
``SamplingParams`` and a request class.

Owns tokenization on the frontend (so it never runs on the engine loop), chat
template rendering, and the checks that need the model: token ids inside the
vocabulary, prompt plus ``max_tokens`` within ``max_model_len``. Every failure
is an ``APIError`` 400 naming its parameter.

Sampling fields a request leaves unset take the model's defaults from its
``generation_config.json`` (``ModelInfo.sampling_defaults``), then vLLM's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fluidserve.engine.sampling_params import MAX_LOGPROBS, PoolingParams, SamplingParams, StructuredOutputs
from fluidserve.engine.structured import check_structured_outputs
from fluidserve.serve.beam_search import BeamSearchParams
from fluidserve.serve.errors import CONTEXT_LENGTH_EXCEEDED, APIError, bad_request, from_value_error
from fluidserve.serve.protocol import (
    BATCH_ENDPOINTS,
    POOLING_ENDPOINTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    _SamplingFields,
)
from fluidserve.serve.reasoning import Reasoning, ReasoningParser
from fluidserve.serve.tool_parsers import (KEEPS_SPECIAL_TOKENS, ToolMode, named_call_schema, parameter_types,
                                           required_calls_schema)

if TYPE_CHECKING:
    from fluidserve.serve.embeddings import EmbeddingRequest, PooledRequest

logger = logging.getLogger("fluidserve.serve")


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str  # the prompt as text (echo)


@dataclass(frozen=True)
class EngineInputs:
    prompts: list[Prompt]
    params: SamplingParams
    klass: str
    tool_mode: ToolMode | None = None  # chat with tools: how the reply becomes tool calls
    beam: BeamSearchParams | None = None  # use_beam_search: run by serve/beam_search.py, not sampled
    reasoning: Reasoning | None = None  # --reasoning-parser, on a thinking reply: how it is split
    # Only the finished output comes back (Batch API lines): the engine skips
    # the per-token text and outputs nobody reads.
    final_only: bool = False


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
    root: str | None = None  # the model as given (hub id or path): model cards' "root"
    max_logprobs: int = MAX_LOGPROBS  # vLLM's --max-logprobs: the most per position; -1: the vocabulary
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a sequence (a beam, in beam search)
    # LoRA adapters served beside the model (--lora-modules, and those loaded
    # at runtime): name -> the folder it was read from. The frontend's own
    # view, changed only by the load and unload routes on the event loop.
    lora_modules: dict[str, str] = field(default_factory=dict)
    # An embedding model (--runner pooling): /v1/embeddings instead of the generation routes.
    pooling: bool = False
    # A sequence classifier (pooling too): its labels, in order; /classify instead of /v1/embeddings.
    labels: tuple[str, ...] = ()
    use_sep_token: bool = True  # a classifier scores a pair tokenized as a pair (else the texts joined)
    # --chat-template on a cross-encoder: each pair rendered through it as a query and a document message.
    score_template: str | None = None
    # --speculative-config: steps verify drafts, so a request's predicted output can be its drafts.
    speculative: bool = False

    @property
    def batch_endpoints(self) -> tuple[str, ...]:
        """The Batch API endpoints this model serves (vLLM's batch runner
        has no classify endpoint, nor do we)."""
        if not self.pooling:
            return tuple(e for e in BATCH_ENDPOINTS if e not in POOLING_ENDPOINTS)
        return POOLING_ENDPOINTS[1:] if self.labels else POOLING_ENDPOINTS

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases, *self.lora_modules)

    def adapter(self, requested: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names; None: the base model."""
        return requested if requested in self.lora_modules else None

    def reply_name(self, requested: str | None) -> str:
        """The ``model`` a reply carries: the adapter a request named, else
        the model's own name."""
        return self.adapter(requested) or self.name


class InputProcessor:
    def __init__(self, tokenizer: Any, model: ModelInfo, tool_parser: str | None = None, *,
                 disable_any_whitespace: bool = False, reasoning_parser: ReasoningParser | None = None,
                 enable_in_reasoning: bool = False, trust_request_chat_template: bool = False) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.tool_parser = tool_parser  # --tool-call-parser with --enable-auto-tool-choice; None: no "auto"
        # --structured-outputs-config's: JSON constraints compact unless a request says otherwise.
        self.disable_any_whitespace = disable_any_whitespace
        self.reasoning_parser = reasoning_parser  # --reasoning-parser
        # --structured-outputs-config's: a grammar constrains the reasoning too.
        self.enable_in_reasoning = enable_in_reasoning
        self.trust_request_chat_template = trust_request_chat_template  # --trust-request-chat-template

    # -- endpoints ----------------------------------------------------------
    def completion(self, req: CompletionRequest) -> EngineInputs:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        prompts = [self._truncate(self._prompt(p, add_special), req.truncate_prompt_tokens, req.truncation_side)
                   for p in req.prompts()]
        max_tokens = self._max_tokens(prompts, req.max_tokens, "prompt")
        # Explicit ids replace the top N (vLLM): the engine then lists the sampled token and them.
        logprobs = 0 if req.logprob_token_ids else self._logprobs_count(req.logprobs, "logprobs")
        params = self._params(req, max_tokens, logprobs, self._structured(req))
        return EngineInputs(prompts, params, req.klass, beam=self._beam(req, max_tokens, logprobs))

    def embedding(self, req: EmbeddingRequest) -> EngineInputs:
        """One prompt per input (or conversation), each within max_model_len
        (or cut to ``truncate_prompt_tokens``), all pooled alike
        (serve/embeddings.py)."""
        return self.pooling_inputs(self._pooled_prompts(req), req,
                                   PoolingParams(normalize=req.use_activation, dimensions=req.dimensions))

    def classification(self, req: PooledRequest) -> EngineInputs:
        """A classifier's prompts, as an embedding model's (serve/classify.py)."""
        return self.pooling_inputs(self._pooled_prompts(req), req, PoolingParams(normalize=req.use_activation))

    def _pooled_prompts(self, req: PooledRequest) -> list[Prompt]:
        if req.messages is not None:
            add_special = bool(req.add_special_tokens)
            given: list[str | list[int]] = [self._render_chat(_Conversation(c, req)) for c in req.conversations()]
            param = "messages"
        else:
            add_special = req.add_special_tokens is not False
            given, param = req.inputs(), "input"
        return [self.pooled_prompt(g, add_special, req.truncate_prompt_tokens, req.truncation_side, param)
                for g in given]

    def pooled_prompt(self, given: str | list[int], add_special_tokens: bool, truncate: int | None,
                      side: str, param: str) -> Prompt:
        """One prompt of an embedding model, cut as asked, and a 400
        naming ``param`` when it is still longer than max_model_len."""
        prompt = self._truncate(self._prompt(given, add_special_tokens, param), truncate, side)
        limit = self.model.max_model_len
        if len(prompt.token_ids) > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                           f"requested {len(prompt.token_ids)} tokens in the {param} for embedding generation. "
                           "Please reduce the length of the input, or set truncate_prompt_tokens.",
                           param=param, code=CONTEXT_LENGTH_EXCEEDED)
        return prompt

    def pooling_inputs(self, prompts: list[Prompt], req: Any, pooling: PoolingParams) -> EngineInputs:
        """Engine inputs pooling every prompt alike: a positive ``priority``
        runs as offline work, as it does for the generation routes."""
        params = SamplingParams(max_tokens=1, pooling=pooling, cache_salt=req.cache_salt,
                                lora=self.model.adapter(req.model))
        return EngineInputs(prompts, params, "offline" if req.priority > 0 else "online", final_only=True)

    def cut_text(self, text: str, max_tokens: int) -> str:
        """``text`` cut to its first ``max_tokens`` tokens (special tokens
        not counted) at a character boundary, as vLLM's ``max_tokens_per_query``
        and ``max_tokens_per_doc`` cut: the cut text is tokenized afresh."""
        while text:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            offsets = enc["offset_mapping"]
            if len(offsets) <= max_tokens:
                break
            end = offsets[max_tokens - 1][1] if max_tokens else 0
            # A merge across the cut can change the count: cut again until it fits.
            text = text[:min(end, len(text) - 1)]
        return text

    def chat(self, req: ChatCompletionRequest) -> EngineInputs:
        text = self._render_chat(req)
        # The template already wrote the special tokens it wants.
        prompt = Prompt(self._encode(text, add_special_tokens=bool(req.add_special_tokens)), text)
        if not prompt.token_ids:
            raise bad_request("messages render to an empty prompt", "messages")
        prompt = self._truncate(prompt, req.truncate_prompt_tokens, req.truncation_side)
        max_tokens = self._max_tokens([prompt], req.max_new_tokens, "messages")
        top_n = None
        if req.logprobs:
            top_n = 0 if req.logprob_token_ids else self._logprobs_count(req.top_logprobs or 0, "top_logprobs")
        tool_mode, forced = self._tool_mode(req)
        structured = forced or self._structured(req)
        reasoning = self._reasoning(req, prompt)
        # A thinking reply's grammar starts once the thinking has ended.
        after = None
        if reasoning and structured and not self.enable_in_reasoning:
            after = _thinking_end(reasoning, "tool_choice" if forced else _constraint_field(req))
        params = self._params(req, max_tokens, top_n, structured, after)
        beam = self._beam(req, max_tokens, top_n)
        keep_special = tool_mode is not None and tool_mode.parser in KEEPS_SPECIAL_TOKENS  # its [TOOL_CALLS] is one
        if keep_special or (reasoning is not None and reasoning.parser.keeps_special_tokens):  # so are its markers
            params = dataclasses.replace(params, skip_special_tokens=False)
            if beam is not None:
                beam = dataclasses.replace(beam, skip_special_tokens=False)
        budget = self._thinking_budget(req, reasoning, structured)
        if budget is not None:
            params = dataclasses.replace(params, thinking_token_budget=budget,
                                         thinking_start_token_id=reasoning.parser.start_id,
                                         thinking_end_token_id=reasoning.parser.end_id)
        if req.prediction is not None:
            params = dataclasses.replace(params, prediction_token_ids=self._prediction(req, beam))
        return EngineInputs([prompt], params, req.klass, tool_mode, beam=beam, reasoning=reasoning)

    def _prediction(self, req: ChatCompletionRequest, beam: BeamSearchParams | None) -> list[int]:
        """The predicted output's tokens: speculative decoding's drafts, so a
        server without it would only carry them (a 400 naming the flag)."""
        if not self.model.speculative:
            raise bad_request("prediction: this server verifies no drafts (start it with --speculative-config, "
                              'e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\')', "prediction")
        if beam is not None:
            raise bad_request("prediction: is not supported with beam search", "prediction")
        ids = self._encode(req.prediction.text, add_special_tokens=False)
        if not ids:
            raise bad_request("prediction: the predicted content is empty", "prediction")
        if len(ids) > self.model.max_model_len:  # no reply can follow it that far
            raise bad_request(f"prediction: {len(ids)} tokens, more than the model's context of "
                              f"{self.model.max_model_len}", "prediction")
        return ids

    def _thinking_budget(self, req: ChatCompletionRequest, reasoning: Reasoning | None,
                         structured: StructuredOutputs | None) -> int | None:
        """``thinking_token_budget`` as the engine takes it: None for no
        limit, or where the reply does not think (nothing to limit)."""
        budget = req.thinking_token_budget
        if budget is None or budget == -1:
            return None
        if self.reasoning_parser is None:
            raise bad_request("thinking_token_budget: needs a server started with --reasoning-parser, which "
                              "says where the thinking ends", "thinking_token_budget")
        if reasoning is None:
            return None
        _thinking_end(reasoning, "thinking_token_budget")  # a 400 if there is no one token to force
        if structured is not None and self.enable_in_reasoning:
            raise bad_request("thinking_token_budget: cannot force the end of the thinking where the grammar "
                              "constrains the thinking too (enable_in_reasoning)", "thinking_token_budget")
        if req.use_beam_search:
            raise bad_request("thinking_token_budget: not supported with beam search", "thinking_token_budget")
        return budget

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        if isinstance(req, TokenizeChatRequest):
            ids = self._encode(self._render_chat(req), add_special_tokens=req.add_special_tokens)
        else:
            ids = self._encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.model.max_model_len, tokens=ids,
                                token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        ids = self._in_vocab(req.tokens, "tokens") or []
        return DetokenizeResponse(prompt=self.tokenizer.decode(ids))

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's configuration as its
        tokenizer_config.json gives it, less file paths, plus its class and
        the chat template in use."""
        kwargs = getattr(self.tokenizer, "init_kwargs", None) or {}
        info = {k: _json_value(v) for k, v in kwargs.items() if not k.endswith("_file")}
        info["tokenizer_class"] = type(self.tokenizer).__name__
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, str):
            info["chat_template"] = template
        return info

    # -- pieces -------------------------------------------------------------
    def _prompt(self, p: str | list[int], add_special_tokens: bool = True, param: str = "prompt") -> Prompt:
        if isinstance(p, str):
            if not p:
                raise bad_request(f"{param} must not be empty", param)
            return Prompt(self._encode(p, add_special_tokens=add_special_tokens), p)
        if not p:
            raise bad_request(f"{param} must not be empty", param)
        vocab = self.model.vocab_size
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{param} contains token id {bad} outside the vocabulary [0, {vocab})", param)
        return Prompt(list(p), self.tokenizer.decode(p))

    def _truncate(self, prompt: Prompt, keep: int | None, side: str = "left") -> Prompt:
        """``truncate_prompt_tokens``: ``keep`` tokens (-1: as many as the
        context holds), the last ones when cutting on the left, the first
        when on the right; the echoed text becomes theirs."""
        if keep is None:
            return prompt
        keep = self.model.max_model_len if keep == -1 else keep
        if len(prompt.token_ids) <= keep:
            return prompt
        ids = prompt.token_ids[-keep:] if side == "left" else prompt.token_ids[:keep]
        return Prompt(ids, self.tokenizer.decode(ids))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _reasoning(self, req: ChatCompletionRequest, prompt: Prompt) -> Reasoning | None:
        """How the reply is split into reasoning and content; None when the
        server has no reasoning parser, the request turned thinking off, or
        the prompt already closed it."""
        parser = self.reasoning_parser
        if parser is None or not parser.thinking(self._template_kwargs(req)) or \
                parser.ended_in(prompt.token_ids, prompt.text):
            return None
        return Reasoning(parser, include=req.include_reasoning)

    @staticmethod
    def _template_kwargs(req: ChatCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        """The chat template's extra variables: the request's own, and
        vLLM's ``reasoning_effort`` with ``enable_thinking`` read from it."""
        extra = dict(req.chat_template_kwargs or {})
        effort = getattr(req, "reasoning_effort", None)
        if effort is not None:
            extra["reasoning_effort"] = effort
            extra.setdefault("enable_thinking", effort != "none")
        return extra

    def _render_chat(self, req: ChatCompletionRequest | TokenizeChatRequest) -> str:
        messages = [_template_message(m) for m in req.messages]
        tools = [t.model_dump(mode="json", exclude_none=True) for t in req.tools] if req.tools else None
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs or {}))
        if reserved:
            raise bad_request(f"chat_template_kwargs: {reserved[0]!r} cannot be set here (it is a request field "
                              "or the renderer's own argument)", "chat_template_kwargs")
        extra = self._template_kwargs(req)
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise bad_request("chat_template: this server renders chats with the model's own template only (a "
                              "request's template needs a server started with --trust-request-chat-template)",
                              "chat_template")
        template = req.chat_template or getattr(self.tokenizer, "chat_template", None)
        if getattr(req, "reasoning_effort", None) is not None:
            if not any(name in str(template) for name in ("reasoning_effort", "enable_thinking")):
                raise bad_request("reasoning_effort: the chat template reads neither reasoning_effort nor "
                                  "enable_thinking, so the field would change nothing", "reasoning_effort")
        if req.documents and "documents" not in str(template):
            raise bad_request("documents: the chat template does not read documents, so the field would change "
                              "nothing", "documents")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, documents=req.documents or None, chat_template=req.chat_template,
                tokenize=False, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **extra,
            )
        except Exception as exc:  # noqa: BLE001 - a template's own raise_exception is a client error
            raise bad_request(f"messages could not be rendered with the chat template: {exc}", "messages") from None

    def _logprobs_count(self, asked: int | None, param: str, kind: str = "sample") -> int | None:
        """vLLM's reading of a logprobs count: -1 is the whole vocabulary, and
        a count past --max-logprobs (-1 there: the vocabulary size) is a 400."""
        if asked is None:
            return None
        vocab = self.model.vocab_size
        count = vocab if asked == -1 else asked
        cap = vocab if self.model.max_logprobs == -1 else self.model.max_logprobs
        if count > cap:
            raise bad_request(f"Requested {kind} logprobs of {count}, which is greater than max allowed: {cap}",
                              param)
        return count

    def _beam(self, req: _SamplingFields, max_tokens: int, top_n: int | None) -> BeamSearchParams | None:
        """use_beam_search: n beams. Each step asks the engine for one token
        with 2n logprobs per beam (vLLM's); more when the response lists more."""
        if not req.use_beam_search:
            return None
        width = req.n
        eos = self.model.eos_token_ids or tuple(t for t in [self.tokenizer.eos_token_id] if t is not None)
        # Each step's requests reuse the last step's KV through the prefix
        # cache: under the request's salt, never another's.
        step = SamplingParams(max_tokens=1, temperature=self._default(req, "temperature", 1.0),
                              logprobs=max(2 * width, top_n or 0), ignore_eos=True, cache_salt=req.cache_salt,
                              lora=self.model.adapter(req.model))
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens, step=step, eos_token_ids=frozenset(eos),
                                ignore_eos=req.ignore_eos, length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output,
                                skip_special_tokens=req.skip_special_tokens)

    def _default(self, req: _SamplingFields, name: str, fallback: float) -> Any:
        """The request's value, else the model's generation config's, else ``fallback``."""
        value = getattr(req, name)
        return value if value is not None else self.model.sampling_defaults.get(name, fallback)

    def _max_tokens(self, prompts: list[Prompt], asked: int | None, prompt_param: str) -> int:
        """``asked``, or all the room the longest prompt leaves; 400 when the
        prompt and the completion do not fit in the context."""
        limit = self.model.max_model_len
        longest = max(len(p.token_ids) for p in prompts)
        if longest >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the {longest} tokens of "
                           f"the {prompt_param} leave no room for a completion", param=prompt_param,
                           code=CONTEXT_LENGTH_EXCEEDED)
        if asked is None:
            return limit - longest
        if longest + asked > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{longest + asked} tokens ({longest} in the {prompt_param}, {asked} in the completion)",
                           param="max_tokens", code=CONTEXT_LENGTH_EXCEEDED)
        return asked

    def _structured(self, req: _SamplingFields) -> StructuredOutputs | None:
        """The request's output constraint (at most one: protocol.py checks),
        checked to build into a grammar; a 400 naming its field if not."""
        field_name, spec = None, None
        try:
            fmt = req.response_format
            if fmt is not None and fmt.type != "text":
                field_name = "response_format"
                schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
                spec = self._json_spec(json.dumps(schema) if fmt.type == "json_schema" and schema is not None
                                       else None)
            elif req.structured_outputs is not None:
                field_name = "structured_outputs"
                so = req.structured_outputs
                compact = so.disable_any_whitespace
                if compact is None:  # the server's default, for the kinds it means something to
                    compact = self.disable_any_whitespace and (so.json_ is not None or bool(so.json_object))
                spec = StructuredOutputs(json=_schema_text(so.json_), json_object=bool(so.json_object),
                                         regex=so.regex, choice=so.choice, grammar=so.grammar,
                                         disable_any_whitespace=compact)
            elif req.guided_json is not None:
                field_name, spec = "guided_json", self._json_spec(_schema_text(req.guided_json))
            elif req.guided_regex is not None:
                field_name, spec = "guided_regex", StructuredOutputs(regex=req.guided_regex)
            elif req.guided_choice is not None:
                field_name, spec = "guided_choice", StructuredOutputs(choice=tuple(req.guided_choice))
            elif req.guided_grammar is not None:
                field_name, spec = "guided_grammar", StructuredOutputs(grammar=req.guided_grammar)
            if spec is not None:
                check_structured_outputs(spec)
        except ValueError as exc:
            raise bad_request(f"{field_name}: {str(exc).removeprefix('structured_outputs: ')}", field_name) from None
        return spec

    def _json_spec(self, schema: str | None) -> StructuredOutputs:
        """A JSON constraint: the schema's, or any object where None."""
        return StructuredOutputs(json=schema, json_object=schema is None,
                                 disable_any_whitespace=self.disable_any_whitespace)

    def _tool_mode(self, req: ChatCompletionRequest) -> tuple[ToolMode | None, StructuredOutputs | None]:
        """How the reply becomes tool calls, and the constraint a forced call
        puts on decoding."""
        mode = req.tool_choice_mode
        if mode == "none":
            return None, None
        if mode == "auto":
            if self.tool_parser is None:
                raise bad_request('tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
                                  "and --tool-call-parser (or send tool_choice \"required\", a named function, "
                                  'or "none")', "tool_choice")
            tools = [t.function.model_dump(mode="json", exclude_none=True) for t in req.tools or []]
            return ToolMode("auto", parser=self.tool_parser, types=parameter_types(tools)), None
        tools = [t.function.model_dump(mode="json", exclude_none=True) for t in req.tools or []]
        if mode == "required":
            schema = required_calls_schema(tools, parallel=req.parallel_tool_calls is not False)
            tool_mode = ToolMode("required", compact=self.disable_any_whitespace)
        else:
            name = req.tool_choice.function.name
            schema, tool_mode = named_call_schema(tools, name), ToolMode("named", function=name)
        spec = self._json_spec(json.dumps(schema))
        try:
            check_structured_outputs(spec)
        except ValueError as exc:
            raise bad_request(f"tools: a function's parameters are not a usable JSON schema: "
                              f"{str(exc).split(': ', 1)[-1]}", "tools") from None
        return tool_mode, spec

    def _params(self, req: _SamplingFields, max_tokens: int, logprobs: int | None,
                structured: StructuredOutputs | None = None, structured_after: int | None = None) -> SamplingParams:
        pick = functools.partial(self._default, req)
        # Echo with logprobs scores the echoed prompt too (vLLM's reading).
        prompt_logprobs = self._logprobs_count(req.prompt_logprobs, "prompt_logprobs", "prompt")
        if prompt_logprobs is None and getattr(req, "echo", False) and logprobs is not None:
            prompt_logprobs = logprobs

        try:
            return SamplingParams(
                n=req.candidates,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=int(pick("top_k", -1)),
                min_p=pick("min_p", 0.0),
                seed=req.seed,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=pick("repetition_penalty", 1.0),
                # best_of ranks its candidates by their tokens' logprobs, asked for or not.
                logprobs=0 if logprobs is None and req.ranked else logprobs,
                prompt_logprobs=prompt_logprobs,
                logprob_token_ids=self._in_vocab(req.logprob_token_ids, "logprob_token_ids"),
                stop=req.stop_list,
                stop_token_ids=list(self._in_vocab(req.stop_token_ids, "stop_token_ids") or []),
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                logit_bias=self._logit_bias(req.logit_bias),
                allowed_token_ids=self._in_vocab(req.allowed_token_ids, "allowed_token_ids"),
                bad_words_token_ids=self._bad_words(req.bad_words),
                structured_outputs=structured,
                structured_after_token_id=structured_after,
                cache_salt=req.cache_salt,
                lora=self.model.adapter(req.model),
            )
        except ValueError as exc:
            raise from_value_error(exc) from None

    def _in_vocab(self, ids: list[int] | None, param: str) -> list[int] | None:
        if ids is None:
            return None
        vocab = self.model.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param)
        return ids

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's ``{"token id as a string": bias}`` with ids checked."""
        if not bias:
            return None
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                tok = int(key)
            except ValueError:
                raise bad_request(f"logit_bias: key {key[:32]!r} is not a token id", "logit_bias") from None
            self._in_vocab([tok], "logit_bias")
            out[tok] = value
        return out

    def _bad_words(self, words: list[str] | None) -> list[list[int]]:
        """Each word as it tokenizes alone and after a space (mid-sentence
        form), so both spellings are banned."""
        out: list[list[int]] = []
        for word in words or []:
            for form in (word.lstrip(), " " + word.lstrip()):
                ids = self._encode(form, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out


# apply_chat_template's own arguments and the request fields that set them:
# through chat_template_kwargs they would change the rendering's machinery
# (tokenize, return types) or contradict the request's own field.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def _thinking_end(reasoning: Reasoning, param: str) -> int:
    """The token that ends the thinking, which ``param`` waits for (a
    grammar) or forces (a budget); a 400 naming ``param`` where the parser's
    end marker is text, not one token."""
    parser = reasoning.parser
    if parser.end_id is not None:
        return parser.end_id
    if param == "thinking_token_budget":
        consequence = "no budget can force it"
    else:
        consequence = ("a constraint cannot start after it (one over the whole reply: --structured-outputs-config "
                       "'{\"enable_in_reasoning\": true}')")
    switches = parser.family.switches
    off = f'; a request with chat_template_kwargs {{"{switches[0]}": false}} does not think' if switches else ""
    raise bad_request(f"{param}: the {parser.name} reasoning parser finds the end of the thinking in text "
                      f"({parser.end_marker!r}), not in one token, so {consequence}{off}", param)


def _constraint_field(req: _SamplingFields) -> str:
    """The field that asked for the request's output constraint (protocol.py
    allows one), in ``_structured``'s order."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        return "response_format"
    return next((name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                   "guided_grammar") if getattr(req, name, None) is not None), "response_format")


def _json_value(value: Any) -> Any:
    """A tokenizer config value as JSON takes it: added tokens by their text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _schema_text(schema: dict | str | None) -> str | None:
    return schema if schema is None or isinstance(schema, str) else json.dumps(schema)


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it. Tool-call arguments go in as
    objects where they parse: templates write them with ``tojson``."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.reasoning_text is not None:  # both names, as templates read one or the other (vLLM's)
        out["reasoning"] = out["reasoning_content"] = m.reasoning_text
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            try:
                args: Any = json.loads(call.function.arguments)
            except ValueError:
                args = call.function.arguments
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def log_request(request_id: str, inputs: EngineInputs, max_log_len: int | None) -> None:
    """``--enable-log-requests``: one info line per request, the prompt cut
    to ``max_log_len`` characters and token ids."""
    for i, prompt in enumerate(inputs.prompts):
        text, ids = prompt.text, prompt.token_ids
        if max_log_len is not None:
            text, ids = text[:max_log_len], ids[:max_log_len]
        logger.info("request %s%s: class %s, params %s, prompt %r, prompt_token_ids %s", request_id,
                    f"-{i}" if len(inputs.prompts) > 1 else "", inputs.klass, inputs.params, text, ids)


def check_model(requested: str | None, served: ModelInfo) -> None:
    """404 for a model this server does not serve (None means the default)."""
    if requested is not None and requested not in served.names:
        raise APIError(404, f"The model `{requested}` does not exist", param="model", code="model_not_found")


class _Conversation:
    """One conversation of an embeddings request's ``messages``, in the shape
    ``_render_chat`` reads (no tools, no documents; the request's template
    where it brings one and the server trusts it)."""

    tools = documents = None

    def __init__(self, messages: list[ChatMessage], req: Any) -> None:
        self.messages = messages
        self.chat_template = req.chat_template
        self.add_generation_prompt = req.add_generation_prompt
        self.continue_final_message = req.continue_final_message
        self.chat_template_kwargs = req.chat_template_kwargs
