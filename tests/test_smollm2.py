"""The default model, SmolLM2-135M-Instruct from its Q4_1 GGUF, through the engine, decodes as transformers does."""

import numpy as np
import pytest
import torch
import transformers

from jserve import LLM, SamplingParams

from tiny_models import assert_engine_idle, jserve_prompt_logits

MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(smollm2_gguf_path):
    path = smollm2_gguf_path
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def llm(smollm2_gguf_path):
    engine = LLM(smollm2_gguf_path, dtype="float32", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256,
                 kv_cache_memory=512 << 20, enable_prefix_caching=False)  # fmt: skip
    yield engine
    assert_engine_idle(engine)


def reference_greedy(model, ids, eos_id):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=eos_id)
    return out[0, len(ids) :].tolist()


def test_chat_answer_matches_transformers(llm, reference):
    model, tokenizer = reference
    expected_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"]
    out = llm.chat(CHAT, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == expected_ids
    completion = out.outputs[0]
    assert completion.text == "The capital of France is Paris."
    assert completion.token_ids == reference_greedy(model, expected_ids, tokenizer.eos_token_id)
    assert completion.finish_reason == "stop"


def test_story_continuation_matches_transformers(llm, reference):
    model, tokenizer = reference
    out = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == tokenizer("Once upon a time")["input_ids"]
    assert len(out.outputs[0].token_ids) == MAX_NEW_TOKENS
    assert out.outputs[0].token_ids == reference_greedy(model, out.prompt_token_ids, tokenizer.eos_token_id)


def test_the_answer_does_not_depend_on_the_batch(llm):
    alone = llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0]
    topics = ["rivers", "the moon", "bread", "chess", "volcanoes", "jazz", "owls", "glass"]
    others = [[{"role": "user", "content": f"Tell me {i % 3 + 1} facts about {topics[i % 8]}."}] for i in range(31)]
    lengths = [SamplingParams(temperature=0, max_tokens=8 + 5 * (i % 7)) for i in range(31)]
    outputs = llm.chat(others[:20] + [CHAT] + others[20:], lengths[:20] + [GREEDY] + lengths[20:], use_tqdm=False)
    assert outputs[20].outputs[0].token_ids == alone.token_ids


def test_prompt_logits_match_transformers(llm, reference):
    model, _ = reference
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog, and then")
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    # 30 float32 layers: measured max |diff| 1.2e-4 on logits of magnitude ~20 (the tiny models meet 1e-4).
    np.testing.assert_allclose(jserve_prompt_logits(llm.engine.model, ids), expected, atol=5e-4, rtol=0)
