"""From engine outputs to OpenAI response bodies: choices, logprobs, usage,
and the Server-Sent-Event chunks of a streamed response.

Owns the bookkeeping a stream needs across outputs (which choices already
sent their role or finish chunk, each choice's running text offset), so the
handlers in ``api.py`` only move data between the engine and the socket.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from fluidserve.engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from fluidserve.serve.inputs import Prompt
from fluidserve.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionTokensDetails,
    CompletionChunk,
    CompletionLogprobs,
    FunctionCallDelta,
    FunctionCallWire,
    ToolCallDelta,
    ToolCallWire,
    CompletionResponseChoice,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from fluidserve.serve.reasoning import Reasoning, ReasoningStream
from fluidserve.serve.tool_parsers import CallStream, ToolMode, parse_reply

Decode = Callable[[int], str]


def make_usage(prompts: list[Prompt], completion_tokens: int, cached_tokens: int | None = None,
               reasoning_tokens: int | None = None, prediction: tuple[int, int] | None = None) -> Usage:
    """``cached_tokens``: given (and non-zero, as vLLM reports them) they
    become ``prompt_tokens_details``; ``reasoning_tokens`` (given by a
    server with a reasoning parser, zero included) and ``prediction`` (a
    request's predicted tokens kept and thrown away: ``prediction_tokens``)
    ``completion_tokens_details``."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens else None
    completion_details = None
    if reasoning_tokens is not None or prediction is not None:
        completion_details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens or 0)
        if prediction is not None:
            completion_details.accepted_prediction_tokens, completion_details.rejected_prediction_tokens = prediction
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details,
                 completion_tokens_details=completion_details)


def prediction_tokens(outputs: list[CompletionOutput]) -> tuple[int, int] | None:
    """A predicted output's drafted tokens the completions kept and threw
    away, summed; None for a request without a prediction."""
    counted = [co for co in outputs if co.accepted_prediction_tokens is not None]
    if not counted:
        return None
    return (sum(co.accepted_prediction_tokens for co in counted),
            sum(co.rejected_prediction_tokens or 0 for co in counted))


def reasoning_tokens(reasoning: Reasoning | None, outputs: list[CompletionOutput]) -> int:
    """The tokens of the outputs' reasoning (none where the reply did not think)."""
    return 0 if reasoning is None else sum(reasoning.parser.reasoning_tokens(co.token_ids) for co in outputs)


def finish_reason(co: CompletionOutput) -> str | None:
    return co.finish_reason if co.finish_reason in (None, "stop", "length") else "stop"


def stop_reason(co: CompletionOutput) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the
    choice; None when it ended on EOS, on length, or has not ended."""
    return co.stop_reason if co.finish_reason == "stop" else None


# -- logprobs -----------------------------------------------------------------

# vLLM's floor: -inf has no JSON form.
MIN_LOGPROB = -9999.0


def _sampled(entry: TokenLogprobs, token_id: int, decode: Decode) -> Logprob:
    lp = entry.get(token_id)
    return lp if lp is not None else Logprob(float("nan"), 0, decode(token_id))


def _top(entry: TokenLogprobs, top_n: int) -> list[tuple[int, Logprob]]:
    """The ``top_n`` likeliest of a position's entries; a negative ``top_n``
    (-1: the whole vocabulary, or logprob_token_ids) lists every entry the
    engine returned, in its order (the sampled token first), as vLLM does."""
    if top_n < 0:
        return list(entry.items())
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
    return [(t, lp) for t, lp in ranked if lp.rank <= top_n][:top_n]


def _text(lp: Logprob, token_id: int, decode: Decode, as_ids: bool = False) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    return lp.decoded if lp.decoded else decode(token_id)


def _floor(logprob: float) -> float:
    return logprob if logprob != logprob else max(logprob, MIN_LOGPROB)


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprobs | None] | None, top_n: int,
                        text_offset: int, decode: Decode, as_ids: bool = False) -> CompletionLogprobs:
    """OpenAI's completion logprobs; a None entry (the first prompt token of
    an echo) has a null logprob and null top_logprobs. Each position's
    ``top_logprobs`` holds the chosen token first and then the ``top_n``
    likeliest (vLLM's reading of OpenAI: up to ``top_n`` + 1 entries, so
    ``logprobs=0`` gives the chosen token alone)."""
    out = CompletionLogprobs()
    offset = text_offset
    for token_id, entry in zip(token_ids, entries or []):
        if entry is None:
            text = decode(token_id)
            out.tokens.append(f"token_id:{token_id}" if as_ids else text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            continue
        lp = _sampled(entry, token_id, decode)
        text = _text(lp, token_id, decode)
        out.tokens.append(_text(lp, token_id, decode, as_ids))
        out.token_logprobs.append(_floor(lp.logprob))
        top: dict[str, float] = {}
        if token_id in entry:
            top[_text(lp, token_id, decode, as_ids)] = _floor(lp.logprob)
        for t, t_lp in _top(entry, top_n):  # tokens that decode alike keep the likeliest
            top.setdefault(_text(t_lp, t, decode, as_ids), _floor(t_lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def echo_logprobs(prompt: Prompt, out: RequestOutput, generated: CompletionLogprobs, top_n: int,
                  text_offset: int, decode: Decode, as_ids: bool = False) -> CompletionLogprobs:
    """Echo with logprobs: the prompt's tokens and their logprobs first, then
    the generated ones (whose offsets already count the echoed text)."""
    head = completion_logprobs(prompt.token_ids, out.prompt_logprobs, top_n, text_offset, decode, as_ids)
    return CompletionLogprobs(tokens=head.tokens + generated.tokens,
                              token_logprobs=head.token_logprobs + generated.token_logprobs,
                              top_logprobs=head.top_logprobs + generated.top_logprobs,
                              text_offset=head.text_offset + generated.text_offset)


def prompt_logprobs(entries: list[TokenLogprobs | None] | None) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: per prompt token ``{token id: {logprob,
    rank, decoded_token}}``, None for the first."""
    if entries is None:
        return None
    return [None if e is None else
            {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded) for t, lp in e.items()}
            for e in entries]


def chat_logprobs(token_ids: list[int], entries: list[TokenLogprobs] | None, top_n: int,
                  decode: Decode, as_ids: bool = False) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries or []):
        lp = _sampled(entry, token_id, decode)
        text = _text(lp, token_id, decode, as_ids)
        top = [TopLogprob(token=_text(t_lp, t, decode, as_ids), logprob=_floor(t_lp.logprob),
                          bytes=list(_text(t_lp, t, decode, as_ids).encode()))
               for t, t_lp in _top(entry, top_n)]
        content.append(TokenLogprob(token=text, logprob=_floor(lp.logprob), bytes=list(text.encode()),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


# -- whole responses ----------------------------------------------------------


def mean_logprob(co: CompletionOutput) -> float:
    """A completion's logprob per token, the sampled tokens' (0 for none)."""
    if not co.token_ids:
        return 0.0
    if co.logprobs is None:
        raise ValueError("ranking completions needs their logprobs")
    return sum(entry[token].logprob for token, entry in zip(co.token_ids, co.logprobs)) / len(co.token_ids)


def keep_best(finals: list[RequestOutput], n: int) -> list[RequestOutput]:
    """``best_of``: each prompt's ``n`` candidates with the highest logprob
    per token (OpenAI's "best"), best first, indexed 0 to n - 1; ties keep
    the candidates' order."""
    kept = []
    for out in finals:
        best = sorted(out.outputs, key=mean_logprob, reverse=True)[:n]
        kept.append(dataclasses.replace(out, outputs=[dataclasses.replace(co, index=i) for i, co in enumerate(best)]))
    return kept


def completion_choices(prompts: list[Prompt], finals: list[RequestOutput], *, n: int, echo: bool,
                       top_n: int | None, decode: Decode, as_ids: bool = False,
                       token_ids: bool = False) -> list[CompletionChoice]:
    choices = []
    for i, (prompt, out) in enumerate(zip(prompts, finals)):
        for co in sorted(out.outputs, key=lambda c: c.index):
            head = prompt.text if echo else ""
            logprobs = None
            if top_n is not None:
                logprobs = completion_logprobs(co.token_ids, co.logprobs, top_n, len(head), decode, as_ids)
                if echo and out.prompt_logprobs is not None:
                    logprobs = echo_logprobs(prompt, out, logprobs, top_n, 0, decode, as_ids)
            choices.append(CompletionResponseChoice(
                index=i * n + co.index, text=head + co.text, logprobs=logprobs, finish_reason=finish_reason(co),
                stop_reason=stop_reason(co), prompt_logprobs=prompt_logprobs(out.prompt_logprobs),
                prompt_token_ids=list(prompt.token_ids) if token_ids else None,
                token_ids=list(co.token_ids) if token_ids else None))
    return choices


def chat_choices(final: RequestOutput, *, top_n: int | None, decode: Decode,
                 tool_mode: ToolMode | None = None, role: str = "assistant", echo_text: str = "",
                 as_ids: bool = False, token_ids: bool = False,
                 reasoning: Reasoning | None = None) -> list[ChatChoice]:
    """``echo_text``: chat ``echo``, the last message's content put before
    each reply. ``reasoning``: the reply thinks first; its reasoning is cut
    off before its content is read for tool calls."""
    choices = []
    for co in sorted(final.outputs, key=lambda c: c.index):
        logprobs = chat_logprobs(co.token_ids, co.logprobs, top_n, decode, as_ids) if top_n is not None else None
        content: str | None = co.text
        thought, calls = None, []
        if reasoning is not None:
            thought, content = reasoning.split(co.text)
            thought = (thought or None) if reasoning.include else None
        # Read as the stream reads it, whatever ended the reply: a named call
        # cut short by length is its arguments so far (as vLLM returns it),
        # a "required" array cut short does not parse and stays content.
        if tool_mode is not None and content is not None:
            content, calls = parse_reply(tool_mode, content)
            if tool_mode.kind != "auto" and calls:
                content = ""  # vLLM's: a forced call's reply is all call, its content empty
        if reasoning is not None and tool_mode is None:
            content = content or None  # vLLM's: a reply that is all thinking has null content
        if echo_text:
            content = echo_text + (content or "")
        message = ChatResponseMessage(role=role, content=content, reasoning=thought, tool_calls=[
            ToolCallWire(id=c.id, function=FunctionCallWire(name=c.name, arguments=c.arguments)) for c in calls])
        reason = "tool_calls" if calls and co.finish_reason == "stop" else finish_reason(co)
        choices.append(ChatChoice(index=co.index, message=message, logprobs=logprobs, finish_reason=reason,
                                  stop_reason=stop_reason(co), token_ids=list(co.token_ids) if token_ids else None))
    return choices


# -- streams ------------------------------------------------------------------


class _ChoiceTracker:
    """Per-choice stream state: started, finished, text sent, tokens generated."""

    def __init__(self) -> None:
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.offset: dict[int, int] = {}
        self.num_tokens: dict[int, int] = {}

    def news(self, co: CompletionOutput, index: int, per_token: bool) -> bool:
        """Whether ``co`` has anything to send for choice ``index``: text, a
        finish reason, or (``per_token``: the client reads each token's id,
        logprob or time) new tokens, which may have no text yet (a token
        that ends inside a UTF-8 character). Counts the choice's tokens."""
        if index in self.finished:
            return False
        # The delta, not len(co.token_ids): that list keeps growing on the engine thread.
        self.num_tokens[index] = self.num_tokens.get(index, 0) + len(co.new_token_ids)
        return bool(co.text_delta or co.finish_reason or (per_token and co.new_token_ids))


def _chunk_usage(prompt: Prompt, completion_tokens: int) -> Usage:
    return make_usage([prompt], completion_tokens)


class CompletionStreamer:
    """Turns the outputs of one /v1/completions request into chunks, one
    choice per chunk (as vLLM streams them)."""

    def __init__(self, request_id: str, model: str, prompts: list[Prompt], *, n: int, echo: bool,
                 top_n: int | None, decode: Decode, continuous_usage: bool = False, as_ids: bool = False,
                 token_ids: bool = False) -> None:
        self.id, self.model, self.prompts = request_id, model, prompts
        self.n, self.echo, self.top_n, self.decode = n, echo, top_n, decode
        # Usage on every chunk: the chunk's prompt and its choice's tokens so far.
        self.continuous_usage = continuous_usage
        self.as_ids, self.token_ids = as_ids, token_ids
        self.track = _ChoiceTracker()

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[CompletionChunk]:
        chunks = []
        prompt = self.prompts[prompt_index]
        for co in sorted(out.outputs, key=lambda c: c.index):
            index = prompt_index * self.n + co.index
            # vLLM's completions stream a chunk for every step that made a
            # token, text or not: a client times tokens (and keeps their
            # ids) by chunk.
            if not self.track.news(co, index, per_token=True):
                continue
            first = index not in self.track.started
            head = prompt.text if self.echo and first else ""
            self.track.started.add(index)
            offset = self.track.offset.get(index, 0)
            logprobs = None
            if self.top_n is not None:
                logprobs = completion_logprobs(co.new_token_ids, co.new_logprobs, self.top_n,
                                               offset + len(head), self.decode, self.as_ids)
                if head and out.prompt_logprobs is not None:
                    logprobs = echo_logprobs(prompt, out, logprobs, self.top_n, offset, self.decode, self.as_ids)
            self.track.offset[index] = offset + len(head) + len(co.text_delta)
            if co.finish_reason:
                self.track.finished.add(index)
            choice = CompletionChoice(
                index=index, text=head + co.text_delta, logprobs=logprobs, finish_reason=finish_reason(co),
                stop_reason=stop_reason(co),
                prompt_token_ids=list(prompt.token_ids) if self.token_ids and first else None,
                token_ids=list(co.new_token_ids) if self.token_ids else None)
            usage = _chunk_usage(prompt, self.track.num_tokens[index]) if self.continuous_usage else None
            chunks.append(CompletionChunk(id=self.id, model=self.model, choices=[choice], usage=usage))
        return chunks

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return CompletionChunk(id=self.id, model=self.model, choices=[], usage=usage)


class ChatStreamer:
    """Turns the outputs of one /v1/chat/completions request into chunks."""

    def __init__(self, request_id: str, model: str, *, top_n: int | None, decode: Decode,
                 prompt: Prompt | None = None, tool_mode: ToolMode | None = None, role: str = "assistant",
                 echo_text: str = "", as_ids: bool = False, token_ids: bool = False,
                 reasoning: Reasoning | None = None) -> None:
        self.id, self.model, self.top_n, self.decode = request_id, model, top_n, decode
        self.prompt = prompt  # given: usage on every chunk (continuous_usage_stats)
        self.track = _ChoiceTracker()
        self.tool_mode = tool_mode
        self.role, self.echo_text = role, echo_text
        self.as_ids, self.token_ids = as_ids, token_ids
        self.calls: dict[int, CallStream] = {}  # choice index -> its tool-call stream
        self.reasoning = reasoning
        self.thoughts: dict[int, ReasoningStream] = {}  # choice index -> its reasoning split

    def _delta(self, co: CompletionOutput) -> tuple[ChatDelta, str | None]:
        """The choice's delta (reasoning, text, or tool-call pieces) and finish reason."""
        text, thought, thinking = co.text_delta, "", False
        if self.reasoning is not None:
            split = self.thoughts.setdefault(co.index, ReasoningStream(self.reasoning.parser))
            thought, text = split.step(text, last=bool(co.finish_reason))
            thought = thought if self.reasoning.include else ""
            thinking = split.in_reasoning and not text  # no content yet: nothing for a tool-call parser
        if self.tool_mode is None or thinking:
            return ChatDelta(content=text or None, reasoning=thought or None), finish_reason(co)
        stream = self.calls.setdefault(co.index, CallStream(self.tool_mode))
        pieces = stream.step(text, last=bool(co.finish_reason))
        content = "".join(p.content for p in pieces)
        calls = [ToolCallDelta(index=d.index, id=d.id, type="function" if d.id else None,
                               function=FunctionCallDelta(name=d.name, arguments=d.arguments))
                 for p in pieces for d in p.calls]
        reason = "tool_calls" if stream.num_calls and co.finish_reason == "stop" else finish_reason(co)
        return ChatDelta(content=content or None, reasoning=thought or None, tool_calls=calls or None), reason

    def _usage(self, completion_tokens: int) -> Usage | None:
        return _chunk_usage(self.prompt, completion_tokens) if self.prompt is not None else None

    def chunk(self, out: RequestOutput) -> list[ChatCompletionChunk]:
        chunks = []
        for co in sorted(out.outputs, key=lambda c: c.index):
            if not self.track.news(co, co.index, per_token=self.top_n is not None or self.token_ids):
                continue
            if co.index not in self.track.started:
                self.track.started.add(co.index)
                # The role-only chunk precedes every token: it counts none (vLLM's).
                first = ChatChunkChoice(index=co.index, delta=ChatDelta(role=self.role, content=""))
                prompt_ids = list(out.prompt_token_ids) if self.token_ids else None  # on each role chunk, as vLLM
                chunks.append(ChatCompletionChunk(id=self.id, model=self.model, choices=[first],
                                                  usage=self._usage(0), prompt_token_ids=prompt_ids))
                if self.echo_text:
                    echoed = ChatChunkChoice(index=co.index, delta=ChatDelta(content=self.echo_text))
                    chunks.append(ChatCompletionChunk(id=self.id, model=self.model, choices=[echoed],
                                                      usage=self._usage(0)))
            logprobs = None
            if self.top_n is not None:
                logprobs = chat_logprobs(co.new_token_ids, co.new_logprobs, self.top_n, self.decode, self.as_ids)
            if co.finish_reason:
                self.track.finished.add(co.index)
            delta, reason = self._delta(co)
            ids = list(co.new_token_ids) if self.token_ids else None
            if delta.content is None and delta.reasoning is None and delta.tool_calls is None and reason is None \
                    and logprobs is None and not ids:
                continue  # no text yet (held back by a tool-call parser, or mid-character): nothing to send
            choice = ChatChunkChoice(index=co.index, delta=delta, logprobs=logprobs, finish_reason=reason,
                                     stop_reason=stop_reason(co),
                                     token_ids=ids)
            chunks.append(ChatCompletionChunk(id=self.id, model=self.model, choices=[choice],
                                              usage=self._usage(self.track.num_tokens[co.index])))
        return chunks

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=usage)
