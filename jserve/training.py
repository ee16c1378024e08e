"""Differentiable scoring for training loops: each token's log-probability under given weights, through the
engine's own model, so a policy-gradient step and the engine's rollouts agree on the numbers.

    score = token_logprobs_fn(llm.engine.model)
    params = llm.get_weights(names="jserve")              # the engine's arrays, no copy
    grads = jax.grad(lambda p: -score(p, tokens).sum())(params)
    ...                                                   # an optimizer step on params
    llm.update_weights(params, names="jserve")            # served without a copy

The engine's attention reads and writes a paged KV cache (through C++ or Pallas kernels that reverse mode
does not differentiate); here every sequence attends to its own tokens in plain JAX instead, with the same
causal mask, sliding windows and soft-caps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.attention import KVPages, ModelInput
from jserve.attention.metadata import PAD_SLOT, AttentionMetadata
from jserve.loader import LoadedModel
from jserve.loader.weights import param_name
from jserve.models.quantization import Quantization


@dataclass(frozen=True)
class DenseAttention:
    """Causal attention among a batch's own tokens, no cache (an attention backend the model can call)."""

    def __call__(self, q, k, v, pages, meta: AttentionMetadata, *, scale, sliding_window=None, soft_cap=None):
        tokens, heads, _ = q.shape
        sequence = jnp.searchsorted(meta.query_start_loc[1:], jnp.arange(tokens), side="right")
        pos = meta.positions
        mask = (sequence[:, None] == sequence[None, :]) & (pos[None, :] <= pos[:, None])
        if sliding_window is not None:
            mask &= pos[None, :] > pos[:, None] - sliding_window
        group = heads // k.shape[1]
        keys, values = (jnp.repeat(x, group, axis=1).astype(jnp.float32) for x in (k, v))
        scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32) * scale, keys)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
        return jnp.einsum("hqk,khd->qhd", probs, values).astype(q.dtype), pages


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
        hidden, _ = lm.hidden_states(batch, KVPages(no_pages, no_pages, config.num_layers), DenseAttention())
        logprobs = jax.nn.log_softmax(lm.logits(hidden).reshape(rows, length, -1)[:, :-1], axis=-1)
        return jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]

    return token_logprobs
