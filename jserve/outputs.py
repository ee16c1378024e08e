"""What generation returns, shaped like vLLM's outputs so users' code carries over. Slotted dataclasses: the
engine makes outputs for every running request every step, and slots make them smaller and quicker to read."""

from __future__ import annotations

from dataclasses import dataclass, field

from jserve.tools.calls import ToolCall


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely under the model
    decoded_token: str | None = None


# One entry per generated token: the sampled token and the top alternatives, by token id.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None  # first admitted to the running batch
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    """One completion as of one engine step. Every output carries what the step adds (`delta`,
    `delta_token_ids`, `delta_logprobs`), which is all a stream reads, so an output costs what it adds; the
    whole completion (`text`, `token_ids`, `logprobs`) is assembled once, in its finished output, and is
    empty in the outputs before it."""

    index: int
    text: str  # the whole text, in the finished output
    token_ids: list[int]  # every generated token, in the finished output
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None  # one entry per generated token, in the finished output
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error", None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # Final text: never half a UTF-8 character, nor a tail that could still become a stop string (both wait
    # for a later delta), so the deltas of a completion's outputs concatenate to its whole text.
    delta: str = ""
    delta_token_ids: list[int] = field(default_factory=list)  # their text may come in a later delta
    delta_logprobs: SampleLogprobs | None = None  # for delta_token_ids; None when logprobs were not asked for
    # LLM.chat with tools: the calls parsed from the finished text, which is then the content around them
    tool_calls: list[ToolCall] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # with SamplingParams.prompt_logprobs, once the prompt is scored: None for the first token, then per token
    # its own logprob and the top alternatives, by token id
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    weights_version: int = 0  # the weights that produced it: 0 as loaded, +1 with each LLM.update_weights


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """One input's vector, shaped like vLLM's (`output.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    prompt: str | None = None
    finished: bool = True
    num_cached_tokens: int = 0  # leading tokens whose K/V came from the prefix cache
    metrics: RequestMetrics | None = field(default=None, repr=False)
