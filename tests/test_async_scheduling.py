"""Async scheduling: step N+1 is launched before step N's samples reach the host, and outputs are the same
token for token as with it off, whatever ends requests, preempts them or shares their pages."""

import time

import pytest

from jserve import SamplingParams

from test_engine import prompts, tiny_llm
from tiny_models import assert_engine_idle, tiny_kv_bytes


def mixed_workload():
    """Prompts and per-request params exercising everything that reads or ends a sequence mid-flight."""
    system = prompts(1, seed=40, low=40, high=41)[0]  # a shared prefix: prefix-cache hits
    batch = prompts(14, seed=41, low=3, high=70) + [system + p for p in prompts(4, seed=42, low=3, high=20)]
    penalties = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3}
    params = [
        SamplingParams(temperature=0, max_tokens=1),  # ends in its first step
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=4, max_tokens=20, n=3, ignore_eos=True),
        SamplingParams(temperature=0.7, **penalties, seed=5, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, logprobs=3),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=10, stop_token_ids=[1, 2, 3, 4, 5, 6, 7, 8]),
        SamplingParams(temperature=0.8, seed=6, max_tokens=40, stop=["a", "e"]),  # stop strings end it early
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),  # runs to max_model_len
    ]
    return batch, [params[i % len(params)] for i in range(len(batch))]


def summary(outputs):
    """What must match exactly, and the log-probs, which match to float noise (steps pad to other buckets)."""
    exact = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]
    logprobs = [
        [
            (c.cumulative_logprob, *[lp.logprob for entry in c.logprobs or [] for lp in entry.values()])
            for c in o.outputs
        ]
        for o in outputs
    ]
    ranks = [
        [[(tid, lp.rank) for entry in c.logprobs or [] for tid, lp in entry.items()] for c in o.outputs]
        for o in outputs
    ]
    return exact, ranks, logprobs


@pytest.mark.parametrize(
    "settings",
    [
        dict(),  # chunked prefill mixed with decodes
        dict(enable_prefix_caching=True),
        dict(kv_cache_memory=tiny_kv_bytes(24), max_num_seqs=16),  # pages run short: preemption
    ],
    ids=["chunked", "prefix-cache", "preemption"],
)
def test_outputs_are_identical_with_and_without_async_scheduling(tiny_llama_checkpoint, settings):
    batch, params = mixed_workload()
    results, preemptions = [], []
    for async_scheduling in (False, True):
        llm = tiny_llm(tiny_llama_checkpoint[0], max_model_len=96, async_scheduling=async_scheduling, **settings)
        results.append(summary(llm.generate(batch, params, use_tqdm=False)))
        preemptions.append(llm.engine.stats.preemptions)
        assert_engine_idle(llm)
        assert llm.engine.in_flight is None
    (exact, ranks, logprobs), (async_exact, async_ranks, async_logprobs) = results
    assert exact == async_exact and ranks == async_ranks
    for a, b in zip(logprobs, async_logprobs, strict=True):
        a, b = [x for c in a for x in c], [x for c in b for x in c]
        assert [x is None for x in a] == [x is None for x in b]  # no logprobs asked for: None on both sides
        present = [x for x in a if x is not None], [x for x in b if x is not None]
        assert present[0] == pytest.approx(present[1], rel=1e-5, abs=1e-5)
    if "kv_cache_memory" in settings:
        assert min(preemptions) > 0


def test_the_next_step_is_launched_before_the_previous_is_processed(tiny_llama_checkpoint):
    llm = tiny_llm(tiny_llama_checkpoint[0])
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompts(1, seed=43, low=16, high=17)[0], greedy)
    assert engine.step() == [] and engine.in_flight is not None  # the prefill launched, nothing processed yet
    outputs = engine.step()  # the first decode launched, then the prefill's sample processed
    assert [o.outputs[0].delta_token_ids for o in outputs] == [engine.in_flight.sequences[0].request.output_token_ids]
    request = engine.in_flight.sequences[0].request
    assert request.num_output_tokens == 1 and request.num_pending == 1  # one token known, the next in flight
    while engine.has_unfinished_requests():
        engine.step()
    assert request.num_output_tokens == 8 and engine.in_flight is None
    stats = engine.sync_stats()
    elapsed = time.perf_counter() - start
    assert (stats.steps, stats.prompt_tokens, stats.generated_tokens) == (8, 16, 8)  # one step per token
    # The device's busy and idle time tile the span from the first launch to the last step's end, and the
    # host's time leaves out its waits for samples: each is a part of the wall time these steps took.
    assert stats.device_busy_s > 0 and stats.device_busy_s + stats.device_idle_s <= elapsed
    assert 0 < stats.host_s <= elapsed
    assert_engine_idle(llm)
