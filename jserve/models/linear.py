"""A dense projection holding its weight in the checkpoint's [out, in] layout, so loading never transposes;
a fused one stacks several checkpoint projections of one input (fused.py).
Quantized, the weight is int8 with a float32 scale per output feature, in rows or, where jserve's CPU
kernel runs it, in the kernel's tiles, and activations are quantized in the mode's scheme (quantization.py).
Kept from a GGUF file (`--quantization gguf`), the weight is the file's blocks, flat uint8, and `segments`
says their formats (loader/gguf_blocks.py)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jserve import cpu_kernels
from jserve.models import fused
from jserve.models.low_rank import Delta
from jserve.models.norm import RMSNorm
from jserve.models.quantization import Quantization, int8_matmul


class Linear(nnx.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int | dict[str, int],
        *,
        bias: bool,
        dtype,
        quantization: Quantization,
        shards: int = 1,
        experts: int = 0,
    ):
        """`out_features` {checkpoint name: rows} fuses those projections, their rows ordered for `shards`
        tensor-parallel devices (fused.py). `experts`: one weight per expert, stacked (models/moe.py)."""
        quantized = quantization.quantized
        self.pieces = tuple(out_features.items()) if isinstance(out_features, dict) else ()
        self.shards = shards
        rows = sum(width for _, width in self.pieces) or out_features
        self.activation_group = quantization.activation_group
        stack = (experts,) if experts else ()
        self.weight = nnx.Param(jnp.zeros((*stack, rows, in_features), jnp.int8 if quantized else dtype))
        self.weight_scale = nnx.Param(jnp.zeros((*stack, rows), jnp.float32)) if quantized else None
        self.bias = nnx.Param(jnp.zeros((rows,), dtype)) if bias else None
        self.segments: tuple[tuple[int, int], ...] | None = None  # GGUF blocks: (ggml type, rows) per run of rows

    def __call__(
        self, x: jax.Array, real_rows: jax.Array | None = None, norm: RMSNorm | None = None, delta: Delta | None = None
    ) -> jax.Array:
        """norm(x), or x, times the weight. Quantized, the CPU kernel applies the norm itself, and skips x's
        rows past `real_rows` (int32 [1]: a step's padding; their outputs are zeros). `delta`: adapters'
        low-rank updates of the tokens, added in float (low_rank.py)."""
        y = self._base(x, real_rows, norm)
        if self.bias is not None:
            y = y + self.bias[...]
        if delta is not None:
            y = delta.add_to(y, x, norm, self.shards)
        return y

    def _base(self, x: jax.Array, real_rows: jax.Array | None, norm: RMSNorm | None) -> jax.Array:
        if self.segments is not None:
            norm = None if norm is None else norm.params
            y = cpu_kernels.gguf_linear(x, self.weight[...], self.segments, real_rows, norm).astype(x.dtype)
        elif self.weight_scale is None:
            x = x if norm is None else norm(x)
            y = jax.lax.dot_general(x, self.weight[...], (((x.ndim - 1,), (1,)), ((), ())))
        else:
            norm = None if norm is None else norm.params
            y = int8_matmul(x, self.weight[...], self.weight_scale[...], real_rows, norm, self.activation_group)
        return y

    def split(self, y: jax.Array) -> list[jax.Array]:
        """A fused projection's output -> its pieces' outputs (q, k, v or gate, up)."""
        return fused.split(y, [width for _, width in self.pieces], self.shards, axis=-1)
