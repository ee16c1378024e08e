"""The jitted model step: a pure function of (params, KV cache, batch), with the cache donated.

The model's structure (graphdef) is static; its parameters travel as an explicit pytree, so the same
function can be bucketed by batch shape, and later sharded, without touching the module code.
"""

from __future__ import annotations

from functools import partial

import jax
from flax import nnx

from jserve.attention import REFERENCE, AttentionBackend, KVCache, ModelInput


@partial(jax.jit, static_argnums=0, static_argnames="attention", donate_argnums=2)
def forward_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv_cache: KVCache,
    batch: ModelInput,
    attention: AttentionBackend = REFERENCE,
):
    """-> (float32 logits [L, vocab] at batch.logits_indices, updated KV cache)."""
    model = nnx.merge(graphdef, params)
    return model(batch, kv_cache, attention)
