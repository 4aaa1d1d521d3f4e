"""Reasoning output: a thinking model's reply split into its reasoning and
its answer, whole or streamed (vLLM's ``--reasoning-parser``).

Owns the two parsers built in, both of ``<think>...</think>`` models:

* ``deepseek_r1`` (DeepSeek-R1 and its distills): everything before the
  first ``</think>`` is reasoning, whether or not the reply opened with
  ``<think>`` (their templates put it in the prompt). A reply that never
  closes its thinking is all reasoning.
* ``qwen3`` (Qwen3, QwQ): the same, but a request that turns thinking off
  (``chat_template_kwargs: {"enable_thinking": false}``, or
  ``reasoning_effort: "none"``) has no reasoning at all, and a
  ``<tool_call>`` in the reasoning ends it: the call is the answer's.

A prompt whose own end already closed the thinking (a template that writes
``<think></think>`` for a non-thinking turn, or a continued assistant
message that did) starts in the answer. ``ReasoningStream`` works on text:
the markers are added tokens that decode to themselves, so a marker split
over two deltas is held back until it is whole. Pure Python: no pydantic,
no engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

REASONING_PARSERS = ("deepseek_r1", "qwen3")

_START, _END, _TOOL_CALL = "<think>", "</think>", "<tool_call>"


@dataclass(frozen=True)
class ReasoningParser:
    """A ``--reasoning-parser`` bound to the served tokenizer's marker ids."""

    name: str
    start_id: int
    end_id: int
    start: str = _START
    end: str = _END
    # qwen3: a marker that ends the reasoning implicitly and starts the answer.
    implicit_end: str | None = None
    # qwen3: a second end marker inside the answer is dropped, not shown.
    drops_repeated_end: bool = False

    @classmethod
    def load(cls, name: str, tokenizer: Any) -> ReasoningParser:
        """The parser ``name`` for ``tokenizer``; ValueError when the name is
        unknown or the tokenizer lacks the markers as single tokens that
        decode to their own text (what the splitting reads)."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {name!r}: not a parser this server has "
                             f"({', '.join(REASONING_PARSERS)})")
        ids = {}
        for marker in (_START, _END):
            tok = tokenizer.convert_tokens_to_ids(marker)
            if tok is None or tok == getattr(tokenizer, "unk_token_id", None) or \
                    tokenizer.decode([tok], skip_special_tokens=True) != marker:
                raise ValueError(f"--reasoning-parser {name}: the tokenizer has no {marker!r} token that decodes "
                                 "to itself (the model is not a <think> reasoning model)")
            ids[marker] = tok
        qwen = name == "qwen3"
        return cls(name, ids[_START], ids[_END], implicit_end=_TOOL_CALL if qwen else None,
                   drops_repeated_end=qwen)

    def thinking(self, template_kwargs: dict[str, Any]) -> bool:
        """Whether a request rendered with these template variables thinks."""
        return self.name != "qwen3" or template_kwargs.get("enable_thinking", True) is not False

    def ended_in(self, token_ids: Sequence[int]) -> bool:
        """Whether the thinking is already closed at the end of ``token_ids``
        (a prompt): the last marker in it is the end one."""
        for tok in reversed(token_ids):
            if tok == self.start_id:
                return False
            if tok == self.end_id:
                return True
        return False

    def reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the reasoning in an output that starts in it: those
        before the first end marker, the markers themselves not counted."""
        count = 0
        for tok in token_ids:
            if tok == self.end_id:
                break
            count += tok != self.start_id
        return count


@dataclass(frozen=True)
class Reasoning:
    """How one request's replies are split. ``include``: the request's
    ``include_reasoning``; off, the reasoning is still made but not sent."""

    parser: ReasoningParser
    include: bool = True

    def split(self, text: str) -> tuple[str, str | None]:
        """(reasoning, content) of a whole reply; content is None when the
        reply never finished thinking (cut by its length)."""
        stream = ReasoningStream(self.parser)
        reasoning, content = stream.step(text, last=True)
        return reasoning, None if stream.in_reasoning else content


@dataclass
class ReasoningStream:
    """One reply, delta by delta, as (reasoning, content) pieces."""

    parser: ReasoningParser
    in_reasoning: bool = True
    _held: str = ""  # a tail that may be the start of a marker
    _markers: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        p = self.parser
        self._markers = tuple(m for m in (p.start, p.end, p.implicit_end) if m)

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning, content = [], []
        while text:
            if not self.in_reasoning:
                if not self.parser.drops_repeated_end:
                    content.append(text)
                    return "".join(reasoning), "".join(content)
                head, text = self._until(text, (self.parser.end,))
                content.append(head)
                if text.startswith(self.parser.end):
                    text = text[len(self.parser.end):]
                continue
            head, text = self._until(text, self._markers)
            reasoning.append(head)
            if text.startswith(self.parser.start):  # absorbed, wherever it comes
                text = text[len(self.parser.start):]
            elif text.startswith(self.parser.end):
                text = text[len(self.parser.end):]
                self.in_reasoning = False
            elif self.parser.implicit_end and text.startswith(self.parser.implicit_end):
                self.in_reasoning = False  # the marker is the answer's first text
        return "".join(reasoning), "".join(content)

    def step(self, delta: str, last: bool) -> tuple[str, str]:
        """``feed``, and on the reply's ``last`` delta ``finish`` too."""
        reasoning, content = self.feed(delta)
        if last:
            tail = self.finish()
            reasoning, content = reasoning + tail[0], content + tail[1]
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)

    def _until(self, text: str, markers: tuple[str, ...]) -> tuple[str, str]:
        """``text`` cut before the first whole marker (returned as the rest);
        with none, a tail that could begin one is held for the next delta."""
        found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
        if found:
            i = min(found)[0]
            return text[:i], text[i:]
        keep = max((n for m in markers for n in range(1, len(m)) if text.endswith(m[:n])), default=0)
        if keep:
            self._held = text[-keep:]
            return text[:-keep], ""
        return text, ""
