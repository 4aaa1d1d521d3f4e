"""TextStream tests on the byte-level tokenizer: one token per UTF-8 byte, so
every multi-byte character is split across tokens."""

from __future__ import annotations

import random

import pytest
import transformers

from fluidserve.engine.detokenizer import TextStream
from fluidserve.engine.sampling_params import SamplingParams
from fluidserve.engine.tiny_model import save_byte_tokenizer

EOS = 257
PROMPT = list("Q: say it\nA:".encode())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))  # the byte tokenizer's id of a byte is the byte


def stream_all(stream: TextStream, token_ids: list[int], flush_every: int = 1) -> tuple[list[str], str | None]:
    """Append tokens, flushing every ``flush_every`` tokens; stop at a stop string."""
    chunks: list[str] = []
    stop = None
    for i, tok in enumerate(token_ids, start=1):
        stop = stream.append(tok)
        if stop is not None:
            break
        if i % flush_every == 0:
            chunks.append(stream.flush(finished=False))
    chunks.append(stream.flush(finished=True))
    assert "".join(chunks) == stream.text  # the streaming contract, checked everywhere
    return chunks, stop


# ---------------------------------------------------------------- UTF-8


def test_multibyte_byte_by_byte(tokenizer) -> None:
    text = "héllo wörld 你好 🙂"
    tokens = byte_ids(text)
    assert tokenizer.encode(text, add_special_tokens=False) == tokens
    stream = TextStream(tokenizer, PROMPT, SamplingParams())
    chunks, stop = stream_all(stream, tokens)
    assert stop is None
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == stream.text == tokenizer.decode(tokens) == text
    # Each character comes out as soon as its last byte is in, never earlier.
    assert [c for c in chunks if c] == list(text)


def test_character_released_only_when_complete(tokenizer) -> None:
    stream = TextStream(tokenizer, PROMPT, SamplingParams())
    first, second, third = byte_ids("你")
    for tok in (first, second):
        stream.append(tok)
        assert stream.flush(finished=False) == ""
        assert stream.text == ""
    stream.append(third)
    assert stream.flush(finished=False) == "你"


def test_partial_character_at_the_end_is_released_as_decode_does(tokenizer) -> None:
    tokens = byte_ids("ok你")[:-1]  # generation cut inside the last character
    stream = TextStream(tokenizer, PROMPT, SamplingParams())
    chunks, _ = stream_all(stream, tokens)
    assert chunks[-1] == "\ufffd"
    assert stream.text == tokenizer.decode(tokens) == "ok\ufffd"


def test_invalid_bytes_mid_stream_match_decode(tokenizer) -> None:
    tokens = [0xBD] + byte_ids("A") + [0xE4] + byte_ids("b")  # stray continuation, broken lead
    stream = TextStream(tokenizer, PROMPT, SamplingParams())
    stream_all(stream, tokens)
    assert stream.text == tokenizer.decode(tokens)


def test_prompt_not_in_output_even_when_it_ends_mid_character(tokenizer) -> None:
    prompt = PROMPT + byte_ids("你")[:2]  # odd, but the stream must not choke on it
    stream = TextStream(tokenizer, prompt, SamplingParams())
    stream_all(stream, byte_ids("xyz"))
    assert stream.text == "xyz"


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    tokens = byte_ids("hi") + [EOS]
    skip = TextStream(tokenizer, PROMPT, SamplingParams())
    stream_all(skip, tokens)
    assert skip.text == "hi"
    keep = TextStream(tokenizer, PROMPT, SamplingParams(skip_special_tokens=False))
    stream_all(keep, tokens)
    assert keep.text == "hi<|eos|>"


def test_decode_token(tokenizer) -> None:
    stream = TextStream(tokenizer, PROMPT, SamplingParams())
    assert stream.decode_token(ord("a")) == "a"
    assert stream.decode_token(EOS) == "<|eos|>"
    assert stream.decode_token(0xE4) == "\ufffd"  # a lone lead byte


# ---------------------------------------------------------------- stop strings


def test_stop_string_across_tokens(tokenizer) -> None:
    stream = TextStream(tokenizer, PROMPT, SamplingParams(stop=["o w"]))
    chunks, stop = stream_all(stream, byte_ids("Hello world. Bye"))
    assert stop == "o w" and stream.stopped
    assert stream.text == "Hell"
    assert stream.append(ord("x")) is None and stream.text == "Hell"  # no more tokens taken


def test_include_stop_str_in_output(tokenizer) -> None:
    stream = TextStream(tokenizer, PROMPT, SamplingParams(stop=["o w"], include_stop_str_in_output=True))
    _, stop = stream_all(stream, byte_ids("Hello world. Bye"))
    assert stop == "o w" and stream.text == "Hello w"


def test_multibyte_stop_string(tokenizer) -> None:
    stream = TextStream(tokenizer, PROMPT, SamplingParams(stop=["你好"]))
    chunks, stop = stream_all(stream, byte_ids("a 你好 b"))
    assert stop == "你好" and stream.text == "a "
    assert not any("\ufffd" in c for c in chunks)


def test_holdback_until_disambiguated(tokenizer) -> None:
    stream = TextStream(tokenizer, PROMPT, SamplingParams(stop=["STOP"]))
    for tok in byte_ids("abcST"):
        assert stream.append(tok) is None
    assert stream.flush(finished=False) == "abc"  # "ST" might begin "STOP"
    stream.append(ord("O"))
    assert stream.flush(finished=False) == ""  # "STO" still might
    stream.append(ord("x"))
    assert stream.flush(finished=False) == "STOx"  # "STOx" cannot
    for tok in byte_ids("ySTOP"):
        stop = stream.append(tok)
    assert stop == "STOP"
    assert stream.flush(finished=False) == "y"  # stopped: the rest is final
    assert stream.flush(finished=True) == ""
    assert stream.text == "abcSTOxy"


def test_holdback_releases_on_finish(tokenizer) -> None:
    stream = TextStream(tokenizer, PROMPT, SamplingParams(stop=["STOP"]))
    for tok in byte_ids("abST"):
        stream.append(tok)
    assert stream.flush(finished=False) == "ab"
    assert stream.flush(finished=True) == "ST"  # length-limited: the held tail is final


def test_holdback_overlapping_prefixes(tokenizer) -> None:
    # "aab" with stop "ab": after "aa" only the last "a" may start a match.
    stream = TextStream(tokenizer, PROMPT, SamplingParams(stop=["ab", "xyz"]))
    for tok in byte_ids("xaa"):
        stream.append(tok)
    assert stream.flush(finished=False) == "xa"
    assert stream.append(ord("b")) == "ab"
    assert stream.flush(finished=True) == ""
    assert stream.text == "xa"


def test_earliest_match_wins_within_one_token(tokenizer) -> None:
    # "<|eos|>" arrives as one token (7 characters at once): both stops end in it.
    for stops in (["eos", "<|e"], ["<|e", "eos"]):
        stream = TextStream(tokenizer, PROMPT, SamplingParams(stop=stops, skip_special_tokens=False))
        _, stop = stream_all(stream, byte_ids("hi") + [EOS])
        assert stop == "<|e" and stream.text == "hi"


def test_first_completed_stop_wins_across_tokens(tokenizer) -> None:
    stream = TextStream(tokenizer, PROMPT, SamplingParams(stop=["world", "o w"]))
    _, stop = stream_all(stream, byte_ids("hello world"))
    assert stop == "o w" and stream.text == "hell"


def test_stop_strings_wait_for_min_tokens(tokenizer) -> None:
    stream = TextStream(tokenizer, PROMPT, SamplingParams(stop=["a"], min_tokens=3, max_tokens=10))
    _, stop = stream_all(stream, byte_ids("aaaa"))
    assert stop == "a" and stream.text == "aa"  # the third token is the first that may stop


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Single-character tokens: the stop whose first occurrence ends first wins
    (ties: the one starting earlier)."""
    best = None
    for s in stops:
        at = text.find(s)
        if at != -1:
            key = (at + len(s), at)
            if best is None or key < best[0]:
                best = (key, s)
    if best is None:
        return text, None
    (end, at), s = best
    return text[: end if include else at], s


def test_streaming_randomised_against_reference(tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab¢") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("ab¢") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3))]
        include = rng.random() < 0.5
        stream = TextStream(tokenizer, PROMPT, SamplingParams(stop=stops, include_stop_str_in_output=include))
        released = ""
        stop = None
        for tok in byte_ids(text):
            stop = stream.append(tok)
            assert stream.text.startswith(released)  # released text is never retracted
            if stop is not None:
                break
            if rng.random() < 0.5:
                released += stream.flush(finished=False)
                assert "\ufffd" not in released
        released += stream.flush(finished=True)
        assert (stream.text, stop) == _reference(text, stops, include), (text, stops)
        assert released == stream.text
