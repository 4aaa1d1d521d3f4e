"""TextStream over ``tokenizers``' DecodeStream: the same text as a whole
decode, on the byte-level tokenizer and on a Metaspace (SentencePiece-style)
one whose lone-token decode drops the leading space; and the window path it
falls back to gives the same text."""

from __future__ import annotations

import random

import pytest
import transformers

from fluidserve.engine.detokenizer import TextStream
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


def run(tokenizer, prompt: list[int], outputs: list[int], params: SamplingParams, window: bool = False) -> str:
    stream = TextStream(tokenizer, prompt, params)
    if window:
        stream._decode_stream = None
    chunks = []
    for tok in outputs:
        stream.append(tok)
        chunks.append(stream.flush(finished=False))
    chunks.append(stream.flush(finished=True))
    assert "".join(chunks) == stream.text
    return stream.text


def test_decode_stream_is_used_for_fast_tokenizers(byte_tokenizer):
    assert TextStream(byte_tokenizer, list(b"Q: "), SamplingParams())._decode_stream is not None
    spaced = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=True)
    assert TextStream(byte_tokenizer, list(b"Q: "), spaced)._decode_stream is None


def test_random_bytes_match_a_whole_decode_on_both_paths(byte_tokenizer):
    rng = random.Random(0)
    for _ in range(30):
        text = "".join(rng.choice(["a", "é", "你", "🙂", " ", "\n", "z"]) for _ in range(rng.randint(1, 12)))
        ids = list(text.encode())
        cut = rng.randint(0, len(ids))
        ids = ids[:cut] + [rng.randint(0, 255) for _ in range(rng.randint(0, 3))]  # maybe invalid UTF-8
        expected = byte_tokenizer.decode(ids)
        assert run(byte_tokenizer, list(b"Q:"), ids, SamplingParams()) == expected
        assert run(byte_tokenizer, list(b"Q:"), ids, SamplingParams(), window=True) == expected


def test_metaspace_keeps_the_space_a_lone_decode_drops(metaspace_tokenizer):
    tok = metaspace_tokenizer
    prompt = tok.convert_tokens_to_ids(["▁Hello"])
    out = tok.convert_tokens_to_ids(["▁how", "▁are", "▁you", "?"])
    assert tok.decode(out[:1]) == "how"  # alone, the leading space is gone
    assert run(tok, prompt, out, SamplingParams()) == " how are you?"
    assert run(tok, prompt, out, SamplingParams(), window=True) == " how are you?"
    eos = tok.convert_tokens_to_ids("</s>")
    assert run(tok, prompt, out + [eos], SamplingParams(skip_special_tokens=False)).endswith("?</s>")
    assert run(tok, prompt, out + [eos], SamplingParams()) == " how are you?"
