"""Tokenizer tests: ids, decoding, BOS rules and chat templates against references.

References are transformers and the raw `tokenizers`/`sentencepiece` libraries.
Small tokenizers are trained inside the tests; SmolLM2 comes from its GGUF.
"""

import json
import logging
from pathlib import Path

import gguf
import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_model
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from jserve.errors import ModelLoadError
from jserve.tokenizer import Tokenizer

from texts import CONVERSATIONS, PLAIN_TEXTS

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you doing today?",
    "Tokenizers split text into pieces; numbers like 12345 too.",
    "Café, naïve, résumé: accents matter.",
    "日本語のテキストも少し。",
    "Streaming detokenization must never emit broken characters.",
]


def train_byte_level_bpe(post_processor: processors.PostProcessor | None) -> HFTokenizer:
    model = HFTokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    model.train_from_iterator(CORPUS * 20, trainer)
    model.post_processor = post_processor
    return model


def train_sentencepiece(folder: Path) -> Path:
    """A tiny Llama-style model: BPE, byte fallback, no text normalisation."""
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "tiny"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )
    return folder / "tiny.model"


def write_config(folder: Path, **config) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def write_sentencepiece_gguf(path: Path, model_file: Path, **tokenizer_keys) -> None:
    proto = sp_model.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(tokenizer_keys.pop("model", "llama"))
    writer.add_token_list([piece.piece for piece in proto.pieces])
    writer.add_token_scores([piece.score for piece in proto.pieces])
    writer.add_token_types([int(piece.type) for piece in proto.pieces])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if "add_bos_token" in tokenizer_keys:
        writer.add_add_bos_token(tokenizer_keys.pop("add_bos_token"))
    if "add_space_prefix" in tokenizer_keys:
        writer.add_add_space_prefix(tokenizer_keys.pop("add_space_prefix"))
    assert not tokenizer_keys, f"unhandled keys {tokenizer_keys}"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- Hugging Face folders ---------------------------------------------------------------------


@pytest.fixture
def bpe_folder(tmp_path: Path) -> Path:
    bos_first = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    train_byte_level_bpe(bos_first).save(str(tmp_path / "tokenizer.json"))
    write_config(tmp_path, bos_token="<s>", eos_token="</s>", chat_template=CHATML_TEMPLATE)
    return tmp_path


@pytest.mark.parametrize("text", [*PLAIN_TEXTS, "<|im_start|>user\nhi<|im_end|>"])
def test_bpe_folder_matches_transformers(bpe_folder: Path, text: str) -> None:
    ours, reference = Tokenizer.from_folder(bpe_folder), AutoTokenizer.from_pretrained(bpe_folder)
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ids[0] == ours.bos_token_id == 0
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids[1:], skip_special_tokens=False) == text


def test_bpe_folder_chat_template(bpe_folder: Path) -> None:
    ours, reference = Tokenizer.from_folder(bpe_folder), AutoTokenizer.from_pretrained(bpe_folder)
    for conversation in CONVERSATIONS.values():
        expected = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(conversation) == expected


def test_encode_chat_gives_the_ids_transformers_gives(bpe_folder: Path) -> None:
    """The template's text, encoded without special tokens: the template writes any BOS itself."""
    ours, reference = Tokenizer.from_folder(bpe_folder), AutoTokenizer.from_pretrained(bpe_folder)

    def reference_ids(conversation, add_generation_prompt):
        return reference.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
        )["input_ids"]

    for conversation in CONVERSATIONS.values():
        text, ids = ours.encode_chat(conversation)
        assert text == ours.apply_chat_template(conversation)
        assert ids == reference_ids(conversation, True) and ids != ours.encode(text)  # encode adds a BOS
    _, ids = ours.encode_chat(CONVERSATIONS["multi turn"], add_generation_prompt=False)
    assert ids == reference_ids(CONVERSATIONS["multi turn"], False)


def test_chat_template_file_takes_precedence(bpe_folder: Path) -> None:
    (bpe_folder / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}", encoding="utf-8")
    assert Tokenizer.from_folder(bpe_folder).apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi"


def test_post_processor_decides_bos_over_config(tmp_path: Path) -> None:
    # tokenizer.json adds no BOS; transformers ignores the config's flags when it has a tokenizer.json.
    train_byte_level_bpe(post_processor=None).save(str(tmp_path / "tokenizer.json"))
    write_config(tmp_path, bos_token="<s>", eos_token="</s>", add_bos_token=True, add_eos_token=True)
    ours, reference = Tokenizer.from_folder(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    ids = ours.encode("Hello world")
    assert ids == reference.encode("Hello world")
    assert ids == ours.encode("Hello world", add_special_tokens=False)
    assert ours.bos_token_id not in ids and ours.eos_token_id not in ids


def test_special_tokens_map_names_special_tokens(tmp_path: Path) -> None:
    train_byte_level_bpe(post_processor=None).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert Tokenizer.from_folder(tmp_path).eos_token_id == 3


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("sentencepiece"))


@pytest.fixture
def sentencepiece_folder(tmp_path: Path, sentencepiece_model: Path) -> Path:
    (tmp_path / "tokenizer.model").write_bytes(sentencepiece_model.read_bytes())
    write_config(
        tmp_path,
        tokenizer_class="LlamaTokenizer",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        add_bos_token=True,
        chat_template=CHATML_TEMPLATE,
    )
    return tmp_path


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_sentencepiece_folder_matches_sentencepiece(
    sentencepiece_folder: Path, sentencepiece_model: Path, text: str
) -> None:
    ours = Tokenizer.from_folder(sentencepiece_folder)
    processor = spm.SentencePieceProcessor(model_file=str(sentencepiece_model))
    ids = ours.encode(text)
    assert ids == [processor.bos_id(), *processor.encode(text)]
    assert ours.decode(ids) == processor.decode(ids) == text


@pytest.mark.parametrize("text", [t for t in PLAIN_TEXTS if t and not t[0].isspace()])
def test_sentencepiece_folder_matches_transformers(sentencepiece_folder: Path, text: str) -> None:
    # transformers' converted Llama tokenizer drops SentencePiece's extra "▁" before
    # text that already starts with a space, so such texts are compared above only.
    ours, reference = Tokenizer.from_folder(sentencepiece_folder), AutoTokenizer.from_pretrained(sentencepiece_folder)
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_sentencepiece_folder_special_tokens(sentencepiece_folder: Path) -> None:
    ours = Tokenizer.from_folder(sentencepiece_folder)
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.pad_token_id) == (1, 2, 0, None)
    assert ours.all_special_ids == [0, 1, 2]
    start, end = ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")
    ids = ours.encode("<|im_start|>user\nhi<|im_end|></s>", add_special_tokens=False)
    assert (ids[0], ids[-2], ids[-1]) == (start, end, 2)
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|></s>"
    assert ours.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sentencepiece_folder_add_bos_token_false(sentencepiece_folder: Path) -> None:
    write_config(sentencepiece_folder, add_bos_token=False, add_eos_token=True)
    ids = Tokenizer.from_folder(sentencepiece_folder).encode("Hello world")
    assert ids[0] != 1 and ids[-1] == 2


def test_sentencepiece_added_tokens_past_the_model(sentencepiece_folder: Path) -> None:
    added = {"400": {"content": "<tool_call>", "special": False}, "401": {"content": "<|eot|>", "special": True}}
    write_config(sentencepiece_folder, bos_token="<s>", added_tokens_decoder=added)
    ours = Tokenizer.from_folder(sentencepiece_folder)
    assert ours.vocab_size == 402
    ids = ours.encode("a<tool_call>b<|eot|>", add_special_tokens=False)
    assert ids[-1] == 401 and 400 in ids
    assert ours.decode(ids) == "a<tool_call>b"
    assert ours.decode(ids, skip_special_tokens=False) == "a<tool_call>b<|eot|>"


def test_sentencepiece_save_round_trip(sentencepiece_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    original = Tokenizer.from_folder(sentencepiece_folder)
    saved = tmp_path_factory.mktemp("saved")
    original.save(saved)
    reloaded = Tokenizer.from_folder(saved)
    for text in [*PLAIN_TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        assert reloaded.encode(text) == original.encode(text)
    assert reloaded.apply_chat_template(CONVERSATIONS["multi turn"]) == original.apply_chat_template(
        CONVERSATIONS["multi turn"]
    )


# --- GGUF with a SentencePiece vocabulary -----------------------------------------------------


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_sentencepiece_gguf_matches_sentencepiece(sentencepiece_model: Path, tmp_path: Path, text: str) -> None:
    # No add_bos_token key: llama.cpp adds BOS to SentencePiece vocabularies by default.
    write_sentencepiece_gguf(tmp_path / "tiny.gguf", sentencepiece_model)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "tiny.gguf"))
    processor = spm.SentencePieceProcessor(model_file=str(sentencepiece_model))
    ids = ours.encode(text)
    assert ids == [processor.bos_id(), *processor.encode(text)]
    assert ours.decode(ids) == processor.decode(ids) == text


def test_sentencepiece_gguf_flags(sentencepiece_model: Path, tmp_path: Path) -> None:
    write_sentencepiece_gguf(tmp_path / "tiny.gguf", sentencepiece_model, add_bos_token=False, add_space_prefix=False)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "tiny.gguf"))
    ids = ours.encode("Hello world")
    assert ids[0] != 1
    assert ours.convert_ids_to_tokens(ids)[0] == "H"  # no "▁" prefix without add_space_prefix
    assert ours.decode(ids) == "Hello world"


def test_sentencepiece_gguf_save_round_trip(sentencepiece_model: Path, tmp_path: Path) -> None:
    write_sentencepiece_gguf(tmp_path / "tiny.gguf", sentencepiece_model)
    original = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "tiny.gguf"))
    original.save(tmp_path / "saved")
    reloaded = Tokenizer.from_folder(tmp_path / "saved")
    for text in [*PLAIN_TEXTS, "<|im_start|>user\nhi<|im_end|></s>"]:
        assert reloaded.encode(text) == original.encode(text)
        assert reloaded.decode(original.encode(text)) == original.decode(original.encode(text))


# --- Bad input --------------------------------------------------------------------------------


def test_unsupported_gguf_tokenizer_model(sentencepiece_model: Path, tmp_path: Path) -> None:
    write_sentencepiece_gguf(tmp_path / "odd.gguf", sentencepiece_model, model="rwkv")
    with pytest.raises(ModelLoadError, match=r"'rwkv'.*gpt2, llama"):
        Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "odd.gguf"))


def write_byte_level_gguf(path: Path, pre: str, tokens: list[str], token_types: list[int], merges: list[str]) -> None:
    writer = gguf.GGUFWriter(str(path), arch="gpt2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<eos>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_gguf_pre_tokenizer_falls_back_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_byte_level_gguf(tmp_path / "bpe.gguf", "made-up", ["a", "b", "ab", "Ġ", "<eos>"], [1, 1, 1, 1, 3], ["a b"])
    with caplog.at_level(logging.WARNING):
        ours = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "bpe.gguf"))
    assert "made-up" in caplog.text
    assert ours.encode("ab ab<eos>") == [2, 3, 2, 4]
    assert ours.decode([2, 3, 2, 4]) == "ab ab"


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        ("gpt2", ["123456"]),  # GPT-2 keeps a run of digits together
        ("llama-bpe", ["123", "456"]),  # Llama 3 cuts digits into groups of up to three
        ("qwen2", ["1", "2", "3", "4", "5", "6"]),  # Qwen2 splits digits one by one
        ("smollm", ["1", "2", "3", "4", "5", "6"]),
    ],
)
def test_gguf_pre_tokenizer_splits_digits(tmp_path: Path, pre: str, expected: list[str]) -> None:
    tokens = ["1", "2", "3", "4", "5", "6", "12", "123", "45", "456", "123456", "<eos>"]
    merges = ["1 2", "12 3", "4 5", "45 6", "123 456"]
    write_byte_level_gguf(tmp_path / "bpe.gguf", pre, tokens, [1] * 11 + [3], merges)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "bpe.gguf"))
    assert ours.convert_ids_to_tokens(ours.encode("123456")) == expected


def test_gguf_token_stored_as_plain_text_is_respelled(tmp_path: Path) -> None:
    # "日" is bytes E6 97 A5, spelled "æĹ¥" in the byte alphabet; this file stores it as "日".
    tokens = ["æ", "Ĺ", "¥", "æĹ", "日", "<eos>"]
    write_byte_level_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, [1, 1, 1, 1, 1, 3], ["æ Ĺ", "æĹ ¥"])
    ours = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "bpe.gguf"))
    assert ours.encode("日日") == [4, 4]
    assert ours.decode([4, 4]) == "日日"


def test_folder_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=rf"{tmp_path}.*tokenizer\.json.*tokenizer\.model"):
        Tokenizer.from_folder(tmp_path)


def test_corrupt_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ', encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)


def test_corrupt_tokenizer_config(bpe_folder: Path) -> None:
    (bpe_folder / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_folder(bpe_folder)


def test_corrupt_sentencepiece_model(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"\xff\xfe not a protobuf")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.model"):
        Tokenizer.from_folder(tmp_path)


def test_missing_chat_template(tmp_path: Path) -> None:
    train_byte_level_bpe(post_processor=None).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_folder(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


# --- Chat template environment ----------------------------------------------------------------


def test_chat_template_environment(bpe_folder: Path) -> None:
    template = (
        "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{% for m in messages %}{% if m.content is defined %}{{ m.content }}{% endif %}"
        "{{ m.extra | tojson }}{% endfor %}{{ tools | tojson(indent=1) }}{{ eos_token }}{{ thinking }}"
    )
    (bpe_folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    ours = Tokenizer.from_folder(bpe_folder)
    messages = [{"role": "user", "content": None, "extra": {"é": "<b>"}}]
    rendered = ours.apply_chat_template(messages, tools=[{"x": 1}], thinking=False)
    # content None is dropped; tojson keeps non-ASCII and HTML characters as they are.
    assert rendered == '{"é": "<b>"}[\n {\n  "x": 1\n }\n]</s>False'
    with pytest.raises(ValueError, match="the chat template cannot render these messages: no tools here"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
