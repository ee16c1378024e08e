"""Differentiable scoring for training loops: each token's log-probability under given weights, through the
engine's own model, so a policy-gradient step and the engine's rollouts agree on the numbers.

    score = token_logprobs_fn(llm.engine.model)
    params = llm.get_weights(names="jserve")              # the engine's arrays, no copy
    grads = jax.grad(lambda p: -score(p, tokens).sum())(params)
    ...                                                   # an optimizer step on params
    llm.update_weights(params, names="jserve")            # served without a copy

`rollout_batch` lays a generate() call's completions out as the rows that function scores.

The engine's attention reads and writes a paged KV cache (through C++ or Pallas kernels that reverse mode
does not differentiate); here every sequence attends to its own tokens in plain JAX instead, with the same
causal mask, sliding windows and soft-caps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.attention import KVPages, ModelInput
from jserve.attention.metadata import PAD_SLOT, AttentionMetadata
from jserve.loader import LoadedModel
from jserve.loader.weights import param_name
from jserve.models.quantization import Quantization
from jserve.outputs import RequestOutput


@dataclass(frozen=True)
class DenseAttention:
    """Causal attention within each row of a batch of equal-length rows, no cache (an attention backend the
    model can call). Row by row, so the cost grows with rows x length^2, not with (rows x length)^2."""

    length: int  # tokens per row; the batch's tokens are rows one after another

    def __call__(self, q, k, v, pages, meta: AttentionMetadata, *, scale, sliding_window=None, soft_cap=None):
        tokens, heads, head_dim = q.shape
        pos = meta.positions[: self.length]  # every row has positions 0 .. length - 1
        mask = pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= pos[None, :] > pos[:, None] - sliding_window
        group = heads // k.shape[1]
        rows = tokens // self.length
        keys, values = (
            jnp.repeat(x, group, axis=1).astype(jnp.float32).reshape(rows, self.length, heads, head_dim) for x in (k, v)
        )
        queries = q.astype(jnp.float32).reshape(rows, self.length, heads, head_dim) * scale
        scores = jnp.einsum("bqhd,bkhd->bhqk", queries, keys)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, values).reshape(tokens, heads, head_dim)
        return out.astype(q.dtype), pages


def token_logprobs_fn(model: LoadedModel) -> Callable[[dict, jax.Array], jax.Array]:
    """A pure function (params by jserve name, as get_weights(names="jserve") gives them; tokens [B, L] int32)
    -> [B, L - 1] float32: log p(tokens[b, t + 1] | tokens[b, : t + 1]) under those params. Jit it, and take
    gradients with respect to params. Float weights of dense models only."""
    if model.quantization is not Quantization.NONE:
        raise ValueError(f"training scores float weights; this engine holds {model.quantization.value} weights")
    if model.config.num_experts:
        raise ValueError("training scores dense models: the experts' grouped matmul has no gradient here")
    graphdef, structure, config = model.graphdef, model.params, model.config

    def token_logprobs(params: dict, tokens: jax.Array) -> jax.Array:
        state = jax.tree_util.tree_map_with_path(lambda path, _: params[param_name(path)], structure)
        lm = nnx.merge(graphdef, state)
        rows, length = tokens.shape
        count = rows * length
        meta = AttentionMetadata(
            positions=jnp.tile(jnp.arange(length, dtype=jnp.int32), rows),
            slot_mapping=jnp.full(count, PAD_SLOT, jnp.int32),  # nothing is written anywhere
            page_tables=jnp.zeros((rows, 1), jnp.int32),
            context_lens=jnp.full(rows, length, jnp.int32),
            query_start_loc=jnp.arange(rows + 1, dtype=jnp.int32) * length,
        )
        batch = ModelInput(tokens.reshape(-1), meta, jnp.arange(count, dtype=jnp.int32))
        no_pages = jnp.zeros((config.num_layers, 1, config.num_kv_heads, config.head_dim), model.dtype)
        hidden, _ = lm.hidden_states(batch, KVPages(no_pages, no_pages, config.num_layers), DenseAttention(length))
        logprobs = jax.nn.log_softmax(lm.logits(hidden).reshape(rows, length, -1)[:, :-1], axis=-1)
        return jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]

    return token_logprobs


@dataclass(frozen=True)
class RolloutBatch:
    """A generate() call's completions as fixed-shape rows for token_logprobs_fn: one row per completion,
    request by request, completion by completion (so a request's n samples are adjacent)."""

    tokens: np.ndarray  # [rows, length] int32: prompt, then completion, then 0s
    # [rows, length - 1] float32: 1 where token_logprobs' column scores a completion token, else 0
    completion_mask: np.ndarray
    # [rows, length - 1] float32: each completion token's logprob as the engine sampled it (0 elsewhere), the
    # behaviour policy's side of an importance ratio; None unless the requests asked for logprobs
    sampled_logprobs: np.ndarray | None


def rollout_batch(outputs: Sequence[RequestOutput], length: int) -> RolloutBatch:
    """Rows of `length` tokens (pick one length for every batch, e.g. the longest prompt plus max_tokens, so
    a jitted training step compiles once). Raises ValueError for a prompt and completion longer than that."""
    completions = [(out.prompt_token_ids, c) for out in outputs for c in out.outputs]
    tokens = np.zeros((len(completions), length), np.int32)
    mask = np.zeros((len(completions), length - 1), np.float32)
    with_logprobs = all(c.logprobs is not None for _, c in completions)
    sampled = np.zeros_like(mask) if with_logprobs else None
    for row, (prompt, completion) in enumerate(completions):
        end = len(prompt) + len(completion.token_ids)
        if end > length:
            raise ValueError(f"a prompt and completion of {end} tokens do not fit rows of {length}")
        tokens[row, : len(prompt)] = prompt
        tokens[row, len(prompt) : end] = completion.token_ids
        mask[row, len(prompt) - 1 : end - 1] = 1  # column t scores token t + 1
        if sampled is not None:
            picked = zip(completion.token_ids, completion.logprobs, strict=True)
            sampled[row, len(prompt) - 1 : end - 1] = [entry[token].logprob for token, entry in picked]
    return RolloutBatch(tokens, mask, sampled)
