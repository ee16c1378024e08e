"""Lowering for an accelerator this CPU host does not have.

Pallas reads the target's generation from the device of the abstract mesh in context (Mosaic the TPU's,
Triton the GPU's compute capability, which jax >= 0.12 refuses to guess without a GPU): these stand in.
"""

import jax
import jax.numpy as jnp

ABSTRACT_DEVICES = {
    "cuda": jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"),
    "tpu": jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"),
}


def lowering_for(platform: str):
    """A context in which a jitted function lowers for `platform` ("cuda" or "tpu") as on one such device."""
    # Auto axes, as the engine's meshes have (jax >= 0.12 makes an abstract mesh's axes Explicit by default,
    # under which ragged_dot asks for an output sharding the engine never needs to give).
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=ABSTRACT_DEVICES[platform]
    )
    return jax.sharding.use_abstract_mesh(mesh)


def lowered_kernel_text(kernel, heads: int, kv_heads: int, head_dim: int, dtype, page_size: int, max_pages: int) -> str:
    """The CUDA lowering of an attention kernel (the contract of `jserve.attention.paged_attention`) over an
    engine-sized step: 256 tokens of 64 sequences, 512 pages."""
    tokens, num_seqs, num_pages = 256, 64, 512
    pages = jax.ShapeDtypeStruct((num_pages, page_size, kv_heads, head_dim), dtype)
    args = (
        jax.ShapeDtypeStruct((tokens, heads, head_dim), dtype),
        pages,
        pages,
        jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32),
    )
    with lowering_for("cuda"):
        return jax.jit(kernel).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
