"""The engine's periodic log line: rates over the time work ran, and no line without work."""

import logging

import pytest

from jserve.engine import stats as stats_module
from jserve.engine.stats import LOG_INTERVAL_S, EngineStats


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(stats_module.time, "monotonic", clock)
    return clock


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "tok/s" in r.getMessage()]


def test_no_line_before_any_work(clock, caplog):
    stats = EngineStats()
    clock.now += 60  # loading and warm-up
    stats.start()
    clock.now += 3 * LOG_INTERVAL_S
    with caplog.at_level(logging.INFO, logger="jserve"):
        stats.maybe_log(running=0, waiting=0, kv_used=0.0)
    assert lines(caplog) == []


def test_rates_leave_out_warm_up_and_idle_spells(clock, caplog):
    stats = EngineStats()
    clock.now += 60
    stats.start()
    clock.now += 300  # idle until the first request
    stats.resume()
    with caplog.at_level(logging.INFO, logger="jserve"):
        for _ in range(4):  # 4 s of steps, then an idle minute, then 8 s more
            clock.now += 1
            stats.prompt_tokens += 100
            stats.generated_tokens += 10
            stats.maybe_log(running=1, waiting=0, kv_used=0.1)
        clock.now += 60
        stats.resume()
        for _ in range(8):
            clock.now += 1
            stats.prompt_tokens += 100
            stats.generated_tokens += 10
            stats.maybe_log(running=1, waiting=0, kv_used=0.1)
    assert len(lines(caplog)) == 1
    assert lines(caplog)[0].startswith("prefill 100.0 tok/s, generation 10.0 tok/s over 10s of work")


def test_an_engine_logs_no_throughput_while_starting(tiny_llama_checkpoint, caplog):
    from test_engine import tiny_llm

    with caplog.at_level(logging.INFO, logger="jserve"):
        llm = tiny_llm(tiny_llama_checkpoint[0])
    messages = [r.getMessage() for r in caplog.records]
    assert lines(caplog) == []
    assert any(m.startswith("KV cache: 64 pages of 16 tokens = 1024 tokens of float32, ") for m in messages), messages
    assert any(m.startswith("Compiled ") and "token buckets 1, 16, 32, 64" in m for m in messages), messages
    llm.close()


def test_an_engine_that_does_not_generate_logs_no_generation_rate(clock, caplog):
    stats = EngineStats(generates=False)
    stats.start()
    with caplog.at_level(logging.INFO, logger="jserve"):
        for _ in range(10):
            clock.now += 1
            stats.prompt_tokens += 100
            stats.maybe_log(running=2, waiting=0, kv_used=0.1)
    assert lines(caplog)[0].startswith("prefill 100.0 tok/s over 10s of work; running 2")
