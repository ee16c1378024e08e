"""The server's Prometheus metrics, fed outputs as the engine thread feeds them."""

from jserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jserve.server.metrics import ServerMetrics


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
