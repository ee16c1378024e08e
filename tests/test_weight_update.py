"""New weights without a reload: LLM.update_weights and get_weights on tiny random checkpoints written with
transformers (two per family, seeds 0 and 1). Every engine here runs with debug checks, so a step that
compiled after warm-up (new weights must not recompile anything) would fail the test."""

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jserve import SamplingParams
from jserve.errors import EngineAsleepError, WeightUpdateError
from jserve.loader import load_model
from jserve.loader.weight_update import updated_params
from jserve.loader.weights import leaves_by_name
from jserve.models.quantization import Quantization
from jserve.training import rollout_batch, token_logprobs_fn

from test_engine import prompts, tiny_llm
from tiny_models import VARIANTS, assert_engine_idle, reference_logits, save_tiny_checkpoint

FAMILIES = ["llama", "mistral-sliding", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe"]
PROMPTS = prompts(3, seed=5)
# Greedy, with each sampled token's logprob: what a rollout's importance ratios read.
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)


def rollout(llm, prompts=PROMPTS):
    """(token ids, each token's logprob, weights_version) of every prompt's greedy completion."""
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[entry[t].logprob for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
                for o in outs]  # fmt: skip
    return tokens, logprobs, {o.weights_version for o in outs}


def pair(tmp_path, variant):
    """Two checkpoints of one variant: (folder, torch model) for seeds 0 and 1."""
    family, overrides = VARIANTS[variant]
    return [(tmp_path / str(seed), save_tiny_checkpoint(tmp_path / str(seed), family, seed, **overrides))
            for seed in (0, 1)]  # fmt: skip


def state_dict(torch_model) -> dict:
    """The checkpoint's tensors as transformers holds them in memory, as numpy."""
    return {name: tensor.numpy() for name, tensor in torch_model.state_dict().items()}


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    return pair(tmp_path_factory.mktemp("llamas"), "llama")


@pytest.fixture(scope="module")
def fresh_second(llamas):
    """What an engine loaded from the second checkpoint serves."""
    return rollout(tiny_llm(llamas[1][0]))


@pytest.mark.parametrize("variant", FAMILIES)
def test_new_weights_serve_what_an_engine_loaded_with_them_serves(tmp_path, variant):
    (first, _), (second, second_torch) = pair(tmp_path, variant)
    llm = tiny_llm(first)
    before = rollout(llm)
    llm.update_weights(second_torch.state_dict())  # torch tensors, by Hugging Face name
    tokens, logprobs, versions = rollout(llm)
    fresh_tokens, fresh_logprobs, _ = rollout(tiny_llm(second))
    assert tokens == fresh_tokens
    np.testing.assert_allclose(np.concatenate(logprobs), np.concatenate(fresh_logprobs), rtol=0, atol=1e-5)
    assert not np.allclose(np.concatenate(logprobs), np.concatenate(before[1])), "the new weights should score apart"
    assert versions == {1} and before[2] == {0}
    # Handed out again as the checkpoint's files hold them (a tied head is the embedding).
    expected = {name: array for name, array in load_file(second / "model.safetensors").items()
                if not (name == "lm_head.weight" and second_torch.config.tie_word_embeddings)}  # fmt: skip
    weights = llm.get_weights()
    assert sorted(weights) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(weights[name], array, err_msg=name)
    assert_engine_idle(llm)


def test_jserve_arrays_are_used_without_a_copy(llamas, fresh_second):
    llm = tiny_llm(llamas[0][0])
    held = llm.get_weights(names="jserve")
    assert all(isinstance(array, jax.Array) for array in held.values())
    second = load_model(llamas[1][0], dtype="float32")  # placed as the engine places its own
    given = leaves_by_name(second.params)
    llm.update_weights(given, names="jserve")
    now = llm.get_weights(names="jserve")
    for name, array in given.items():
        assert now[name].unsafe_buffer_pointer() == array.unsafe_buffer_pointer(), name
    assert rollout(llm) == (*fresh_second[:2], {1})


def test_host_arrays_are_copied(llamas):
    """Changing a host array in place after the update leaves the served weights alone (a CPU's device_put
    may otherwise keep the host buffer as the device's)."""
    llm = tiny_llm(llamas[0][0])
    host = {name: np.asarray(array).copy() + 1 for name, array in llm.get_weights(names="jserve").items()}
    llm.update_weights(host, names="jserve")
    served = {name: np.asarray(array).copy() for name, array in llm.get_weights(names="jserve").items()}
    for array in host.values():
        array += 100
    for name, array in llm.get_weights(names="jserve").items():
        np.testing.assert_array_equal(np.asarray(array), served[name], err_msg=name)


def test_a_subset_keeps_the_other_weights(llamas):
    (first, first_torch), (_, second_torch) = llamas
    llm = tiny_llm(first)
    held = llm.get_weights(names="jserve")
    k_name = "model.layers.0.self_attn.k_proj.weight"
    k = second_torch.state_dict()[k_name].numpy()
    llm.update_weights({k_name: k})
    weights = llm.get_weights()
    first_weights = state_dict(first_torch)
    np.testing.assert_array_equal(weights[k_name], k)  # the new piece, inside the fused q/k/v
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"):
        np.testing.assert_array_equal(weights[name], first_weights[name])
    now = llm.get_weights(names="jserve")
    changed = [name for name in held if now[name] is not held[name]]
    assert changed == ["layers.0.self_attn.qkv_proj.weight"]


@pytest.mark.parametrize(
    ("weights", "names", "message"),
    [
        (
            {
                "model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32),
                "model.layers.9.mlp.up_proj.weight": np.zeros((128, 64), np.float32),
            },
            "hf",
            "'model.layers.9.mlp.up_proj.weight' names no parameter",
        ),
        (
            {
                "model.norm.weight": np.ones(64, np.float32),
                "model.embed_tokens.weight": np.zeros((320, 32), np.float32),
            },
            "hf",
            "'model.embed_tokens.weight' has shape (320, 32)",
        ),
        (
            {"norm.weight": np.ones(64, np.float32), "layers.0.mlp.down_proj.weight": np.zeros((64, 64), np.float32)},
            "jserve",
            "'layers.0.mlp.down_proj.weight' has shape (64, 64)",
        ),
        ({"norm.weight": np.ones(64, np.float32)}, "torch", "names must be one of"),
        ([1, 2, 3], "hf", "weights must be"),
    ],  # fmt: skip
)
def test_bad_weights_are_an_error_and_change_nothing(llamas, weights, names, message):
    llm = tiny_llm(llamas[0][0])
    before, held = rollout(llm), llm.get_weights(names="jserve")
    with pytest.raises(WeightUpdateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        llm.update_weights(weights, names=names)
    now = llm.get_weights(names="jserve")
    assert all(now[name] is held[name] for name in held)
    assert rollout(llm) == before


def test_a_path_and_an_nnx_state(llamas, fresh_second):
    llm = tiny_llm(llamas[0][0])
    llm.update_weights(llamas[1][0])  # a Hugging Face folder
    assert rollout(llm)[:2] == fresh_second[:2]
    llm = tiny_llm(llamas[0][0])
    llm.update_weights(load_model(llamas[1][0], dtype="float32").params)
    assert rollout(llm)[:2] == fresh_second[:2]


def test_an_int8_engine_quantizes_new_weights(llamas):
    (first, _), (second, second_torch) = llamas
    llm = tiny_llm(first, quantization="int8")
    llm.update_weights(second_torch.state_dict())
    assert rollout(llm)[:2] == rollout(tiny_llm(second, quantization="int8"))[:2]
    with pytest.raises(WeightUpdateError, match="int8 model quantizes 'layers.0.self_attn.qkv_proj.weight'"):
        llm.update_weights({"model.layers.0.self_attn.k_proj.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(WeightUpdateError, match="names='jserve' returns them"):
        llm.get_weights()


def test_gguf_blocks_cannot_take_new_weights(llamas):
    model = load_model(llamas[0][0], dtype="float32")
    with pytest.raises(WeightUpdateError, match="GGUF file's blocks"):
        updated_params(dataclasses.replace(model, quantization=Quantization.GGUF), {}, "hf")


def test_requests_in_flight_finish_on_their_weights(llamas, fresh_second):
    """A request running when new weights arrive finishes on the old ones; one added after waits for them."""
    (first, _), (_, second_torch) = llamas
    llm = tiny_llm(first)
    alone_first = rollout(llm, PROMPTS[:1])[0]
    engine = llm.engine
    old = engine.add_request(PROMPTS[0], GREEDY, request_id="old")
    for _ in range(3):
        engine.step()
    llm.update_weights(second_torch.state_dict())
    assert engine.weights.version == 0  # waiting for "old"
    new = engine.add_request(PROMPTS[1], GREEDY, request_id="new")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[old].outputs[0].token_ids == alone_first[0] and finished[old].weights_version == 0
    assert finished[new].outputs[0].token_ids == fresh_second[0][1] and finished[new].weights_version == 1
    assert finished[new].metrics.first_scheduled_time >= finished[old].metrics.finish_time
    assert_engine_idle(llm)


def test_cached_prefixes_go_with_the_old_weights(llamas, fresh_second):
    (first, _), (second, second_torch) = llamas
    llm = tiny_llm(first, enable_prefix_caching=True)
    long_prompts = [p * 4 for p in PROMPTS]  # several whole pages each, cached after the first run
    rollout(llm, long_prompts)
    assert llm.engine.scheduler.num_reclaimable_pages > 0
    llm.update_weights(second_torch.state_dict())
    assert llm.engine.scheduler.num_reclaimable_pages == 0
    assert rollout(llm, long_prompts)[:2] == rollout(tiny_llm(second), long_prompts)[:2]


def live_bytes() -> int:
    gc.collect()  # (engines earlier tests left behind go now, not between two readings)
    return sum(array.nbytes for array in jax.live_arrays())


def test_sleep_hands_the_kv_cache_back_and_wakes_to_the_same_outputs(llamas):
    llm = tiny_llm(llamas[0][0], enable_prefix_caching=True)
    before = rollout(llm)
    kv_bytes = sum(array.nbytes for array in jax.tree.leaves(llm.engine.runner.kv_cache))
    held = live_bytes()
    llm.sleep()
    assert llm.is_sleeping and held - live_bytes() >= 0.95 * kv_bytes
    with pytest.raises(EngineAsleepError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping
    assert rollout(llm) == before
    assert_engine_idle(llm)


def test_sleep_level_2_lets_the_weights_go_until_new_ones_come(llamas, fresh_second):
    llm = tiny_llm(llamas[0][0])
    rollout(llm)
    engine = llm.engine
    kv_bytes = sum(array.nbytes for array in jax.tree.leaves(engine.runner.kv_cache))
    weight_bytes = sum(array.nbytes for array in jax.tree.leaves(engine.model.params))
    held = live_bytes()
    llm.sleep(level=2)
    assert held - live_bytes() >= 0.95 * (kv_bytes + weight_bytes)
    llm.wake_up()
    with pytest.raises(EngineAsleepError, match="update_weights"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(EngineAsleepError, match="update_weights"):
        llm.get_weights()
    with pytest.raises(WeightUpdateError, match="give every one; missing"):
        llm.update_weights({"model.norm.weight": np.ones(64, np.float32)})
    llm.update_weights(llamas[1][0])
    assert rollout(llm) == (*fresh_second[:2], {1})
    assert_engine_idle(llm)


def test_sleep_waits_for_no_request(llamas):
    llm = tiny_llm(llamas[0][0])
    request_id = llm.engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        llm.sleep()
    llm.engine.abort_request(request_id)
    llm.engine.step()
    llm.sleep()
    llm.wake_up()
    assert_engine_idle(llm)


def test_rollouts_score_their_tokens_as_the_model_does(llamas):
    """n samples of a prompt, each sampled token's logprob equal to the model's log-softmax there (what an
    importance ratio reads), and the same samples again from the same seed."""
    (first, first_torch), _ = llamas
    llm = tiny_llm(first)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0, seed=3)
    prompt = PROMPTS[0]
    completions = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in completions}) > 1
    for completion in completions:
        ids = prompt + completion.token_ids
        logits = reference_logits(first_torch, ids)[len(prompt) - 1 : -1]
        shifted = logits - logits.max(-1, keepdims=True)
        expected = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # log-softmax
        scored = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)]
        np.testing.assert_allclose(scored, expected[np.arange(len(ids) - len(prompt)), completion.token_ids],
                                   atol=1e-4)  # fmt: skip
    again = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]


@pytest.mark.parametrize("variant", ["llama", "gemma2"])
def test_training_scores_match_the_engine_and_train(tmp_path, variant):
    """token_logprobs_fn scores a rollout's tokens as the engine did (sliding windows and soft-caps included;
    prompts of two lengths padded into rows by rollout_batch), and a gradient step on that score, handed back
    without a copy, makes the engine score them higher."""
    (first, _), _ = pair(tmp_path, variant)
    llm = tiny_llm(first)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0, seed=2)
    prompts = [PROMPTS[1], PROMPTS[1][:5]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    batch = rollout_batch(outs, length=len(PROMPTS[1]) + 8 + 3)
    assert batch.completion_mask.sum() == 4 * 8
    score = jax.jit(token_logprobs_fn(llm.engine.model))
    weights = llm.get_weights(names="jserve")
    scored = np.asarray(score(weights, jnp.asarray(batch.tokens)))
    np.testing.assert_allclose(scored * batch.completion_mask, batch.sampled_logprobs, atol=2e-5)
    sequences = [out.prompt_token_ids + c.token_ids for out in outs for c in out.outputs]
    before = engine_scores(llm, sequences[:2], len(PROMPTS[1]))

    def completion_score(p):
        return (score(p, jnp.asarray(batch.tokens)) * batch.completion_mask)[:2].sum()

    grads = jax.grad(completion_score)(weights)
    llm.update_weights({name: w + 1e-3 * grads[name] for name, w in weights.items()}, names="jserve")
    after = engine_scores(llm, sequences[:2], len(PROMPTS[1]))
    assert np.sum(after) > np.sum(before)
    now = np.asarray(score(llm.get_weights(names="jserve"), jnp.array(sequences[:2], jnp.int32)))
    np.testing.assert_allclose(now[:, len(PROMPTS[1]) - 1 :], after, atol=2e-5)


def test_rollout_batch_refuses_rows_too_short(llamas):
    llm = tiny_llm(llamas[0][0])
    outs = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    batch = rollout_batch(outs, length=len(PROMPTS[0]) + 4)
    assert batch.sampled_logprobs is None and batch.completion_mask.sum() == 4
    with pytest.raises(ValueError, match="do not fit rows of"):
        rollout_batch(outs, length=len(PROMPTS[0]) + 3)


def engine_scores(llm, sequences: list[list[int]], start: int) -> list[list[float]]:
    """The engine's logprob of each sequence's tokens from `start` on, scored as a prompt."""
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(sequences, scoring, use_tqdm=False)
    return [[entry[token].logprob for token, entry in zip(seq[start:], out.prompt_logprobs[start:], strict=True)]
            for seq, out in zip(sequences, outs, strict=True)]  # fmt: skip


def test_training_scores_need_float_dense_models(llamas):
    with pytest.raises(ValueError, match="float weights"):
        token_logprobs_fn(
            dataclasses.replace(load_model(llamas[0][0], dtype="float32"), quantization=Quantization.INT8)
        )
