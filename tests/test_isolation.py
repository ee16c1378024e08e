"""One request cannot hurt another: bad values are refused at admission naming the field, and a fault
while one request's step is prepared or its output processed fails that request alone."""

import numpy as np
import pytest

from jserve import LLM, SamplingParams
from jserve.engine.input_batch import InputBatch
from jserve.engine.runner import ModelRunner
from jserve.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS

from tiny_models import VOCAB_SIZE, assert_engine_idle, tiny_kv_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tiny_llm(folder, **overrides) -> LLM:
    settings = dict(
        dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=tiny_kv_bytes(64)
    )
    return LLM(folder, **settings | overrides)


def prompt(seed: int, length: int = 20) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB_SIZE, length).tolist()


@pytest.fixture(scope="module")
def llm(tiny_llama_checkpoint):
    engine = tiny_llm(tiny_llama_checkpoint[0])
    yield engine
    assert_engine_idle(engine)


@pytest.fixture(scope="module")
def solo(llm):
    """Each test prompt's greedy tokens, run alone."""
    return {seed: llm.generate([prompt(seed)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for seed in range(4)}


def test_a_bad_top_k_is_refused_and_the_good_request_still_runs(llm, solo):
    bad = SamplingParams(max_tokens=8, temperature=0.7, top_k=2**40)
    with pytest.raises(ValueError, match=r"top_k must be .* at most the vocabulary size \(320\)"):
        llm.generate([prompt(0), prompt(1)], [GREEDY, bad], use_tqdm=False)
    assert_engine_idle(llm)  # the batch was withdrawn whole
    assert llm.generate([prompt(0)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == solo[0]
    # at the engine's level the good request, queued first, finishes untouched
    engine = llm.engine
    engine.add_request(prompt(0), GREEDY, request_id="good")
    with pytest.raises(ValueError, match="top_k"):
        engine.add_request(prompt(1), bad, request_id="bad")
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    assert set(finished) == {"good"} and finished["good"].outputs[0].token_ids == solo[0]


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(n=5), "n must be at most max_num_seqs \\(4\\)"),
        (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), f"at most {MAX_STOP_STRINGS} strings"),
        (dict(stop="x" * (MAX_STOP_LENGTH + 1)), f"at most {MAX_STOP_LENGTH} characters"),
        (dict(seed=2**63), "seed must be in"),
        (dict(seed=-(2**63) - 1), "seed must be in"),
        (dict(seed=2**70), "seed must be in"),
        (dict(stop_token_ids=[VOCAB_SIZE]), "stop_token_ids token ids must be < vocab_size"),
    ],
)
def test_limits_are_refused_naming_the_field(llm, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt(0)], SamplingParams(**params), use_tqdm=False)
    assert_engine_idle(llm)


def test_seeds_at_the_64_bit_edges_are_taken(llm):
    for seed in (-(2**63), 2**63 - 1):
        out = llm.generate([prompt(0)], SamplingParams(max_tokens=2, seed=seed), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2


def test_priority_needs_the_priority_policy(llm, tiny_llama_checkpoint):
    with pytest.raises(ValueError, match="priority is honoured only with schedule_policy 'priority'"):
        llm.generate([prompt(0)], GREEDY, use_tqdm=False, priority=[1])
    ranked = tiny_llm(tiny_llama_checkpoint[0], schedule_policy="priority", max_num_seqs=1)
    outputs = ranked.generate([prompt(0), prompt(1)], GREEDY, use_tqdm=False, priority=[1, 0])
    assert outputs[1].metrics.first_scheduled_time < outputs[0].metrics.first_scheduled_time


def _fail_for_seed(monkeypatch, seed: int) -> None:
    """Make InputBatch.join, where a request's own options enter the step's inputs, raise for the request
    with this sampling seed, as a bug there would."""
    original = InputBatch.join

    def faulty(self, slot, request):
        if request.seed == seed:
            raise RuntimeError("injected fault")
        return original(self, slot, request)

    monkeypatch.setattr(InputBatch, "join", faulty)


def _fail_output_for_seed(monkeypatch, llm, seed: int) -> None:
    processor = llm.engine.outputs
    original = processor.append

    def faulty(request, samples, row):
        if request.seed == seed:
            raise RuntimeError("injected fault")
        return original(request, samples, row)

    monkeypatch.setattr(processor, "append", faulty)


@pytest.mark.parametrize("stage", ["prepare", "output"])
def test_a_fault_in_one_request_fails_it_alone(llm, solo, monkeypatch, stage):
    if stage == "prepare":
        _fail_for_seed(monkeypatch, seed=666)
    else:
        _fail_output_for_seed(monkeypatch, llm, seed=666)
    faulty = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, seed=666)
    outputs = llm.generate(
        [prompt(0), prompt(1), prompt(2), prompt(3)], [GREEDY, faulty, GREEDY, GREEDY], use_tqdm=False
    )
    assert outputs[1].outputs[0].finish_reason == "error"
    for seed in (0, 2, 3):
        assert outputs[seed].outputs[0].token_ids == solo[seed]
        assert outputs[seed].outputs[0].finish_reason == "length"
    assert_engine_idle(llm)  # the failed request's pages came back


def test_a_fault_no_single_request_explains_is_raised(llm, monkeypatch):
    """A step that fails for every row alike is the engine's fault: it is raised, not pinned on a request."""

    def broken(self, sequences):
        raise RuntimeError("device lost")

    monkeypatch.setattr(ModelRunner, "launch", broken)
    engine = llm.engine
    engine.add_request(prompt(0), GREEDY, request_id="victim")
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    monkeypatch.undo()
    engine.abort_request("victim")
    engine.step()
    assert_engine_idle(llm)


def test_kv_usage_counts_only_pages_requests_hold(llm):
    scheduler = llm.engine.scheduler
    llm.generate([prompt(seed, 40) for seed in range(4)], GREEDY, use_tqdm=False)
    assert scheduler.num_used_pages == 0  # idle: nothing is held by a request
    assert scheduler.num_reclaimable_pages == scheduler.kv.cache.num_pages > 0  # the prompts stay cached
    engine = llm.engine
    engine.add_request(prompt(0, 40), GREEDY, request_id="holder")
    engine.step()
    held = len(scheduler.running[0].pages)
    assert scheduler.num_used_pages == held > 0
    engine.abort_request("holder")
    engine.step()
    assert scheduler.num_used_pages == 0
