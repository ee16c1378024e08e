"""The model's one entry point: a pure function of (structure, parameters, KV cache, batch).

The module structure (graphdef) is static and the parameters travel as an explicit pytree, so a caller can
jit it, bucket it by batch shape and shard it without touching module code. The engine's jitted step
(engine/step.py) runs the model through it; the tests that compare logits call it too, so they check the
very function the engine runs.
"""

from __future__ import annotations

import jax
from flax import nnx

from jserve.attention import AttentionBackend, KVCache, ModelInput


def forward(
    graphdef: nnx.GraphDef, params: nnx.State, kv_cache: KVCache, batch: ModelInput, attention: AttentionBackend
) -> tuple[jax.Array, KVCache]:
    """-> (float32 logits [L, vocab] at batch.logits_indices, the KV cache with the batch's K/V written)."""
    return nnx.merge(graphdef, params)(batch, kv_cache, attention)
