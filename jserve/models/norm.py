"""RMSNorm, computed in float32 and scaled after casting back, as the reference implementations do."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    def __init__(self, size: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)

    @property
    def params(self) -> tuple[jax.Array, float]:
        """(weight, eps): what a projection that applies this norm itself needs (Linear.__call__)."""
        return self.weight[...], self.eps


@jax.named_scope("norm")  # (scopes name the step's parts in profiles: benchmarks/step_profile.py)
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    if x.size == x.shape[-1]:  # a single row (a lone decode's): on GPUs one kernel, not XLA's two (see there)
        gpu = functools.partial(_gpu_rms_norm_row, eps=eps)
        return jax.lax.platform_dependent(x, weight, cuda=gpu, default=functools.partial(_rms_norm, eps=eps))
    return _rms_norm(x, weight, eps)


def _gpu_rms_norm_row(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # Imported when first traced, as the attention backends' Pallas modules are: Pallas' Triton backend
    # takes about 0.1 s to import, which `import jserve` need not pay.
    from pallas_kernels.gpu.rms_norm import rms_norm_row

    return rms_norm_row(x, weight, eps)


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)
