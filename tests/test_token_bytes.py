"""Token bytes: what each vocabulary entry stands for, as the grammar engine sees it, for every way jserve
loads a tokenizer (tokenizer.json byte-level BPE, metaspace with byte fallback, tokenizer.model, GGUF)."""

import json
from pathlib import Path

import gguf
import llguidance as llg
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, trainers

from jserve.tokenizer import Tokenizer
from jserve.tokenizer.token_bytes import SPECIAL_MARKER

from test_tokenizer import CORPUS, train_byte_level_bpe, train_sentencepiece, write_config, write_sentencepiece_gguf
from texts import PLAIN_TEXTS


def metaspace_bpe_folder(folder: Path) -> Path:
    """A Llama-2-style tokenizer.json: "▁" for spaces, byte-fallback pieces, a Replace/ByteFallback decoder."""
    model = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40)
    model.train_from_iterator(CORPUS * 20, trainer)
    spec = json.loads(model.to_str())  # the byte pieces join the vocabulary as ordinary entries, as in Llama's
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    write_config(folder, bos_token="<s>", eos_token="</s>")
    return folder


@pytest.fixture(params=["byte-level json", "metaspace json", "sentencepiece", "sentencepiece gguf", "smollm2 gguf"])
def tokenizer(request, tmp_path, smollm2_gguf_path) -> Tokenizer:
    kind = request.param
    if kind == "byte-level json":
        train_byte_level_bpe(None).save(str(tmp_path / "tokenizer.json"))
        write_config(tmp_path, bos_token="<s>", eos_token="</s>")
        return Tokenizer.from_folder(tmp_path)
    if kind == "metaspace json":
        return Tokenizer.from_folder(metaspace_bpe_folder(tmp_path))
    if kind == "sentencepiece":
        (tmp_path / "tokenizer.model").write_bytes(train_sentencepiece(tmp_path).read_bytes())
        return Tokenizer.from_folder(tmp_path)
    if kind == "sentencepiece gguf":
        write_sentencepiece_gguf(tmp_path / "t.gguf", train_sentencepiece(tmp_path))
        return Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "t.gguf"))
    return Tokenizer.from_gguf(gguf.GGUFReader(smollm2_gguf_path))


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_token_bytes_spell_the_encoded_text(tokenizer, text):
    table = tokenizer.token_bytes()
    assert len(table) == tokenizer.vocab_size
    ids = tokenizer.encode(text, add_special_tokens=False)
    spelled = b"".join(table[i] for i in ids).decode("utf-8")
    # SentencePiece-style tokenizers spell the dummy-prefix space that decoding strips
    assert spelled in (text, " " + text)


def test_special_tokens_are_marked_and_nothing_else_is(tokenizer):
    table = tokenizer.token_bytes()
    # (a byte-level vocabulary's token for the lone byte 0xFF looks marked too; no UTF-8 text contains it)
    marked = {i for i, b in enumerate(table) if b.startswith(SPECIAL_MARKER) and b != b"\xff"}
    assert marked == set(tokenizer.all_special_ids)
    assert table[tokenizer.eos_token_id] == SPECIAL_MARKER + tokenizer.special_tokens.eos.encode()


def test_byte_level_bytes_match_llguidances_own_reading_of_tokenizer_json(smollm2_gguf_path):
    """llguidance parses a tokenizer.json itself; jserve's table for the GGUF-built tokenizer agrees on every
    ordinary id (llguidance spells special tokens its own way)."""
    tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(smollm2_gguf_path))
    table = tokenizer.token_bytes()
    theirs = llg.LLTokenizer(tokenizer._backend._model.to_str())
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(table)) if i not in special]
    assert [table[i] for i in ordinary] == [theirs.decode_bytes([i]) for i in ordinary]
