"""The SmolLM2 GGUF tokenizer (byte-level BPE rebuilt from GGUF metadata) against transformers."""

from pathlib import Path

import gguf
import pytest
from transformers import AutoTokenizer

from jserve.tokenizer import Tokenizer

from texts import CONVERSATIONS, PLAIN_TEXTS


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(smollm2_gguf_path))


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_gguf_path: Path):
    return AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)


# --- SmolLM2 GGUF (byte-level BPE) ------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        *PLAIN_TEXTS,
        "<|im_start|>user\nhi<|im_end|>",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
        "text<|endoftext|>more text",
        # Numbers are safe to compare: a single space before them behaves alike (see below).
        "In 2024 there were 365 days, 3.14159 and 1,000,000.",
    ],
)
def test_smollm2_ids_match_transformers(smollm2_tokenizer: Tokenizer, smollm2_transformers, text: str) -> None:
    assert smollm2_tokenizer.encode(text) == smollm2_transformers.encode(text)
    without_special = smollm2_transformers.encode(text, add_special_tokens=False)
    assert smollm2_tokenizer.encode(text, add_special_tokens=False) == without_special


def test_smollm2_splits_digits_like_its_own_tokenizer(smollm2_tokenizer: Tokenizer, smollm2_transformers) -> None:
    # SmolLM2's tokenizer.json splits digits off one by one before the GPT-2 split
    # (GGUF pre-tokenizer "smollm"); transformers' GGUF loader uses the plain GPT-2 split.
    # Its vocabulary has no multi-digit token, so every digit is one token either way:
    ids = smollm2_tokenizer.encode("In 2024 there were 365 days")
    assert smollm2_tokenizer.convert_ids_to_tokens(ids) == [
        "In",
        "Ġ",
        "2",
        "0",
        "2",
        "4",
        "Ġthere",
        "Ġwere",
        "Ġ",
        "3",
        "6",
        "5",
        "Ġdays",
    ]
    # The split shows where whitespace runs into a digit: cut off from the digit, the
    # run stays whole ("ĠĠ"), while GPT-2's regex glues its last space to the digit.
    assert smollm2_tokenizer.convert_ids_to_tokens(smollm2_tokenizer.encode("x  42")) == ["x", "ĠĠ", "4", "2"]
    reference = smollm2_transformers.encode("x  42")
    assert smollm2_transformers.convert_ids_to_tokens(reference) == ["x", "Ġ", "Ġ", "4", "2"]


def test_smollm2_special_tokens_in_text_are_single_ids(smollm2_tokenizer: Tokenizer) -> None:
    assert smollm2_tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


@pytest.mark.parametrize("text", [*PLAIN_TEXTS, "In 2024 there were 365 days"])
def test_smollm2_decode_round_trips(smollm2_tokenizer: Tokenizer, smollm2_transformers, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text
    assert smollm2_tokenizer.decode(ids) == smollm2_transformers.decode(ids, skip_special_tokens=True)


def test_smollm2_decode_of_special_tokens(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert smollm2_tokenizer.decode(ids) == "user\nhi"
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_smollm2_special_token_metadata(smollm2_tokenizer: Tokenizer, smollm2_transformers) -> None:
    assert smollm2_tokenizer.vocab_size == len(smollm2_transformers) == 49152
    assert (smollm2_tokenizer.bos_token_id, smollm2_tokenizer.eos_token_id, smollm2_tokenizer.pad_token_id) == (1, 2, 2)
    # The 17 control tokens: exactly what transformers skips when decoding.
    assert smollm2_tokenizer.all_special_ids == list(range(17))
    first_ids = list(range(18))
    assert smollm2_tokenizer.decode(first_ids) == smollm2_transformers.decode(first_ids, skip_special_tokens=True)
    assert smollm2_tokenizer.decode(first_ids) == smollm2_tokenizer.decode([17]) != ""
    assert smollm2_tokenizer.encode("hi")[0] != smollm2_tokenizer.bos_token_id  # the GGUF says add_bos_token = False


@pytest.mark.parametrize("conversation", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(
    smollm2_tokenizer: Tokenizer, smollm2_transformers, conversation: list[dict], add_generation_prompt: bool
) -> None:
    expected = smollm2_transformers.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert smollm2_tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_smollm2_save_round_trip(smollm2_tokenizer: Tokenizer, tmp_path: Path) -> None:
    smollm2_tokenizer.save(tmp_path)
    reloaded = Tokenizer.from_folder(tmp_path)
    for text in [*PLAIN_TEXTS, "<|im_start|>user\n2024<|im_end|>", "x  42"]:
        assert reloaded.encode(text) == smollm2_tokenizer.encode(text)
    conversation = CONVERSATIONS["multi turn"]
    assert reloaded.apply_chat_template(conversation) == smollm2_tokenizer.apply_chat_template(conversation)
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id) == (1, 2, 2)
    assert reloaded.all_special_ids == smollm2_tokenizer.all_special_ids
