"""Reasoning output: a thinking model's reply split into its reasoning and
its answer, whole or streamed (vLLM's ``--reasoning-parser``).

Owns the parsers built in, one ``Family`` each (how the family marks its
thinking), bound to the served tokenizer by ``ReasoningParser.load``:

* ``deepseek_r1`` (DeepSeek-R1 and its distills): everything before the
  first ``</think>`` is reasoning, whether or not the reply opened with
  ``<think>`` (their templates put it in the prompt). A reply that never
  closes its thinking is all reasoning.
* ``qwen3`` (Qwen3, QwQ): the same, but a request that turns thinking off
  (``chat_template_kwargs: {"enable_thinking": false}``, or
  ``reasoning_effort: "none"``) has no reasoning at all, a ``<tool_call>``
  in the reasoning ends it (the call is the answer's), and a second
  ``</think>`` in the answer is dropped.
* ``mistral`` (Magistral): the reply is content until a ``[THINK]``; what
  follows up to ``[/THINK]`` is reasoning (its trailing whitespace dropped).
  A later ``[THINK]`` thinks again, a stray ``[/THINK]`` is dropped, and a
  ``[TOOL_CALLS]`` in the thinking ends it. No template switch.
* ``granite`` (Granite 3.2): text phrases, not tokens. A request thinks only
  with ``chat_template_kwargs: {"thinking": true}`` (its template's switch);
  its reply is reasoning only if it opens with "Here is my thought
  process:" (or "Here's ..."), up to "Here is my response:" (or
  "Here's ..."), the rest content; a reply that opens otherwise is all
  content.
* ``ernie45`` (ERNIE 4.5 thinking): as ``deepseek_r1``; an answer written as
  ``<response>...</response>`` after the thinking (whitespace before it
  allowed) is given without the tags and what follows the last
  ``</response>``.
* ``glm45`` (GLM-4.5 and on): as ``deepseek_r1`` (trailing whitespace of the
  reasoning dropped), with ``mistral``'s later ``<think>`` and stray
  ``</think>`` rules and a ``<tool_call>`` ending the thinking; thinking is
  off when ``thinking`` or ``enable_thinking`` is set and neither is true.
  The prompt's last turn decides whether it closed the thinking (a marker
  before the last ``<|assistant|>``, ``<|user|>``, ``<|system|>`` or
  ``<|observation|>`` is an earlier turn's).
* ``olmo3`` (OLMo 3 Think): as ``deepseek_r1``, its markers read as text.

Where vLLM 0.32's whole and streamed splits of a reply differ, ours keep
one split for both: a never-closed thinking is reasoning (its ``granite``,
``ernie45`` and ``olmo3`` whole replies make it content), a ``granite``
reply thinks only if it opens with the phrase (its whole reply finds the
phrases anywhere), text before a ``<think>`` is reasoning (its ``ernie45``
whole reply drops it, its ``olmo3`` stream makes it content), text before an
``ernie45`` ``<response>`` keeps the answer as written and a ``<response>``
with no ``</response>`` loses its tag (its whole reply drops that text, and
keeps that tag), and a ``mistral`` or ``glm45`` marker after the thinking
follows the rules above (its streams pass it on as content).

What the parsers rely on in the real tokenizers (not downloaded here; read
from mistral_common 1.13 and vLLM 0.32's sources and public tokenizer
configs): Magistral's ``[THINK]`` and ``[/THINK]`` are control tokens, which
a decode that skips special tokens drops (vLLM's Mistral tokenizer keeps
them by name); GLM-4.x configs list ``<think>`` and ``</think>`` with the
tool tags among their additional special tokens (seen in a GLM-4.x vision
model's config, whose page had lost the tags' text: inferred, and vLLM 0.32
keeps special tokens for every ``glm45`` request); ERNIE's are taken as
plain tokens, as vLLM's ``ernie45`` finds them in text decoded with special
tokens skipped; Granite 3.2's phrases and OLMo 3's ``<think>`` / ``</think>`` are
ordinary text (OLMo 3's ``</think>`` is "</", "think", ">"), as vLLM's
parsers for them say. None of that is assumed: ``ReasoningParser.load``
asks the tokenizer. A marker that is one token must decode to itself; if it
is a special token, the replies of thinking requests are decoded with
special tokens kept (the request's ``skip_special_tokens`` overridden, as
vLLM 0.32 overrides it for its ``mistral`` and ``glm45``), and every other
special token's text but the family's tool-call tags (the named special
tokens and the added tokens flagged special: what a decode skipping special
tokens skips) is dropped from them, as vLLM's parser drops the named ones. Text markers must survive encode and decode.

A prompt whose own end already closed the thinking (a template that writes
``<think></think>`` for a non-thinking turn, or a continued assistant
message that did) starts in the answer. ``ReasoningStream`` works on text, so
a marker split over two deltas is held back until it is whole. Pure Python:
no pydantic, no engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence


@dataclass(frozen=True)
class Family:
    """How one model family marks its thinking. A marker has spellings, the
    first its canonical one."""

    start: tuple[str, ...]
    end: tuple[str, ...]
    # Where a reply begins: "reasoning", "content", or "opening" (it thinks
    # only if its very first text is a start marker).
    begins: str = "reasoning"
    text_markers: bool = False  # the markers are text, not single tokens
    implicit_end: str | None = None  # ends the thinking and is the answer's first text
    # A marker after the thinking ended: "keep" as text, "drop_end" (an end
    # marker is dropped), "reopen" (an end marker is dropped, a start marker
    # thinks again).
    after_end: str = "keep"
    strips_reasoning_tail: bool = False  # whitespace closing a span of reasoning is dropped
    response_tags: tuple[str, str] | None = None  # the answer may come wrapped in these
    # Template variables that switch thinking: unset (or None), the default;
    # set, thinking is on when any of them is true.
    switches: tuple[str, ...] = ()
    thinks_by_default: bool = True
    turn_boundaries: tuple[str, ...] = ()  # a prompt's markers before the last of these are an earlier turn's
    tool_tags: tuple[str, ...] = ()  # special tokens the family's tool calls are written in: kept in a reply


_THINK = (("<think>",), ("</think>",))
_FAMILIES: dict[str, Family] = {
    "deepseek_r1": Family(*_THINK),
    "qwen3": Family(*_THINK, implicit_end="<tool_call>", after_end="drop_end", switches=("enable_thinking",)),
    "mistral": Family(("[THINK]",), ("[/THINK]",), begins="content", implicit_end="[TOOL_CALLS]", after_end="reopen",
                      strips_reasoning_tail=True, tool_tags=("[TOOL_CALLS]", "[ARGS]")),
    "granite": Family(("Here is my thought process:", "Here's my thought process:"),
                      ("Here is my response:", "Here's my response:"), begins="opening", text_markers=True,
                      switches=("thinking",), thinks_by_default=False),
    "ernie45": Family(*_THINK, response_tags=("<response>", "</response>")),
    "glm45": Family(*_THINK, implicit_end="<tool_call>", after_end="reopen", strips_reasoning_tail=True,
                    switches=("enable_thinking", "thinking"),
                    turn_boundaries=("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
                    tool_tags=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                               "</arg_value>")),
    "olmo3": Family(*_THINK, text_markers=True),
}
REASONING_PARSERS = tuple(_FAMILIES)


@dataclass(frozen=True)
class ReasoningParser:
    """A ``--reasoning-parser`` bound to the served tokenizer: the markers'
    ids (None where they are text), and whether they are special tokens."""

    name: str
    start_id: int | None
    end_id: int | None
    keeps_special_tokens: bool = False  # the markers are special: replies are decoded with them kept
    drops: tuple[str, ...] = ()  # then every other special token's text, dropped from a reply
    implicit_end_id: int | None = None
    boundary_ids: frozenset[int] = frozenset()
    # Text markers: the tokenizer's decode, to count the reasoning's tokens.
    decode: Callable[[Sequence[int]], str] | None = field(default=None, compare=False, repr=False)
    family: Family = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", _FAMILIES[self.name])

    @classmethod
    def load(cls, name: str, tokenizer: Any) -> ReasoningParser:
        """The parser ``name`` for ``tokenizer``; ValueError when the name is
        unknown or the tokenizer lacks the family's markers (single tokens
        that decode to their own text, or text that survives encode and
        decode, as the family writes them)."""
        if name not in _FAMILIES:
            raise ValueError(f"--reasoning-parser {name!r}: not a parser this server has "
                             f"({', '.join(REASONING_PARSERS)})")
        family = _FAMILIES[name]
        if family.text_markers:
            for marker in family.start + family.end:
                back = tokenizer.decode(tokenizer.encode(marker, add_special_tokens=False), skip_special_tokens=True)
                if back != marker:
                    raise ValueError(f"--reasoning-parser {name}: the tokenizer does not give {marker!r} back as "
                                     f"text (it reads {back!r}); this parser reads its markers as text")
            return cls(name, None, None, decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))
        markers = (family.start[0], family.end[0])
        ids = []
        for marker in markers:
            tok = _token_id(tokenizer, marker)
            if tok is None:
                raise ValueError(f"--reasoning-parser {name}: the tokenizer has no {marker!r} token that decodes "
                                 f"to itself (the model is not a {markers[0]}...{markers[1]} reasoning model)")
            ids.append(tok)
        special = any(tokenizer.decode([tok], skip_special_tokens=True) != m for tok, m in zip(ids, markers))
        kept = {*markers, *family.tool_tags}
        drops = tuple(sorted(_special_texts(tokenizer) - kept)) if special else ()
        boundaries = frozenset(t for m in family.turn_boundaries if (t := _token_id(tokenizer, m)) is not None)
        implicit = _token_id(tokenizer, family.implicit_end) if family.implicit_end else None
        return cls(name, ids[0], ids[1], keeps_special_tokens=special, drops=drops, implicit_end_id=implicit,
                   boundary_ids=boundaries)

    @property
    def end_marker(self) -> str:
        return self.family.end[0]

    def thinking(self, template_kwargs: dict[str, Any]) -> bool:
        """Whether a request rendered with these template variables thinks."""
        asked = [v for name in self.family.switches if (v := template_kwargs.get(name)) is not None]
        return any(bool(v) for v in asked) if asked else self.family.thinks_by_default

    def ended_in(self, token_ids: Sequence[int], text: str = "") -> bool:
        """Whether the thinking is already closed at the end of a prompt (its
        ``token_ids``, or for text markers its ``text``): the last marker in
        its last turn is the end one. A reply that begins in its answer
        anyway never counts as closed."""
        family = self.family
        if family.begins != "reasoning":
            return False
        if self.end_id is None:
            return max(text.rfind(m) for m in family.end) > max(text.rfind(m) for m in family.start)
        for tok in reversed(token_ids):
            if tok == self.start_id or tok in self.boundary_ids:
                return False
            if tok == self.end_id:
                return True
        return False

    def reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the reasoning in an output that thinks. Marker tokens:
        those inside its thinking, the markers not counted. Text markers:
        those that end inside the reasoning's text, found by decoding the
        output's prefixes (a token across a marker's edge counts on the side
        it ends on)."""
        if self.end_id is None:
            return self._text_reasoning_tokens(token_ids)
        reopens = self.family.after_end == "reopen"
        thinking, count = self.family.begins == "reasoning", 0
        for tok in token_ids:
            if tok == self.start_id:
                thinking = True
            elif tok == self.end_id or (thinking and tok == self.implicit_end_id):
                if not reopens:
                    break
                thinking = False
            else:
                count += thinking
        return count

    def _text_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        text = self.decode(token_ids)
        start = next((len(m) for m in self.family.start if text.startswith(m)), None)
        if start is None and self.family.begins == "opening":
            return 0
        start = start or 0
        stop = min((i for m in self.family.end if (i := text.find(m, start)) >= 0), default=len(text))
        return _tokens_ending_by(self.decode, token_ids, stop) - _tokens_ending_by(self.decode, token_ids, start)


def _token_id(tokenizer: Any, marker: str) -> int | None:
    """The id of the single token that is ``marker`` (and decodes to it)."""
    tok = tokenizer.convert_tokens_to_ids(marker)
    if tok is None or tok == getattr(tokenizer, "unk_token_id", None):
        return None
    return tok if tokenizer.decode([tok], skip_special_tokens=False) == marker else None


def _special_texts(tokenizer: Any) -> set[str]:
    """Every special token's text: the named ones, and the added tokens
    flagged special (which a decode that skips special tokens skips)."""
    texts = set(getattr(tokenizer, "all_special_tokens", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return texts | {t.content for t in added.values() if getattr(t, "special", False)}


def _tokens_ending_by(decode: Callable[[Sequence[int]], str], token_ids: Sequence[int], offset: int) -> int:
    """How many of the first tokens decode within the text's first ``offset``
    characters (a binary search: a prefix's text only grows)."""
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(decode(token_ids[:mid])) <= offset:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Reasoning:
    """How one request's replies are split. ``include``: the request's
    ``include_reasoning``; off, the reasoning is still made but not sent."""

    parser: ReasoningParser
    include: bool = True

    def split(self, text: str) -> tuple[str, str | None]:
        """(reasoning, content) of a whole reply; content is None when the
        reply ended in its thinking (cut by its length) with no answer before."""
        stream = ReasoningStream(self.parser)
        reasoning, content = stream.step(text, last=True)
        return reasoning, None if stream.in_reasoning and not content else content


class _Markers:
    """Marker strings to find in text, and the tail of a text that may yet
    grow into one of them."""

    def __init__(self, markers: Iterable[str]) -> None:
        self.markers = sorted({m for m in markers if m}, key=len, reverse=True)  # longest first where two start
        self._pattern = re.compile("|".join(map(re.escape, self.markers))) if self.markers else None
        self._prefixes = {m[:n] for m in self.markers for n in range(1, len(m))}
        self._longest = len(self.markers[0]) if self.markers else 0

    def cut(self, text: str) -> tuple[str, str, str]:
        """(before, marker, after) at the first marker; without one, (text
        less a tail that may begin a marker, "", that tail)."""
        found = self._pattern.search(text) if self._pattern else None
        if found:
            return text[:found.start()], found.group(), text[found.end():]
        for i in range(max(0, len(text) - self._longest + 1), len(text)):
            if text[i:] in self._prefixes:
                return text[:i], "", text[i:]
        return text, "", ""


class _ResponseTags:
    """ernie45's answer after its thinking: ``<response>`` after nothing but
    whitespace opens it (the whitespace and tag dropped), and what follows
    its last ``</response>`` is dropped; any other answer is as written."""

    def __init__(self, tags: tuple[str, str]) -> None:
        self.open, self.close = tags
        self.state = "lead"  # "lead": whitespace so far; "inside" the tags; "plain" text
        self._held = ""  # lead whitespace, or a piece of a tag
        self._after = ""  # inside: a close tag and what followed it, until another shows it was not the last
        self._close = _Markers([self.close])

    def feed(self, text: str, last: bool) -> str:
        text, self._held = self._held + text, ""
        if self.state == "lead":
            body = text.lstrip()
            if body.startswith(self.open):
                self.state, text = "inside", body[len(self.open):]
            elif (body and not self.open.startswith(body)) or last:
                self.state = "plain"
            else:
                self._held = text
                return ""
        return text if self.state == "plain" else self._inside(text, last)

    def _inside(self, text: str, last: bool) -> str:
        out = []
        before, tag, rest = self._close.cut(text)
        while tag:
            out.append(self._after + before)  # the close tag before it was not the last
            self._after = tag
            before, tag, rest = self._close.cut(rest)
        if last:
            before, rest = before + rest, ""
        self._held = rest
        if self._after:
            self._after += before
        else:
            out.append(before)
        if last:
            self._after = ""  # what follows the last close tag is dropped
        return "".join(out)


@dataclass
class ReasoningStream:
    """One reply, delta by delta, as (reasoning, content) pieces."""

    parser: ReasoningParser
    phase: str = field(init=False)  # "opening", "reasoning" or "content"
    _held: str = ""  # a tail that may be the start of a marker
    _space: str = ""  # whitespace ending the reasoning so far (a family that drops it at the end)

    def __post_init__(self) -> None:
        family, p = self.parser.family, self.parser
        self.phase = family.begins
        starts = family.start if family.begins != "opening" else ()  # granite's reasoning keeps a repeat as text
        self._in_reasoning = _Markers([*starts, *family.end, family.implicit_end or "", *p.drops])
        self._in_content = _Markers([*(family.end if family.after_end != "keep" else ()),
                                     *(family.start if family.after_end == "reopen" else ()), *p.drops])
        self._answer = _ResponseTags(family.response_tags) if family.response_tags else None
        self._reasoning: list[str] = []
        self._content: list[str] = []

    @property
    def in_reasoning(self) -> bool:
        return self.phase == "reasoning"

    def feed(self, delta: str) -> tuple[str, str]:
        self._run(delta, last=False)
        return self._take()

    def step(self, delta: str, last: bool) -> tuple[str, str]:
        """``feed``, and on the reply's ``last`` delta ``finish`` too."""
        self._run(delta, last)
        return self._take()

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended."""
        self._run("", last=True)
        return self._take()

    def _take(self) -> tuple[str, str]:
        out = "".join(self._reasoning), "".join(self._content)
        self._reasoning.clear()
        self._content.clear()
        return out

    def _run(self, delta: str, last: bool) -> None:
        text, self._held = self._held + delta, ""
        while text:
            if self.phase == "opening":
                text = self._open(text, last)
            elif self.phase == "reasoning":
                text = self._think(text, last)
            else:
                text = self._answer_with(text, last)
        if last:
            self._space = ""  # the reasoning's closing whitespace
            if self._answer is not None:
                self._content.append(self._answer.feed("", last=True))

    def _open(self, text: str, last: bool) -> str:
        """granite: a reply thinks only if it opens with a start marker."""
        starts = self.parser.family.start
        marker = next((m for m in starts if text.startswith(m)), None)
        if marker:
            self.phase = "reasoning"
            return text[len(marker):]
        if not last and any(m.startswith(text) for m in starts):
            self._held = text
            return ""
        self.phase = "content"
        return text

    def _cut(self, markers: _Markers, text: str, last: bool) -> tuple[str, str, str]:
        """``markers.cut(text)``, a tail that may begin a marker held back for
        the next delta (or, on the reply's last, kept as text)."""
        head, marker, rest = markers.cut(text)
        if marker or not rest:
            return head, marker, rest
        if last:
            return head + rest, "", ""
        self._held = rest
        return head, "", ""

    def _think(self, text: str, last: bool) -> str:
        family = self.parser.family
        head, marker, rest = self._cut(self._in_reasoning, text, last)
        self._reason(head)
        if marker in family.end:
            self._end_thinking()
        elif marker == family.implicit_end:
            self._end_thinking()
            rest = marker + rest  # the marker is the answer's first text
        return rest  # a start marker or a dropped special token: absorbed

    def _answer_with(self, text: str, last: bool) -> str:
        family = self.parser.family
        head, marker, rest = self._cut(self._in_content, text, last)
        self._say(head)
        if marker in family.start:
            self.phase = "reasoning"
        return rest  # an end marker or a dropped special token: absorbed

    def _end_thinking(self) -> None:
        self.phase = "content"
        self._space = ""

    def _reason(self, text: str) -> None:
        if not self.parser.family.strips_reasoning_tail:
            self._reasoning.append(text)
            return
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        self._reasoning.append(body)

    def _say(self, text: str) -> None:
        self._content.append(self._answer.feed(text, last=False) if self._answer is not None else text)
