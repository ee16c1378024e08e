"""A decode step made from the step before's arrays (engine/decode_continuation.py) has the inputs the same
step built from its requests has: under debug checks, on in every test, the engine builds both and compares
them at every continued step, so each test that decodes checks it; these make sure it happens, and that the
comparison can fail."""

from dataclasses import replace

import numpy as np
import pytest

from jserve import LLM, SamplingParams
from jserve.engine.decode_continuation import check_same_inputs

from tiny_models import VOCAB_SIZE, assert_engine_idle, tiny_kv_bytes


@pytest.fixture(scope="module")
def llm(tiny_llama_checkpoint):
    engine = LLM(tiny_llama_checkpoint[0], dtype="float32", max_model_len=256, max_num_seqs=4,
                 max_num_batched_tokens=64, kv_cache_memory=tiny_kv_bytes(128))  # fmt: skip
    assert engine.engine.config.debug_checks  # (conftest.py)
    yield engine
    assert_engine_idle(engine)


def test_steady_decodes_continue_the_step_before_with_the_tokens_of_each_request_alone(llm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB_SIZE, int(n)).tolist() for n in (5, 17, 30, 12, 9, 21)]
    # Greedy and seeded, with and without penalties, finishing at different steps (the batch changes, then
    # continues again); 40+ tokens cross pages of 16.
    params = [
        SamplingParams(temperature=0, max_tokens=44, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=1, max_tokens=23, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, seed=2, top_k=5, max_tokens=50, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, seed=4, max_tokens=41, ignore_eos=True, presence_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=19, ignore_eos=True),
    ]
    runner = llm.engine.runner
    before, steps_before = runner.continued_steps, llm.engine.stats.steps
    together = llm.generate(prompts, params, use_tqdm=False)
    continued, steps = runner.continued_steps - before, llm.engine.stats.steps - steps_before
    assert continued > steps // 2, f"{continued} of {steps} steps continued the step before"
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_a_continued_step_unlike_its_inputs_built_afresh_fails_the_check(llm):
    runner = llm.engine.runner
    bucket = runner.bucket_for(1)
    step = runner.prepare([], bucket)
    packed = runner.packings[bucket].pack(step)
    check_same_inputs((step, packed), (step, runner.packings[bucket].pack(step)))  # equal: passes
    attention = step.model.attention
    moved = replace(step, model=replace(step.model, attention=replace(attention, positions=attention.positions + 1)))
    with pytest.raises(AssertionError, match="positions"):
        check_same_inputs((moved, packed), (step, packed))
    ints = packed.ints.copy()
    ints[0] += 1
    with pytest.raises(AssertionError, match="ints"):
        check_same_inputs((step, replace(packed, ints=ints)), (step, packed))
