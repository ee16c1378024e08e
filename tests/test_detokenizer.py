"""Streaming detokenization: deltas never split a character and add up to the full decode, whether the
tokenizer's text streams as joined bytes (byte-level BPE) or through a decoding window (any tokenizer)."""

from pathlib import Path

import gguf
import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from jserve.tokenizer import IncrementalDetokenizer, Tokenizer, incremental_detokenizer
from jserve.tokenizer.detokenizer import ByteStream, DecodeWindow

STREAMED_TEXTS = [
    "Hello, world! The café serves crème brûlée.",
    "emoji 🙂🚀 and a family 👨‍👩‍👧 and flags 🇫🇷🇯🇵",
    "日本語のテキスト、中文句子，한국어 문장.",
    "Ångström, naïve, façade, Øresund, ßtraße",
    "  spaced\n\n\tout  text  ",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(smollm2_gguf_path))


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A tiny Llama-style SentencePiece model with byte fallback, so rare characters come out as bytes."""
    folder = tmp_path_factory.mktemp("sentencepiece")
    (folder / "corpus.txt").write_text("\n".join(["Hello world, the quick brown fox.", "Café naïve 日本"] * 50))
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["<|im_end|>"],
        minloglevel=2,
    )
    return Tokenizer.from_folder(folder)


def _byte_level_tokenizer(folder: Path, added: list[str]) -> Tokenizer:
    """A tiny byte-level BPE tokenizer.json with a special token and these plain added tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    model = HFTokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"]
    )
    model.train_from_iterator(["Hello world, café naïve 日本 🙂"] * 20, trainer)
    model.add_tokens(added)
    model.save(str(folder / "tokenizer.json"))
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def byte_level_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return _byte_level_tokenizer(tmp_path_factory.mktemp("byte_level"), ["<tool>", " 日本語"])


# The streaming each tokenizer gets, and the window every tokenizer can use.
STREAMS = {
    "smollm2_tokenizer": ByteStream,
    "byte_level_tokenizer": ByteStream,
    "sentencepiece_tokenizer": DecodeWindow,
}
DETOKENIZERS = {"chosen": incremental_detokenizer, "window": DecodeWindow}


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add(token_id) for token_id in ids] + [detokenizer.flush()]


@pytest.mark.parametrize("tokenizer_name", STREAMS)
def test_each_tokenizer_streams_the_expected_way(tokenizer_name: str, request: pytest.FixtureRequest) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(tokenizer_name)
    for skip_special_tokens in (True, False):
        detokenizer = incremental_detokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        assert type(detokenizer) is STREAMS[tokenizer_name]


def test_added_token_that_is_not_whole_characters_falls_back_to_the_window(tmp_path: Path) -> None:
    # A byte-level decoder reads an added token's text through its byte table too: "é" is byte 0xE9 there,
    # so "café" alone decodes to "caf\ufffd", and joining bytes would not reproduce what it does next to others.
    tokenizer = _byte_level_tokenizer(tmp_path, ["café"])
    assert tokenizer.decode([tokenizer.token_to_id("café")]) == "caf\ufffd"
    assert type(incremental_detokenizer(tokenizer)) is DecodeWindow


@pytest.mark.parametrize("text", STREAMED_TEXTS)
@pytest.mark.parametrize("tokenizer_name", ["smollm2_tokenizer", "sentencepiece_tokenizer"])
@pytest.mark.parametrize("detokenizer", DETOKENIZERS)
def test_streamed_text_is_whole_characters(
    tokenizer_name: str, text: str, detokenizer: str, request: pytest.FixtureRequest
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(tokenizer_name)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(DETOKENIZERS[detokenizer](tokenizer), ids)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("detokenizer", DETOKENIZERS)
def test_incomplete_character_is_held_back(smollm2_tokenizer: Tokenizer, detokenizer: str) -> None:
    # "🙂" is F0 9F 99 82; byte-level BPE spells those bytes "ðŁĻĤ", one token each.
    byte_ids = [smollm2_tokenizer.token_to_id(byte) for byte in "ðŁĻĤ"]
    detokenizer = DETOKENIZERS[detokenizer](smollm2_tokenizer)
    assert [detokenizer.add(token_id) for token_id in byte_ids] == ["", "", "", "🙂"]
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("detokenizer", DETOKENIZERS)
def test_invalid_bytes_come_out_on_flush(smollm2_tokenizer: Tokenizer, detokenizer: str) -> None:
    detokenizer = DETOKENIZERS[detokenizer](smollm2_tokenizer)
    assert "".join(map(detokenizer.add, smollm2_tokenizer.encode("ok", add_special_tokens=False))) == "ok"
    assert detokenizer.add(smollm2_tokenizer.token_to_id("ð")) == ""  # could still become a character
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("detokenizer", DETOKENIZERS)
def test_special_tokens_are_skipped_or_kept(smollm2_tokenizer: Tokenizer, detokenizer: str) -> None:
    ids = smollm2_tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(DETOKENIZERS[detokenizer](smollm2_tokenizer), ids)) == "hi"
    kept = DETOKENIZERS[detokenizer](smollm2_tokenizer, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "hi<|im_end|>"


def test_prompt_gives_first_token_its_space(sentencepiece_tokenizer: Tokenizer) -> None:
    # Decoded alone, "▁world" loses its leading space; after a prompt it keeps it.
    prompt = sentencepiece_tokenizer.encode("Hello")
    output = sentencepiece_tokenizer.encode(" world, the fox", add_special_tokens=False)[1:]
    assert sentencepiece_tokenizer.convert_ids_to_tokens(output)[0].startswith("▁")
    deltas = stream(incremental_detokenizer(sentencepiece_tokenizer, prompt_ids=prompt), output)
    assert "".join(deltas) == " world, the fox"
    assert sentencepiece_tokenizer.decode(output) == "world, the fox"


def _assert_stream_equals_decode(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> None:
    for make in DETOKENIZERS.values():
        deltas = stream(make(tokenizer, skip_special_tokens=skip_special_tokens), ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@settings(max_examples=50, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_random_smollm2_ids_stream_to_their_decode(
    smollm2_tokenizer: Tokenizer, data: st.DataObject, skip_special_tokens: bool
) -> None:
    # Low ids are the special tokens; mixing them in exercises skipping.
    token_id = st.one_of(st.integers(0, smollm2_tokenizer.vocab_size - 1), st.integers(0, 300))
    ids = data.draw(st.lists(token_id, max_size=40))
    _assert_stream_equals_decode(smollm2_tokenizer, ids, skip_special_tokens)


@settings(max_examples=50, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_random_sentencepiece_ids_stream_to_their_decode(
    sentencepiece_tokenizer: Tokenizer, data: st.DataObject, skip_special_tokens: bool
) -> None:
    ids = data.draw(st.lists(st.integers(0, sentencepiece_tokenizer.vocab_size - 1), max_size=40))
    _assert_stream_equals_decode(sentencepiece_tokenizer, ids, skip_special_tokens)


@settings(max_examples=50, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_random_byte_level_ids_stream_to_their_decode(
    byte_level_tokenizer: Tokenizer, data: st.DataObject, skip_special_tokens: bool
) -> None:
    # Ids past the vocabulary (a model's padded one) have no text either way.
    ids = data.draw(st.lists(st.integers(0, byte_level_tokenizer.vocab_size + 3), max_size=40))
    _assert_stream_equals_decode(byte_level_tokenizer, ids, skip_special_tokens)
