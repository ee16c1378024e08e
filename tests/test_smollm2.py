"""The default model, SmolLM2-135M-Instruct from its Q4_1 GGUF, decodes exactly as transformers does."""

import numpy as np
import pytest
import torch
import transformers

from jserve.greedy import greedy_generate, prompt_logits

MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(smollm2_gguf_path):
    path = smollm2_gguf_path
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def reference_greedy(model, ids, eos_id):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=eos_id)
    return out[0, len(ids) :].tolist()


def test_chat_answer_matches_transformers(smollm2, reference):
    model, tokenizer = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]

    ours = greedy_generate(smollm2, ids, MAX_NEW_TOKENS)
    assert ours == reference_greedy(model, ids, tokenizer.eos_token_id)
    assert smollm2.tokenizer.decode(ours) == "The capital of France is Paris."


def test_story_continuation_matches_transformers(smollm2, reference):
    model, tokenizer = reference
    ids = smollm2.tokenizer.encode("Once upon a time")
    assert ids == tokenizer("Once upon a time")["input_ids"]
    ours = greedy_generate(smollm2, ids, MAX_NEW_TOKENS)
    assert len(ours) == MAX_NEW_TOKENS
    assert ours == reference_greedy(model, ids, tokenizer.eos_token_id)


def test_prompt_logits_match_transformers(smollm2, reference):
    model, _ = reference
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    # 30 float32 layers: measured max |diff| 1.2e-4 on logits of magnitude ~20 (the tiny models meet 1e-4).
    np.testing.assert_allclose(prompt_logits(smollm2, ids), expected, atol=5e-4, rtol=0)
