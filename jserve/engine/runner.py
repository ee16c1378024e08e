"""Turn a scheduled batch into padded device arrays, run the compiled step for its bucket, fetch the samples.

Buckets: a step's tokens are padded to the next token bucket (powers of two up to the token budget) and
its sequences to that bucket's sequence count, so every step reuses one of a few executables, compiled at
start-up (on GPUs two per bucket, and in the background one per further combination of optional sampling
stages in use: step_executables.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jserve.attention import SequenceChunk, allocate_kv_cache, build_model_input, resolve_attention_backend
from jserve.engine.config import EngineConfig
from jserve.engine.decode_continuation import DecodeContinuation, Places, check_same_inputs
from jserve.engine.deferred_sampling import DeferredSampler
from jserve.engine.input_batch import HAS_GRAMMAR, PROMPT_LEN, SCORES_PROMPT, InputBatch, padded
from jserve.engine.progress import progress
from jserve.engine.sampler import BIAS_WIDTH, full_bitmask, init_penalty_state
from jserve.engine.scheduler import ScheduledSequence, proposing_rows, verify_row_starts
from jserve.engine.speculation import ProposingRows, StepProposer
from jserve.engine.stages import StepStages, host_decides
from jserve.engine.step import StepInput, StepOutput, VerifyInput, init_sampled, jit_engine_step
from jserve.engine.step_executables import StepExecutables
from jserve.engine.step_packing import PackedStep, StepPacking
from jserve.loader import LoadedModel
from jserve.parallel import kv_cache_spec
from jserve.parallel.distributed import StepBroadcast, is_leader, is_multi_process
from jserve.structured import BitmaskFiller

log = logging.getLogger("jserve")

COMPILE_WORKERS = 4  # at most; never more than the CPU cores
MASK_TIMINGS_KEPT = 10_000
NO_ROWS, NO_FLAGS = np.zeros(0, np.int32), np.zeros(0, bool)  # a step's verify or proposing rows, with none


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        stop_ids: frozenset[int],
        proposer: StepProposer | None = None,
        adapters=None,
    ):
        """`proposer`: a speculative proposer that runs inside each step (see engine/speculation.py).
        `adapters`: LoRA adapter slots (lora/slots.py), whose `weights` every step reads as they are at launch."""
        self.model, self.config = model, config
        self.stop_ids = stop_ids
        mesh = model.mesh
        # With a mesh, the cache is split by KV head and the host's batch arrays are replicated; the
        # shardings are made once here, so every step sees the same ones (no recompiles).
        kv_sharding = self.kv_sharding = NamedSharding(mesh, kv_cache_spec()) if mesh else None
        self.input_sharding = NamedSharding(mesh, PartitionSpec()) if mesh else None
        self.proposer_config = proposer.model_config if proposer else None
        self.allocate_memory()
        self.attention = resolve_attention_backend(config.attention_backend, mesh=mesh)
        # The step's outputs, penalty state and sampled ids replicated, the caches as allocated.
        replicated = self.input_sharding
        shardings = (replicated, kv_sharding, kv_sharding, replicated, replicated)
        self.step_fn = jit_engine_step(shardings if mesh else None, jax.default_backend())
        log.info(
            "Attention: %s%s%s",
            self.attention.kernel,
            " (interpret mode)" if self.attention.interpret else "",
            f", tensor-parallel over {mesh.size} devices" if mesh else "",
        )
        self.params, self.params_def = jax.tree_util.tree_flatten(model.params)
        self.proposer = proposer.run if proposer else None
        self.proposer_params = proposer.params if proposer else []
        self.adapters = adapters
        self.packings: dict[int, StepPacking] = {}  # by bucket: how its step's host arrays travel
        self.places: dict[int, Places] = {}  # by bucket: the inputs a continued decode step advances
        # Steps without a grammar share one all-ones bitmask per batch size: never written, so a step still
        # reading it on the device cannot see a later step's mask.
        batch_sizes = {config.seq_bucket(bucket) for bucket in config.token_buckets}
        batch_sizes |= {config.verify_rows(bucket) for bucket in config.token_buckets}
        self._full_bitmasks = {n: full_bitmask(n, model.config.vocab_size) for n in batch_sizes}
        for mask in self._full_bitmasks.values():
            mask.flags.writeable = False
        # What most steps pass unchanged stays on the device: the all-ones bitmasks and the empty bias rows
        # (at 256 rows and a 128k vocabulary, 4.8 MB a step to upload otherwise).
        self._device_bitmasks = {n: self._put(mask) for n, mask in self._full_bitmasks.items()}
        self._no_bias = {
            n: (self._put(np.full((n, BIAS_WIDTH), -1, np.int32)), self._put(np.zeros((n, BIAS_WIDTH), np.float32)))
            for n in batch_sizes
        }
        self.prepare_s = 0.0  # host time building step inputs, for the engine's stats
        self.batch = InputBatch(config.max_num_seqs, config.max_pages_per_seq, config.page_size, stop_ids)
        self._continuation: DecodeContinuation | None = None  # the last launch, if the next may continue it
        self.continued_steps = 0  # steps launched from the step before's arrays (decode_continuation.py)
        self.bitmask_filler = BitmaskFiller()
        seq_buckets = sorted({config.seq_bucket(bucket) for bucket in config.token_buckets})
        self.deferred = DeferredSampler(seq_buckets, model.config.vocab_size, self.input_sharding, self.bitmask_filler)
        self.mask_fill_s: deque[float] = deque(maxlen=MASK_TIMINGS_KEPT)  # host time per constrained step
        # Across hosts the leader tells followers every step it launches (see jserve.parallel.distributed).
        self.broadcast = StepBroadcast(lambda bucket: self.prepare([], bucket)) if is_multi_process() else None
        # Across hosts every process must run the same executable for a step: there the device decides.
        decides = host_decides(jax.default_backend()) and self.broadcast is None
        self.steps = StepExecutables(decides, model.config.vocab_size, self._lowering)

    def allocate_memory(self) -> None:
        """The device state steps carry from one to the next, as it starts: the KV cache (and a device
        proposer's, whose pages shadow the target's: same ids, its own arrays), the penalty state and the
        sampled-token record of each slot."""
        cfg, vocab = self.config, self.model.config.vocab_size
        self.kv_cache = allocate_kv_cache(
            self.model.config, cfg.num_pages, cfg.page_size, cfg.kv_cache_dtype, self.kv_sharding
        )
        self.proposer_kv = () if self.proposer_config is None else allocate_kv_cache(
            self.proposer_config, cfg.num_pages, cfg.page_size, cfg.kv_cache_dtype, self.kv_sharding
        )  # fmt: skip
        self.penalty_state = jax.device_put(init_penalty_state(cfg.max_num_seqs, vocab), self.input_sharding)
        max_rows = cfg.seq_bucket(cfg.token_buckets[-1])
        self.sampled = jax.device_put(init_sampled(max_rows, vocab), self.input_sharding)

    def release_memory(self) -> int:
        """Free the device state allocate_memory made (between requests only: no step may need it); returns
        its bytes."""
        state = jax.tree.leaves((self.kv_cache, self.proposer_kv, self.penalty_state, self.sampled))
        freed = sum(array.nbytes for array in state)
        for array in state:
            array.delete()
        self.kv_cache = self.proposer_kv = self.penalty_state = self.sampled = None
        self._continuation = None
        return freed

    def warm_up(self, progress_bars: bool = False) -> None:
        """Compile every bucket now, and run each once on an all-padding batch (which writes nothing):
        a first execution pays one-off costs of its own (~0.6 s here) that would otherwise land on a request.

        Tracing is Python (one thread at a time), while XLA compiles without the GIL and first runs are
        dispatched asynchronously; so worker threads compile the traced buckets, and each first run is
        launched as soon as its bucket is compiled, both while the next buckets are traced."""
        start = time.perf_counter()
        buckets = self.config.token_buckets
        compiling: list[tuple[int, StepStages, StepInput, Future]] = []
        variants = self.steps.warm_up_stages()
        workers = min(COMPILE_WORKERS, os.cpu_count() or 1)
        with (
            ThreadPoolExecutor(workers, thread_name_prefix="jserve-compile") as compiler,
            progress(len(buckets) * len(variants), "Compiling step buckets", "executable", progress_bars) as bar,
        ):
            for bucket in buckets:
                step = self.prepare([], bucket)
                if self.broadcast:  # every bucket's broadcast compiles now too, and the channel is proven
                    self._exchange(bucket, step)
                packing = self.packings[bucket] = StepPacking.of(step)
                self.places[bucket] = Places.of(packing, step)
                for stages in variants:
                    lowered = self._lowering(bucket, stages, step)()
                    compiling.append((bucket, stages, step, compiler.submit(lowered.compile)))
                # Across hosts every process must issue its collectives (broadcasts, TP steps) in one
                # order, so there first runs wait until every bucket is exchanged.
                while compiling and compiling[0][3].done() and not self.broadcast:
                    self._first_run(*compiling.pop(0), bar)
            while compiling:
                self._first_run(*compiling.pop(0), bar)
            jax.block_until_ready(self.sampled)
        log.info(
            "Compiled %d step executables (token buckets %s) in %.1fs",
            len(self.steps.compiled),
            ", ".join(map(str, buckets)),
            time.perf_counter() - start,
        )

    def _first_run(self, bucket: int, stages: StepStages, step: StepInput, compiled: Future, bar) -> None:
        """Take an executable and launch its first run (in bucket order: each donates the state)."""
        executable = compiled.result()
        self.steps.add(bucket, stages, executable)
        self._run(executable, self.packings[bucket].pack(step))
        bar.update()

    @property
    def executables(self) -> dict[tuple[int, StepStages], jax.stages.Compiled]:
        """The step's executables by (bucket, stages) (step_executables.py)."""
        return self.steps.compiled

    def _lowering(self, bucket: int, stages: StepStages, step: StepInput):
        """A function lowering the bucket's step with `stages`, for arguments shaped as the state is now."""
        packing = self.packings[bucket]
        args = (self.params, self.proposer_params, self._adapter_weights(), self.kv_cache, self.proposer_kv,
                self.penalty_state, self.sampled, self._placed(packing.pack(step)))  # fmt: skip
        shapes = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), args
        )
        statics = (self.model.graphdef, self.attention, self.params_def, self.proposer, packing, stages)
        return lambda: self.step_fn.lower(*statics, *shapes)

    def step_seconds(self, num_tokens: int, num_drafts: int = 0, runs: int = 5, proposes: bool = True) -> float:
        """The fastest of `runs` steps of `num_tokens` real tokens, `num_drafts` of them verified (noise only
        ever adds time), with a device proposer's proposals unless not `proposes`: one sequence from position 0,
        its K/V written to the first pages, so call it before any request holds pages. Padding can cost less
        than real tokens (the int8 kernel skips it), so steps carry real ones."""
        cfg = self.config
        chunk = SequenceChunk(np.zeros(num_tokens, np.int32), 0, np.arange(cfg.max_pages_per_seq, dtype=np.int32))
        bucket = self.bucket_for(num_tokens)
        step = self.prepare([], bucket)
        positions = step.verify.positions.copy()
        positions[:num_drafts] = np.arange(num_drafts)
        proposing, verified = step.proposing.rows.copy(), step.proposing.verify_count.copy()
        proposing[:1], verified[:1] = (0 if proposes else -1), num_drafts  # a proposer proposes after the chunk
        step = replace(step, model=build_model_input([chunk], cfg.page_size, bucket, cfg.seq_bucket(bucket),
                                                     cfg.max_pages_per_seq),
                       verify=replace(step.verify, positions=positions),
                       proposing=replace(step.proposing, rows=proposing, verify_count=verified))  # fmt: skip
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            jax.block_until_ready(self._execute(bucket, step))
            times.append(time.perf_counter() - start)
        return min(times)

    def set_params(self, params) -> None:
        """Run the steps from now on with `params` (an nnx.State): the structure, shapes, dtypes and shardings
        the steps were compiled for, so nothing compiles again."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if treedef != self.params_def:
            raise ValueError("new params must have the structure of the ones loaded")
        for new, old in zip(leaves, self.params, strict=True):
            if (new.shape, new.dtype, new.sharding) != (old.shape, old.dtype, old.sharding):
                raise ValueError(f"a new param is {new.shape} {new.dtype} on {new.sharding}, not {old.shape} "
                                 f"{old.dtype} on {old.sharding}")  # fmt: skip
        self.params = leaves

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.config.token_buckets if b >= num_tokens)

    def launch(self, sequences: list[ScheduledSequence]) -> tuple[StepOutput, StepInput]:
        """Dispatch one step and return at once: its outputs are device arrays until fetched (with its host
        inputs). Reads the requests' pending rows, so it runs before the engine marks new ones."""
        start = time.perf_counter()
        last, self._continuation = self._continuation, None  # (a launch that fails leaves none)
        continued = last.next(sequences, self.batch) if last is not None else None
        if continued is not None:
            bucket = last.bucket
            step, packed, continuation = continued
            self.continued_steps += 1
            if self.config.debug_checks:
                built = self.prepare(sequences, bucket)
                check_same_inputs((step, packed), (built, self.packings[bucket].pack(built)))
        else:
            bucket = self.bucket_for(sum(s.num_tokens for s in sequences))
            step = self.prepare(sequences, bucket)
            packed = self.packings[bucket].pack(step)
            continuation = DecodeContinuation.of(sequences, bucket, step, packed, self.batch, self.places[bucket])
        self.prepare_s += time.perf_counter() - start
        if self.broadcast:
            self.broadcast.send(bucket, step)
        output = self._execute(bucket, step, packed)
        self._continuation = continuation
        return output, step

    @property
    def defers_grammar(self) -> bool:
        """Grammar rows whose previous token is in flight are sampled after launch (see deferred_sampling.py):
        once their calls are compiled, and on one host (followers do not mirror the extra call)."""
        return self.broadcast is None and self.deferred.ready

    def start_deferred_sampling(self) -> None:
        self.deferred.start(self.sampled, self.penalty_state)

    def sample_deferred(self, step: StepInput, rows: np.ndarray, grammars: list) -> jax.Array:
        """Sample the deferred rows of the latest launched step, now that their grammars are current (packed
        samples: sampler.pack_samples)."""
        start = time.perf_counter()
        out, self.sampled = self.deferred.run(self.sampled, self.penalty_state, step.sampling, rows, grammars)
        self.mask_fill_s.append(time.perf_counter() - start)
        return out

    def _execute(self, bucket: int, step: StepInput, packed: PackedStep | None = None) -> StepOutput:
        """Run the bucket's executable on a step's inputs (`packed`: packed already)."""
        packed = packed if packed is not None else self.packings[bucket].pack(step)
        return self._run(self.steps.for_step(bucket, step), packed)

    def _run(self, executable: jax.stages.Compiled, packed: PackedStep) -> StepOutput:
        out, self.kv_cache, self.proposer_kv, self.penalty_state, self.sampled = executable(
            self.params, self.proposer_params, self._adapter_weights(), self.kv_cache, self.proposer_kv,
            self.penalty_state, self.sampled, self._placed(packed),
        )  # fmt: skip
        return out

    def _adapter_weights(self):
        return None if self.adapters is None else self.adapters.weights

    def _placed(self, packed: PackedStep) -> PackedStep:
        """The step's inputs as the executable takes them: on one device the numpy arrays themselves (cheaper
        than a device_put per array); with a mesh replicated, as the step was compiled for (left to itself,
        the compiler would split the token bitmask by vocabulary like the logits it masks)."""
        return packed if self.input_sharding is None else jax.device_put(packed, self.input_sharding)

    def _put(self, array: np.ndarray) -> jax.Array | np.ndarray:
        """A constant input kept on the device; across hosts it stays on the host, where the leader's step
        broadcast (numpy arrays, replicated by every process alike) can take it."""
        return array if is_multi_process() else jax.device_put(array, self.input_sharding)

    def _exchange(self, bucket: int, step: StepInput) -> None:
        if is_leader():
            self.broadcast.send(bucket, step)
        elif (received := self.broadcast.receive()) is None or received[0] != bucket:
            raise RuntimeError(
                f"the leader is not warming up bucket {bucket}: do all processes run the same "
                "jserve version and engine arguments?"
            )

    def follow(self) -> None:
        """On a follower process: launch every step the leader launches, until it closes."""
        while (received := self.broadcast.receive()) is not None:
            self._execute(*received)

    def close(self) -> None:
        """Stop compiling in the background; on the leader, release the followers from `follow`."""
        self.steps.close()
        if self.broadcast and is_leader():
            self.broadcast.stop()
            self.broadcast = None

    def prepare_error(self, sequence: ScheduledSequence) -> Exception | None:
        """What preparing a step of this sequence alone raises (host work only; nothing runs), if anything."""
        try:
            self.prepare([sequence], self.bucket_for(sequence.num_tokens))
        except Exception as error:
            return error
        return None

    def prepare(self, sequences: list[ScheduledSequence], bucket: int) -> StepInput:
        """Host arrays for a step, padded to `bucket` tokens and its sequence count: one pass over the
        sequences for their own numbers (refreshing the rows of requests that joined or whose pages changed),
        then everything else gathered from the persistent batch by slot."""
        cfg, batch = self.config, self.batch
        num_seqs = cfg.seq_bucket(bucket)
        if len(sequences) > num_seqs:
            raise ValueError(f"{len(sequences)} sequences exceed the batch of {num_seqs}")
        numbers = []  # 10 per sequence, flat (numpy reads a flat list faster than tuples)
        chunks = []  # (index, token ids) of the chunks of more than one token; a decode's token is a number
        owner, pages = batch.owner, batch.pages
        for i, s in enumerate(sequences):
            request, samples, num_tokens = s.request, s.samples, s.num_tokens
            slot = request.slot
            if owner[slot] != request.admit_index:
                batch.join(slot, request)
            if pages[slot] is not request.pages:
                batch.set_pages(slot, request.pages)
            pending = request.pending_row if request.num_pending and samples else -1  # its own last token
            if num_tokens == 1:  # (a pending token comes from the device: its id here is unknown and unused)
                token = int(request.token_buffer[s.start]) if pending < 0 else 0
            else:
                token = 0
                chunks.append((i, s.token_ids))
            numbers += (slot, s.start, num_tokens, len(s.drafts), pending, request.seq_len, samples, s.first,
                        s.proposes, token)  # fmt: skip
        columns = np.array(numbers, np.int32).reshape(len(sequences), 10).T
        slots, starts, lens, num_drafts, pending, seq_lens, samples, first, proposes, tokens = columns
        ends = np.cumsum(lens) - 1
        token_ids = np.repeat(tokens, lens)
        for i, ids in chunks:
            token_ids[ends[i] + 1 - len(ids) : ends[i] + 1] = ids
        rows = batch.rows(slots, num_seqs)
        facts = batch.facts[slots]
        padded_slots = padded(slots, num_seqs)
        model = batch.model_input(rows, starts, lens, token_ids, bucket)
        # A chunk that ends in a token still in flight takes it from the previous step's samples (drafts
        # follow that token).
        pending_rows = np.full(bucket, -1, np.int32)
        in_flight = pending >= 0
        pending_rows[(ends - num_drafts)[in_flight]] = pending[in_flight]
        # pending tokens count (they exist on device), and drafts: the step samples after them
        num_output = seq_lens - facts[:, PROMPT_LEN] + num_drafts
        constrained = (facts[:, HAS_GRAMMAR] != 0) & (samples == 1)
        if constrained.any():
            # A grammar row whose previous token is in flight gets its mask after launch (not a proposing one:
            # the proposer proposes after the row's sample).
            deferred = constrained & in_flight & (proposes == 0) if self.defers_grammar else np.zeros_like(in_flight)
            constrained, deferred = padded(constrained & ~deferred, num_seqs), padded(deferred, num_seqs)
        else:
            constrained = deferred = batch.constant(("no rows", num_seqs), lambda: np.zeros(num_seqs, bool))
        num_verify = cfg.verify_rows(bucket)
        bitmask, verify_bitmask = self._token_bitmasks(sequences, constrained, num_seqs, num_verify)
        return StepInput(
            model=model,
            sampling=batch.sampling(
                rows, facts, padded_slots, num_output, constrained, bitmask, self._no_bias[num_seqs]
            ),  # fmt: skip
            penalties=batch.penalties(padded_slots, facts, first == 1, model.attention.positions, lens, bucket),
            pending_rows=pending_rows,
            prompt_targets=self._prompt_targets(sequences, facts, ends - lens + 1, bucket),
            verify=self._verify_input(sequences, ends, num_verify, verify_bitmask),
            proposing=self._proposing_rows(sequences, cfg.proposing_rows(bucket)),
            deferred=deferred,
            adapter_slots=batch.adapter_slots(slots, lens, bucket),
        )

    def _prompt_targets(self, sequences: list[ScheduledSequence], facts, starts, bucket: int) -> np.ndarray:
        """A chunk of a prompt being scored scores each of its tokens' successor in the prompt."""
        scoring = np.flatnonzero(facts[:, SCORES_PROMPT])
        if not len(scoring):
            return self.batch.constant(("no targets", bucket), lambda: np.full(bucket, -1, np.int32))
        targets = np.full(bucket, -1, np.int32)
        for i in scoring:
            s, start = sequences[i], starts[i]
            request = s.request
            stop = min(s.start + s.num_tokens, request.num_prompt_tokens - 1)  # positions with a next token
            if stop > s.start:
                targets[start : start + stop - s.start] = request.token_buffer[s.start + 1 : stop + 1]
        return targets

    def _verify_input(
        self, sequences: list[ScheduledSequence], ends: np.ndarray, num_rows: int, bitmask: np.ndarray
    ) -> VerifyInput:
        """A row per draft: at the token before it (the request's latest token, then each earlier draft), with
        its request's options and the seeded key of a decode step that would sample there."""
        if num_rows == 0:  # no speculation configured
            return VerifyInput(NO_ROWS, NO_ROWS, NO_ROWS, bitmask, NO_FLAGS)
        positions, rows, steps = (
            np.full(num_rows, -1, np.int32),
            np.zeros(num_rows, np.int32),
            np.zeros(num_rows, np.int32),
        )
        constrained = np.zeros(num_rows, bool)
        for i, (end, first, s) in enumerate(zip(ends, verify_row_starts(sequences), sequences, strict=True)):
            if count := len(s.drafts):
                request = s.request
                at = slice(first, first + count)
                positions[at] = np.arange(end - count, end)
                rows[at] = i
                steps[at] = request.seq_len - request.num_prompt_tokens + np.arange(count)
                constrained[at] = request.grammar is not None
        return VerifyInput(positions, rows, steps, bitmask, constrained)

    @staticmethod
    def _proposing_rows(sequences: list[ScheduledSequence], num_rows: int) -> ProposingRows:
        """A row per sequence that proposes for its next step (see proposing_rows), with its verify rows."""
        if num_rows == 0:  # no draft model
            return ProposingRows(NO_ROWS, NO_ROWS, NO_ROWS)
        rows, start, count = (np.full(num_rows, -1, np.int32), np.zeros(num_rows, np.int32),
                              np.zeros(num_rows, np.int32))  # fmt: skip
        proposing = proposing_rows(sequences)
        verify_starts = verify_row_starts(sequences)
        for i, r in proposing.items():
            rows[r], start[r], count[r] = i, verify_starts[i], len(sequences[i].drafts)
        return ProposingRows(rows, start, count)

    def _token_bitmasks(
        self, sequences: list[ScheduledSequence], constrained: np.ndarray, num_seqs: int, num_verify: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The step's token bitmasks, for its rows and its verify rows: each constrained row's grammar says
        which tokens may come next (after the drafts before the row, for a speculating request)."""
        if not constrained.any():
            return self._device_bitmasks[num_seqs], self._device_bitmasks[num_verify]
        constrained = [(i, sequences[i]) for i in np.flatnonzero(constrained)]
        start = time.perf_counter()
        bitmask = self._full_bitmasks[num_seqs].copy()  # fresh arrays: the device may still read the last ones
        verify = self._device_bitmasks[num_verify]
        if plain := [(seq.request.grammar, i) for i, seq in constrained if not len(seq.drafts)]:
            self.bitmask_filler.fill(plain, bitmask)
        if drafting := [(i, seq) for i, seq in constrained if len(seq.drafts)]:
            # Each speculating request's masks after none, one, ... all of its drafts, then split: the first
            # ones are its verify rows', the last its own row's.
            verify = self._full_bitmasks[num_verify].copy()
            verify_starts = verify_row_starts(sequences)
            sizes = [len(seq.drafts) + 1 for _, seq in drafting]
            offsets = np.cumsum([0, *sizes])[:-1]
            masks = np.empty((sum(sizes), bitmask.shape[1]), np.int32)
            entries = [(seq.request.grammar, int(o), seq.drafts) for (_, seq), o in zip(drafting, offsets, strict=True)]
            self.bitmask_filler.fill_with_drafts(entries, masks)
            for (i, seq), offset in zip(drafting, offsets, strict=True):
                count = len(seq.drafts)
                verify[verify_starts[i] : verify_starts[i] + count] = masks[offset : offset + count]
                bitmask[i] = masks[offset + count]
        self.mask_fill_s.append(time.perf_counter() - start)
        return bitmask, verify
