"""Draft-model proposals, made on device inside the engine's step (no extra dispatch, no extra sync).

The draft model keeps a paged KV cache of its own that shadows the target's: the same page ids and page
tables, its own K/V arrays. Every step first runs the draft over the step's tokens (`extend`), so wherever the
target has K/V the draft has too, prefix-cache hits and preemption included, with no bookkeeping of its own.

Then each proposing sequence (the engine's ProposingRows) continues from where this step leaves it: the token the step
sampled after its last accepted draft (worked out on device from the verify samples), at the position after
them. `num_tokens` draft decode steps follow, each sampling with the request's own options and the seeded key
of that output position, the key the target samples it with. So the draft picks the target's token whenever
the two distributions put that Gumbel draw on the same token (always under greedy when they agree on the
argmax); the target's sample is kept either way, so outputs are exactly those of decoding without speculation.

The proposals come back with the step's samples; the host hands them to the next step as drafts. Draft K/V at
the proposal positions are written over by the next step's `extend`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.attention import PAD_SLOT, AttentionBackend, AttentionMetadata, KVCache, ModelInput

if TYPE_CHECKING:
    from jserve.loader import LoadedModel


def check_draft_model(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must spell tokens as the target does: its ids are the target's drafts. A ValueError says
    where they differ."""
    ours, theirs = target.tokenizer, draft.tokenizer
    if ours.vocab_size != theirs.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's tokenizer has {theirs.vocab_size} tokens, the target's "
            f"{ours.vocab_size}: a draft model must share the target's tokenizer"
        )
    ids = range(ours.vocab_size)
    pieces = zip(ids, ours.convert_ids_to_tokens(ids), theirs.convert_ids_to_tokens(ids), strict=True)
    differ = [i for i, a, b in pieces if a != b]
    if differ:
        raise ValueError(
            f"speculative_config: the draft model's tokenizer differs from the target's at {len(differ)} ids "
            f"(first: {differ[0]}): a draft model must share the target's tokenizer"
        )


@dataclass(frozen=True)
class Drafter:
    """The draft model's structure (static: a jit argument): its graph, its parameters' tree, the target's
    vocabulary size (draft logits are cut or padded to it, so both draw the same noise) and the tokens each
    proposal has."""

    graphdef: nnx.GraphDef
    params_def: jax.tree_util.PyTreeDef
    vocab_size: int
    num_tokens: int

    @staticmethod
    def of(draft: LoadedModel, vocab_size: int, num_tokens: int) -> tuple[Drafter, list[jax.Array]]:
        """The Drafter of a loaded draft model, and its parameters as the flat list the step takes."""
        params, params_def = jax.tree_util.tree_flatten(draft.params)
        return Drafter(draft.graphdef, params_def, vocab_size, num_tokens), params

    def _model(self, params: list[jax.Array]) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.params_def, params))

    def extend(self, params: list[jax.Array], kv: KVCache, batch: ModelInput, attention: AttentionBackend) -> KVCache:
        """Write the draft's K/V of the step's tokens (the target's batch, the same pages)."""
        return self._model(params).hidden_states(batch, kv, attention)[1]

    def propose(
        self,
        params: list[jax.Array],
        kv: KVCache,
        attention: AttentionBackend,
        batch: ModelInput,
        proposing,
        next_tokens: jax.Array,
        verify_tokens: jax.Array,
        verify_positions: jax.Array,
        sampling,
        sample,
    ) -> tuple[jax.Array, KVCache]:
        """-> ([D, num_tokens] proposals, the draft KV). `proposing`: the engine's ProposingRows (which rows
        propose, and where their verify rows are); `next_tokens`: the step's samples by sequence; the verify
        samples and their positions; `sampling` the step's SamplingBatch and `sample` its sampler
        (bound to the step's penalty state; proposing requests have no penalties)."""
        used = proposing.rows >= 0
        count = proposing.rows.shape[0]

        def run() -> tuple[jax.Array, KVCache]:
            rows = jnp.maximum(proposing.rows, 0)
            options = jax.tree.map(lambda column: column[rows], sampling)
            start, token, steps = _restart(batch, proposing, rows, options.steps, self.num_tokens, next_tokens,
                                           verify_tokens, verify_positions)  # fmt: skip
            options = replace(options, wants_top_logprobs=jnp.zeros_like(used),
                              constrained=jnp.zeros_like(used))  # fmt: skip
            meta = batch.attention
            page_size = kv.page_size
            page_tables = meta.page_tables[rows]
            query_start_loc = jnp.minimum(jnp.arange(count + 1, dtype=jnp.int32), jnp.sum(used, dtype=jnp.int32))
            model = self._model(params)

            def decode(i, carry):
                token, kv, proposals = carry
                position = start + i
                page = jnp.take_along_axis(page_tables, (position // page_size)[:, None], axis=1)[:, 0]
                step_meta = AttentionMetadata(
                    positions=jnp.where(used, position, 0),
                    slot_mapping=jnp.where(used, page * page_size + position % page_size, PAD_SLOT),
                    page_tables=page_tables,
                    context_lens=jnp.where(used, position + 1, 0),
                    query_start_loc=query_start_loc,
                )
                step = ModelInput(token, step_meta, jnp.arange(count, dtype=jnp.int32))
                hidden, kv = model.hidden_states(step, kv, attention)
                drawn = sample(self._fit_vocab(model.logits(hidden)), replace(options, steps=steps + i)).token_ids
                return drawn, kv, proposals.at[:, i].set(drawn)

            proposals = jnp.zeros((count, self.num_tokens), jnp.int32)
            _, new_kv, proposals = jax.lax.fori_loop(0, self.num_tokens, decode, (token, kv, proposals))
            return proposals, new_kv

        return jax.lax.cond(jnp.any(used), run, lambda: (jnp.zeros((count, self.num_tokens), jnp.int32), kv))

    def _fit_vocab(self, logits: jax.Array) -> jax.Array:
        """The draft's logits over the target's vocabulary (ids past the draft's own can never be drawn)."""
        extra = self.vocab_size - logits.shape[-1]
        if extra <= 0:
            return logits[:, : self.vocab_size]
        return jnp.pad(logits, ((0, 0), (0, extra)), constant_values=-jnp.inf)


def _restart(batch, proposing, rows, sample_steps, width, next_tokens, verify_tokens, verify_positions):
    """Where each proposing sequence stands after the step: its first new position, the token there (the sample
    after its accepted drafts) and the output index of the token after that one (its sampling key)."""
    runs = proposing.verify_start[:, None] + jnp.arange(width)  # [D, width]: the sequence's verify rows
    in_run = jnp.arange(width) < proposing.verify_count[:, None]
    if verify_tokens.shape[0]:
        at = jnp.minimum(runs, verify_tokens.shape[0] - 1)
        draft_ids = batch.token_ids[verify_positions[at] + 1]  # the draft each verify row checks
        matched = in_run & (verify_tokens[at] == draft_ids)
        accepted = jnp.sum(jnp.cumprod(matched, axis=1), axis=1)
        after = verify_tokens[jnp.minimum(proposing.verify_start + accepted, verify_tokens.shape[0] - 1)]
    else:
        accepted, after = jnp.zeros_like(rows), next_tokens[rows]
    token = jnp.where(accepted == proposing.verify_count, next_tokens[rows], after)
    last = batch.attention.query_start_loc[rows + 1] - 1  # the sequence's last token in the step
    last_position = batch.attention.positions[last]
    start = last_position + 1 - (proposing.verify_count - accepted)
    # The step sampled the sequence's row (position last_position + 1) at output index sample_steps; each
    # position further on is one index more, and the first proposal is for position start + 1.
    return start, token, sample_steps + start - last_position
