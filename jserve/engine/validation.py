"""What the engine checks of a request before it queues anything: the prompt's ids against the vocabulary and
max_model_len, and the options against this engine (vocabulary, max_num_seqs, schedule policy, bias row
width). SamplingParams checks what it can alone when it is made; everything else is here. Each failure is a
RequestError naming the field, raised before the engine changes."""

from __future__ import annotations

from jserve.engine.config import EngineConfig, SchedulePolicy
from jserve.engine.sampler import bias_entries
from jserve.errors import RequestError
from jserve.sampling_params import SamplingParams


class RequestValidator:
    def __init__(self, config: EngineConfig, vocab_size: int, stop_ids: frozenset[int]):
        self.config, self.vocab_size, self.stop_ids = config, vocab_size, tuple(stop_ids)

    def prompt_ids(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt as a list of int ids, checked."""
        if isinstance(prompt_token_ids, str):
            raise TypeError("add_request takes token ids; encode a text prompt with the tokenizer first")
        ids = [int(t) for t in prompt_token_ids]
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt"
            )
        if not ids:
            raise RequestError("prompt is empty", "prompt")
        if len(ids) >= self.config.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens, but max_model_len is {self.config.max_model_len} "
                "(the prompt plus at least one generated token must fit)",
                "prompt",
            )
        return ids

    def check(self, params: SamplingParams, priority: int) -> None:
        """The request's options, as this engine can honour them."""
        config = self.config
        params.validate_for_vocab(self.vocab_size)
        if params.n > config.max_num_seqs:  # each completion is a sequence of its own
            raise RequestError(f"n must be at most max_num_seqs ({config.max_num_seqs}), got {params.n}", "n")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestError(f"priority must be an integer, got {priority!r:.60}", "priority")
        if priority != 0 and config.schedule_policy != SchedulePolicy.PRIORITY:
            raise RequestError(
                f"priority is honoured only with schedule_policy 'priority' (--schedule-policy priority); this "
                f"engine runs '{config.schedule_policy}', got {priority}",
                "priority",
            )
        bias_entries(params, self.stop_ids + params.stop_token_ids)  # raises now if the bias row would overflow
