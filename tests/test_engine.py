"""The engine end to end on tiny checkpoints: exactness, batch/chunk/preemption invariance, stops, API."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from jserve import LLM, SamplingParams
from jserve.engine.compile_guard import compile_count

from tiny_models import (
    VARIANTS,
    VOCAB_SIZE,
    assert_engine_idle,
    reference_greedy,
    reference_logits,
    save_tiny_checkpoint,
    tiny_engine_args,
    tiny_kv_bytes,
)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tiny_llm(folder, **kwargs) -> LLM:
    return LLM.from_engine_args(tiny_engine_args(folder, **kwargs))


def prompts(count, seed=0, low=5, high=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB_SIZE, int(rng.integers(low, high))).tolist() for _ in range(count)]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama_checkpoint):
    engine = tiny_llm(tiny_llama_checkpoint[0])
    yield engine
    assert_engine_idle(engine)


@pytest.fixture(autouse=True)
def pages_return(request):
    yield
    if "llm" in request.fixturenames:
        assert_engine_idle(request.getfixturevalue("llm"))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_batched_greedy_matches_transformers(tmp_path, variant):
    family, overrides = VARIANTS[variant]
    reference = save_tiny_checkpoint(tmp_path, family, **overrides)
    engine = tiny_llm(tmp_path)
    batch = prompts(6, seed=7)
    expected = [reference_greedy(reference, p, GREEDY.max_tokens) for p in batch]
    # Decisive steps only: jserve's logits are within 1e-4 of the reference (test_models), so a top-2 gap
    # above 2e-4 cannot flip the argmax, and a mismatch below is a real bug, not float noise.
    for prompt, reply in zip(batch, expected, strict=True):
        top2 = np.sort(reference_logits(reference, prompt + reply)[len(prompt) - 1 : -1], axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 2e-4
    assert token_ids(engine.generate(batch, GREEDY, use_tqdm=False)) == expected
    assert_engine_idle(engine)


def test_output_does_not_depend_on_the_batch(llm):
    probe = prompts(1, seed=1)[0]
    alone = token_ids(llm.generate([probe], GREEDY, use_tqdm=False))[0]
    crowd = prompts(31, seed=2, low=3, high=120)
    mixed = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True) for n in np.arange(31) % 29 + 2]
    outputs = llm.generate(crowd[:15] + [probe] + crowd[15:], mixed[:15] + [GREEDY] + mixed[15:], use_tqdm=False)
    assert outputs[15].outputs[0].token_ids == alone


@pytest.mark.parametrize("chunk", [8, 64, 256])
def test_output_does_not_depend_on_chunk_size(tiny_llama_checkpoint, llm, chunk):
    batch = prompts(5, seed=3, low=30, high=200)
    expected = token_ids(llm.generate(batch, GREEDY, use_tqdm=False))
    chunked = tiny_llm(tiny_llama_checkpoint[0], max_num_batched_tokens=chunk)
    assert token_ids(chunked.generate(batch, GREEDY, use_tqdm=False)) == expected
    assert_engine_idle(chunked)


def test_preempted_requests_recompute_to_the_same_output(tiny_llama_checkpoint, llm):
    batch = prompts(8, seed=4, low=20, high=40)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = token_ids(llm.generate(batch, params, use_tqdm=False))
    cramped = tiny_llm(tiny_llama_checkpoint[0], kv_cache_memory=tiny_kv_bytes(20))  # 320 tokens for ~700 needed
    outputs = cramped.generate(batch, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert token_ids(outputs) == expected
    assert_engine_idle(cramped)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    probe = prompts(1, seed=5)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = token_ids(llm.generate([probe], params, use_tqdm=False))[0]
    neighbours = prompts(5, seed=6)
    others = SamplingParams(temperature=0.7, max_tokens=10, seed=99, ignore_eos=True)
    outputs = llm.generate(neighbours + [probe], [others] * 5 + [params], use_tqdm=False)
    assert outputs[-1].outputs[0].token_ids == alone
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=4321, ignore_eos=True)
    assert token_ids(llm.generate([probe], reseeded, use_tqdm=False))[0] != alone


def test_penalised_output_does_not_depend_on_plain_neighbours_or_slot_reuse(llm):
    # Only requests with penalties record their history on device; a plain request that had their slot
    # before, or runs beside them, must not change what the penalties see.
    probe = prompts(1, seed=12)[0]
    penalised = SamplingParams(
        temperature=0, repetition_penalty=1.5, frequency_penalty=0.7, max_tokens=24, ignore_eos=True
    )
    alone = token_ids(llm.generate([probe], penalised, use_tqdm=False))[0]
    assert alone != token_ids(llm.generate([probe], GREEDY, use_tqdm=False))[0]  # the penalties matter
    plain = prompts(7, seed=13)
    llm.generate(plain, GREEDY, use_tqdm=False)  # plain requests take every slot, recording nothing
    outputs = llm.generate(plain[:3] + [probe] + plain[3:], [GREEDY] * 3 + [penalised] + [GREEDY] * 4, use_tqdm=False)
    assert outputs[3].outputs[0].token_ids == alone
    assert token_ids(llm.generate([probe], penalised, use_tqdm=False))[0] == alone


def test_n_completions(llm):
    out = llm.generate(
        [prompts(1, seed=8)[0]],
        SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_no_compilation_after_warm_up(llm):
    before = compile_count()
    llm.generate(prompts(12, seed=9, high=150), SamplingParams(temperature=0.5, top_k=5, max_tokens=30), use_tqdm=False)
    assert compile_count() == before


def test_every_bucket_writes_the_kv_cache_in_place(llm):
    """No compiled step copies pages: a lone decode's once copied the whole cache to write one row."""
    cache = llm.engine.runner.kv_cache
    num_pages, page_size, *row = cache.k.shape
    # the cache's pages or one layer's, as pages and as slots
    layouts = {(n, page_size, *row) for n in (num_pages, num_pages // cache.num_layers)}
    layouts |= {(n * page_size, *row) for n, *_ in list(layouts)}
    for (bucket, _), executable in llm.engine.runner.executables.items():
        copies = re.findall(r"= \w+\[([\d,]+)\][^ ]* copy\(", executable.as_text())
        assert not layouts & {tuple(map(int, dims.split(","))) for dims in copies}, f"bucket {bucket} copies pages"


# --- stops -------------------------------------------------------------------------------------------


def test_max_tokens_and_eos(llm):
    probe = prompts(1, seed=10)[0]
    free_run = llm.generate([probe], GREEDY, use_tqdm=False)[0].outputs[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == GREEDY.max_tokens
    # Make the 5th generated token a stop token: generation ends there, the token is kept.
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    stopped = llm.generate(
        [probe], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_at)


def test_min_tokens_suppresses_stops(llm):
    probe = prompts(1, seed=10)[0]
    free_run = llm.generate([probe], GREEDY, use_tqdm=False)[0].outputs[0]
    stop_at = free_run.token_ids[0]  # without min_tokens, generation would stop at once
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at], min_tokens=6, ignore_eos=True)
    out = llm.generate([probe], params, use_tqdm=False)[0].outputs[0]
    # Expected: 6 tokens with the stop token barred, then a plain greedy run that may stop on it.
    barred = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={stop_at: -100})
    first_six = llm.generate([probe], barred, use_tqdm=False)[0].outputs[0].token_ids
    rest_params = SamplingParams(temperature=0, max_tokens=18, stop_token_ids=[stop_at], ignore_eos=True)
    rest = llm.generate([probe + first_six], rest_params, use_tqdm=False)[0].outputs[0]
    assert stop_at not in first_six
    assert out.token_ids == first_six + rest.token_ids and out.finish_reason == rest.finish_reason


def test_stop_string_is_excluded_from_text(llm):
    probe = prompts(1, seed=11)[0]
    text = llm.generate([probe], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[5:8]
    assert len(stop) == 3 and stop.strip()
    out = llm.generate([probe], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.text == text[: text.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def test_max_model_len_ends_generation(llm):
    probe = prompts(1, seed=12, low=250, high=251)[0]
    out = llm.generate([probe], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 256 - 250 and out.outputs[0].finish_reason == "length"


def test_abort_by_request_id(llm):
    engine = llm.engine
    keep = engine.add_request(prompts(1, seed=13)[0], GREEDY)
    drop = engine.add_request(prompts(1, seed=14)[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.step()
    engine.abort_request(drop)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[drop].outputs[0].finish_reason == "abort"
    assert finished[keep].outputs[0].finish_reason == "length"


def test_priority_runs_urgent_requests_first(tiny_llama_checkpoint):
    single = tiny_llm(tiny_llama_checkpoint[0], max_num_seqs=1, schedule_policy="priority")
    outputs = single.generate(prompts(3, seed=15), GREEDY, use_tqdm=False, priority=[5, 0, 1])
    order = sorted(range(3), key=lambda i: outputs[i].metrics.first_token_time)
    assert order == [1, 2, 0]
    assert_engine_idle(single)


# --- API --------------------------------------------------------------------------------------------


def test_stream_matches_generate(llm):
    probe = prompts(1, seed=16)[0]
    deltas = list(llm.stream(probe, GREEDY))
    assert len(deltas) > 1
    assert "".join(deltas) == llm.generate([probe], GREEDY, use_tqdm=False)[0].outputs[0].text


def test_step_outputs_carry_deltas_that_add_up_to_the_finished_completion(llm):
    """Each output carries what its step added; the whole completion comes once, in the finished output,
    and is what the deltas add up to (a stop string cut from it, n > 1 completions finishing apart)."""
    probe = prompts(1, seed=18)[0]
    settings = dict(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True, n=2, logprobs=1)
    unstopped = llm.generate([probe], SamplingParams(**settings), use_tqdm=False)[0].outputs[0].text
    stop = unstopped[10:12]
    assert len(unstopped) > 20
    engine = llm.engine
    engine.add_request(probe, SamplingParams(**settings, stop=[stop]))
    texts, token_ids, logprobs = ["", ""], [[], []], [[], []]
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                texts[c.index] += c.delta
                token_ids[c.index] += c.delta_token_ids
                logprobs[c.index] += c.delta_logprobs
                if not c.finished:
                    assert (c.text, c.token_ids, c.logprobs) == ("", [], [])
    assert out.finished and out.outputs[0].stop_reason == stop
    assert [c.text for c in out.outputs] == texts and texts[0] == unstopped[: unstopped.index(stop)]
    assert [c.token_ids for c in out.outputs] == token_ids
    assert [c.logprobs for c in out.outputs] == logprobs


def test_stream_closed_early_frees_its_pages(llm):
    stream = llm.stream(prompts(1, seed=17)[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    assert next(stream)
    assert llm.engine.has_unfinished_requests()
    stream.close()
    [out] = llm.engine.step()  # the abort lands on the next step
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 200
    assert_engine_idle(llm)  # every page back


def test_bfloat16_kv_cache(tiny_llama_checkpoint, llm):
    """--kv-cache-dtype bfloat16 holds K/V in bfloat16, twice the pages in the same memory; the CPU kernel and
    the plain-JAX reference read them alike, and the first token's logprobs stay near the float32 cache's."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    batch = prompts(4, seed=7)
    outputs = {}
    for backend in ("cpu", "reference"):
        half = tiny_llm(tiny_llama_checkpoint[0], kv_cache_dtype="bfloat16", attention_backend=backend)
        assert half.engine.runner.kv_cache.k.dtype == jnp.bfloat16
        assert half.engine.config.num_pages == 2 * llm.engine.config.num_pages
        outputs[backend] = half.generate(batch, params, use_tqdm=False)
        assert_engine_idle(half)
    assert token_ids(outputs["cpu"]) == token_ids(outputs["reference"])
    for full, half in zip(llm.generate(batch, params, use_tqdm=False), outputs["cpu"], strict=True):
        first, first_half = full.outputs[0].logprobs[0], half.outputs[0].logprobs[0]
        assert first.keys() == first_half.keys()  # the same top 3 alternatives
        for token in first:
            assert abs(first[token].logprob - first_half[token].logprob) < 0.05


def test_logprobs(llm):
    probe = prompts(1, seed=18)[0]
    out = llm.generate([probe], SamplingParams(temperature=0, max_tokens=3, logprobs=4), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry[token].rank == 1  # greedy picks the most likely token
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3, 4]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:], strict=False))
    chosen = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs, strict=True)]
    assert out.cumulative_logprob == pytest.approx(sum(chosen), rel=1e-5)


def test_keyboard_interrupt_leaves_the_engine_usable(llm, monkeypatch):
    engine, real_step, calls = llm.engine, llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(4, seed=19), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_engine_idle(llm)
    assert len(llm.generate(prompts(2, seed=20), GREEDY, use_tqdm=False)) == 2


def test_a_failing_request_does_not_break_the_others(llm, monkeypatch):
    processor = llm.engine.outputs
    real_append = processor.append

    def flaky_append(request, samples, row):
        if request.prompt_token_ids[0] == 7:
            raise RuntimeError("boom")
        return real_append(request, samples, row)

    monkeypatch.setattr(processor, "append", flaky_append)
    batch = [[7, 1, 2, 3], *prompts(3, seed=21)]
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert all(o.outputs[0].finish_reason == "length" for o in outputs[1:])


# --- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt,kwargs,field",
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([1] * 256, {}, "max_model_len"),
        ([1, VOCAB_SIZE + 5], {}, "prompt_token_ids"),
        ([1, -1], {}, "prompt_token_ids"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"temperature": -0.5}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"top_k": -3}, "top_k"),
        ([1, 2], {"n": 0}, "n"),
        ([1, 2], {"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
    ],
)
def test_bad_input_is_rejected_before_anything_is_queued(llm, prompt, kwargs, field):
    good = prompts(2, seed=22)
    with pytest.raises(ValueError, match=field):
        llm.generate(good + [prompt], [GREEDY, GREEDY, SamplingParams(**kwargs)], use_tqdm=False)
    assert_engine_idle(llm)


def test_generate_one_liner_reuses_its_engine(tiny_llama_checkpoint):
    import jserve
    from jserve import llm as llm_module

    folder = str(tiny_llama_checkpoint[0])
    first = jserve.generate("The quick brown fox", model=folder, max_tokens=5, ignore_eos=True)
    engine = llm_module._engines[folder]
    again = jserve.generate(["The quick brown fox", "Paris is"], model=folder, max_tokens=5, ignore_eos=True)
    assert llm_module._engines[folder] is engine
    # Greedy by default; the tiny checkpoint has no chat template, so the prompts go in as they are.
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = [o.outputs[0].text for o in engine.generate(["The quick brown fox", "Paris is"], params, use_tqdm=False)]
    assert first == expected[0] and again == expected
    assert_engine_idle(engine)
    del llm_module._engines[folder]
