"""TextStream's three ways to decode give the text of a whole decode: the
byte table (byte-level BPE), ``tokenizers``' DecodeStream (here also on a
Metaspace, SentencePiece-style tokenizer whose lone-token decode drops the
leading space), and the window both fall back to. On a trained byte-level
BPE with merges, added and special tokens, the table agrees with the
tokenizer's decode of random sequences, with and without special tokens."""

from __future__ import annotations

import random

import pytest
import transformers

from fluidserve.engine.detokenizer import TextStream, byte_table
from fluidserve.engine.sampling_params import SamplingParams
from fluidserve.engine.tiny_model import save_byte_tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["▁Hello", "▁world", "▁how", "▁are", "▁you", "!", "?", "▁", "<unk>", "</s>"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["</s>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


PATHS = ("table", "stream", "window")


def run(tokenizer, prompt: list[int], outputs: list[int], params: SamplingParams, path: str = "table") -> str:
    stream = TextStream(tokenizer, prompt, params)
    if path != "table" and stream._bytes is not None:  # as built for a tokenizer without a table
        stream._bytes, stream._pending = None, b""
        stream._decode_stream = stream._make_decode_stream(stream._tokens)
    if path == "window":
        stream._decode_stream = None
    chunks = []
    for tok in outputs:
        stream.append(tok)
        chunks.append(stream.flush(finished=False))
    chunks.append(stream.flush(finished=True))
    assert "".join(chunks) == stream.text
    return stream.text


def test_which_path_a_stream_takes(byte_tokenizer, metaspace_tokenizer):
    plain = TextStream(byte_tokenizer, list(b"Q: "), SamplingParams())
    assert plain._bytes is not None and plain._decode_stream is None
    spaced = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=True)
    spaced_stream = TextStream(byte_tokenizer, list(b"Q: "), spaced)  # specials decode run by run: the window
    assert spaced_stream._bytes is None and spaced_stream._decode_stream is None
    split = TextStream(byte_tokenizer, list("Q: é".encode())[:-1], SamplingParams())  # ends inside a character
    assert split._bytes is not None and split._pending == "é".encode()[:1]
    meta = TextStream(metaspace_tokenizer, [0], SamplingParams())
    assert meta._bytes is None and meta._decode_stream is not None


def test_random_bytes_match_a_whole_decode_on_every_path(byte_tokenizer):
    rng = random.Random(0)
    for _ in range(30):
        text = "".join(rng.choice(["a", "é", "你", "🙂", " ", "\n", "z"]) for _ in range(rng.randint(1, 12)))
        ids = list(text.encode())
        cut = rng.randint(0, len(ids))
        ids = ids[:cut] + [rng.randint(0, 255) for _ in range(rng.randint(0, 3))]  # maybe invalid UTF-8
        expected = byte_tokenizer.decode(ids)
        for path in PATHS:
            assert run(byte_tokenizer, list(b"Q:"), ids, SamplingParams(), path) == expected, path


def test_a_prompt_that_ends_inside_a_character(byte_tokenizer):
    """The prompt's last bytes start a character the output may finish: every
    path gives the window's text (the joined character is dropped: the
    prompt's own decode showed U+FFFD in its place), whatever follows."""
    rng = random.Random(2)
    for _ in range(40):
        prompt = list("Q: ".encode()) + list(rng.choice(["é", "你", "🙂"]).encode())[:rng.randint(1, 2)]
        text = "".join(rng.choice(["a", "é", "你", "🙂", " "]) for _ in range(rng.randint(0, 6)))
        ids = [rng.randint(0x80, 0xBF) for _ in range(rng.randint(0, 3))] + list(text.encode())
        ids = ids[:rng.randint(0, len(ids))]
        window = run(byte_tokenizer, prompt, ids, SamplingParams(), "window")
        assert run(byte_tokenizer, prompt, ids, SamplingParams(), "table") == window


def test_metaspace_keeps_the_space_a_lone_decode_drops(metaspace_tokenizer):
    tok = metaspace_tokenizer
    prompt = tok.convert_tokens_to_ids(["▁Hello"])
    out = tok.convert_tokens_to_ids(["▁how", "▁are", "▁you", "?"])
    assert tok.decode(out[:1]) == "how"  # alone, the leading space is gone
    assert run(tok, prompt, out, SamplingParams()) == " how are you?"
    assert run(tok, prompt, out, SamplingParams(), "window") == " how are you?"
    eos = tok.convert_tokens_to_ids("</s>")
    assert run(tok, prompt, out + [eos], SamplingParams(skip_special_tokens=False)).endswith("?</s>")
    assert run(tok, prompt, out + [eos], SamplingParams()) == " how are you?"


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A byte-level BPE trained here on text with multi-byte characters (so
    some tokens hold pieces of a character), with special tokens and two
    added ones, one spelled outside the byte alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ["héllo wörld, naïve café 你好世界 🙂🙃 über straße", "the cat sat on the mat — ça va? 日本語のテキスト",
              "emoji 🚀🔥 and math ∑∫√ and ßüöä", "plain ascii words repeated words words"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(["<tool_call>", "<工具>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


@pytest.mark.parametrize("skip_special", [True, False])
def test_byte_table_agrees_with_the_tokenizers_decode(bpe_tokenizer, skip_special):
    tok = bpe_tokenizer
    table = byte_table(tok, skip_special)
    assert table is not None and len(table.pieces) == len(tok)
    assert any(b and t is None for b, t in zip(table.pieces, table.texts))  # pieces of a character
    params = SamplingParams(skip_special_tokens=skip_special, spaces_between_special_tokens=False)
    rng = random.Random(1)
    special = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<tool_call>", "<工具>"])
    prompt = tok.encode("Q: héllo")
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.15 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 20))]
        expected = tok.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)
        assert run(tok, prompt, ids, params) == expected
        assert run(tok, prompt, ids, params, "window") == expected


def test_a_stop_string_across_tokens_on_the_table_path(bpe_tokenizer):
    tok = bpe_tokenizer
    ids = tok.encode("the cat sat on the mat")
    params = SamplingParams(stop=["sat on"], include_stop_str_in_output=True)
    stream = TextStream(tok, tok.encode("Q: "), params)
    assert stream._bytes is not None
    matched = next(s for s in map(stream.append, ids) if s is not None)
    assert matched == "sat on" and stream.text == "the cat sat on" and stream.flush(finished=True) == stream.text


def test_a_table_that_disagrees_is_not_used(byte_tokenizer, monkeypatch):
    """Each entry is checked against the tokenizer's own decode: a wrong
    alphabet (two bytes swapped) gives no table, and the stream decodes by
    DecodeStream instead, with the right text."""
    from fluidserve.engine import detokenizer

    right = detokenizer.byte_level_alphabet()
    swapped = dict(right)
    swapped["a"], swapped["b"] = right["b"], right["a"]
    monkeypatch.setattr(detokenizer, "byte_level_alphabet", lambda: swapped)
    monkeypatch.setattr(detokenizer, "_TABLES", detokenizer.weakref.WeakKeyDictionary())
    assert byte_table(byte_tokenizer, True) is None
    stream = TextStream(byte_tokenizer, list(b"Q: "), SamplingParams())
    assert stream._bytes is None and stream._decode_stream is not None
    assert run(byte_tokenizer, list(b"Q: "), list(b"abc"), SamplingParams()) == "abc"
