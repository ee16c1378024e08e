"""A request's state as it moves WAITING -> RUNNING -> FINISHED (and PREEMPTED back to waiting)."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from jserve.engine.radix_cache import Node
from jserve.sampling_params import SamplingParams
from jserve.structured import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed; it recomputes prompt + output so far
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """One sequence to complete. Past its identity (set at construction, never written after), each field
    has one writer, named first in its comment (or in the comment above it); everyone else only reads it:
      Scheduler (scheduler.py): where the request is in its life, and when;
      SequenceSlots (slots.py): its slot;
      KVManager (kv_manager.py): its KV pages, cache lock and computed tokens;
      OutputProcessor (output_processor.py): its sampled tokens, from launch (pending) to fetch (appended);
      LLMEngine (engine.py): when its first sample was fetched.
    """

    # Identity and options: set at construction (LLMEngine.add_request), never written after.
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed: params.seed, or one the engine drew
    arrival_index: int  # FCFS order among equal priorities
    max_model_len: int
    prompt: str | None = None
    priority: int = 0  # lower runs first, as in vLLM
    index: int = 0  # which of the parent's n completions this is
    parent_id: str | None = None
    # prefix-cache namespace: requests share cached pages only within one (a str, or with an adapter a tuple)
    cache_salt: Hashable = None
    adapter: object | None = None  # the LoRA adapter it runs with (lora/registry.py ServedAdapter), None: the base
    stream: bool = True  # its consumer reads every step's delta (else only the finished output)
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING  # Scheduler
    admit_index: int = -1  # Scheduler: order of admission to RUNNING; the latest admitted is preempted first
    num_preemptions: int = 0  # Scheduler
    num_cached_tokens: int = 0  # Scheduler: prompt tokens found in the prefix cache at first admission
    first_scheduled_time: float | None = None  # Scheduler
    finish_reason: str | None = None  # Scheduler
    stop_reason: int | str | None = None  # Scheduler
    finish_time: float | None = None  # Scheduler

    slot: int = -1  # SequenceSlots: the engine row (page table, penalty state) while running
    adapter_slot: int = -1  # AdapterSlots (lora/slots.py): the device slot holding its adapter while running

    # KVManager: the pages holding its K/V while it runs, covering at least its computed tokens.
    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32), repr=False)
    # KVManager: the locked cache node its pages reach (with prefix caching, while running).
    cache_node: Node | None = field(default=None, repr=False)
    # KVManager, on the engine's word (KVManager.advance at launch): tokens whose K/V are in its pages, or
    # being written by a launched step.
    num_computed_tokens: int = 0

    # OutputProcessor: all tokens (prompt then output) in a buffer sized for the longest sequence, so
    # slicing is cheap; the prompt is written at construction.
    token_buffer: np.ndarray = field(init=False, repr=False)
    num_prompt_tokens: int = field(init=False)  # set with the prompt (read several times a step: not a property)
    max_len: int = field(init=False)  # the length that ends it: the prompt plus max_tokens, or max_model_len
    num_tokens: int = field(init=False)  # OutputProcessor: tokens whose ids the host knows
    # OutputProcessor, on the engine's word (OutputProcessor.launched) for async scheduling: tokens sampled
    # by launched steps whose ids the host has not fetched yet (0-2), and the row of the latest launched
    # step's samples that holds the newest of them.
    num_pending: int = 0
    pending_row: int = -1
    cumulative_logprob: float = 0.0  # OutputProcessor
    # OutputProcessor: with structured outputs, the request's place in its grammar (advanced with each
    # appended token; preemption keeps the tokens, so it keeps this too). Made by LLMEngine.add_request.
    grammar: GrammarMatcher | None = field(default=None, repr=False)
    logprobs: list = field(default_factory=list)  # OutputProcessor
    # OutputProcessor: with prompt_logprobs, the prompt's scores so far, chunk by chunk (see record_prompt_scores)
    prompt_scores: list = field(default_factory=list, repr=False)
    num_prompt_scored: int = 0  # OutputProcessor: prompt positions scored (each scores the token after it)
    first_token_time: float | None = None  # LLMEngine, as it fetches the step that sampled it

    def __post_init__(self):
        self.token_buffer = np.zeros(self.max_model_len, np.int32)
        self.num_prompt_tokens = self.num_tokens = len(self.prompt_token_ids)
        self.token_buffer[: self.num_prompt_tokens] = self.prompt_token_ids
        max_tokens = self.params.max_tokens
        self.max_len = (
            self.max_model_len if max_tokens is None else min(self.max_model_len, self.num_prompt_tokens + max_tokens)
        )

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence, counting those sampled but not yet fetched: what the scheduler plans with."""
        return self.num_tokens + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_buffer[self.num_prompt_tokens : self.num_tokens].tolist()

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_buffer[self.num_tokens] = token_id
        self.num_tokens += 1
