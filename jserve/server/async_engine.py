"""AsyncEngine: the engine (an LLMEngine, or an EmbeddingEngine) in one background thread, fed by asyncio handlers.

Handlers never touch the engine: they put commands (server/commands.py) on a thread-safe queue, read
what they need of the model from `info`, and get outputs back from the engine thread through
`call_soon_threadsafe`, one batch per step. The thread also loads the model, so the server answers
/health (503) while that happens.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jserve.engine.args import EngineArgs
from jserve.engine.engine import LLMEngine
from jserve.errors import JServeError
from jserve.lora import LoRARequest
from jserve.outputs import EmbeddingRequestOutput, RequestOutput
from jserve.pooling import EmbeddingEngine, PoolingConfig, PoolingParams
from jserve.sampling_params import SamplingParams
from jserve.server.commands import AbortRequests, AddRequests, CallEngine, Command, PromptInput, Stop
from jserve.server.metrics import ServerMetrics
from jserve.server.submission import EngineError, Submission
from jserve.startup import create_engine
from jserve.structured import GrammarCompiler
from jserve.tokenizer import Tokenizer

log = logging.getLogger("jserve")

SHUT_DOWN = "the server shut down before this request finished"


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # shutting down: finishing what is in flight, taking nothing new
    FAILED = "failed"  # the model did not load
    STOPPED = "stopped"


@dataclass(frozen=True)
class EngineInfo:
    """What handlers may know of the loaded model, captured once by the engine thread before it serves."""

    tokenizer: Tokenizer  # the engine's own (with the server's chat template, if one was given)
    vocab_size: int
    max_model_len: int
    # thread-safe: handlers compile off the engine thread, the engine finds them cached (None: an embedder)
    grammars: GrammarCompiler | None
    pooling: PoolingConfig | None = None  # an embedding model's pooling (None: a model that generates)
    dimension: int | None = None  # an embedding model's vectors' length
    serves_adapters: bool = False  # LoRA adapters are enabled: a request's model may name one

    @property
    def embeds(self) -> bool:
        return self.pooling is not None


class AsyncEngine:
    def __init__(self, args: EngineArgs, metrics: ServerMetrics, chat_template: str | None = None,
                 on_failure: Callable[[], None] | None = None, on_ready: Callable[[], None] | None = None):  # fmt: skip
        """`on_failure`: called (on the engine thread) if the model fails to load; `on_ready`: once it has
        loaded, before the engine takes requests."""
        self.args, self.metrics = args, metrics
        self.chat_template = chat_template
        self.on_failure, self.on_ready = on_failure, on_ready
        self.state = EngineState.LOADING
        self.info: EngineInfo | None = None  # set once the model has loaded, before the state turns READY
        self.engine: LLMEngine | EmbeddingEngine | None = None  # touched by the engine thread only (tests inspect it)
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.submissions: set[Submission] = set()  # event-loop side: open submissions
        self._routes: dict[str, Submission] = {}  # engine-thread side: request id -> its submission
        self._ids = itertools.count()
        self._abort_at: float | None = None  # draining: when what is still in flight is ended (time.monotonic)
        self._thread = threading.Thread(target=self._run, name="jserve-engine", daemon=True)

    # --- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def num_queued(self) -> int:
        """Sequences (prompts × n) accepted but not yet producing output."""
        return sum(len(s.unstarted) * s.n for s in self.submissions)

    async def submit(
        self,
        prompts: list[PromptInput],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Submission:
        """Queue one engine request per prompt (PoolingParams: one input each to embed); raises RequestError
        (the engine's validation, naming the field) if any is bad, in which case none is queued. A grammar is
        compiled here, on a worker thread, so a slow one holds up only its own request."""
        generates = isinstance(params, SamplingParams)
        if generates and params.structured_outputs is not None:
            await asyncio.to_thread(self.info.grammars.compile, params.structured_outputs)
        prefix = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        n = params.n if generates else 1
        submission = Submission([f"{prefix}-{i}" for i in range(len(prompts))], n, self._abort)
        accepted = submission.loop.create_future()
        self.submissions.add(submission)
        self.commands.put(AddRequests(submission, prompts, params, priority, cache_salt, lora_request, accepted))
        try:
            await accepted
        except BaseException:  # refused, or the client left while it was being queued
            submission.abort()
            raise
        return submission

    async def call(self, call: Callable[[LLMEngine], Any]) -> Any:
        """`call(engine)`'s result, run on the engine thread between steps (its exception raised here)."""
        done = asyncio.get_running_loop().create_future()
        self.commands.put(CallEngine(call, done))
        return await done

    def _abort(self, submission: Submission, unfinished: bool) -> None:
        """A submission's call ended: stop routing to it, and abort its requests if some have not finished."""
        self.submissions.discard(submission)
        if unfinished:
            self.commands.put(AbortRequests(tuple(submission.request_ids)))

    def begin_drain(self, abort_after: float | None = None) -> None:
        """Take no new requests; those in flight finish, or after `abort_after` seconds end with an error
        (EngineError), so that their responses and streams end themselves before the server gives up on them."""
        if self.state is EngineState.READY:
            self.state = EngineState.DRAINING
            log.info("Draining: finishing %d requests in flight, accepting no new ones", len(self.submissions))
            if abort_after is not None:
                self._abort_at = time.monotonic() + abort_after

    def shutdown(self) -> None:
        """Abort what is still running and stop the engine thread."""
        self.commands.put(Stop())
        self._thread.join(timeout=60)
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED

    # --- engine-thread side ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = create_engine(self.args)
            if self.chat_template is not None:
                self.engine.tokenizer.chat_template = self.chat_template
            self.info = engine_info(self.engine)
        except (JServeError, ValueError) as err:  # a bad model or setting: say what, without a traceback
            log.error("The model failed to load: %s", err)
            self._fail_load()
            return
        except BaseException:
            log.exception("The model failed to load")
            self._fail_load()
            return
        if self.on_ready is not None:
            self.on_ready()
        if self.state is EngineState.LOADING:
            self.state = EngineState.READY
        engine = self.engine
        while True:
            if not self._take_commands(block=not engine.has_unfinished_requests()):
                break
            if self._routes and self._abort_at is not None and time.monotonic() >= self._abort_at:
                log.warning("Shutdown timeout: aborting the %d requests still in flight", len(self._routes))
                self._fail_all(EngineError(SHUT_DOWN))
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as err:  # a bug, not a request's fault: fail what is in flight, keep serving
                log.exception("Engine step failed; failing the %d requests in flight", len(self._routes))
                self._fail_all(EngineError(f"engine step failed: {err}"))
                continue
            self._deliver(outputs)
        self._fail_all(EngineError(SHUT_DOWN))
        engine.close()

    def _fail_load(self) -> None:
        self.state = EngineState.FAILED
        if self.on_failure is not None:
            self.on_failure()

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once told to stop."""
        while True:
            try:
                command = self.commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            match command:
                case AddRequests():
                    self._add(command)
                case AbortRequests(request_ids):
                    for request_id in request_ids:
                        self.engine.abort_request(request_id)
                        self._routes.pop(request_id, None)
                case CallEngine(call, done):
                    try:
                        result, error = call(self.engine), None
                    except Exception as err:  # the caller's to report; the engine goes on
                        result, error = None, err
                    done.get_loop().call_soon_threadsafe(_settle, done, error, result)
                case Stop():
                    return False

    def _add(self, command: AddRequests) -> None:
        submission, added = command.submission, []
        try:
            for request_id, prompt in zip(submission.request_ids, command.prompts, strict=True):
                self.engine.add_request(
                    prompt.token_ids,
                    command.params,
                    request_id,
                    command.priority,
                    prompt.text,
                    command.cache_salt,
                    lora_request=command.lora_request,
                )
                added.append(request_id)
        except Exception as err:  # bad input: withdraw this call's requests, touch nothing else
            for request_id in added:
                self.engine.abort_request(request_id)
            submission.loop.call_soon_threadsafe(_settle, command.accepted, err)
            return
        for request_id in added:
            self._routes[request_id] = submission
        submission.loop.call_soon_threadsafe(_settle, command.accepted, None)

    def _deliver(self, outputs: list[RequestOutput] | list[EmbeddingRequestOutput]) -> None:
        now = time.monotonic()
        batch = []
        for out in outputs:
            submission = self._routes.get(out.request_id)
            if out.finished:
                self._routes.pop(out.request_id, None)
            self.metrics.observe_output(out, now)
            if submission is not None:
                batch.append((submission, out))
        self.metrics.observe_step(self.engine.snapshot())
        if batch:
            batch[0][0].loop.call_soon_threadsafe(_deliver_batch, batch)

    def _fail_all(self, err: EngineError) -> None:
        for request_id, submission in list(self._routes.items()):
            self.engine.abort_request(request_id)
            submission.loop.call_soon_threadsafe(submission._deliver, err)
        self._routes.clear()


def engine_info(engine: LLMEngine | EmbeddingEngine) -> EngineInfo:
    vocab, max_model_len = engine.model.config.vocab_size, engine.config.max_model_len
    if isinstance(engine, EmbeddingEngine):
        return EngineInfo(engine.tokenizer, vocab, max_model_len, None, engine.pooling, engine.dimension)
    return EngineInfo(engine.tokenizer, vocab, max_model_len, engine.grammars,
                      serves_adapters=engine.adapters is not None)  # fmt: skip


def _settle(future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    if not future.done():  # the handler may have been cancelled meanwhile
        future.set_exception(error) if error is not None else future.set_result(result)


def _deliver_batch(batch: list[tuple[Submission, RequestOutput | EmbeddingRequestOutput]]) -> None:
    for submission, out in batch:
        submission._deliver(out)
