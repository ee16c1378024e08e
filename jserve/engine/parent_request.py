"""What the user asked for: n completions of one prompt, each a Request of its own, and the RequestOutput
that reports them after a step."""

from __future__ import annotations

from dataclasses import dataclass

from jserve.engine.output_processor import OutputProcessor
from jserve.engine.request import Request, RequestStatus
from jserve.outputs import RequestMetrics, RequestOutput


@dataclass(slots=True)
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    metrics: RequestMetrics | None = None  # the latest output's, while it still holds

    @property
    def finished(self) -> bool:
        children = self.children
        return children[0].is_finished if len(children) == 1 else all(child.is_finished for child in children)

    def output(self, processor: OutputProcessor, weights_version: int) -> RequestOutput:
        """The parent's output for this step. Its completions carry what changed since their last output, and
        each change is handed out once: every output the engine returns must reach its consumer. Weights
        change only while no request runs, so the engine's current ones made all of it."""
        children = self.children
        if len(children) == 1:  # the common case, without the folds over siblings
            child = children[0]
            finished = child.status is RequestStatus.FINISHED
            metrics = self.metrics
            # Made again only when it changes (never edited: earlier outputs hold it too); positional, since a
            # keyword call costs about twice as much.
            if (finished or metrics is None or metrics.first_token_time is not child.first_token_time
                    or metrics.first_scheduled_time is not child.first_scheduled_time
                    or metrics.num_preemptions != child.num_preemptions):  # fmt: skip
                metrics = self.metrics = RequestMetrics(
                    child.arrival_time, child.first_scheduled_time, child.first_token_time,
                    child.finish_time if finished else None, child.num_preemptions,
                )  # fmt: skip
            num_cached = child.num_cached_tokens
            completions = [processor.completion(child)]
        else:
            finished = self.finished
            scheduled = [c.first_scheduled_time for c in children if c.first_scheduled_time is not None]
            first_tokens = [c.first_token_time for c in children if c.first_token_time is not None]
            finishes = [c.finish_time for c in children if c.finish_time is not None]
            metrics = RequestMetrics(
                arrival_time=min(c.arrival_time for c in children),
                first_scheduled_time=min(scheduled, default=None),
                first_token_time=min(first_tokens, default=None),
                finish_time=max(finishes, default=None) if finished else None,
                num_preemptions=sum(c.num_preemptions for c in children),
            )
            num_cached = max(c.num_cached_tokens for c in children)
            completions = [processor.completion(c) for c in children]
        scores = processor.prompt_logprobs(children[0]) if children[0].params.prompt_logprobs is not None else None
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, completions, finished, scores, num_cached, metrics,
            weights_version,
        )  # fmt: skip
