"""Detokenizer: the text of one completion, built one token at a time.

Owns ``TextStream``: incremental detokenization (multi-byte UTF-8 characters
split across tokens come out whole), stop-string matching across token
boundaries, and the streaming hold-back that keeps released text final — a
chunk handed to a client is never taken back by a later stop match.

Three ways to decode, the first that applies:

* **Byte table** (byte-level BPE: GPT-2, Llama 3, Qwen, SmolLM): the decode
  of a sequence is the UTF-8 decode, with U+FFFD for bad bytes, of its
  tokens' bytes laid end to end. Each token's bytes are looked up once per
  tokenizer (``byte_table``, checked against the tokenizer's own decode of
  every token and of mixed sequences) and fed to Python's incremental UTF-8
  decoder: a lookup and one C call per token.
* Otherwise, where the tokenizer is a fast one, each token goes through its
  Rust ``tokenizers.decoders.DecodeStream`` (one call per token, seeded with
  the prompt's tail as context).
* The window below, kept in step with the stream, decodes the tail left at
  the end (partial UTF-8), spaced special tokens, and everything for a
  tokenizer without a Rust backend (or whose stream fails).

How the window works (no whole-output re-decode per token)::

    tokens:  [ prompt tail ... | out0 out1 ... | pending ... ]
               ^prefix_offset   ^read_offset-ish         ^end
    prefix_text = decode(tokens[prefix_offset:read_offset])
    new_text    = decode(tokens[prefix_offset:])
    delta       = new_text[len(prefix_text):]   once it grew and ends in a whole character

Decoding a few tokens of context before the new ones matters for tokenizers
whose decode of a lone token differs from its decode in context (SentencePiece
drops a leading space at the start of a decode). A trailing U+FFFD means the
last tokens end inside a UTF-8 sequence: wait for more tokens.
"""

from __future__ import annotations

import random
import weakref
from codecs import utf_8_decode as _utf8_decode
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fluidserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded as context before the first output token.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: each byte is spelled as one printable
    character (printable Latin-1 bytes as themselves, the others as the
    code points from 256 up, in byte order); character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = (b for b in range(256) if b not in set(printable))
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return alphabet


@dataclass(frozen=True)
class ByteTable:
    pieces: list[bytes]  # by token id
    # The piece as text where it is whole characters (most tokens), else None:
    # between characters a token costs a lookup, no decoder call.
    texts: list[str | None]


# Built tables by tokenizer, then skip_special_tokens; None where one does not apply.
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_table(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> ByteTable | None:
    """Every token id's bytes, when the tokenizer's decode is byte-level BPE
    (its decode of any ids is the lossy UTF-8 decode of their bytes end to
    end); None otherwise. Built once per tokenizer: one decode per token to
    check each entry, and 256 mixed sequences (special and added tokens,
    pieces of multi-byte characters) to check that they join as bytes do."""
    per_tokenizer = _TABLES.setdefault(tokenizer, {})
    if skip_special_tokens not in per_tokenizer:
        per_tokenizer[skip_special_tokens] = _build_byte_table(tokenizer, skip_special_tokens)
    return per_tokenizer[skip_special_tokens]


def _build_byte_table(tokenizer, skip_special: bool) -> ByteTable | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    alphabet = byte_level_alphabet()
    special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
    size = backend.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = []
    for i in range(size):
        piece = backend.id_to_token(i)
        if piece is None or (skip_special and i in special):
            table.append(b"")
        elif all(c in alphabet for c in piece):
            table.append(bytes(alphabet[c] for c in piece))
        else:  # an added token spelled outside the alphabet decodes as its own text
            table.append(piece.encode())

    def agrees(ids: list[int]) -> bool:
        joined = b"".join(table[i] if i < size else b"" for i in ids)
        return backend.decode(ids, skip_special_tokens=skip_special) == joined.decode("utf-8", "replace")

    if not all(agrees([i]) for i in range(size)) or not agrees([size, size + 7]):
        return None
    rng = random.Random(0)
    # Pieces of multi-byte characters (no whole character) meet each other,
    # special and added tokens, and plain ones.
    partial = [i for i, b in enumerate(table) if b and b.decode("utf-8", "replace") != b.decode("utf-8", "ignore")]
    added = list(backend.get_added_tokens_decoder())
    pools = [p for p in (partial, added, list(range(size))) if p]
    for _ in range(256):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(2, 8))]
        if not agrees(ids):
            return None
    return ByteTable(table, [_whole_text(b) for b in table])


def _whole_text(piece: bytes) -> str | None:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


class TextStream:
    """Per-completion text: incremental detokenization, stop strings, streaming hold-back.

    The engine calls ``append`` for each generated token and ``flush`` whenever
    it emits an output; the concatenation of every ``flush`` result equals
    ``text`` once ``flush(finished=True)`` has been called.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        # For a fast tokenizer, decode without cleanup is exactly its Rust
        # backend's decode; calling it directly skips transformers' per-call
        # argument conversion, which costs more than decoding itself.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._backend_decode = backend.decode if backend is not None else None
        self._params = params
        self._skip_special = params.skip_special_tokens
        # Spaced specials decode run by run: plain text between special tokens,
        # each special token on its own, joined by spaces.
        self._special_ids = (frozenset(getattr(tokenizer, "all_special_ids", ()))
                             if params.spaces_between_special_tokens and not params.skip_special_tokens
                             else frozenset())
        self._stops = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # The decode window: a little prompt for context, then every output
        # token. Only tokens[prefix_offset:] are ever decoded.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_generated = 0
        self._text = ""  # whole characters only, already stop-truncated
        self._released = 0  # len of the text handed out by flush
        self._stopped = False
        self._finalised = False
        self._token_text_cache: dict[int, str] = {}
        table = None
        if self._backend is not None and not self._special_ids:
            table = byte_table(tokenizer, self._skip_special)
        self._bytes = table
        self._num_table_ids = len(table.pieces) if table is not None else 0
        # The bytes of a character split across tokens, until it is whole.
        self._pending = b""
        # A prompt that ends inside a character: its bytes start the output's
        # first character, which the window drops (it stands where the
        # prompt's own decode put U+FFFD); so does the table.
        self._skip_first_char = False
        if table is not None:
            tail = b"".join(table.pieces[t] if t < self._num_table_ids else b"" for t in context)
            self._pending = tail[_utf8_decode(tail, "replace", False)[1]:]
            self._skip_first_char = bool(self._pending)
        self._decode_stream = self._make_decode_stream(context) if table is None else None
        # No stream because the prompt tail ends inside a character: the
        # window runs until its first delta, then a stream seeded with the
        # window's context takes over (the same state a fresh one starts in).
        self._reseed = (self._decode_stream is None and table is None and self._backend is not None
                        and not self._special_ids)

    def _make_decode_stream(self, context: list[int]):
        if self._backend is None or self._special_ids:
            return None
        # A prompt tail that ends inside a character gives the stream no prefix
        # to cut at; the window handles that rare case.
        if self._decode_plain(context).endswith(_REPLACEMENT_CHAR):
            return None
        try:
            from tokenizers.decoders import DecodeStream

            return DecodeStream(ids=context, skip_special_tokens=self._skip_special)
        except (ImportError, TypeError):  # tokenizers too old to take a context
            return None

    # ------------------------------------------------------------ public

    @property
    def text(self) -> str:
        """Cumulative text so far (after stop truncation), including text not yet flushed."""
        return self._text

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched; later tokens are ignored."""
        return self._stopped

    def append(self, token_id: int) -> str | None:
        """Add one generated token. Returns the stop string if one now matches;
        the text is then cut at it (or kept through it when
        ``include_stop_str_in_output``) and the stream takes no more tokens."""
        if self._stopped or self._finalised:
            return None
        self._num_generated += 1
        table = self._bytes
        if table is not None:
            if token_id >= self._num_table_ids:  # past the tokenizer's ids (a padded LM head): nothing
                return None
            delta = None if self._pending else table.texts[token_id]  # whole characters after whole ones
            if delta is None:
                # Whole characters out, a started one held; bad bytes decode
                # to U+FFFD, as in the tokenizer's decode.
                data = self._pending + table.pieces[token_id]
                delta, used = _utf8_decode(data, "replace", False)
                self._pending = data[used:]
                if delta and self._skip_first_char:
                    delta, self._skip_first_char = delta[1:], False
        else:
            self._tokens.append(token_id)
            stream = self._decode_stream
            if stream is not None:  # _decode_delta's stream path, inline: it runs once per token
                try:
                    delta = stream.step(self._backend, token_id)
                except Exception:  # noqa: BLE001 - the stream's prefix check failed: the window takes over
                    self._decode_stream = None
                    delta = self._decode_delta()
                else:
                    if delta is None:
                        return None
                    self._prefix_offset = self._read_offset
                    self._read_offset = len(self._tokens)
            else:
                delta = self._decode_delta()
        if not delta:
            return None
        old_len = len(self._text)
        self._text += delta
        # Stop strings count only once min_tokens are out (vLLM semantics: the
        # minimum holds against every way of stopping).
        if self._stops and self._num_generated >= self._params.min_tokens:
            return self._check_stop(old_len)
        return None

    def flush(self, finished: bool) -> str:
        """Text released since the last flush.

        While not finished, holds back any tail that could still grow into a
        stop string, so released text is final. Incomplete UTF-8 characters
        are never in ``text`` until the stream finishes; on ``finished`` any
        trailing partial bytes are decoded as they are (U+FFFD, matching a
        plain ``tokenizer.decode``) and everything is released."""
        if not finished and not self._stops:  # nothing is held back: all of the text is final
            chunk = self._text[self._released:]
            self._released = len(self._text)
            return chunk
        if finished and not self._stopped and not self._finalised:
            self._text += self._decode_remainder()
        if finished:
            self._finalised = True
        end = len(self._text) if finished or self._stopped else self._holdback_start()
        end = max(end, self._released)  # never retract (holdback_start >= released by construction)
        chunk = self._text[self._released:end]
        self._released = end
        return chunk

    def decode_token(self, token_id: int) -> str:
        """One token's own text, for logprobs display. A byte token inside a
        multi-byte character shows as U+FFFD; special tokens show their names."""
        cached = self._token_text_cache.get(token_id)
        if cached is None:
            cached = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = cached
        return cached

    # ------------------------------------------------------------ decoding

    def _decode(self, token_ids: list[int]) -> str:
        if self._special_ids:
            return self._decode_spaced(token_ids)
        return self._decode_plain(token_ids)

    def _decode_spaced(self, token_ids: list[int]) -> str:
        parts: list[str] = []
        run: list[int] = []
        for t in token_ids:
            if t in self._special_ids:
                if run:
                    parts.append(self._decode_plain(run))
                    run = []
                parts.append(self._decode_plain([t]))
            else:
                run.append(t)
        if run:
            parts.append(self._decode_plain(run))
        return " ".join(parts)

    def _decode_plain(self, token_ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(
            token_ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _decode_delta(self) -> str:
        """New whole characters since read_offset, advancing the window; "" while
        the tail is an incomplete character (or decodes to nothing, e.g. a
        skipped special token)."""
        if self._decode_stream is not None:
            try:
                chunk = self._decode_stream.step(self._backend, self._tokens[-1])
            except Exception:  # noqa: BLE001 - the stream's prefix check failed: the window takes over
                self._decode_stream = None
            else:
                if chunk is None:
                    return ""
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._tokens)
                return chunk
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        if self._reseed:
            self._reseed = False
            self._decode_stream = self._make_decode_stream(self._tokens[self._prefix_offset:self._read_offset])
        return new_text[len(prefix_text):]

    def _decode_remainder(self) -> str:
        """At the end: whatever the not-yet-read tokens decode to, partial bytes included."""
        if self._bytes is not None:
            rest = _utf8_decode(self._pending, "replace", True)[0]
            return rest[1:] if self._skip_first_char else rest
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._tokens)
        return new_text[len(prefix_text):]

    # ------------------------------------------------------------ stop strings

    def _check_stop(self, old_len: int) -> str | None:
        """Find a stop string ending in the text added since ``old_len``.

        Earlier text held no match (else we had stopped), so only matches that
        end in the new part count; among them the earliest start wins."""
        best_at, best_stop = -1, None
        for stop in self._stops:
            at = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if at != -1 and (best_stop is None or at < best_at):
                best_at, best_stop = at, stop
        if best_stop is None:
            return None
        end = best_at + len(best_stop) if self._params.include_stop_str_in_output else best_at
        self._text = self._text[:end]
        self._stopped = True
        return best_stop

    def _holdback_start(self) -> int:
        """Where the tail that could still begin a stop string starts (len(text) if none).

        A future match must start at some i where text[i:] is a prefix of a
        stop string; the earliest such i bounds what is safe to release."""
        n = len(self._text)
        if not self._stops:
            return n
        for i in range(max(self._released, n - self._max_stop_len + 1), n):
            tail = self._text[i:]
            if any(stop.startswith(tail) for stop in self._stops):
                return i
        return n
