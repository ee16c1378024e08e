"""The model's one entry point: a pure function of (structure, parameters, KV cache, batch).

The module structure (graphdef) is static and the parameters travel as an explicit pytree, so a caller can
jit it, bucket it by batch shape and shard it without touching module code. The engine's jitted step
(engine/step.py) runs the model through it; the tests that compare logits call it too, so they check the
very function the engine runs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from jserve.attention import AttentionBackend, KVCache, ModelInput
from jserve.models.low_rank import Adapters


def forward(
    graphdef: nnx.GraphDef, params: nnx.State, kv_cache: KVCache, batch: ModelInput, attention: AttentionBackend
) -> tuple[jax.Array, KVCache]:
    """-> (float32 logits [L, vocab] at batch.logits_indices, the KV cache with the batch's K/V written)."""
    logits, _, _, kv_cache = forward_states(graphdef, params, kv_cache, batch, attention)
    return logits, kv_cache


def forward_states(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv_cache: KVCache,
    batch: ModelInput,
    attention: AttentionBackend,
    adapters: Adapters | None = None,
) -> tuple[jax.Array, jax.Array, Callable[[jax.Array], jax.Array], KVCache]:
    """forward, also giving every token's hidden state [T, hidden] and the head that turns hidden states into
    float32 logits (for scoring prompt tokens). `adapters`: LoRA adapters per token (models/low_rank.py)."""
    model = nnx.merge(graphdef, params)
    hidden, kv_cache = model.hidden_states(batch, kv_cache, attention, adapters)
    with jax.named_scope("lm_head"):  # (scopes name the step's parts in profiles: benchmarks/step_profile.py)
        logits = model.logits(hidden[batch.logits_indices])
    return logits, hidden, model.logits, kv_cache
