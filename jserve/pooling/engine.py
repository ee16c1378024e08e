"""EmbeddingEngine: inputs in, one vector each out. The scheduler plans prompt chunks as it does for
generation (token budget, sequence slots, KV pages, priorities); each step runs them, pools, and an input
whose last chunk ran is done: its vector is made, its pages go back. Nothing decodes or samples.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from jserve.engine.compile_guard import check_no_compiles, compile_count
from jserve.engine.config import EngineConfig
from jserve.engine.request import Request
from jserve.engine.scheduler import Scheduler
from jserve.engine.stats import EngineSnapshot, EngineStats
from jserve.engine.validation import RequestValidator
from jserve.errors import RequestError
from jserve.loader import LoadedModel
from jserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestMetrics
from jserve.pooling.config import PoolingConfig
from jserve.pooling.params import PoolingParams
from jserve.pooling.runner import PoolingRunner
from jserve.pooling.vectors import Pooler, normalized
from jserve.sampling_params import SamplingParams

log = logging.getLogger("jserve")

# What the scheduler reads of an input's options: it ends once its prompt is computed.
PROMPT_ONLY = SamplingParams(max_tokens=1)


class EmbeddingEngine:
    def __init__(self, model: LoadedModel, config: EngineConfig, pooling: PoolingConfig, progress_bars: bool = False):
        self.model, self.config, self.pooling = model, config, pooling
        self.tokenizer = model.tokenizer
        self.dimension = pooling.dimension(model.config.hidden_size)
        self.stats = EngineStats(generates=False)
        self.scheduler = Scheduler(config, self.stats)
        self.pooler = Pooler(pooling)
        self.runner = PoolingRunner(model, config, self.pooler.kinds)
        self.validator = RequestValidator(config, model.config.vocab_size, frozenset())
        self.requests: dict[str, Request] = {}
        self._dimensions: dict[str, int | None] = {}  # by request: the length it asked its vector cut to
        self._partial: dict[str, np.ndarray] = {}  # statistics of inputs whose later chunks are still to run
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        log.info("Embedding model: %d-dimensional vectors; pooling %s", self.dimension, pooling.describe())
        self.runner.warm_up(progress_bars)
        self.stats.start()

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        prompt_text: str | None = None,
        cache_salt: str | None = None,
        lora_request=None,
    ) -> str:
        """Validate and queue one input (token ids), as LLMEngine.add_request queues a prompt; raises a
        RequestError naming the field before anything is queued. Inputs share cached prefixes only with inputs
        of the same `cache_salt`. (`lora_request`: refused; adapters are served for generation.)"""
        if lora_request is not None:
            raise RequestError("LoRA adapters are served for generation, not by an embedding model", "lora_request")
        params = params or PoolingParams()
        dimensions = params.dimensions
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        limit = self.config.max_model_len - 1
        if not isinstance(prompt_token_ids, str) and len(prompt_token_ids) > limit:
            raise RequestError(f"input has {len(prompt_token_ids)} tokens; this engine embeds at most {limit} "
                               f"(max_model_len - 1)", "input")  # fmt: skip
        ids = self.validator.prompt_ids(prompt_token_ids)
        self.validator.check(PROMPT_ONLY, priority)
        self.check_dimensions(dimensions)
        request = Request(request_id, ids, PROMPT_ONLY, seed=0, arrival_index=next(self._arrivals),
                          max_model_len=self.config.max_model_len, prompt=prompt_text, priority=priority,
                          cache_salt=cache_salt)  # fmt: skip
        self.requests[request_id] = request
        self._dimensions[request_id] = dimensions
        self.scheduler.add(request)
        return request_id

    def check_dimensions(self, dimensions: int | None) -> None:
        """A vector may be cut only for a model trained for it (matryoshka), to a length it lists if it lists
        any."""
        if dimensions is None:
            return
        allowed = self.pooling.matryoshka_dimensions
        if allowed is None:
            raise RequestError("dimensions: this model was not trained to be truncated (no matryoshka_dimensions "
                               "or is_matryoshka in its config.json)", "dimensions")  # fmt: skip
        if dimensions > self.dimension:
            raise RequestError(f"dimensions must be at most the model's {self.dimension}, got {dimensions}",
                               "dimensions")  # fmt: skip
        if allowed and dimensions not in allowed:
            raise RequestError(f"dimensions must be one of {list(allowed)}, got {dimensions}", "dimensions")

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request, "abort")
            self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """(An embedding model runs on one host: there are no followers to release.)"""

    def step(self) -> list[EmbeddingRequestOutput]:
        """Run one step of prompt chunks; returns the inputs it finished."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.stats.preemptions += len(scheduled.preempted)
        for request in scheduled.preempted:
            self._partial.pop(request.request_id, None)  # it starts over
        sequences = scheduled.sequences
        if not sequences:
            return []
        prepared, compiled, ran_at = self.runner.prepare_s, compile_count(), time.perf_counter()
        stats = self.runner.run(sequences)  # (waits for the device)
        device_s = time.perf_counter() - ran_at - (self.runner.prepare_s - prepared)
        check_no_compiles(compiled, "the pooling step", self.config.debug_checks)
        finished: list[tuple[Request, np.ndarray]] = []
        for seq, chunk in zip(sequences, stats, strict=True):
            request = seq.request
            self.scheduler.kv.advance(request, seq.num_tokens)
            self.stats.prompt_tokens += seq.num_tokens
            so_far = None if seq.first else self._partial.pop(request.request_id)
            combined = self.pooler.combine(so_far, chunk)
            if seq.samples:  # its last chunk
                finished.append((request, combined))
            else:
                self._partial[request.request_id] = combined
        outputs = self._finish(finished) if finished else []
        self.stats.steps += 1
        self.stats.host_s += time.perf_counter() - start - device_s
        self.stats.device_busy_s += device_s
        scheduler = self.scheduler
        running = len(scheduler.running)
        self.stats.maybe_log(
            running, scheduler.num_unfinished - running, scheduler.num_used_pages / scheduler.pool.num_pages
        )
        if self.config.debug_checks and not self.requests:
            scheduler.check_idle()
        return outputs

    def _finish(self, finished: list[tuple[Request, np.ndarray]]) -> list[EmbeddingRequestOutput]:
        stats = np.stack([combined for _, combined in finished])
        lengths = np.array([request.num_prompt_tokens for request, _ in finished])
        vectors = self.pooler.vectors(stats, lengths)
        outputs = []
        for (request, _), vector in zip(finished, vectors, strict=True):
            self.scheduler.finish(request, "stop")
            dimensions = self._dimensions[request.request_id]
            if dimensions is not None:
                vector = vector[:dimensions]
                vector = normalized(vector) if self.pooling.normalize else vector
            metrics = RequestMetrics(request.arrival_time, request.first_scheduled_time, None, request.finish_time,
                                     request.num_preemptions)  # fmt: skip
            output = EmbeddingRequestOutput(request.request_id, request.prompt_token_ids,
                                            EmbeddingOutput(vector.tolist()), request.prompt,
                                            num_cached_tokens=request.num_cached_tokens, metrics=metrics)  # fmt: skip
            outputs.append(output)
            del self.requests[request.request_id]
            self._forget(request.request_id)
        return outputs

    def snapshot(self) -> EngineSnapshot:
        """Where the engine stands, as LLMEngine.snapshot (nothing generated, nothing speculated)."""
        return EngineSnapshot.of(self.stats, self.scheduler)

    def sync_stats(self) -> EngineStats:
        return self.stats  # (every step is waited for: its device time is counted already)

    def _forget(self, request_id: str) -> None:
        self._dimensions.pop(request_id, None)
        self._partial.pop(request_id, None)
