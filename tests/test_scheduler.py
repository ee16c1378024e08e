"""The scheduler alone, on host state: token budget, chunking, bucket fitting, admission, preemption."""

import numpy as np

from jserve import SamplingParams
from jserve.engine.config import EngineConfig
from jserve.engine.request import Request, RequestStatus
from jserve.engine.scheduler import Scheduler
from jserve.engine.stats import EngineStats

from test_radix_cache import dump


def make_scheduler(budget=64, seqs=8, pages=64, page_size=4, caching=False, policy="fcfs") -> Scheduler:
    config = EngineConfig(max_model_len=256, max_num_seqs=seqs, max_num_batched_tokens=budget, page_size=page_size,
                          num_pages=pages, seed=0, enable_prefix_caching=caching, schedule_policy=policy,
                          attention_backend="auto", async_scheduling=True, kv_cache_dtype="float32")  # fmt: skip
    return Scheduler(config, EngineStats())


def make_request(num_prompt_tokens: int, arrival: int, priority: int = 0) -> Request:
    return Request(str(arrival), list(range(1, num_prompt_tokens + 1)), SamplingParams(), seed=0,
                   arrival_index=arrival, max_model_len=256, priority=priority)  # fmt: skip


def run_step(scheduler: Scheduler, new_token: int = 7) -> list[tuple[str, int, int]]:
    """Schedule one step and apply it as the engine would; returns (id, start, num_tokens) per sequence."""
    out = scheduler.schedule()
    for seq in out.sequences:
        scheduler.kv.advance(seq.request, seq.num_tokens)
        if seq.samples:
            seq.request.append_token(new_token)
    return [(s.request.request_id, s.start, s.num_tokens) for s in out.sequences]


def assert_pages_whole(scheduler: Scheduler) -> None:
    held = sum(len(r.pages) for r in scheduler.running)
    assert scheduler.pool.num_free + held == scheduler.pool.num_pages


def test_decodes_first_then_prefill_chunks_within_the_budget():
    scheduler = make_scheduler(budget=64)
    for i in range(2):
        scheduler.add(make_request(8, i))
    assert run_step(scheduler) == [("0", 0, 8), ("1", 0, 8)]
    scheduler.add(make_request(100, 2))
    # Two decodes, then the new prompt's first chunk fills the rest of the budget.
    assert run_step(scheduler) == [("0", 8, 1), ("1", 8, 1), ("2", 0, 62)]
    assert run_step(scheduler) == [("0", 9, 1), ("1", 9, 1), ("2", 62, 30)]  # cut back to bucket 32
    assert run_step(scheduler) == [("0", 10, 1), ("1", 10, 1), ("2", 92, 8)]
    assert_pages_whole(scheduler)


def test_a_chunk_spilling_past_a_bucket_is_cut_back_to_its_edge():
    scheduler = make_scheduler(budget=64)  # buckets 16, 32, 64
    scheduler.add(make_request(4, 0))
    run_step(scheduler)
    scheduler.add(make_request(34, 1))
    # 1 decode + 34 prompt tokens = 35 would pad to 64; 31 of them fill bucket 32 and 3 ride along next step.
    assert run_step(scheduler) == [("0", 4, 1), ("1", 0, 31)]
    assert run_step(scheduler) == [("0", 5, 1), ("1", 31, 3)]


def test_a_step_that_fills_its_bucket_is_not_cut():
    scheduler = make_scheduler(budget=64)  # buckets 16, 32, 64
    scheduler.add(make_request(32, 0))
    # 32 prompt tokens fill bucket 32: cutting them back to 16 would pad nothing away and cost a step.
    assert run_step(scheduler) == [("0", 0, 32)]


def test_a_chunk_is_not_cut_below_half():
    scheduler = make_scheduler(budget=64, seqs=16)
    for i in range(10):
        scheduler.add(make_request(1, i))
    run_step(scheduler)
    scheduler.add(make_request(20, 10))
    # 10 decodes + 20 prompt tokens = 30: bucket 16 would leave the prompt only 6 tokens, so it pads to 32.
    assert run_step(scheduler)[-1] == ("10", 0, 20)


def test_max_num_seqs_limits_admission():
    scheduler = make_scheduler(seqs=2)
    for i in range(3):
        scheduler.add(make_request(4, i))
    assert [r for r, _, _ in run_step(scheduler)] == ["0", "1"]
    scheduler.finish(scheduler.running[0], "stop")
    assert [r for r, _, _ in run_step(scheduler)] == ["1", "2"]


def test_priority_orders_admission():
    scheduler = make_scheduler(seqs=1)
    scheduler.add(make_request(4, 0, priority=1))
    scheduler.add(make_request(4, 1, priority=0))
    assert run_step(scheduler) == [("1", 0, 4)]


def test_out_of_pages_preempts_the_latest_admitted_and_it_resumes_first():
    scheduler = make_scheduler(budget=64, pages=4, page_size=4)  # 16 tokens of KV in all
    scheduler.add(make_request(8, 0))
    scheduler.add(make_request(8, 1))
    run_step(scheduler)  # both prompts fill their two pages each; the pool is empty
    assert scheduler.pool.num_free == 0
    out = scheduler.schedule()  # request 0 needs a third page for its next token
    assert [r.request_id for r in out.preempted] == ["1"]
    assert [(s.request.request_id, s.num_tokens) for s in out.sequences] == [("0", 1)]
    preempted = out.preempted[0]
    assert preempted.status is RequestStatus.PREEMPTED and preempted.num_computed_tokens == 0
    assert len(preempted.pages) == 0 and preempted.num_output_tokens == 1  # its output is kept
    assert scheduler.waiting[0] is preempted
    assert_pages_whole(scheduler)
    scheduler.finish(scheduler.running[0], "stop")
    assert scheduler.pool.num_free == scheduler.pool.num_pages
    # It comes back recomputing prompt + output (9 tokens).
    assert [(s.request.request_id, s.start, s.num_tokens) for s in scheduler.schedule().sequences] == [("1", 0, 9)]


def test_finish_returns_pages_and_slots():
    scheduler = make_scheduler()
    requests = [make_request(9, i) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    run_step(scheduler)
    for r in requests:
        scheduler.finish(r, "abort")
    assert scheduler.pool.num_free == scheduler.pool.num_pages
    assert sorted(scheduler.slots.free) == list(range(8))
    assert not scheduler.running and np.all(scheduler.pool.ref_counts == 0)


# --- with the prefix cache -----------------------------------------------------------------------


def finish_all(scheduler: Scheduler) -> None:
    for request in list(scheduler.running):
        scheduler.finish(request, "stop")


def check(scheduler: Scheduler) -> None:
    scheduler.kv.cache.check_integrity([r.pages for r in scheduler.running])


def test_a_cached_prefix_is_skipped_and_its_path_locked():
    scheduler = make_scheduler(caching=True)
    scheduler.add(make_request(10, 0))
    run_step(scheduler)  # 10 prompt tokens: two whole pages enter the cache
    check(scheduler)
    assert scheduler.kv.cache.num_pages == 2
    scheduler.add(make_request(10, 1))  # the same prompt
    assert run_step(scheduler)[-1] == ("1", 8, 2)
    later = scheduler.running[-1]
    assert later.num_cached_tokens == 8 and scheduler.kv.cache.evictable_pages == 0
    check(scheduler)
    finish_all(scheduler)
    check(scheduler)
    assert scheduler.kv.cache.evictable_pages == scheduler.kv.cache.num_pages


def test_cached_pages_are_evicted_before_anyone_is_preempted():
    scheduler = make_scheduler(caching=True, pages=6)
    scheduler.add(make_request(16, 0))
    run_step(scheduler)
    finish_all(scheduler)
    assert scheduler.kv.cache.num_pages == 4 and scheduler.pool.num_free == 2
    scheduler.add(Request("other", list(range(50, 66)), SamplingParams(), seed=0, arrival_index=1, max_model_len=256))
    out = scheduler.schedule()  # needs 4 pages: 2 free + 2 evicted
    assert not out.preempted and out.sequences[0].num_tokens == 16
    assert scheduler.kv.cache.num_pages == 2
    check(scheduler)


def test_lpm_admits_the_longest_cached_prefix_first():
    scheduler = make_scheduler(caching=True, seqs=1, policy="lpm")
    scheduler.add(make_request(12, 0))
    run_step(scheduler)
    finish_all(scheduler)
    scheduler.add(Request("cold", list(range(90, 102)), SamplingParams(), seed=0, arrival_index=1, max_model_len=256))
    scheduler.add(make_request(12, 2))  # arrives later, but shares two cached pages
    assert run_step(scheduler)[0][0] == "2"


def test_lpm_ordering_leaves_the_cache_untouched_and_admission_still_hits():
    scheduler = make_scheduler(caching=True, seqs=1, policy="lpm")
    cache = scheduler.kv.cache
    scheduler.add(make_request(12, 0))  # tokens 1..12: one 3-page edge enters the cache
    run_step(scheduler)
    finish_all(scheduler)
    scheduler.add(Request("busy", list(range(40, 56)), SamplingParams(), seed=0, arrival_index=1, max_model_len=256))
    run_step(scheduler)  # "busy" takes the only slot
    waiting = [make_request(10, 2),  # tokens 1..10: its match ends inside the 3-page edge
               Request("cold", list(range(90, 102)), SamplingParams(), seed=0, arrival_index=3, max_model_len=256),
               Request("salted", list(range(1, 11)), SamplingParams(), seed=0, arrival_index=4, max_model_len=256,
                       cache_salt="tenant")]  # fmt: skip
    for request in waiting:
        scheduler.add(request)
    before = dump(cache)
    assert run_step(scheduler) == [("busy", 16, 1)]  # the queue is ranked, but no slot is free
    assert dump(cache) == before  # no edge split, no access stamped, no root made for "tenant"
    finish_all(scheduler)
    hits = scheduler.stats.prefix_cache_hits
    assert run_step(scheduler) == [("2", 8, 2)]  # the longest cached prefix first, its two pages reused
    assert waiting[0].num_cached_tokens == 8 and scheduler.stats.prefix_cache_hits == hits + 8
    check(scheduler)


def test_penalised_requests_compute_their_whole_history():
    scheduler = make_scheduler(caching=True)
    scheduler.add(make_request(12, 0))
    run_step(scheduler)
    finish_all(scheduler)
    request = Request(
        "p", list(range(1, 13)), SamplingParams(repetition_penalty=1.2), seed=0, arrival_index=1, max_model_len=256
    )
    scheduler.add(request)
    assert run_step(scheduler) == [("p", 0, 12)]
    check(scheduler)


def test_drafts_are_scheduled_within_limits_and_rejected_ones_give_their_pages_back():
    from jserve.spec_decode import SpeculativeConfig, Speculator

    scheduler = make_scheduler(budget=64, page_size=4, caching=True)
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=2),
                            scheduler.stats)  # fmt: skip
    scheduler.speculation = speculator
    # A prompt that repeats, with max_tokens leaving room for 3 tokens after the first.
    request = Request("r", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=4), seed=0, arrival_index=0,
                      max_model_len=256)  # fmt: skip
    scheduler.add(request)
    assert run_step(scheduler, new_token=7) == [("r", 0, 10)]  # the prefill samples 7: "5 6 7" occurred before
    out = scheduler.schedule()
    (seq,) = out.sequences
    assert seq.drafts.tolist() == [8, 5]  # what followed "6 7", cut to max_tokens: 1 + 2 drafts fill it
    assert seq.num_tokens == 3 and seq.samples and seq.token_ids.tolist() == [7, 8, 5]
    scheduler.kv.advance(request, seq.num_tokens)
    assert request.num_computed_tokens == 13 and len(request.pages) == 4
    scheduler.kv.reject(request, 2)  # neither draft accepted
    assert request.num_computed_tokens == 11 and len(request.pages) == 3
    assert_pages_whole(scheduler)
    request.append_token(9)
    scheduler.finish(request, "stop")
    # Only known tokens are cached: the 11 computed, not the drafts' positions.
    assert scheduler.kv.cache.num_pages == 2
    scheduler.check_idle()
