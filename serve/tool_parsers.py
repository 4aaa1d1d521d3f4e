"""Tool calls: from a model's text to OpenAI ``tool_calls``, whole or streamed.

Owns the three ways a chat reply becomes tool calls:

* ``tool_choice: "auto"``: the model decides; a parser chosen with
  ``--tool-call-parser`` finds calls in its own output format:

  - ``hermes`` (Hermes 2/3, Qwen 2.5/3 templates): any number of
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the
    text around them is content;
  - ``llama3_json`` (Llama 3.1-3.3 templates): the whole reply is a JSON object
    ``{"name": ..., "parameters": {...}}`` (``arguments`` also taken), maybe
    after ``<|python_tag|>``, several joined by ``;``;
  - ``pythonic`` (Llama 3.2 and 4, ToolACE): the whole reply is a Python list
    of calls with literal keyword arguments, ``[get_weather(city="Oslo")]``;
  - ``mistral`` (Mistral, Mixtral, Ministral templates): content, then
    ``[TOOL_CALLS]`` and the calls, as a JSON array of ``{"name",
    "arguments"}`` objects (tokenizers before v11) or as ``name[ARGS]{...}``
    after each ``[TOOL_CALLS]`` (v11 on); its call ids are the nine
    alphanumerics its templates check;
  - ``qwen3_coder`` (Qwen3-Coder): ``<tool_call>`` blocks holding
    ``<function=name>`` and ``<parameter=key>value</parameter>`` tags, each
    value's text read as the tool's schema types it;
  - ``granite`` (Granite 3.x): content, then ``<|tool_call|>`` (3.0, a
    special token) or ``<tool_call>`` (3.1 on) and a JSON array of
    ``{"name", "arguments"}`` objects, with no closing tag;
  - ``phi4_mini_json`` (Phi-4-mini): content, then ``functools`` and a JSON
    array of ``{"name", "arguments"}`` objects;
  - ``olmo3`` (OLMo 3): content, then ``<function_calls>``, one pythonic
    call ``name(key=literal, ...)`` a line, and ``</function_calls>``;
  - ``glm45`` (GLM-4.5 and on): ``<tool_call>name`` blocks holding
    ``<arg_key>key</arg_key><arg_value>value</arg_value>`` pairs, each
    value's text read as the tool's schema types it (special tokens kept).

* ``tool_choice: "required"``: decoding is constrained to a JSON array of
  ``{"name", "parameters"}`` objects, one schema per tool
  (``required_calls_schema``);
* a named function: decoding is constrained to that function's parameters
  schema; the whole reply is its arguments.

``CallStream`` turns text deltas into content deltas and ``CallDelta`` s as
they become known; ``parse_reply`` is the same on a whole reply. Pure Python:
no pydantic, no engine.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "granite", "phi4_mini_json",
                     "olmo3", "glm45")
# The parsers whose markers are special tokens: a reply they read keeps its special tokens.
KEEPS_SPECIAL_TOKENS = ("mistral", "granite", "glm45")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)


@dataclass
class CallDelta:
    """A piece of one streamed tool call: its id and name come on its first
    delta, the arguments in one or more pieces to be concatenated."""

    index: int  # the call's place in the choice's tool_calls
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class StreamPiece:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ToolMode:
    """How one request's reply is read: ``kind`` is "auto" (with ``parser``),
    "required", or "named" (with ``function``)."""

    kind: str
    parser: str | None = None
    function: str | None = None
    # "required": the calls' arguments, which are read out of the reply's
    # array and written anew, written without whitespace, as the compact
    # grammar (disable_any_whitespace) had the model write them.
    compact: bool = False
    # "auto": each tool's parameters' JSON schema types, {function: {parameter: type}},
    # for a format that writes values as bare text (qwen3_coder).
    types: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, hash=False)


# -- schemas that force a call --------------------------------------------------


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("parameters") or {"type": "object", "properties": {}}


def _rebased(node: Any, base: str) -> Any:
    """``node`` with each local ``$ref`` ("#...") pointing below ``base``."""
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    return node


def parameter_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{function: {parameter: its schema's ``type``}} of a request's tools."""
    return {t["name"]: {k: v.get("type") for k, v in (_parameters(t).get("properties") or {}).items()
                        if isinstance(v, dict)} for t in tools if isinstance(t.get("name"), str)}


def required_calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls, each naming a tool and carrying
    arguments valid for it; one call only when ``parallel`` is false.

    Each tool's parameters sit under the array schema's ``$defs``, their
    local references rebased there, so a ``$ref`` to the parameters' own
    ``$defs`` (as pydantic writes them) still resolves."""
    defs: dict[str, Any] = {}
    items = []
    for t in tools:
        key = f"{t['name']}.parameters"  # function names hold no "/" or "~": a plain pointer segment
        defs[key] = _rebased(_parameters(t), f"#/$defs/{key}")
        items.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t["name"]]}, "parameters": {"$ref": f"#/$defs/{key}"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_call_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return _parameters(next(t for t in tools if t["name"] == name))


# -- whole replies --------------------------------------------------------------


def parse_reply(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply; content is None when the reply
    was only tool calls."""
    stream = CallStream(mode)
    pieces = [stream.feed(text), stream.finish()]
    calls: dict[int, ToolCall] = {}
    content = "".join(p.content for p in pieces)
    for p in pieces:
        for d in p.calls:
            prev = calls.get(d.index)
            calls[d.index] = (ToolCall(d.name or "", d.arguments, d.id or new_call_id()) if prev is None
                              else ToolCall(prev.name, prev.arguments + d.arguments, prev.id))
    ordered = [calls[i] for i in sorted(calls)]
    if ordered and not content.strip():
        return None, ordered
    return content, ordered


# -- streams --------------------------------------------------------------------


class CallStream:
    """One choice's reply, delta by delta, as content and tool-call deltas."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.num_calls = 0
        if mode.kind == "auto":
            self._auto = _PARSERS[mode.parser or ""](mode)
        self._buffer = ""
        self._named_id: str | None = None

    def feed(self, delta: str) -> StreamPiece:
        if not delta:
            return StreamPiece()
        if self.mode.kind == "named":  # the reply is the arguments: pass them through
            if self._named_id is None:
                self._named_id = new_call_id()
                self.num_calls = 1
                return StreamPiece(calls=[CallDelta(0, delta, self._named_id, self.mode.function)])
            return StreamPiece(calls=[CallDelta(0, delta)])
        if self.mode.kind == "required":  # an array: read it whole at the end
            self._buffer += delta
            return StreamPiece()
        content, calls = self._auto.feed(delta)
        return StreamPiece(content, self._number(calls))

    def step(self, delta: str, last: bool) -> list[StreamPiece]:
        """``feed``, and on the reply's ``last`` delta ``finish`` too."""
        return [self.feed(delta)] + ([self.finish()] if last else [])

    def finish(self) -> StreamPiece:
        if self.mode.kind == "named":
            if self._named_id is None:  # an empty reply is still the (empty) arguments
                self._named_id = new_call_id()
                self.num_calls = 1
                return StreamPiece(calls=[CallDelta(0, "", self._named_id, self.mode.function)])
            return StreamPiece()
        if self.mode.kind == "required":
            calls = _calls_from_array(self._buffer, self.mode.compact)
            if calls is None:  # cut short (length): what there is, as content
                return StreamPiece(self._buffer)
            return StreamPiece(calls=self._number(calls))
        content, calls = self._auto.finish()
        return StreamPiece(content, self._number(calls))

    def _number(self, calls: list[ToolCall]) -> list[CallDelta]:
        out = []
        for call in calls:
            out.append(CallDelta(self.num_calls, call.arguments, call.id, call.name))
            self.num_calls += 1
        return out


def _calls_from_array(text: str, compact: bool = False) -> list[ToolCall] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list):
        return None
    calls = [_call_from_object(v, "parameters", compact) for v in value]
    return None if any(c is None for c in calls) else calls


def _call_from_object(value: Any, args_key: str, compact: bool = False) -> ToolCall | None:
    """``{"name": str, args_key: object}`` (or ``arguments``) as a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(args_key, value.get("arguments", value.get("parameters")))
    if args is None:
        args = {}
    if isinstance(args, str):  # already JSON text
        return ToolCall(value["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":") if compact else None))


class _AutoParser:
    """A model format: text deltas in, (content to send, finished calls) out."""

    name: ClassVar[str]

    def __init__(self, mode: ToolMode | None = None) -> None:
        self.mode = mode

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class HermesParser(_AutoParser):
    """``<tool_call>JSON</tool_call>`` blocks amid content. Text that might
    be the start of a tag is held back until it is known not to be."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, mode: ToolMode | None = None) -> None:
        super().__init__(mode)
        self._pending = ""
        self._in_call = False

    def read(self, body: str) -> ToolCall | None:
        """One block's call; None: the block is no call."""
        return _json_call(body, "arguments")

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._pending += delta
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                at = self._pending.find(self.START)
                if at < 0:
                    keep = _partial_suffix(self._pending, self.START)
                    content.append(self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                content.append(self._pending[:at])
                self._pending = self._pending[at + len(self.START):]
                self._in_call = True
            at = self._pending.find(self.END)
            if at < 0:
                break
            body, self._pending = self._pending[:at], self._pending[at + len(self.END):]
            self._in_call = False
            call = self.read(body)
            if call is None:  # not a call after all: the model's text, unchanged
                content.append(self.START + body + self.END)
            else:
                calls.append(call)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._pending = self._pending, ""
        if not self._in_call:
            return rest, []
        self._in_call = False
        call = self.read(rest)  # a reply that ended before its closing tag
        return ("", [call]) if call is not None else (self.START + rest, [])


def _json_call(text: str, args_key: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _call_from_object(value, args_key)


def _json_calls(text: str) -> list[ToolCall]:
    """Objects separated by ``;`` (and whitespace), each a call; [] if any is not."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return []
        call = _call_from_object(value, "parameters")
        if call is None:
            return []
        calls.append(call)
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _WholeReplyParser(_AutoParser):
    """A reply whose calls are read whole at its end once its opening says
    it holds calls (``opens_calls``); content before a marker streams at
    once, and a reply that opens otherwise streams as content."""

    MARKERS: ClassVar[tuple[str, ...]] = ()  # texts that start the calls anywhere in the reply

    def __init__(self, mode: ToolMode | None = None) -> None:
        super().__init__(mode)
        self._buffer = ""
        self._mode: str | None = None  # None: undecided, "content" or "calls"

    def opens_calls(self, head: str) -> bool | None:
        """Whether a reply opening with ``head`` (stripped) holds calls; None: not known yet."""
        raise NotImplementedError

    def calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self._mode == "calls":
            self._buffer += delta
            return "", []
        self._buffer += delta
        if self.MARKERS:
            found = [at for marker in self.MARKERS if (at := self._buffer.find(marker)) >= 0]
            if found:  # content up to the first marker, the calls from it
                self._mode = "calls"
                content, self._buffer = self._buffer[:min(found)], self._buffer[min(found):]
                return content, []
            keep = max(_partial_suffix(self._buffer, marker) for marker in self.MARKERS)
            content, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            return content, []
        if self._mode == "content":
            text, self._buffer = self._buffer, ""
            return text, []
        head = self._buffer.lstrip()
        opens = self.opens_calls(head) if head else None
        if opens is None:
            return "", []
        self._mode = "calls" if opens else "content"
        if opens:
            return "", []
        text, self._buffer = self._buffer, ""
        return text, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buffer = self._buffer, ""
        if self._mode != "calls":
            return text, []
        calls = self.calls(text)
        return ("", calls) if calls else (text, [])


class Llama3JsonParser(_WholeReplyParser):
    """A reply that opens with ``{`` (or ``<|python_tag|>``) is read whole as
    calls at its end; any other reply streams as content at once."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def opens_calls(self, head: str) -> bool | None:
        if len(head) < len(self.TAG) and self.TAG.startswith(head):
            return None  # maybe the tag: wait
        return head.startswith(("{", self.TAG))

    def calls(self, text: str) -> list[ToolCall]:
        return _json_calls(text.strip().removeprefix(self.TAG))


class PythonicParser(_WholeReplyParser):
    """``[name(key=literal, ...), ...]``: read with Python's parser, never
    run; every argument must be a literal (strings, numbers, booleans,
    None, and lists and dicts of them)."""

    name = "pythonic"

    def opens_calls(self, head: str) -> bool | None:
        return head.startswith("[")

    def calls(self, text: str) -> list[ToolCall]:
        return self.read_list(text)

    @staticmethod
    def read_list(text: str) -> list[ToolCall]:
        """``[name(key=literal, ...), ...]`` as calls; [] if it is not one."""
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError:
            return []
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return []
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return []
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return []
            if len(args) != len(node.keywords):  # a **mapping argument
                return []
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's templates refuse other call ids
    when the history comes back."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class MistralParser(_WholeReplyParser):
    """Content, then ``[TOOL_CALLS]`` and the calls: a JSON array (or one
    object), or ``name[ARGS]{...}`` after each ``[TOOL_CALLS]``."""

    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    MARKERS = (MARKER,)
    ARGS = "[ARGS]"

    def calls(self, text: str) -> list[ToolCall]:
        body = text.removeprefix(self.MARKER).strip()
        if body.startswith(("[", "{")):
            try:
                value = json.loads(body)
            except ValueError:
                return []
            found = [_call_from_object(v, "arguments") for v in (value if isinstance(value, list) else [value])]
        else:
            found = [self._named(part) for part in text.split(self.MARKER)[1:]]
        if not found or any(c is None for c in found):
            return []
        return [ToolCall(c.name, c.arguments, mistral_call_id()) for c in found]

    def _named(self, part: str) -> ToolCall | None:
        name, sep, args = part.partition(self.ARGS)
        if not sep:  # v11's first form: the arguments right after the name
            at = part.find("{")
            if at < 0:
                return None
            name, args = part[:at], part[at:]
        name = name.strip()
        try:
            value = json.loads(args)
        except ValueError:
            return None
        if not name or not isinstance(value, dict):
            return None
        return ToolCall(name, json.dumps(value, ensure_ascii=False))


def _leading_array(text: str) -> list[ToolCall]:
    """A JSON array of ``{"name", "arguments"}`` objects and nothing but
    whitespace after it; [] otherwise."""
    text = text.strip()
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return []
    if text[end:].strip() or not isinstance(value, list) or not value:
        return []
    calls = [_call_from_object(v, "arguments") for v in value]
    return [] if any(c is None for c in calls) else calls


class GraniteParser(_WholeReplyParser):
    """Content, then ``<|tool_call|>`` or ``<tool_call>`` and a JSON array of
    calls, which ends the reply."""

    name = "granite"
    MARKERS = ("<|tool_call|>", "<tool_call>")

    def calls(self, text: str) -> list[ToolCall]:
        marker = next(m for m in self.MARKERS if text.startswith(m))
        return _leading_array(text[len(marker):])


class Phi4MiniJsonParser(_WholeReplyParser):
    """Content, then ``functools`` and a JSON array of calls, which ends the reply."""

    name = "phi4_mini_json"
    MARKERS = ("functools",)

    def calls(self, text: str) -> list[ToolCall]:
        return _leading_array(text[len(self.MARKERS[0]):])


class Olmo3Parser(_WholeReplyParser):
    """Content, then ``<function_calls>``, a pythonic call a line, and
    ``</function_calls>`` (or the reply's end) with nothing after it."""

    name = "olmo3"
    MARKERS = ("<function_calls>",)
    CLOSE = "</function_calls>"

    def calls(self, text: str) -> list[ToolCall]:
        body, _, rest = text[len(self.MARKERS[0]):].partition(self.CLOSE)
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        if rest.strip() or not lines:
            return []
        return PythonicParser.read_list(f"[{', '.join(lines)}]")


class Qwen3CoderParser(HermesParser):
    """``<tool_call><function=name><parameter=key>value</parameter>...
    </function></tool_call>`` blocks amid content. A value is bare text
    (one newline either side dropped), read as its parameter's schema type:
    a string as it is, numbers, booleans and null from their text, objects
    and arrays as JSON; a parameter the schema does not type is JSON where
    it parses, else a string."""

    name = "qwen3_coder"
    FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)

    def read(self, body: str) -> ToolCall | None:
        found = self.FUNCTION.search(body)
        if found is None or body[:found.start()].strip():
            return None
        name = found[1].strip()
        types = (self.mode.types if self.mode is not None else {}).get(name, {})
        args = {}
        for key, raw in self.PARAMETER.findall(found[2]):
            key = key.strip()
            args[key] = _typed(raw.removeprefix("\n").removesuffix("\n"), types.get(key))
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


class Glm45Parser(HermesParser):
    """``<tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value>
    ...</tool_call>`` blocks amid content (newlines between the tags
    allowed). A value is bare text, read as its parameter's schema type as
    ``qwen3_coder`` reads it; a call may have no arguments."""

    name = "glm45"
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def read(self, body: str) -> ToolCall | None:
        at = body.find("<arg_key>")
        name, pairs = (body, "") if at < 0 else (body[:at], body[at:])
        name = name.strip()
        if not name or "<" in name or "\n" in name or self.PAIR.sub("", pairs).strip():
            return None
        types = (self.mode.types if self.mode is not None else {}).get(name, {})
        args = {key.strip(): _typed(raw, types.get(key.strip())) for key, raw in self.PAIR.findall(pairs)}
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _typed(text: str, kind: Any) -> Any:
    """A bare-text value as its JSON schema ``type`` reads it."""
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if text == "null" and "null" in kinds | {None}:
        return None
    if kinds & {"string"}:
        return text
    try:
        if kinds & {"integer"}:
            return int(text)
        if kinds & {"number"}:
            value = float(text)
            return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value
    except ValueError:
        return text
    if kinds & {"boolean"}:
        return {"true": True, "false": False}.get(text.strip().lower(), text)
    try:
        return json.loads(text)
    except ValueError:
        return text


_PARSERS: dict[str, type[_AutoParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                          "pythonic": PythonicParser, "mistral": MistralParser,
                                          "qwen3_coder": Qwen3CoderParser, "granite": GraniteParser,
                                          "phi4_mini_json": Phi4MiniJsonParser, "olmo3": Olmo3Parser,
                                          "glm45": Glm45Parser}
assert tuple(_PARSERS) == TOOL_CALL_PARSERS
