"""LLMEngine: requests in, one scheduled + executed + processed step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from jserve.engine.compile_guard import check_no_compiles, compile_count
from jserve.engine.config import EngineConfig
from jserve.engine.device_timeline import DeviceTimeline
from jserve.engine.output_processor import FetchedSamples, OutputProcessor
from jserve.engine.parent_request import ParentRequest
from jserve.engine.progress import progress
from jserve.engine.request import Request, RequestStatus
from jserve.engine.runner import ModelRunner
from jserve.engine.scheduler import ScheduledSequence, Scheduler, proposing_rows, verify_row_starts
from jserve.engine.served_weights import ServedWeights
from jserve.engine.speculation import Speculation, StepProposer
from jserve.engine.stats import EngineSnapshot, EngineStats
from jserve.engine.step import StepInput, StepOutput
from jserve.engine.validation import RequestValidator
from jserve.errors import RequestError
from jserve.loader import LoadedModel
from jserve.lora import AdapterError, AdapterRegistry, AdapterSlots, LoRAConfig, LoRARequest, ServedAdapter, SlotLayout
from jserve.outputs import RequestOutput
from jserve.sampling_params import SamplingParams
from jserve.spec_decode import Drafter, Speculator
from jserve.structured import GrammarCompiler

log = logging.getLogger("jserve")


@dataclass
class LaunchedStep:
    """A dispatched step: its sequences (each knowing whether it samples), its host inputs and its outputs
    (device arrays), and the samples of its deferred grammar rows once they are drawn (deferred_sampling.py)."""

    sequences: list[ScheduledSequence]
    inputs: StepInput
    output: StepOutput
    deferred_rows: np.ndarray
    verifies: bool  # a row has drafts to verify
    proposes: bool  # a sampling row proposes its next step's drafts
    constrained: bool  # a sampling row has a grammar
    deferred_output: jax.Array | None = None  # the deferred rows' samples, packed (sampler.pack_samples)

    def blocks_next(self, defers_grammar: bool) -> bool:
        """The next step cannot be planned without this one's samples: a verification decides how many tokens
        a request gained, a draft model proposed, or a grammar needs one of them for its next mask (unless
        that row's sampling can be deferred)."""
        return self.verifies or self.proposes or (self.constrained and not defers_grammar)


class LLMEngine:
    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        draft: LoadedModel | None = None,
        progress_bars: bool = False,
        lora: LoRAConfig | None = None,
    ):
        """`draft`: the draft model, when config.speculative uses one. `progress_bars`: show start-up work as
        tqdm bars (for a person watching) rather than log lines (for a server's logs). `lora`: serve LoRA
        adapters (jserve/lora), `adapters` knows them by name."""
        self.model, self.config = model, config
        self.tokenizer = model.tokenizer
        eos = set(model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.stats = EngineStats()
        spec = config.speculative
        self.speculation: Speculation | None = Speculator(spec, self.stats) if spec else None
        self.adapters, self.adapter_slots = self._adapters(lora)
        self.scheduler = Scheduler(config, self.stats, self.speculation, self.adapter_slots)
        self.runner = ModelRunner(model, config, self.eos_ids, self._step_proposer(draft), self.adapter_slots)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_ids)
        self.validator = RequestValidator(config, model.config.vocab_size, self.eos_ids)
        self.grammars = GrammarCompiler(self.tokenizer, model.config.vocab_size, self.eos_ids)
        self.parents: dict[str, ParentRequest] = {}
        self._rng = np.random.default_rng(config.seed)
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self.timeline = DeviceTimeline(self.stats)
        self.in_flight: LaunchedStep | None = None  # async scheduling: launched, samples not yet processed
        self._busy = False  # requests were unfinished after the last step: the next one is back to back
        self._aborted: set[str] = set()  # parents aborted since the last step: their outputs are due
        self.weights = ServedWeights(model, self.runner, self.scheduler)
        log.info(
            "KV cache: %d pages of %d tokens = %d tokens of %s, %.2f GiB; max concurrency at max_model_len %d: %.1f",
            config.num_pages, config.page_size, config.num_pages * config.page_size, config.kv_cache_dtype,
            sum(pages.nbytes for pages in jax.tree.leaves(self.runner.kv_cache)) / 2**30, config.max_model_len,
            config.num_pages * config.page_size / config.max_model_len,
        )  # fmt: skip
        log.info("Prefix caching %s; schedule policy %s; async scheduling %s",
                 "on" if config.enable_prefix_caching else "off", config.schedule_policy,
                 "on" if config.async_scheduling else "off")  # fmt: skip
        self.runner.warm_up(progress_bars)
        if self.speculation is not None:
            self._measure_step_costs(progress_bars)
        self.stats.start()

    def _adapters(self, lora: LoRAConfig | None) -> tuple[AdapterRegistry | None, AdapterSlots | None]:
        if lora is None:
            return None, None
        model = self.model
        layout = SlotLayout.of(model.config, lora.max_loras, lora.max_lora_rank)
        slots = AdapterSlots(layout, model.dtype, model.placement)
        log.info("LoRA: %d adapter slots of rank %d", lora.max_loras, lora.max_lora_rank)
        return AdapterRegistry(lora, model.placement.original, layout, model.placement), slots

    def _step_proposer(self, draft: LoadedModel | None) -> StepProposer | None:
        """A draft model, as a proposer the runner runs inside each step."""
        if draft is None:
            return None
        num_tokens = self.config.speculative.num_speculative_tokens
        drafter, params = Drafter.of(draft, self.model.config.vocab_size, num_tokens)
        return StepProposer(drafter, params, draft.config)

    def _measure_step_costs(self, progress_bars: bool) -> None:
        """Time the steps the speculation weighs extra tokens against."""
        steps = self.speculation.steps_to_time(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        with progress(len(steps), "Timing speculative steps", "step", progress_bars) as bar:
            seconds = []
            for num_tokens, num_extra, proposes in steps:
                seconds.append(self.runner.step_seconds(num_tokens, num_extra, proposes=proposes))
                bar.update()
        self.speculation.calibrate(dict(zip(steps, seconds, strict=True)))
        log.info("Speculative decoding: %s", self.speculation.summary())

    # --- requests in -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        prompt_text: str | None = None,
        cache_salt: str | None = None,
        stream: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError (naming the field) before anything is queued.

        The prompt comes as token ids, which its callers encode (LLM, and the server's handlers, which need
        the ids to check a request before queueing it, and tokenize off the engine thread); `prompt_text` is
        its text (e.g. a rendered chat template) for the output. Requests share cached prefixes only with
        requests of the same `cache_salt`. `stream`: step() returns the request's output after each step that
        adds to it; otherwise only its finished output (which holds the whole completion either way).
        `lora_request`: run it with that LoRA adapter (loaded from its path the first time)."""
        self.weights.check_serving()
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.validator.prompt_ids(prompt_token_ids)
        self.validator.check(params, priority)
        adapter = self._adapter(lora_request)
        if adapter is not None:
            cache_salt = adapter.namespace(cache_salt)
        # Compiled now, or found in the cache where the server compiled it off this thread.
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        if grammar is not None:
            self.runner.start_deferred_sampling()  # compiled in the background, once
        seeds = [
            params.seed + i if params.seed is not None else int(self._rng.integers(2**31)) for i in range(params.n)
        ]
        arrival = next(self._arrivals)
        children = [
            Request(
                request_id=f"{request_id}#{i}" if params.n > 1 else request_id,
                prompt_token_ids=ids,
                params=params,
                seed=seed,
                arrival_index=arrival,
                max_model_len=self.config.max_model_len,
                prompt=prompt_text,
                priority=priority,
                index=i,
                parent_id=request_id,
                cache_salt=cache_salt,
                adapter=adapter,
                grammar=grammar.matcher() if grammar else None,
                stream=stream,
            )
            for i, seed in enumerate(seeds)
        ]
        self.parents[request_id] = ParentRequest(request_id, prompt_text, ids, children)
        for child in children:
            self.outputs.register(child)
            self.scheduler.add(child)
        return request_id

    def _adapter(self, lora_request: LoRARequest | None) -> ServedAdapter | None:
        if lora_request is None:
            return None
        if self.adapters is None:
            raise RequestError("this engine serves no LoRA adapters: start it with enable_lora=True", "lora_request")
        try:
            return self.adapters.resolve(lora_request)
        except AdapterError as error:
            raise RequestError(str(error), "lora_request") from None

    def abort_request(self, request_id: str) -> None:
        parent = self.parents.get(request_id)
        if parent is None:
            return
        for child in parent.children:
            self.scheduler.finish(child, "abort")
        self._aborted.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    # --- weights and device memory (served_weights.py) -------------------------------------------

    def update_weights(self, params: nnx.State) -> bool:
        """Serve `params` (the model's params with new values: loader.weight_update) from now on, without
        compiling anything. Requests in flight (running, or preempted and waiting to resume) finish on the
        weights they started with; requests that have not started wait, and the new weights take over as soon
        as the last request in flight is done (at once if none is). Returns whether they serve already."""
        return self.weights.update(params, self.in_flight is not None)

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back between rollouts: level 1 frees the KV cache, level 2 also lets go of
        the weights (update_weights must bring new ones). Only while no request is unfinished."""
        if self.has_unfinished_requests():
            raise RuntimeError(f"{len(self.parents)} requests are unfinished: let them finish, or abort them, first")
        self.weights.sleep(level)

    def wake_up(self) -> None:
        self.weights.wake_up()

    # --- across hosts ----------------------------------------------------------------------------

    def follow(self) -> None:
        """On a follower process of a multi-host run: mirror the leader's steps until it closes."""
        self.runner.follow()

    def close(self) -> None:
        """On the leader of a multi-host run: release the followers (a no-op on one host)."""
        self.runner.close()

    # --- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, then process the samples of the step before it (async
        scheduling: the host works while the device runs) or of this one; returns the outputs of every
        request that changed."""
        start = time.perf_counter()
        if not self._busy:
            self.stats.resume()
        if self.weights.pending is not None:
            self.weights.swap(self.in_flight is not None)
        host = (self.runner.prepare_s, self.outputs.detokenize_s)
        changed, self._aborted = self._aborted, set()  # requests aborted since the last step
        waited = 0.0
        if self.in_flight is not None and self.in_flight.blocks_next(self.runner.defers_grammar):
            # A verification's outcome (or a grammar's next mask) needs the step in flight: this step waits for
            # it (no overlap).
            waited, self.in_flight = self._process(self.in_flight, changed), None
        scheduled_at = time.perf_counter()
        scheduled = self.scheduler.schedule()
        launch_at = time.perf_counter()
        self.stats.preemptions += len(scheduled.preempted)
        launched = self._launch(scheduled.sequences, changed) if scheduled.sequences else None
        launched_at = time.perf_counter()
        previous, self.in_flight = self.in_flight, launched
        if not self.config.async_scheduling:
            previous, self.in_flight = self.in_flight, None
        waited += self._process(previous, changed) if previous is not None else 0.0
        if self.in_flight is not None:
            self._sample_deferred(self.in_flight)  # its grammars have seen every token before it now
        if self.in_flight is not None and not self.scheduler.num_unfinished:
            waited += self._process(self.in_flight, changed)  # only surplus tokens: leave the engine idle
            self.in_flight = None
        outputs_at = time.perf_counter()
        version = self.weights.version
        results = [self.parents[pid].output(self.outputs, version) for pid in changed]
        for out in results:
            if out.finished:
                for child in self.parents.pop(out.request_id).children:
                    self.outputs.forget(child)
        self._busy = self.has_unfinished_requests()
        end = time.perf_counter()
        self.stats.host_s += end - start - waited
        prepare, detokenize = self.runner.prepare_s - host[0], self.outputs.detokenize_s - host[1]
        phases = self.stats.phase_s  # ("process" counted by _process, detokenizing included)
        phases["schedule"] += launch_at - scheduled_at
        phases["prepare"] += prepare
        phases["launch"] += launched_at - launch_at - prepare
        phases["process"] -= detokenize
        phases["detokenize"] += detokenize
        phases["outputs"] += end - outputs_at
        if self.config.debug_checks and not self._busy:
            self.scheduler.check_idle()
            if self.adapter_slots is not None:
                self.adapter_slots.check_idle()
        return results

    def _launch(self, sequences: list[ScheduledSequence], changed: set[str]) -> LaunchedStep | None:
        """Dispatch the step, then advance each request as if it had run: the device runs steps in launch
        order, so the next step may already read these K/V pages and (by row) these samples. The request's
        owners record it: KVManager its computed tokens, OutputProcessor its pending samples."""
        before = compile_count()
        sequences, launched = self._dispatch(sequences, changed)
        if launched is None:
            return None
        output, inputs = launched
        self.timeline.launched(time.perf_counter(), output.samples, self._busy)
        check_no_compiles(before, "the step", self.config.debug_checks)
        verifies = proposes = constrained = False
        advance, mark_launched = self.scheduler.kv.advance, self.outputs.launched
        for row, seq in enumerate(sequences):
            request = seq.request
            if seq.start < request.num_prompt_tokens:
                self.stats.prompt_tokens += min(seq.num_tokens, request.num_prompt_tokens - seq.start)
            advance(request, seq.num_tokens)
            verifies = verifies or len(seq.drafts) > 0  # (a row with drafts decodes, so it samples)
            if seq.samples:
                mark_launched(request, row)
                proposes = proposes or seq.proposes
                constrained = constrained or request.grammar is not None
        deferred = np.flatnonzero(inputs.deferred[: len(sequences)])
        return LaunchedStep(sequences, inputs, output, deferred, verifies, proposes, constrained)

    def _dispatch(
        self, sequences: list[ScheduledSequence], changed: set[str]
    ) -> tuple[list[ScheduledSequence], tuple[StepOutput, StepInput] | None]:
        """The runner's launch, isolating the culprit if it fails: the requests whose own rows cannot be
        prepared fail, and the rest launch again. A failure no single row explains (the device, the
        executable) is not one request's fault, and is raised."""
        try:
            return sequences, self.runner.launch(sequences)
        except Exception:
            errors = [self.runner.prepare_error(seq) for seq in sequences]
            if not any(errors):
                raise
        for seq, error in zip(sequences, errors, strict=True):
            if error is not None:
                self._fail(seq.request, error, changed)
        rest = [seq for seq, error in zip(sequences, errors, strict=True) if error is None]
        return rest, self.runner.launch(rest) if rest else None

    def _fail(self, request: Request, error: Exception, changed: set[str]) -> None:
        """End one request with finish_reason "error" (the others go on)."""
        log.error("request %s failed: %s: %s", request.request_id, type(error).__name__, error, exc_info=error)
        self.scheduler.finish(request, "error")
        changed.add(request.parent_id)

    def _process(self, step: LaunchedStep, changed: set[str]) -> float:
        """Fetch a launched step's samples and hand each to its request; returns the seconds spent waiting."""
        self._sample_deferred(step)
        start = time.perf_counter()
        proposing = proposing_rows(step.sequences) if step.proposes else {}
        output = step.output
        samples, verified, proposals, deferred = jax.device_get(
            (output.samples, output.verified if step.verifies else None, output.proposals if proposing else None,
             step.deferred_output)
        )  # fmt: skip
        waited = time.perf_counter() - start
        samples = FetchedSamples(samples)
        verified = FetchedSamples(verified) if step.verifies else None
        # A deferred row's token is the deferred call's sample (the step's own was drawn without its mask).
        deferred = FetchedSamples(deferred) if deferred is not None else None
        sources = {int(row): (deferred, d) for d, row in enumerate(step.deferred_rows)}
        waited += self._record_prompt_scores(step)
        stats = self.stats
        now = time.monotonic()
        verify_rows = verify_row_starts(step.sequences) if step.verifies else None
        append, finished, generated = self.outputs.append, RequestStatus.FINISHED, 0
        for row, seq in enumerate(step.sequences):
            request = seq.request
            if len(seq.drafts):
                tokens = self._verified_tokens(seq, verified, int(verify_rows[row]), samples, row)
            if not seq.samples or request.status is finished:  # finished by the step before: this token is surplus
                continue
            if request.stream:
                changed.add(request.parent_id)
            if request.first_token_time is None:
                request.first_token_time = now
            finish = None
            try:
                for source, source_row in tokens if len(seq.drafts) else (sources.get(row, (samples, row)),):
                    generated += 1
                    if finish := append(request, source, source_row):
                        break
            except Exception as error:  # one request's failure must not take down the others
                self._fail(request, error, changed)
                continue
            if finish is not None:
                self.scheduler.finish(request, *finish)
                changed.add(request.parent_id)
            elif row in proposing:
                self.speculation.proposed(request, proposals[proposing[row]])
        stats.generated_tokens += generated
        stats.steps += 1
        scheduler = self.scheduler
        running = len(scheduler.running)
        kv_used = scheduler.num_used_pages / scheduler.pool.num_pages
        stats.maybe_log(running, scheduler.num_unfinished - running, kv_used)
        stats.phase_s["process"] += time.perf_counter() - start - waited
        return waited

    def _sample_deferred(self, step: LaunchedStep) -> None:
        """Draw the step's deferred grammar rows (once), now that their grammars have seen every earlier token;
        a request that ended meanwhile gets no mask (its sample is surplus)."""
        if not len(step.deferred_rows) or step.deferred_output is not None:
            return
        requests = [step.sequences[row].request for row in step.deferred_rows]
        grammars = [None if request.is_finished else request.grammar for request in requests]
        step.deferred_output = self.runner.sample_deferred(step.inputs, step.deferred_rows, grammars)

    def _verified_tokens(
        self, seq: ScheduledSequence, verified: FetchedSamples, first: int, samples: FetchedSamples, row: int
    ) -> list[tuple[FetchedSamples, int]]:
        """Where a speculating sequence's new tokens are: the samples at its drafts' positions as long as each
        equals its draft (the last one that differs replaces it), or after all of them its row's own sample.
        The rejected drafts' K/V stop counting as computed (the request's pages end with the accepted ones)."""
        drafts = seq.drafts
        matched = verified.ids[first : first + len(drafts)] == drafts
        accepted = int(np.argmin(matched)) if not matched.all() else len(drafts)
        if seq.request.is_finished:
            return []
        self.scheduler.kv.reject(seq.request, len(drafts) - accepted)
        self.speculation.accepted(seq.request, len(drafts), accepted)
        tokens = [(verified, first + j) for j in range(min(accepted + 1, len(drafts)))]
        return tokens if accepted < len(drafts) else [*tokens, (samples, row)]

    def _record_prompt_scores(self, step: LaunchedStep) -> float:
        """Hand the step's prompt scores to the requests that score their prompt (fetched only if there are
        any); returns the seconds spent waiting for them."""
        if not (step.inputs.prompt_targets >= 0).any():
            return 0.0  # the common case: the step scores no prompt token, so nothing to fetch or hand out
        offsets = np.cumsum([0] + [seq.num_tokens for seq in step.sequences])[:-1]
        scored = [(offset, seq) for offset, seq in zip(offsets, step.sequences, strict=True)
                  if seq.request.params.prompt_logprobs is not None and not seq.request.is_finished]  # fmt: skip
        if not scored:
            return 0.0
        start = time.perf_counter()
        scores = jax.device_get(step.output.scores)
        waited = time.perf_counter() - start
        for offset, seq in scored:
            self.outputs.record_prompt_scores(seq.request, scores, int(offset), seq.start, seq.num_tokens)
        return waited

    def snapshot(self) -> EngineSnapshot:
        """Where the engine stands: its queues, its KV usage and its running totals."""
        spec = self.config.speculative
        per_pos = tuple(self.stats.spec_accepted_per_pos[: spec.num_speculative_tokens].tolist()) if spec else ()
        return EngineSnapshot.of(self.stats, self.scheduler, per_pos)

    def sync_stats(self) -> EngineStats:
        """The stats, once the device timeline has accounted for every launched step."""
        self.timeline.drain()
        return self.stats
