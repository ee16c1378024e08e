"""The server's Prometheus metrics, fed outputs as the engine thread feeds them."""

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.utils import floatToGoString

from jserve.engine.stats import EngineSnapshot
from jserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jserve.server.metrics import TOKEN_LATENCY_BUCKETS, ServerMetrics


def output(*completions: tuple[int, str | None], finished: bool = False) -> RequestOutput:
    """One step's output of request "r" (n = len(completions)): (new tokens, finish_reason) per completion."""
    outputs = [
        CompletionOutput(i, "", [], finish_reason=reason, delta_token_ids=[7] * new)
        for i, (new, reason) in enumerate(completions)
    ]
    return RequestOutput("r", None, [1, 2], outputs, finished, metrics=RequestMetrics(arrival_time=0.0))


def successes(metrics: ServerMetrics, reason: str) -> float:
    labels = {"model_name": "m", "finished_reason": reason}
    return metrics.registry.get_sample_value("jserve:request_success_total", labels) or 0.0


def test_a_completion_is_counted_once_while_its_siblings_run():
    metrics = ServerMetrics("m")
    metrics.observe_output(output((1, None), (1, None)), now=1.0)
    metrics.observe_output(output((1, "stop"), (1, None)), now=2.0)  # the first child stops
    metrics.observe_output(output((0, "stop"), (1, None)), now=3.0)  # and is repeated as its sibling runs
    metrics.observe_output(output((0, "stop"), (1, "length"), finished=True), now=4.0)
    assert (successes(metrics, "stop"), successes(metrics, "length")) == (1.0, 1.0)
    # the same request id later (ids are unique per call, but the counter must not remember it forever)
    metrics.observe_output(output((1, "stop"), finished=True), now=5.0)
    assert successes(metrics, "stop") == 2.0


def test_inter_token_latency_reads_as_prometheus_own_histogram():
    # Each step's gaps go in with one pass at observe_step; /metrics must read as if each had gone through
    # prometheus_client's Histogram: bucket by bucket (a gap on a bound counts in it), count and sum.
    reference_registry = CollectorRegistry()
    reference = Histogram("itl", "itl", buckets=TOKEN_LATENCY_BUCKETS, registry=reference_registry)
    metrics = ServerMetrics("m")
    idle = EngineSnapshot(0, 0, 0.0, 0.0, *[0] * 6, 0.0, 0.0, 0.0, 0, 0, 0, ())
    times = [0.0, 0.01, 0.013, 0.5, 0.5, 3.0, 10.0]  # gaps 0.01 (a bound), 0.003, 0.487, none (no new token), 2.5, 3.5
    for now, new_tokens in zip(times, [1, 1, 1, 1, 0, 1, 2], strict=True):
        metrics.observe_output(output((new_tokens, None)), now=now)
        metrics.observe_step(idle)
    last = None
    for now, new_tokens in zip(times, [1, 1, 1, 1, 0, 1, 2], strict=True):
        if new_tokens:
            if last is not None:
                reference.observe((now - last) / new_tokens)
            last = now
    name = "jserve:inter_token_latency_seconds"
    for bound in [*map(floatToGoString, TOKEN_LATENCY_BUCKETS), "+Inf"]:
        want = reference_registry.get_sample_value("itl_bucket", {"le": bound})
        assert metrics.registry.get_sample_value(f"{name}_bucket", {"model_name": "m", "le": bound}) == want, bound
    assert metrics.registry.get_sample_value(f"{name}_count", {"model_name": "m"}) == 5
    assert metrics.registry.get_sample_value(f"{name}_sum", {"model_name": "m"}) == pytest.approx(
        reference_registry.get_sample_value("itl_sum")
    )
